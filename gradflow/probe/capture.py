"""Record every layer's output while the forward pass runs.

gradflow needs dLoss/d(output of layer k) for every layer, also in subclassed
models whose layers were never called symbolically (there `layer.output`
raises "Layer ... has no inbound nodes", and rebuilding the model as a
Functional model is impossible). So instead of reading the graph, we wrap the
`call` of each leaf layer for the duration of a `with` block and keep each
output as it is produced. Gradients w.r.t. those very tensors then come from
the same tape (eager) or the same trace (`tf.function`).
"""

import contextlib
import math

import keras
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from tensorflow.python.eager import record

from gradflow.schema import ACTIVATION  # noqa: F401  (re-exported vocabulary)

# Layers whose inner pieces run inside a loop or are re-applied per time step:
# their own output is the meaningful one, so we never descend into them.
_OPAQUE_LAYERS = (
    keras.layers.RNN,
    keras.layers.Bidirectional,
    keras.layers.TimeDistributed,
)


def check_model(model):
    """Returns `model` if it is a Keras model (or layer); raises a TypeError naming what it is."""
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model, got {type(model).__name__} {model!r:.80}.")
    return model


def leaf_layers(model):
    """List the layers whose outputs gradflow records, with their paths.

    A leaf is a layer without sub-layers, or a recurrent/wrapper layer (RNN,
    LSTM, GRU, Bidirectional, TimeDistributed) which is kept whole. Nested
    models and layers are named by path, `outer/inner`, relative to `model`.
    A layer with sub-layers that also made trainable weights of its own
    (`add_weight` in a custom block) is listed too, after its sub-layers:
    those weights, and its output, are its own. Two layers of one name (a
    subclassed model may have them) are told apart: `proj`, `proj (2)`.

    Example:

    >>> inner = keras.Sequential([keras.layers.Dense(2, name="d")], name="block")
    >>> [path for path, _ in leaf_layers(keras.Sequential([inner]))]
    ['block/d']

    Args:
        model: A Keras layer or model.

    Returns:
        A list of `(path, layer)` tuples, depth first, in tracking order.
    """
    found = []
    seen = set()

    def visit(layer, prefix):
        for child in layer._layers:
            if id(child) in seen or isinstance(child, keras.layers.InputLayer):
                continue
            seen.add(id(child))
            path = f"{prefix}{child.name}"
            if is_composite(child):
                visit(child, path + "/")
                if child._trainable_variables:
                    found.append((path, child))
            else:
                found.append((path, child))

    visit(model, "")
    return _distinct_paths(found)


def _distinct_paths(found):
    # Keras keeps names unique in a Functional model only: a subclassed model
    # may hold two layers both named "proj". Read as one layer, their weights
    # shared a heatmap row and the second call read as a shared layer's
    # ("proj#2"). The second is "proj (2)", in the order they were found.
    taken = {path for path, _ in found}
    seen, distinct = set(), []
    for path, layer in found:
        if path in seen:
            number = 2
            while f"{path} ({number})" in taken:
                number += 1
            path = f"{path} ({number})"
            taken.add(path)
        seen.add(path)
        distinct.append((path, layer))
    return distinct


def is_composite(layer):
    """Whether gradflow looks inside `layer` for the layers it records."""
    return bool(layer._layers) and not isinstance(layer, _OPAQUE_LAYERS)


def own_trainable_variables(layer):
    """The trainable variables `leaf_layers` files under `layer`.

    All of a leaf's (an LSTM's cell weights too); only those a composite
    layer made itself, not its sub-layers'.
    """
    if is_composite(layer):
        return [v for v in layer._trainable_variables if v.trainable]
    return layer.trainable_variables


class LayerOutputs:
    """The outputs recorded inside a `record_layer_outputs` block, in call order.

    Attributes:
        paths: Layer paths in the order the layers were called. A layer called
            more than once (a shared layer) appears as `path`, `path#2`, ...
        layers: The layer objects, aligned with `paths`.
        tensors: The first tensor each call returned, aligned with `paths`.
        others: The other tensors each call returned (an LSTM's states with
            `return_state=True`), aligned with `paths`; mostly empty lists.
            `reached_outputs` turns to them when the loss does not reach
            the first.
        fed_by: For each call, the path of the recorded call whose first
            output it took as an input, or None: the model's input, or an
            output no recorded call made (an op between layers). Query, key
            and value projections all read one input, not each other's
            output; a rule that took a layer's input gradient from the layer
            called before it saw a 4,500-fold "shrink" through a linear layer.
        spreads: For each call, whether the layer has no weights and its
            first output holds another number of entries per sample than
            the recorded input it takes (pooling, global pooling): its mean
            |gradient| then changes with the count alone, 784-fold through
            a global average pool over 28x28, which is no saturation.
        masked: For each call, whether the recorded input it takes comes with
            a Keras mask (`Embedding(mask_zero=True)`, `Masking`): that
            input's gradient is exactly 0 at the padded time steps, so its
            mean |gradient| shrinks with the share of padding alone. An
            LSTM over sequences padded to 40 steps, most of them 1-3 tokens
            long, was called saturated (a 120-fold "shrink").
        untaped: For each call, whether it ran where the block's tape did not
            record (inside `keras.remat` or `tf.recompute_grad`, which run the
            forward pass with the tape stopped and again in the backward
            pass): the tape has no gradient for its output, though the
            layer's weights get theirs. Read as "no gradient reaches", it
            was told "Training leaves its weights as they are".
    """

    def __init__(self):
        self.paths = []
        self.layers = []
        self.tensors = []
        self.others = []
        self.fed_by = []
        self.spreads = []
        self.masked = []
        self.untaped = []
        self._calls = {}
        self._made_by = {}  # each key (`_keys`) of a recorded first output -> its call's path

    def _add(self, path, layer, outputs, inputs=(), untaped=False):
        flat = keras.tree.flatten(outputs)
        if not flat:
            return
        self.untaped.append(untaped)
        fed_by, taken = None, None
        for tensor in keras.tree.flatten(inputs):
            for key in _keys(tensor):
                if key in self._made_by:
                    fed_by, taken = self._made_by[key], tensor
        count = self._calls.get(path, 0) + 1
        self._calls[path] = count
        self.paths.append(path if count == 1 else f"{path}#{count}")
        self.fed_by.append(fed_by)
        self.spreads.append(
            taken is not None and not layer.weights and _resizes(layer, taken, flat[0])
        )
        kwargs = inputs[1] if len(inputs) == 2 and isinstance(inputs[1], dict) else {}
        self.masked.append(
            taken is not None
            and (kwargs.get("mask") is not None or get_keras_mask(taken) is not None)
        )
        for key in _keys(flat[0]):
            self._made_by[key] = self.paths[-1]
        self.layers.append(layer)
        # RNNs with return_state give [output, *states]: the output comes first.
        self.tensors.append(flat[0])
        # A mask or an index has no gradient to turn to.
        self.others.append([t for t in flat[1:] if _is_float(t)])

    def compared_inputs(self):
        """`fed_by`, with None where the call `spreads` or reads a `masked` input:
        the saturation rule's pairs."""
        return [
            None if spreads or masked else fed
            for fed, spreads, masked in zip(self.fed_by, self.spreads, self.masked, strict=True)
        ]

    def __len__(self):
        return len(self.paths)


def _keys(tensor):
    """What identifies a tensor when a later layer takes it: the object, and in a
    traced graph its name, and the name of what a cast (mixed precision) was made from."""
    keys = [id(tensor)]
    op = getattr(tensor, "op", None)
    name = getattr(tensor, "name", None) if op is not None else None
    if isinstance(name, str):
        keys.append(name)
        if getattr(op, "type", None) == "Cast" and len(op.inputs):
            keys.append(op.inputs[0].name)
    return keys


def _resizes(layer, taken, made):
    """Whether `layer` made `made` with another number of entries per sample than `taken`.

    Unknown sizes (images or sequences of any size) compare by shape: a
    global pool over `(batch, None, 64)` to `(batch, 64)` resizes; and a
    layer with a `pool_size` (Keras's pooling layers) resizes whatever the
    shapes say: `(batch, None, None, 4)` in and out of a 12x12 pool.
    """
    try:
        shapes = [tuple(taken.shape)[1:], tuple(made.shape)[1:]]
    except (AttributeError, TypeError, ValueError):
        return False
    if all(isinstance(d, int) for shape in shapes for d in shape):
        return math.prod(shapes[0]) != math.prod(shapes[1])
    return shapes[0] != shapes[1] or getattr(layer, "pool_size", None) is not None


def _is_float(value):
    dtype = getattr(value, "dtype", None)
    return dtype is not None and keras.backend.is_float_dtype(dtype)


def reached_outputs(tensors, others, gradients):
    """The output each row reads: its first, or else the first the loss reaches.

    A layer's row is the gradient with respect to its first output. A layer
    with several outputs may feed the loss through the others alone: Keras's
    sequence-to-sequence recipe keeps only the encoder LSTM's states
    (`_, h, c = LSTM(..., return_state=True)(x)`). Read off the first output,
    that encoder's row was all zeros and its event said no gradient reaches
    it, while its weights trained. Its row is then the gradient with respect
    to the first other output the loss reaches (the state `h`).

    Example:

    ```python
    extra = [t for row in others for t in row]
    gradients = tape.gradient(loss, tensors + extra)
    tensors, gradients = reached_outputs(tensors, others, gradients)
    ```

    Args:
        tensors: One output per row.
        others: For each row, the call's other outputs (`LayerOutputs.others`).
        gradients: The gradients of `tensors`, then of every tensor in
            `others`, row by row (None where the loss does not reach).

    Returns:
        `(tensors, gradients)`, one per row.
    """
    at = len(tensors)
    tensors, chosen = list(tensors), list(gradients[:at])
    for row, alternatives in enumerate(others):
        for tensor, gradient in zip(
            alternatives, gradients[at : at + len(alternatives)], strict=True
        ):
            if chosen[row] is None and gradient is not None:
                tensors[row], chosen[row] = tensor, gradient
        at += len(alternatives)
    return tensors, chosen


@contextlib.contextmanager
def record_layer_outputs(model, layers=None, watch=None):
    """Record the output of every leaf layer called inside the block.

    Example:

    ```python
    with tf.GradientTape() as tape, record_layer_outputs(model) as outputs:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, outputs.tensors)
    ```

    Works eagerly and inside `tf.function` (the wrapper is traced; the compiled
    graph keeps no reference to it once the block ends).

    Args:
        model: The Keras model (or layer) whose leaf layers are recorded.
        layers: Optional list of `(path, layer)` to record instead of
            `leaf_layers(model)`.
        watch: Optional; a tape's `watch`, called on every float output. A
            layer whose output depends on no variable (a `Rescaling` or
            `Flatten` first, a `Concatenate` of the inputs) is otherwise not
            on the tape, and its output gradient reads as unreached.

    Yields:
        A `LayerOutputs`, filled while the block runs.
    """
    outputs = LayerOutputs()
    targets = leaf_layers(model) if layers is None else layers
    patched = []
    # Whether a tape records the block: a call that then runs unrecorded is
    # inside `keras.remat` (`LayerOutputs.untaped`).
    taping = record.could_possibly_record()
    try:
        for path, layer in targets:
            method = _call_method(layer)
            if method in layer.__dict__:
                continue  # already wrapped by an enclosing block
            original = getattr(layer, method)

            def recording_call(*args, _path=path, _layer=layer, _original=original, **kwargs):
                result = _original(*args, **kwargs)
                if in_symbolic_scope():
                    # Keras building an unbuilt model by running its `call`
                    # on placeholders in a scratch graph (`Layer._maybe_build`),
                    # inside the real pass: not a call of that pass, and its
                    # tensors cannot be used outside the scratch graph.
                    return result
                if watch is not None:
                    for tensor in keras.tree.flatten(result):
                        if _is_float(tensor):
                            watch(tensor)
                untaped = taping and not record.could_possibly_record()
                outputs._add(_path, _layer, result, (args, kwargs), untaped)
                return result

            # An instance attribute shadows the class's method; Keras's
            # `Layer.__call__` looks it up on every call.
            object.__setattr__(layer, method, recording_call)
            patched.append((layer, method))
        yield outputs
    finally:
        for layer, method in patched:
            layer.__dict__.pop(method, None)


def _call_method(layer):
    """The name of the method Keras's `Layer.__call__` runs for `layer`.

    A quantized layer (`model.quantize("int8")`, "int4", "float8", ...) runs
    `quantized_call`, never `call`: wrapped in `call` alone, its output was
    not recorded, so it had no row, and `snapshot` of a model whose layers
    were all quantized failed on an empty list of outputs.
    """
    policy = getattr(layer, "dtype_policy", None)
    if getattr(policy, "quantization_mode", None) is not None:
        return "quantized_call"
    return "call"


def ensure_built(model, x):
    """Build `model` by calling it once on `x`, outside any recording block.

    An unbuilt subclassed model runs its `call` a second, symbolic time while
    it builds; doing that first keeps the recorded outputs to the real pass.

    Args:
        model: A Keras model.
        x: One batch of inputs (any structure the model accepts).
    """
    if not model.built:
        model(x, training=False)


def output_values(output):
    """A copy of a model output's values, for dLoss/d(output) through the loss's formula.

    The copy keeps the output's Keras mask: a Keras loss weighs the time steps
    by it (`Embedding(mask_zero=True)` into an LSTM with `return_sequences=True`),
    and without it the copy's gradient was that of the unmasked loss, nonzero at
    the padded steps and of another size.
    """
    copy = tf.identity(output)
    mask = get_keras_mask(output)
    if mask is not None:
        set_keras_mask(copy, mask)
    return copy
