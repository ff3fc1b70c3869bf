"""How sensitive is each layer's output to the model input?

For every leaf layer k, gradflow reports max |d(sum of layer k's output)/dx|,
the largest entry of the gradient of the summed output with respect to the
model input `x`. All layers are computed in ONE compiled `tf.function` that
runs the forward pass once and builds one backward graph per layer, instead of
an eager persistent tape queried layer by layer (see `bench/bench_probe.py`).

The derivative with respect to an integer input (token ids fed to an
`Embedding`) is not defined: `input_sensitivity` raises a `ValueError` that
says so, and `gradflow.snapshot` reports NaN with the reason in its `note`
column.
"""

import contextlib
import inspect

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

from gradflow.checks import check_backend, check_not_legacy, flag
from gradflow.probe import capture
from gradflow.probe.capture import leaf_layers
from gradflow.probe.naming import layer_order
from gradflow.statistics import summarize

INTEGER_INPUT_NOTE = (
    "the model input is not a float tensor (integer ids, e.g. for an Embedding), "
    "so d(layer output)/d(input) is not defined"
)
SOFTMAX_NOTE = (
    "a softmax output sums to 1 whatever the input, so d(sum of output)/d(input) is 0 "
    "by construction: this row says nothing about the layer"
)


# Normalizations whose output sums to (about) a constant whatever the input:
# their row read as a layer that ignores its input (a lecturer's "deaf" LayerNorm).
LAYER_NORM_NOTE = (
    "a LayerNormalization output sums to a constant whatever the input (exactly while its "
    "scale is all 1), so d(sum of output)/d(input) is about 0 by construction: this row says "
    "little about the layer"
)
BATCH_NORM_NOTE = (
    "in training mode a BatchNormalization output sums over the batch to a constant whatever "
    "the input, so d(sum of output)/d(input) is 0 by construction: this row says nothing about "
    "the layer"
)


def constant_sum_note(layer, training):
    """Why `layer`'s input sensitivity is about 0 by construction, or "" when it is not."""
    if sums_to_one(layer):
        return SOFTMAX_NOTE
    if isinstance(layer, keras.layers.LayerNormalization):
        return LAYER_NORM_NOTE
    if training and isinstance(layer, keras.layers.BatchNormalization):
        return BATCH_NORM_NOTE
    return ""


def sums_to_one(layer):
    """Whether `layer`'s output sums to 1 along its last axis (a softmax), so its input sensitivity is 0."""
    if isinstance(layer, keras.layers.Softmax):
        return True
    return getattr(layer, "activation", None) is keras.activations.softmax


def differentiable_inputs(x):
    """The float tensors of an input structure: what a gradient can flow into."""
    return [t for t in tf.nest.flatten(x) if t.dtype.is_floating]


def to_tensors(data, name):
    """Convert an array structure to tensors; float arrays become `floatx`.

    Keras's own data adapters cast float64 numpy arrays to `floatx()` before
    a model sees them; doing the same keeps a snapshot's numbers equal to a
    training step's.

    Raises:
        TypeError: if `data` holds something that is not array-like.
    """
    _check_one_batch(data, name)
    if _is_nested_numbers(data):
        # `x.tolist()`: one array, not a structure of scalar inputs.
        data = np.asarray(data)

    def convert(value):
        if isinstance(value, (tf.Tensor, tf.Variable)):
            tensor = tf.convert_to_tensor(value)
            if tensor.dtype == tf.string:
                raise TypeError(f"`{name}` must be numbers, got a tensor of strings.")
            return tensor
        try:
            array = np.asarray(value)
        except Exception as error:  # noqa: BLE001  (re-raised with context)
            raise TypeError(
                f"`{name}` must be a numpy array, a tensor, or a list/dict of them; "
                f"got {type(value).__name__}."
            ) from error
        if array.dtype.kind in "USO":
            what = "strings" if array.dtype.kind in "US" else "Python objects (dtype=object)"
            hint = " Turn text labels into class numbers first." if name == "y" else ""
            raise TypeError(
                f"`{name}` must be a numeric array or tensor; got an array of {what} of "
                f"shape {array.shape}.{hint}"
            )
        if np.issubdtype(array.dtype, np.floating):
            array = array.astype(keras.backend.floatx())
        return tf.convert_to_tensor(array)

    return tf.nest.map_structure(convert, data)


def _check_one_batch(data, name):
    """Refuse, by name, what is not one batch: None, a Dataset, a generator."""
    if data is None:
        raise TypeError(f"`{name}` is None: give the batch's arrays.")
    if isinstance(data, (tf.data.Dataset, keras.utils.PyDataset)):
        kind = "tf.data.Dataset" if isinstance(data, tf.data.Dataset) else "PyDataset"
        raise TypeError(
            f"`{name}` is a {kind}, but a probe takes one batch of arrays: take "
            "one with `x, y = next(iter(dataset))` (a tf.data.Dataset of batches) and pass "
            "those."
        )
    if inspect.isgenerator(data) or (
        hasattr(data, "__next__") and not isinstance(data, (np.ndarray, tf.Tensor))
    ):
        raise TypeError(
            f"`{name}` is a {type(data).__name__}, but a probe takes one batch of arrays: take "
            "one with `x, y = next(batches)` and pass those."
        )


def _is_nested_numbers(data):
    """Whether `data` is a Python list of numbers or of such lists (one array, as a list)."""
    if not isinstance(data, list) or not data:
        return False
    first = data[0]
    if isinstance(first, list):
        return _is_nested_numbers(first)
    return isinstance(first, (int, float, np.number)) and not isinstance(first, bool)


def carried_state(model):
    """The variables a forward pass may change: what a probe must put back.

    The model's non-trainable variables (BatchNormalization's moving
    statistics and Dropout's seed state, which a training-mode pass moves; a
    custom layer's own counters, which any pass may assign) and the carried
    states of its stateful RNN layers, which Keras keeps out of
    `model.variables`.

    Args:
        model: A Keras model.

    Returns:
        A list of variables, without repeats.
    """
    found = list(model.non_trainable_variables)
    for layer in _stateful_layers(model):
        if layer.states is not None:
            found.extend(tf.nest.flatten(layer.states))
    unique = {id(v): v for v in found}
    return list(unique.values())


def _stateful_layers(model):
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if getattr(layer, "stateful", False) and hasattr(layer, "states")
    ]


@contextlib.contextmanager
def restored_state(model):
    """Put back, after the block, everything a forward pass may change in the model.

    See `carried_state`. A stateful RNN whose state the block created (its
    first call) gets its initial state back.

    Args:
        model: A Keras model.
    """
    saved = [(v, v.numpy()) for v in carried_state(model)]
    stateless = [layer for layer in _stateful_layers(model) if layer.states is None]
    try:
        yield
    finally:
        for variable, value in saved:
            variable.assign(value)
        for layer in stateless:
            if layer.states is not None:
                layer.reset_state()


def sensitivity_maxima(tape, layer_outputs, inputs, untaped=None):
    """max |d(sum of each layer output)/d(inputs)|, to call inside a traced function.

    Args:
        tape: A persistent `tf.GradientTape` that watched `inputs` and recorded
            the forward pass.
        layer_outputs: The recorded output tensor of each layer.
        inputs: The float input tensors (non-empty list).
        untaped: Optional; for each output, whether the tape did not record
            it (`capture.LayerOutputs.untaped`).

    Returns:
        A float32 vector, one maximum per layer output. A layer whose output
        does not depend on the input gets 0; a NaN in a gradient gives NaN,
        and an output of an integer dtype or one the tape did not record
        (inside `keras.remat`: its 0 would read as independent of the input)
        gets NaN.
    """
    gradients = []
    for index, output in enumerate(layer_outputs):
        if not output.dtype.is_floating or (untaped and untaped[index]):
            gradients.append(tf.fill([1], float("nan")))
            continue
        # A non-scalar target is summed by the tape: d(sum of output)/d(inputs).
        # (A `reduce_sum` taken here, after the tape stopped, would be
        # unrecorded and give no gradient at all.)
        per_input = tape.gradient(
            output,
            inputs,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        # One tensor per layer: all inputs' gradients side by side.
        gradients.append(tf.concat([tf.reshape(g, [-1]) for g in per_input], axis=0))
    statistics, _ = summarize(gradients)
    return statistics[:, 0]


class InputSensitivity:
    """A compiled input-sensitivity probe for one model, reusable across batches.

    Tracing happens on the first call (and again for a new input shape); later
    calls only run the compiled graph. `input_sensitivity` is the one-shot form.

    Example:

    ```python
    probe = InputSensitivity(model)
    table = probe(x_batch)      # layer, layer_index, max_abs
    ```

    Args:
        model: A Keras model whose inputs are float tensors.
        training: Whether to run the forward pass in training mode. Defaults to
            `False`, so that Dropout is off and BatchNormalization uses (and
            does not update) its moving statistics. With `True`, the moving
            statistics are restored after the pass.
    """

    def __init__(self, model, training=False):
        check_backend("gradflow.input_sensitivity")
        check_not_legacy("model", model)
        self.model = capture.check_model(model)
        self.training = flag("training", training)
        self._called = None
        self._compiled = tf.function(self._maxima)

    def _maxima(self, x):
        inputs = differentiable_inputs(x)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(inputs)
            with capture.record_layer_outputs(self.model) as outputs:
                self.model(x, training=self.training)
        # Runs while tracing: remembers which layers the graph covers.
        self._called = list(outputs.paths)
        return sensitivity_maxima(tape, outputs.tensors, inputs, outputs.untaped)

    def __call__(self, x):
        """Compute the sensitivity table for one batch `x`.

        Returns:
            A DataFrame with columns `layer`, `layer_index`, `max_abs`: one row
            per layer call, in call order.

        Raises:
            ValueError: if no input of `x` is a float tensor.
        """
        x = to_tensors(x, "x")
        if not differentiable_inputs(x):
            dtypes = sorted({t.dtype.name for t in tf.nest.flatten(x)})
            raise ValueError(
                f"Cannot compute input sensitivity: {INTEGER_INPUT_NOTE} "
                f"(received `x` with dtype {', '.join(dtypes)}). Measure the "
                "sensitivity to the embedding output instead: split the model "
                "after its Embedding and pass the embeddings as `x`."
            )
        with restored_state(self.model):
            capture.ensure_built(self.model, x)
            maxima = self._compiled(x).numpy().astype(np.float64)
        return sensitivity_table(self.model, self._called, maxima, training=self.training)


def sensitivity_table(model, called_paths, maxima, note="", training=False):
    """The `.inputs` table: one row per layer call, indexed like the weights.

    A `note` column says why a row's value means nothing: `note` for every
    row (e.g. integer inputs), else `constant_sum_note` for softmax outputs
    and normalizations (BatchNormalization in training mode).
    """
    index = {path: i for i, path in enumerate(layer_order(model, called=called_paths))}
    layers = dict(leaf_layers(model))
    paths = [p.split("#")[0] for p in called_paths]
    table = pd.DataFrame(
        {
            "layer": called_paths,
            "layer_index": [index[p] for p in paths],
            "max_abs": maxima,
        }
    )
    notes = [note or constant_sum_note(layers[p], training) for p in paths]
    if any(notes):
        table["note"] = notes
    return table


def input_sensitivity(model, x, training=False):
    """max |d(sum of layer output)/d(model input)| for every layer, on one batch.

    Example:

    >>> import numpy as np, keras
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> table = input_sensitivity(model, np.ones((4, 3), "float32"))
    >>> list(table.columns)
    ['layer', 'layer_index', 'max_abs']

    Args:
        model: A Keras model (Sequential, Functional, subclassed, nested).
        x: One batch of inputs: numpy array, tensor, or a list/dict of them.
        training: Forward pass in training mode. Defaults to `False` (Dropout
            off, BatchNormalization on its moving statistics and not updated).

    Returns:
        A DataFrame with columns `layer`, `layer_index` and `max_abs`, one row
        per layer call in call order. `max_abs` is the largest absolute entry
        over the whole batch and all float inputs.

    Raises:
        ValueError: if the model input is an integer tensor (token ids).
        TypeError: if `x` is not array-like.
    """
    return InputSensitivity(model, training=training)(x)
