"""Decimation that never hides a spike, a NaN or an Inf.

A screen shows about 1,000 columns; a run may have 50,000 steps. Averaging
would smooth away the one step where a gradient exploded, which is the step a
person is looking for, so gradflow keeps the maximum of each block of steps.
NaN wins over everything in its block (it is the worst news), then Inf.
"""

import math

import numpy as np

from gradflow.checks import flag, positive_int
from gradflow.figures.grid import LayerGrid

DEFAULT_MAX_COLUMNS = 1000


def block_size(n_columns, max_columns, power_of_two=False):
    """Columns merged into one by `decimate_max`.

    Args:
        n_columns: columns of the grid.
        max_columns: at most this many columns after merging.
        power_of_two: round the block up to a power of two. Default False.

    Returns:
        `ceil(n_columns / max_columns)` (at least 1), or the smallest power
        of two not below it.
    """
    block = max(1, math.ceil(n_columns / max_columns))
    if power_of_two:
        block = 1 << (block - 1).bit_length()
    return block


def decimate_max(grid, max_columns=DEFAULT_MAX_COLUMNS, *, power_of_two_blocks=False):
    """Merge blocks of consecutive steps of a `LayerGrid`, keeping each block's max.

    Blocks start at the first column, so as a run grows only its last block
    and the new ones change, as long as the block size stays the same. With
    `power_of_two_blocks=True` the size changes only when it doubles (at
    `max_columns`, then 2x, 4x, ... that many columns) instead of every
    `max_columns` columns; a live chart then keeps its earlier columns
    between those points, at the price of drawing between half and all of
    `max_columns` columns.

    Example:

    ```python
    small = decimate_max(layer_grid(stats, "max_abs"), max_columns=1000)
    ```

    Args:
        grid: a `LayerGrid`.
        max_columns: at most this many columns in the result. Default 1000.
        power_of_two_blocks: merge a power-of-two number of columns (1, 2,
            4, ...) per block. Default False: the fewest columns per block
            that fit in `max_columns`.

    Returns:
        A new `LayerGrid` with `ceil(columns / block)` columns where
        `block = block_size(columns, max_columns, power_of_two_blocks)`;
        `step_first`/`step_last` give each column's step range. The grid
        itself when it is small enough.

    Raises:
        ValueError: if `max_columns` is not a positive integer.
    """
    max_columns = positive_int("max_columns", max_columns)
    power_of_two_blocks = flag("power_of_two_blocks", power_of_two_blocks)
    n_cols = grid.values.shape[1]
    block = block_size(n_cols, max_columns, power_of_two_blocks)
    if block <= 1:
        return grid
    merged, merged_present = block_max(grid.values, grid.present, block)
    pad = (-n_cols) % block
    last = np.pad(grid.step_last, (0, pad), mode="edge")
    return LayerGrid(
        values=merged,
        present=merged_present,
        step_first=grid.step_first[::block].copy(),
        step_last=last[block - 1 :: block].copy(),
        layer_index=grid.layer_index,
        layer=grid.layer,
        statistic=grid.statistic,
        tensor=grid.tensor,
    )


def envelope_block(count, max_points=DEFAULT_MAX_COLUMNS):
    """Points per block `decimate_envelope` thins `count` points with; 1 when it keeps them all."""
    block = math.ceil(2 * count / max_points) if count else 1
    return 1 if block <= 2 else block


def decimate_envelope(steps, values, max_points=DEFAULT_MAX_COLUMNS):
    """Thin a long 1-D series to its per-block minimum and maximum.

    Used for loss and accuracy curves, where dips matter as much as spikes:
    each block of steps contributes its smallest and its largest value, at
    the steps where they occurred and in that order, so the drawn line has
    the same envelope as the full one. A block holding a NaN contributes the
    NaN (a gap with a marker) instead of its maximum.

    Args:
        steps: 1-D int array, ascending.
        values: 1-D float array, same length.
        max_points: at most about this many points in the result. Default 1000.

    Returns:
        `(steps, values)` numpy arrays; the inputs unchanged when short enough.

    Raises:
        ValueError: if `max_points` is not a positive integer.
    """
    max_points = positive_int("max_points", max_points)
    steps = np.asarray(steps)
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    block = envelope_block(n, max_points)
    if block == 1:
        return steps, values
    pad = (-n) % block
    n_blocks = (n + pad) // block
    padded = np.pad(values, (0, pad), constant_values=np.nan).reshape(n_blocks, block)
    valid = np.pad(np.ones(n, dtype=bool), (0, pad)).reshape(n_blocks, block)
    is_nan = np.isnan(padded) & valid
    low = np.where(valid & ~is_nan, padded, np.inf).argmin(axis=1)
    high = np.where(valid & ~is_nan, padded, -np.inf).argmax(axis=1)
    high = np.where(is_nan.any(axis=1), is_nan.argmax(axis=1), high)
    first = np.minimum(low, high)
    second = np.maximum(low, high)
    offsets = np.arange(n_blocks) * block
    keep = np.stack([offsets + first, offsets + second], axis=1).ravel()
    keep = np.unique(keep)  # a constant block yields one point, not two
    return steps[keep], values[keep]


def block_max(values, present, block):
    """Max over blocks of `block` consecutive columns of a 2-D array.

    Args:
        values: float array `[rows, columns]`.
        present: bool array of the same shape; False cells are ignored.
        block: columns per block (the last block may be shorter).

    Returns:
        `(merged, merged_present)`: `merged[r, k]` is the max of block `k` in
        row `r` (NaN if any recorded cell of the block is NaN, Inf if any is
        Inf), NaN where the block has no recorded cell.
    """
    n_rows, n_cols = values.shape
    pad = (-n_cols) % block
    values = np.where(present, values, -np.inf)
    if pad:
        values = np.pad(values, ((0, 0), (0, pad)), constant_values=-np.inf)
        present = np.pad(present, ((0, 0), (0, pad)), constant_values=False)
    n_blocks = (n_cols + pad) // block
    # np.max propagates NaN, and Inf is the largest float: both survive.
    merged = values.reshape(n_rows, n_blocks, block).max(axis=2)
    merged_present = present.reshape(n_rows, n_blocks, block).any(axis=2)
    merged[~merged_present] = np.nan
    return merged, merged_present
