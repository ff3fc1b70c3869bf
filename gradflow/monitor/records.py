"""Turn the ring buffer's numpy blocks into gradflow's tidy tables.

The callback keeps what it reads as numpy blocks and builds DataFrames only
when asked (`.history`, TensorBoard); the run store takes the blocks as
arrays (`RunWriter.add_layer_stats_array`), so a fast training loop pays for
a memory copy per read, not for pandas.
"""

import dataclasses
import functools
import itertools
import math

import numpy as np
import pandas as pd

from gradflow import schema
from gradflow.monitor.buffer import ROW_COLUMNS

_NONFINITE = ROW_COLUMNS.index("nonfinite")


@dataclasses.dataclass
class RowLayout:
    """What each row of a recorded step is: layer, layer_index, tensor, variable.

    `rows` says where each row is in the ring's blocks when some of their
    rows are left out of the records (`take` keeps the laid-out ones); None
    when the layout's rows come first in the blocks, in order.
    """

    layers: list
    layer_indices: list
    tensors: list
    variables: list
    rows: list = None

    def __len__(self):
        return len(self.layers)

    @functools.cached_property
    def time_rows(self):
        """Positions of the rows through time (read at every ring read: made once)."""
        return [i for i, tensor in enumerate(self.tensors) if tensor == schema.TIME_STEP]

    @property
    def series(self):
        """`(layer, layer_index, tensor, variable)` of each row, as the run store keys them."""
        return list(zip(self.layers, self.layer_indices, self.tensors, self.variables, strict=True))

    @classmethod
    def build(
        cls, names, activation_paths, layer_order, unreached=(), time_labels=(), time_source=""
    ):
        """Lay out weight rows (from `variable_names`), activation rows, then rows through time.

        Args:
            names: `VariableName`s of the trainable variables, in row order.
            activation_paths: Recorded layer paths (`path` or `path#2`).
            layer_order: Leaf-layer paths, index = `layer_index`.
            unreached: Rows to leave out: those no gradient reaches (the
                ring holds zeros there, which are no measurement).
            time_labels: Labels of the rows through time (`"t=01"`, ...), if
                recorded: `layer` is the label, `layer_index` the row's
                position in time (0 for the first steps), `tensor`
                `schema.TIME_STEP` and `variable` the sequence's name
                (`time_source`: `"input"` or a layer's path).
        """
        index = {path: i for i, path in enumerate(layer_order)}
        time_labels = list(time_labels or ())
        layers = [n.layer for n in names] + list(activation_paths) + time_labels
        indices = (
            [n.layer_index for n in names]
            + [index.get(path.split("#")[0], len(layer_order)) for path in activation_paths]
            + list(range(len(time_labels)))
        )
        tensors = (
            [n.tensor for n in names]
            + [schema.ACTIVATION] * len(activation_paths)
            + [schema.TIME_STEP] * len(time_labels)
        )
        variables = (
            [n.variable for n in names]
            + [""] * len(activation_paths)
            + [time_source or ""] * len(time_labels)
        )
        skipped = set(unreached)
        rows = [i for i in range(len(layers)) if i not in skipped]
        return cls(
            [layers[i] for i in rows],
            [indices[i] for i in rows],
            [tensors[i] for i in rows],
            [variables[i] for i in rows],
            rows if skipped else None,
        )

    def take(self, block):
        """`block` (`[n, ring rows, ...]`) with the laid-out rows only, in layout order.

        Returns `block` itself when no row is left out (the rows past the
        layout's are unused slots, which readers ignore).
        """
        if block is None or self.rows is None:
            return block
        return block[:, self.rows]


def layer_stats_frame(steps, stats, layout):
    """Tidy layer statistics (`schema.LAYER_STATS_COLUMNS`) from blocks.

    Args:
        steps: int array `[n]` of steps.
        stats: float array `[n, rows, len(ROW_COLUMNS)]`; rows past
            `len(layout)` are unused slots and ignored.
        layout: A `RowLayout`.

    Returns:
        A DataFrame with one row per step x layout row.
    """
    rows = len(layout)
    count = len(steps)
    values = np.asarray(stats[:, :rows], dtype=np.float64).reshape(count * rows, -1)
    frame = pd.DataFrame(
        {
            "step": np.repeat(np.asarray(steps, dtype=np.int64), rows),
            "layer": np.tile(np.asarray(layout.layers, dtype=object), count),
            "layer_index": np.tile(np.asarray(layout.layer_indices, dtype=np.int64), count),
            "tensor": np.tile(np.asarray(layout.tensors, dtype=object), count),
            "variable": np.tile(np.asarray(layout.variables, dtype=object), count),
        }
    )
    for position, column in enumerate(ROW_COLUMNS):
        frame[column] = values[:, position]
    unrecorded = unrecorded_time_steps(stats, layout)
    if unrecorded.any():
        # Rows through time of steps traced with another sequence length
        # hold nothing (not even a count): no row, rather than NaN gradients.
        in_time = np.zeros(rows, dtype=bool)
        in_time[layout.time_rows] = True
        frame = frame[~(np.tile(in_time, count) & np.repeat(unrecorded, rows))]
    frame["nonfinite"] = frame["nonfinite"].astype(np.int64)
    return frame[list(schema.LAYER_STATS_COLUMNS)].reset_index(drop=True)


def unrecorded_time_steps(stats, layout):
    """bool `[n]`: the steps whose rows through time hold nothing.

    Their `nonfinite` count is NaN, which no recorded row has: the step was
    traced with another sequence length than the one the rows were made for
    (`gradflow.monitor.through_time.plan_rows`).
    """
    rows = layout.time_rows
    if not rows:
        return np.zeros(len(stats), dtype=bool)
    return np.isnan(np.asarray(stats)[:, rows[0], _NONFINITE])


def metrics_frame(steps, metrics, names, keep):
    """Long metrics (`step, name, value`) from `[n, len(names)]` blocks.

    Args:
        steps: int array `[n]`.
        metrics: float array `[n, len(names)]`.
        names: Column names of `metrics`.
        keep: The names to keep (e.g. no clipping metrics without clipping).
    """
    columns = [i for i, name in enumerate(names) if name in keep]
    count = len(steps)
    return pd.DataFrame(
        {
            "step": np.repeat(np.asarray(steps, dtype=np.int64), len(columns)),
            "name": np.tile(np.asarray([names[i] for i in columns], dtype=object), count),
            "value": np.asarray(metrics[:, columns], dtype=np.float64).reshape(-1),
        }
    )


def nonfinite_origin(stats, layout):
    """The row where a non-finite gradient started, for one recorded step.

    Backpropagation runs from the loss towards the input, so the first
    non-finite gradient is the one nearest the loss: the highest
    `layer_index` with `nonfinite > 0`. Activation rows count too; rows
    through time do not (their gradient is the output's, not the loss's).

    Args:
        stats: float array `[rows, len(ROW_COLUMNS)]` of one step.
        layout: A `RowLayout`.

    Returns:
        The row number, or `None` when every gradient is finite.
    """
    counts = stats[: len(layout), _NONFINITE]
    layers = np.asarray(layout.tensors, dtype=object) != schema.TIME_STEP
    broken = np.flatnonzero((counts > 0) & layers)
    if broken.size == 0:
        return None
    indices = np.asarray(layout.layer_indices)[broken]
    return int(broken[np.argmax(indices)])


def nonfinite_message(step, layer, tensor, count, loss):
    """The `nonfinite` event of the first step with a NaN/Inf gradient.

    Args:
        step: The step.
        layer: The layer nearest the loss with one (`nonfinite_origin`).
        tensor: Its tensor there (`kernel`, `activation`, ...).
        count: How many NaN/Inf entries that tensor's gradient holds.
        loss: The step's loss (NaN when unknown counts as non-finite).
    """
    if math.isfinite(loss):
        return (
            f"First non-finite gradient at step {int(step)}: {count} NaN/Inf entries "
            f"in the {tensor} gradient of layer {layer!r} (the layer nearest the loss "
            "with one; backpropagation carried it towards the input from there)."
        )
    # Every gradient comes from the loss: all of them are NaN, and the layer
    # nearest the loss is only where backprop starts.
    return (
        f"The loss itself was {'NaN' if math.isnan(loss) else 'infinite'} at step "
        f"{int(step)}, so every gradient is non-finite (NaN/Inf) from layer {layer!r} "
        "down. "
        "The NaN/Inf was made in the forward pass: a layer's output (a log or "
        "square root of a negative number, a division by zero, an overflow from "
        "large weights or a large learning rate) or the loss. Gradients cannot "
        "say which layer made it; the steps before show how the weights and "
        "gradients grew."
    )


def loss_alone_message(step, loss):
    """The `nonfinite` event of a loss that turned NaN/Inf while every gradient was finite."""
    return (
        f"The loss was {'NaN' if math.isnan(loss) else 'infinite'} at step {int(step)} while "
        "every gradient was still finite: the loss overflowed first (a large error squared, "
        "or a huge output). The steps before show how the weights and gradients grew; a "
        "smaller learning rate, or inputs and targets scaled to about 1, usually mend it."
    )


def layout_runs(blocks):
    """`(steps, stats, metrics, histograms, layout)` blocks in runs that share a layout.

    Usually one run; a later `fit` of the same monitor may have other rows
    (a layer frozen in between).
    """
    return [list(run) for _, run in itertools.groupby(blocks, key=lambda b: id(b[4]))]


def layer_history(blocks):
    """Tidy layer statistics (`schema.LAYER_STATS_COLUMNS`) of `layout_runs`'s blocks."""
    frames = [
        layer_stats_frame(
            np.concatenate([b[0] for b in run]), np.concatenate([b[1] for b in run]), run[0][4]
        )
        for run in layout_runs(blocks)
    ]
    if not frames:
        # Integer steps, as a table with rows and `.events` have them.
        return pd.DataFrame(columns=list(schema.LAYER_STATS_COLUMNS)).astype({"step": "int64"})
    return pd.concat(frames, ignore_index=True)
