"""Tidy layer statistics -> a dense layer x step array, fast.

Figures draw 100 layers x 50,000 steps in well under a second, so the pivot is
done with integer codes and numpy scatter operations instead of
`DataFrame.pivot` (which hashes every key and costs seconds at 5M rows).
"""

import dataclasses

import numpy as np
import pandas as pd

from gradflow import schema

# `tensor=ALL_WEIGHTS` combines every trainable variable of a layer (kernel,
# bias, gamma, ...) into one value per layer and step.
ALL_WEIGHTS = "all_weights"

# How several rows that fall in one (layer, step) cell combine: norms add in
# quadrature (the norm of all the layer's weights together), counts add, and
# every other statistic keeps its maximum, so a large value is never hidden.
_ROOT_SUM_SQUARE = {"l2_norm", "l2_norm_clipped", "weight_norm", "weight_norm_unconstrained"}
_SUM = {"nonfinite"}


@dataclasses.dataclass
class LayerGrid:
    """One statistic as a dense layer x step array.

    Attributes:
        values: float64 array `[layers, columns]`; NaN/Inf kept as recorded.
        present: bool array `[layers, columns]`; False where nothing was
            recorded (such cells are drawn blank and never exported).
        step_first: int64 array `[columns]`: first step of each column.
        step_last: int64 array `[columns]`: last step of each column (equal
            to `step_first` unless the grid was decimated).
        layer_index: int64 array `[layers]`, ascending (input first).
        layer: list of layer names, one per row.
        statistic: the statistic column drawn.
        tensor: the tensor kind selected.
    """

    values: np.ndarray
    present: np.ndarray
    step_first: np.ndarray
    step_last: np.ndarray
    layer_index: np.ndarray
    layer: list
    statistic: str
    tensor: str

    @property
    def decimated(self):
        """True when a column covers more than one recorded step."""
        return bool(np.any(self.step_last != self.step_first))

    def to_frame(self):
        """The recorded cells as a tidy DataFrame (missing cells left out).

        Returns:
            DataFrame with columns `layer_index, layer, step, step_last,
            <statistic>`, sorted by layer then step.
        """
        rows, cols = np.nonzero(self.present)
        names = np.asarray(self.layer, dtype=object)
        return pd.DataFrame(
            {
                "layer_index": self.layer_index[rows],
                "layer": names[rows] if len(names) else np.array([], dtype=object),
                "step": self.step_first[cols],
                "step_last": self.step_last[cols],
                self.statistic: self.values[rows, cols],
            }
        )


def check_layer_stats(layer_stats, statistic, argument="layer_stats"):
    """Raise a clear error unless `layer_stats` is a tidy frame with `statistic`."""
    if not isinstance(layer_stats, pd.DataFrame):
        raise TypeError(
            f"`{argument}` must be a pandas DataFrame of tidy layer statistics "
            f"(columns {', '.join(schema.KEY_COLUMNS)}, ...), got {type(layer_stats).__name__}."
        )
    needed = ("step", "layer", "layer_index", "tensor", statistic)
    missing = [c for c in needed if c not in layer_stats.columns]
    if missing:
        if statistic in missing:
            raise ValueError(
                f"`statistic` must be a column of `{argument}`, got {statistic!r}; "
                f"available: {sorted(c for c in layer_stats.columns if c not in schema.KEY_COLUMNS)}."
            )
        raise ValueError(
            f"`{argument}` is missing the columns {missing}; see gradflow.schema.LAYER_STATS_COLUMNS."
        )


def tensor_mask(layer_stats, tensor):
    """Boolean numpy mask of the rows of one tensor kind (or all weights).

    A kind matches a tensor name equal to it or ending in `/kind`
    (`schema.is_tensor`); a full name such as `"lstm_cell/kernel"` matches itself.

    Raises:
        ValueError: if the frame has rows but none of kind `tensor`.
    """
    column = layer_stats["tensor"]
    # Compare the few distinct names once and index by code instead of
    # materialising millions of strings (the run store returns categoricals).
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes, names = column.cat.codes.to_numpy(), column.cat.categories
    else:
        codes, names = pd.factorize(column)
    names = np.asarray(names, dtype=object)
    if tensor == ALL_WEIGHTS:
        wanted = np.array([schema.is_weight(n) for n in names], dtype=bool).reshape(len(names))
    else:
        wanted = np.array([schema.is_tensor(n, tensor) for n in names], dtype=bool).reshape(
            len(names)
        )
    mask = np.append(wanted, False)[codes]  # code -1 (missing) -> False
    if len(column) and not mask.any():
        available = sorted(set(column.dropna().astype(str).unique()))
        if any(k != schema.ACTIVATION for k in available):
            available.append(ALL_WEIGHTS)
        raise ValueError(
            f"`tensor` {tensor!r} has no rows in these layer statistics; available: {available}."
        )
    return mask


def _dense_codes(values):
    """Sorted unique integers and each value's position among them."""
    if values.size == 0:
        return np.array([], dtype=np.int64), np.array([], dtype=np.int64)
    low, high = int(values.min()), int(values.max())
    if high - low <= 4 * values.size + 1024:
        # Steps and layer indices are small dense integers: a lookup table is
        # ~10x faster than sorting 5M keys.
        offset = values - low if low else values
        seen = np.zeros(high - low + 1, dtype=bool)
        seen[offset] = True
        if seen.all():  # every step recorded (or every layer): codes are offsets
            return np.arange(low, high + 1, dtype=np.int64), offset
        uniques = np.flatnonzero(seen) + low
        position = np.cumsum(seen) - 1
        return uniques, position[offset]
    uniques, codes = np.unique(values, return_inverse=True)
    return uniques, codes


def layer_grid(layer_stats, statistic="max_abs", tensor="kernel"):
    """Pivot tidy layer statistics to a `LayerGrid` (layers x recorded steps).

    Example:

    ```python
    grid = layer_grid(run.layer_stats, "l2_norm", tensor=ALL_WEIGHTS)
    grid.values.shape  # (layers, steps)
    ```

    Args:
        layer_stats: tidy DataFrame (`gradflow.schema.LAYER_STATS_COLUMNS`).
        statistic: the column to draw. Default `"max_abs"`.
        tensor: a tensor kind (`"kernel"`, `"bias"`, `"activation"`, ...) or
            `ALL_WEIGHTS` to combine every variable of a layer (max for
            `max_abs`, root of the sum of squares for `l2_norm`). Default
            `"kernel"`.

    Returns:
        A `LayerGrid`, rows in ascending `layer_index` (input first).

    Raises:
        TypeError: if `layer_stats` is not a DataFrame.
        ValueError: if `statistic` is not a column, or `tensor` has no rows.
    """
    check_layer_stats(layer_stats, statistic)
    mask = tensor_mask(layer_stats, tensor)
    steps = layer_stats["step"].to_numpy()
    indices = layer_stats["layer_index"].to_numpy()
    values = layer_stats[statistic].to_numpy(dtype=np.float64, na_value=np.nan)
    row_numbers = None
    if not mask.all():
        row_numbers = np.flatnonzero(mask)
        steps, indices, values = steps[row_numbers], indices[row_numbers], values[row_numbers]
    steps = steps.astype(np.int64, copy=False)
    indices = indices.astype(np.int64, copy=False)

    step_values, step_codes = _dense_codes(steps)
    index_values, index_codes = _dense_codes(indices)
    n_rows, n_cols = len(index_values), len(step_values)

    # A layer's name: any row of that layer will do (they all agree).
    last_row = np.zeros(n_rows, dtype=np.int64)
    last_row[index_codes] = np.arange(len(index_codes))
    if row_numbers is not None:
        last_row = row_numbers[last_row]
    layer_names = layer_stats["layer"].iloc[last_row].astype(object).tolist() if n_rows else []

    flat = index_codes * n_cols + step_codes
    size = n_rows * n_cols
    present = np.zeros(size, dtype=bool)
    present[flat] = True
    if np.count_nonzero(present) == len(flat):
        # One row per cell, the usual case: no aggregation needed.
        dense = np.full(size, np.nan)
        dense[flat] = values
    elif statistic in _ROOT_SUM_SQUARE:
        dense = np.sqrt(np.bincount(flat, weights=values * values, minlength=size))
    elif statistic in _SUM:
        dense = np.bincount(flat, weights=values, minlength=size)
    else:
        dense = np.full(size, -np.inf)
        np.maximum.at(dense, flat, values)  # propagates NaN, like the statistic itself
    dense[~present] = np.nan
    return LayerGrid(
        values=dense.reshape(n_rows, n_cols),
        present=present.reshape(n_rows, n_cols),
        step_first=step_values,
        step_last=step_values.copy(),
        layer_index=index_values,
        layer=layer_names,
        statistic=statistic,
        tensor=tensor,
    )
