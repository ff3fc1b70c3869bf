"""Columnar blocks of layer statistics: how tidy rows are packed into `layer_stats`.

A block is one SQLite row holding up to `tables.BLOCK_ROWS` tidy rows (step x
series) of one run, with one little-endian array per column. Reading a million
rows then means a few hundred SQLite rows and one `np.frombuffer` per column,
instead of eleven million Python floats.

Example:

```python
rows = pack(run=1, steps=steps, series=series, values=values)   # for executemany
data = unpack(conn.execute("SELECT steps, series, max_abs ...").fetchall(), ["max_abs"])
```
"""

import numpy as np

from gradflow.store import tables

STEP_DTYPE = np.dtype("<i8")
SERIES_DTYPE = np.dtype("<i4")
VALUE_DTYPE = np.dtype("<f8")

# The layer_stats columns a block row is written with, in `pack`'s order.
INSERT_COLUMNS = ("run", "last_step", "steps", "series") + tables.STAT_COLUMNS


def pack(run, steps, series, values, block_rows=None):
    """Pack tidy rows into layer_stats block rows, ready for `executemany`.

    Rows are put in step, series order first, and of two rows with the same
    step and series only the later one is kept, so that a reader of a
    normal run never has to sort.

    Args:
        run: the run's integer key.
        steps: int array `[n]`.
        series: int array `[n]` of series ids.
        values: float array `[n, len(tables.STAT_COLUMNS)]`, NaN where missing.
        block_rows: the most rows per block, default `tables.BLOCK_ROWS`.

    Returns:
        A list of tuples in the order of `INSERT_COLUMNS`.
    """
    block_rows = tables.BLOCK_ROWS if block_rows is None else int(block_rows)
    steps = np.asarray(steps, dtype=STEP_DTYPE)
    series = np.asarray(series, dtype=SERIES_DTYPE)
    values = np.asarray(values, dtype=VALUE_DTYPE)
    if values.shape != (len(steps), len(tables.STAT_COLUMNS)) or len(series) != len(steps):
        raise ValueError(
            f"`pack` needs {len(steps)} steps, series and value rows of "
            f"{len(tables.STAT_COLUMNS)} statistics; got series {series.shape}, "
            f"values {values.shape}."
        )
    order = ordering(steps, series)
    if order is not None:
        steps, series, values = steps[order], series[order], values[order]
    # Column-major, so that each statistic is one contiguous run of bytes.
    columns = np.asfortranarray(values)
    rows = []
    for start in range(0, len(steps), block_rows):
        stop = start + block_rows
        part = steps[start:stop]
        rows.append(
            (int(run), int(part.max()), part.tobytes(), series[start:stop].tobytes())
            + tuple(columns[start:stop, j].tobytes() for j in range(columns.shape[1]))
        )
    return rows


def unpack(rows, columns):
    """Concatenate block rows into tidy column arrays in step, series order.

    Args:
        rows: `(steps, series, *columns)` blobs of the blocks, in write order.
        columns: the statistic names the rows hold after `steps` and `series`.

    Returns:
        A dict of `step` (int64), `series` (int64) and each statistic
        (float64), with later writes of the same step and series winning.

    Raises:
        RuntimeError: if the blobs of a block disagree in length (a damaged file).
    """
    names = ("step", "series", *columns)
    dtypes = (STEP_DTYPE, SERIES_DTYPE) + (VALUE_DTYPE,) * len(columns)
    # One join per column, then one copy-free view: no Python object per value.
    data = {
        name: np.frombuffer(b"".join(row[i] for row in rows), dtype=dtype)
        for i, (name, dtype) in enumerate(zip(names, dtypes, strict=True))
    }
    lengths = {len(array) for array in data.values()}
    if len(lengths) > 1:
        raise RuntimeError(
            "A layer_stats block of the run store has columns of different lengths; "
            "is the file damaged?"
        )
    order = ordering(data["step"], data["series"])
    if order is not None:
        data = {name: array[order] for name, array in data.items()}
    # Native byte order (a no-op on little-endian machines); pandas copies
    # the read-only buffers when it builds the frame.
    return {
        name: array.astype(np.int64 if i < 2 else np.float64, copy=False)
        for i, (name, array) in enumerate(data.items())
    }


def ordering(steps, series):
    """The row order that sorts by step then series, later duplicates winning.

    Args:
        steps: int array `[n]`, in write order.
        series: int array `[n]`, in write order.

    Returns:
        None when the rows are already strictly in step, series order (the
        usual case, checked in one pass); else an index array that sorts
        them and keeps only the last written of equal (step, series) pairs.
    """
    if len(steps) < 2:
        return None
    same_step = steps[1:] == steps[:-1]
    if np.all((steps[1:] > steps[:-1]) | (same_step & (series[1:] > series[:-1]))):
        return None
    order = np.lexsort((series, steps))  # stable: equal pairs stay in write order
    steps, series = steps[order], series[order]
    last = np.ones(len(order), dtype=bool)
    last[:-1] = (steps[1:] != steps[:-1]) | (series[1:] != series[:-1])
    return order[last]
