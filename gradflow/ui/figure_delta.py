"""What a rerun must send of a Plotly figure to a browser that holds an earlier one.

A live chart is redrawn every second from a growing run. Its big arrays (a
heatmap's `z`, `x` and `customdata`, a line's `x` and `y`) keep their
earlier columns from one rerun to the next, as long as the decimation block
stays the same (`figures.heatmap(..., power_of_two_blocks=True)`); its
layout changes in a key or two (the x range, an axis title). So an update
carries, for each array, the index of its first changed column along the
last axis and the columns from there on; the layout entries whose JSON
changed; and the traces' other attributes only when any of them changed.

Pure numpy and JSON, no Streamlit: `gradflow.ui.live_chart` keeps the
`SentFigure` in the browser session's state and hands the update to the
browser, where `live_chart.js` applies it. Each update has a `revision` and
names the `base` revision it applies to (None: the whole figure, applied to
nothing), so a browser that holds anything else asks for the whole figure
instead of drawing a chart with columns missing.

Example:

```python
update, sent = figure_update(chart.figure)          # the whole figure
update, sent = figure_update(bigger.figure, sent)   # only what changed
```

The wire format of an update (a JSON object):

- `revision`: int, what the browser holds after applying it.
- `base`: the revision it applies to, or None for a whole figure.
- `config`: the Plotly config (whole figures only).
- `layout`: top-level layout entries that are new or changed;
  `layout_drop`: names of entries to remove.
- `traces`: the list of traces without their arrays, when any changed.
- `arrays`: `{"<trace index>.<attribute>": change}` where a change is
  `{"from": i, "shape": [...], ...}` holding the columns `i:` (last axis)
  as `{"dtype", "bdata"}` (little-endian, base64; numbers, NaN and Inf
  exactly) or `{"values"}` (nested JSON lists, for text).
  `drop`: names of arrays to remove.
"""

import base64
import dataclasses
import itertools
import json
import time

import numpy as np
import plotly.io.json as plotly_json

# Trace attributes sent as arrays, column by column; everything else of a
# trace is sent whole when it changes.
ARRAY_ATTRIBUTES = ("x", "y", "z", "customdata", "text", "hovertext")

# Revisions are unique in this server process and unlikely to repeat after a
# restart, so an update never matches a browser's figure by accident.
_revisions = itertools.count(int(time.time() * 1000))


@dataclasses.dataclass
class SentFigure:
    """What the browser holds of one chart, as far as the server knows.

    Attributes:
        revision: the revision of the last update sent.
        arrays: `"<trace index>.<attribute>"` -> numpy array, as drawn.
        traces: JSON of the traces without their arrays.
        layout: top-level layout key -> JSON of its value.
    """

    revision: int
    arrays: dict
    traces: str
    layout: dict


def figure_update(figure, sent=None, config=None):
    """The update that turns the browser's figure `sent` into `figure`.

    Args:
        figure: a `plotly.graph_objects.Figure` (or its `to_plotly_json()`
            dict).
        sent: the `SentFigure` the browser holds, or None (default) when it
            holds nothing (or something the server does not know).
        config: the Plotly config sent with a whole figure. Default None.

    Returns:
        `(update, sent)`: the JSON-ready update (see the module docstring)
        and the `SentFigure` the browser holds once it has applied it. When
        nothing changed, the update is `{"revision": r, "base": r}` with the
        revision the browser already holds, and `sent` is returned as is.
    """
    arrays, traces, layout = split_figure(figure)
    # Already plain JSON values (split_figure went through Plotly's encoder once).
    traces_json = json.dumps(traces)
    layout_json = {key: json.dumps(value) for key, value in layout.items()}
    if sent is None:
        revision = next(_revisions)
        update = {
            "revision": revision,
            "base": None,
            "config": config or {},
            "layout": layout,
            "traces": traces,
            "arrays": {name: _column_change(array, 0) for name, array in arrays.items()},
        }
        return update, SentFigure(revision, arrays, traces_json, layout_json)

    changes = {}
    for name, array in arrays.items():
        start = first_changed_column(sent.arrays.get(name), array)
        if start is not None:
            changes[name] = _column_change(array, start)
    dropped_arrays = sorted(set(sent.arrays) - set(arrays))
    changed_layout = {
        key: value for key, value in layout.items() if sent.layout.get(key) != layout_json[key]
    }
    dropped_layout = sorted(set(sent.layout) - set(layout))
    traces_changed = traces_json != sent.traces
    if not (changes or dropped_arrays or changed_layout or dropped_layout or traces_changed):
        return {"revision": sent.revision, "base": sent.revision}, sent

    revision = next(_revisions)
    update = {"revision": revision, "base": sent.revision}
    if changed_layout:
        update["layout"] = changed_layout
    if dropped_layout:
        update["layout_drop"] = dropped_layout
    if traces_changed:
        update["traces"] = traces
    if changes:
        update["arrays"] = changes
    if dropped_arrays:
        update["drop"] = dropped_arrays
    return update, SentFigure(revision, arrays, traces_json, layout_json)


def split_figure(figure):
    """A figure's arrays, its traces without them, and its layout.

    Args:
        figure: a `plotly.graph_objects.Figure` or its `to_plotly_json()` dict.

    Returns:
        `(arrays, traces, layout)`: `{"<trace index>.<attribute>": ndarray}`
        (numbers as numbers, text as object arrays), a list of JSON-ready
        trace dicts without those attributes, and the JSON-ready layout dict.
    """
    spec = figure if isinstance(figure, dict) else figure.to_plotly_json()
    arrays, traces = {}, []
    for index, trace in enumerate(spec.get("data", [])):
        rest = {}
        for attribute, value in trace.items():
            array = _as_array(value) if attribute in ARRAY_ATTRIBUTES else None
            if array is not None and array.ndim >= 1:
                arrays[f"{index}.{attribute}"] = array
            else:
                rest[attribute] = value
        traces.append(json.loads(_to_json(rest)))
    layout = json.loads(_to_json(spec.get("layout", {})))
    return arrays, traces, layout


def first_changed_column(old, new):
    """Index of the first column (last axis) where `new` differs from `old`.

    Args:
        old: numpy array held by the browser, or None.
        new: numpy array to draw.

    Returns:
        None when `new` equals `old` (NaN equals NaN); 0 when nothing of
        `old` can be kept (None, other leading shape, numbers vs text);
        else the first differing column, which is the length of `old` when
        `new` only appends to it, and the length of `new` when it is `old`
        cut short.
    """
    if old is None or old.shape[:-1] != new.shape[:-1] or _is_text(old) != _is_text(new):
        return 0
    kept = min(old.shape[-1], new.shape[-1])
    if kept == 0 or new.size == 0:
        return None if old.shape == new.shape else kept
    before, after = old[..., :kept], new[..., :kept]
    same = before == after
    if not _is_text(new):
        same = same | (np.isnan(before) & np.isnan(after))
    changed = np.flatnonzero(~np.asarray(same, dtype=bool).reshape(-1, kept).all(axis=0))
    if changed.size:
        return int(changed[0])
    if old.shape == new.shape:
        return None
    return kept


def encode_array(array):
    """A numpy array as JSON: `{"shape", "dtype", "bdata"}` or `{"shape", "values"}`.

    Numbers go as little-endian bytes in base64 (float64, or int32 when the
    integers fit), which keeps NaN, Inf and every bit of a float; text and
    booleans go as nested JSON lists.
    """
    shape = list(array.shape)
    kind = array.dtype.kind
    if kind in "iu":
        fits = array.size == 0 or (array.min() >= -(2**31) and array.max() < 2**31)
        dtype = "<i4" if fits else "<f8"
    elif kind == "f":
        dtype = "<f8"
    else:
        return {"shape": shape, "values": json.loads(_to_json(array.tolist()))}
    data = np.ascontiguousarray(array, dtype=dtype).tobytes()
    return {"shape": shape, "dtype": dtype[1:], "bdata": base64.b64encode(data).decode("ascii")}


def decode_array(encoded):
    """The numpy array of `encode_array`'s JSON (for tests and benches)."""
    if "bdata" in encoded:
        return _from_bdata(encoded)
    return np.array(encoded["values"], dtype=object).reshape(encoded["shape"])


def _from_bdata(encoded):
    """The numpy array of a `{dtype, bdata, shape}` typed array (ours or Plotly 6's)."""
    flat = np.frombuffer(base64.b64decode(encoded["bdata"]), dtype="<" + encoded["dtype"])
    shape = encoded.get("shape")
    if isinstance(shape, str):  # Plotly writes "9,500"
        shape = [int(n) for n in shape.split(",")]
    return flat.reshape(shape) if shape else flat


def _column_change(array, start):
    return {"from": start, **encode_array(array[..., start:])}


def _as_array(value):
    if isinstance(value, dict):
        # Plotly 6 keeps numeric arrays as base64 typed arrays ({dtype, bdata, shape}).
        return _from_bdata(value) if "bdata" in value else None
    if isinstance(value, (list, tuple, np.ndarray)):
        array = np.asarray(value)
        return array.astype(object) if array.dtype.kind in "USO" else array
    return None


def _is_text(array):
    return array.dtype.kind not in "iuf"


def _to_json(value):
    # Plotly's encoder: numpy scalars and arrays, NaN -> null, dates, colours.
    return plotly_json.to_json_plotly(value)
