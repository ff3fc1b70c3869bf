"""The gradient through time: how much each time step of a sequence still reaches the output.

A recurrent network's gradient vanishes through *time*, not only through
depth: the Jacobian products that carry it back from the output to the input
at step t shrink with every step in between. The per-layer rows cannot show
it (a recurrent layer's kernel gradient is summed over every step). These
rows can: one row per time step t (or per run of steps, for long sequences),
holding the statistics of

    d(y_1 - y_2 + y_3 - ...)/d x[:, t, :]

the gradient of the model's outputs with respect to the sequence at step t,
from the same forward pass the optimizer trains on. The outputs are summed
with alternating signs so that a softmax's, which always sum to 1, do not
cancel to an exactly zero gradient. The output's gradient, not the loss's:
the loss's multiplies it by each sample's error, whose signs cancel across
the batch and which shrinks as the network learns, so a trained LSTM that
remembers all 30 steps of the adding problem showed a gradient fading like
the SimpleRNN's that remembers a few. Measured on the two presets
(`gradflow train --preset rnn_simple`, then `rnn_lstm`, 800 steps): the
output's gradient at steps 1-3 over that at steps 28-30 has a median of 1.26
for the LSTM and 1.2e-2 for the SimpleRNN over steps 401-800; the loss's, in
a first try, was about 1e-3 after training for both.

The sequence is the model's input when it is one float tensor shaped
`(batch, time, features)`, else the output of the first layer that gives one
(an `Embedding` after integer tokens).
"""

import math

import tensorflow as tf
from keras.src import tree

from gradflow.checks import warn_user

# More time steps than this are recorded in runs of consecutive steps: a
# 2,000-token sequence would otherwise add 2,000 rows to every recorded step.
MAX_ROWS = 100


def chunk_sizes(length, max_rows=MAX_ROWS):
    """Sizes of the runs of consecutive time steps, one per row.

    ```python
    chunk_sizes(30)    # [1] * 30: one row per time step
    chunk_sizes(250)   # [3] * 83 + [1]: 84 rows
    ```

    """
    per_row = max(1, math.ceil(length / max_rows))
    full, rest = divmod(length, per_row)
    return [per_row] * full + ([rest] if rest else [])


def row_labels(sizes):
    """`"t=01"`, `"t=02"`, ... or `"t=001–003"`, ...: the time steps of each row, from 1.

    Numbers are padded to one width, so that names sorted as text (TensorBoard's
    tags, a spreadsheet's column) keep the order of time: "t=10" came before "t=2".
    """
    width = len(str(sum(sizes)))
    labels, start = [], 1
    for size in sizes:
        end = start + size - 1
        first, last = f"{start:0{width}d}", f"{end:0{width}d}"
        labels.append(f"t={first}" if size == 1 else f"t={first}–{last}")
        start = end + 1
    return labels


def watch_input(tape, x):
    """Watch the model's input when it is one float tensor of rank 3; returns it or None."""
    flat = [t for t in tree.flatten(x) if t is not None]
    if len(flat) != 1:
        return None
    tensor = flat[0]
    if not _is_sequence(tensor):
        return None
    tape.watch(tensor)
    return tensor


def output_probe(y_pred):
    """The scalar whose gradient the rows record: the outputs summed with alternating signs.

    The signs alternate along the last axis (the output units), so that a
    softmax's outputs, which always sum to 1, do not cancel.
    """
    total = tf.constant(0.0)
    for output in tree.flatten(y_pred):
        if output is None or not output.dtype.is_floating:
            continue
        output = tf.cast(output, tf.float32)
        units = output.shape[-1] if output.shape.rank else 1
        units = 1 if units is None else units
        signs = 1.0 - 2.0 * tf.cast(tf.range(units) % 2, tf.float32)
        total += tf.reduce_sum(output * signs)
    return total


def sequence_source(watched_input, outputs):
    """`(tensor, name)` of the sequence to differentiate, or `(None, None)`.

    Args:
        watched_input: `watch_input`'s result.
        outputs: The step's `LayerOutputs` (every layer's output is watched).
    """
    if watched_input is not None:
        return watched_input, "input"
    for path, tensor in zip(outputs.paths, outputs.tensors, strict=True):
        if _is_sequence(tensor):
            return tf.convert_to_tensor(tensor), path
    return None, None


def rows_before_fit(plan):
    """Fix the rows through time from the model's declared input, when it has one.

    The ring must then be made before `fit` traces the step: under
    `tf.distribute` it cannot be made inside a replica's step. A Functional
    or Sequential model declares its input, `(None, time, features)`; a
    subclassed one, or a token input, is left to the first trace.

    Returns:
        Whether the rows are fixed.
    """
    try:
        inputs = list(plan.model.inputs or ())
    except (AttributeError, ValueError):  # a subclassed model has no declared inputs
        return False
    if len(inputs) != 1 or not _is_sequence(inputs[0]) or inputs[0].shape[1] is None:
        return False
    plan.time_labels = row_labels(chunk_sizes(inputs[0].shape[1]))
    plan.time_source = "input"
    return True


_PAD = (
    "pad every sequence to one length (`keras.utils.pad_sequences(..., maxlen=...)`, "
    "with an Embedding's `mask_zero=True` for tokens)"
)


def plan_rows(plan, x, watched_input, outputs):
    """The sequence to differentiate and the sizes of its rows' runs of time steps.

    Called while the step is traced, before the ring is made: the first
    trace fixes `plan.time_labels` (the ring's rows) and `plan.time_source`.
    A later trace with another sequence records no rows through time (they
    stay NaN), with a warning.

    Args:
        plan: The `StepPlan` (with `through_time` on).
        x: The step's input (for the warning when there is no sequence).
        watched_input: `watch_input`'s result.
        outputs: The step's `LayerOutputs` (every layer's output is watched).

    Returns:
        `(source, sizes)`, or `(None, None)` when nothing is recorded.
    """
    source, name = sequence_source(watched_input, outputs)
    length = None if source is None else source.shape[1]
    lead = (
        f"GradientMonitor(through_time=True) records nothing through time for model "
        f"{plan.model.name!r}"
    )
    if source is None:
        inputs = [t for t in tree.flatten(x) if t is not None]
        what = (
            f"it has {len(inputs)} inputs"
            if len(inputs) > 1
            else f"its input is shaped {tuple(inputs[0].shape)} ({inputs[0].dtype.name})"
            if inputs
            else "it has no input"
        )
        _warn_once(
            plan,
            f"{lead}: {what}, and no layer gives an output shaped (batch, time, features). It "
            "records the model's input when that is one float tensor of that shape, else the "
            "first layer output of that shape (an Embedding's, after tokens).",
        )
        return None, None
    if length is None:
        _warn_once(
            plan,
            f"{lead} in this `fit`: Keras traced its step with a varying number of time steps "
            f"in {name!r} (batches of different lengths, or a `fit` with another length than "
            f"an earlier one); {_PAD}.",
        )
        return None, None
    sizes = chunk_sizes(length)
    if plan.time_labels is None and plan.buffer is None:
        plan.time_labels = row_labels(sizes)
        plan.time_source = name
    elif plan.time_labels != row_labels(sizes) or plan.time_source != name:
        _warn_once(
            plan,
            f"{lead} at the steps traced with {length} time steps in {name!r}: its rows were "
            f"made for the {len(plan.time_labels or ())} rows of {plan.time_source!r} it was "
            f"first traced with. A new GradientMonitor records the new length; or "
            f"{_PAD}.",
        )
        return None, None
    return source, sizes


def _warn_once(plan, message):
    """Warn once per plan: Keras traces a step more than once."""
    if message not in plan.time_warnings:
        plan.time_warnings.add(message)
        warn_user(message)


def gradients_through_time(tape, target, source, sizes):
    """The gradient of `target` w.r.t. `source`, split along time into the rows' runs.

    Returns:
        A list of float32 tensors `(batch, steps in the run, features)`, one
        per row.
    """
    gradient = tape.gradient(target, source)
    if gradient is None:  # the output does not depend on the sequence
        gradient = tf.zeros_like(source)
    return tf.split(tf.cast(gradient, tf.float32), sizes, axis=1)


def _is_sequence(tensor):
    shape = getattr(tensor, "shape", None)
    dtype = getattr(tensor, "dtype", None)
    return (
        shape is not None
        and len(shape) == 3
        and dtype is not None
        and tf.as_dtype(dtype).is_floating
    )
