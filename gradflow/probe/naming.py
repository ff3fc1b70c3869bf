"""Name every trainable variable the way gradflow's tables do.

The probe and the monitor must agree on `layer`, `layer_index` and `tensor`
for each variable, or a snapshot and a training history of the same model
would not line up. Both call `variable_names` once per model.
"""

import dataclasses

import keras

from gradflow.probe.capture import leaf_layers, own_trainable_variables


@dataclasses.dataclass(frozen=True)
class VariableName:
    """Where a trainable variable lives, in gradflow's vocabulary.

    Attributes:
        layer: Path of the leaf layer that owns it (`outer/inner` when nested).
        layer_index: Position of that layer in `layer_order(model, called)`;
            0 is nearest the input.
        tensor: The variable's name inside its layer: `kernel`, `bias`,
            `gamma`, `lstm_cell/kernel` in an LSTM, `forward/lstm_cell/kernel`
            in a Bidirectional, `kernel` in a TimeDistributed Dense (a wrapped
            layer's own name, which Keras makes up, is left out).
        variable: The Keras `Variable.path`.
    """

    layer: str
    layer_index: int
    tensor: str
    variable: str


def _wrapped(layer):
    """The layers a Keras wrapper holds, each with the role that names its variables.

    Keras names a wrapped layer itself (`TimeDistributed(Dense(2))` holds
    `dense`, then `dense_1` when the model is built again, and Bidirectional
    holds `forward_lstm` or `forward_lstm_1`), so those names would make two
    runs of one model disagree. The role does not change.
    """
    if isinstance(layer, keras.layers.Bidirectional):
        return [(layer.forward_layer, "forward"), (layer.backward_layer, "backward")]
    if isinstance(layer, keras.layers.Wrapper):
        return [(layer.layer, "")]
    return []


def _tensor_name(layer, variable):
    for inner, role in _wrapped(layer):
        if variable.path.startswith(f"{inner.path}/"):
            name = _tensor_name(inner, variable)
            return f"{role}/{name}" if role else name
    prefix = f"{layer.path}/"
    if variable.path.startswith(prefix):
        return variable.path[len(prefix) :]
    return variable.name


def split_overwritten(variables):
    """`(learned, overwritten)`: `variables` without, then with, `overwrite_with_gradient`.

    Keras's float8 layers (`model.quantize("float8")`) keep scales and amax
    histories as trainable variables whose "gradient" is their next value
    (`Variable.overwrite_with_gradient`): the optimizer assigns it instead of
    taking a step, and leaves it out of clipping. Recorded as gradients, an
    amax history of about 3 joined a layer's gradient norm and its update
    ratio read about 1. gradflow records the learned variables only; a
    train step still hands the others to the optimizer.

    Example:

    >>> layer = keras.layers.Dense(2, name="fp8")
    >>> layer.build((None, 3))
    >>> layer.quantize("float8")
    >>> learned, overwritten = split_overwritten(layer.trainable_variables)
    >>> [v.name for v in learned]
    ['kernel', 'bias']
    >>> len(overwritten)
    6

    Args:
        variables: A list of variables.

    Returns:
        Two lists, each in the order of `variables`.
    """
    learned, overwritten = [], []
    for variable in variables:
        (overwritten if is_overwritten(variable) else learned).append(variable)
    return learned, overwritten


def is_overwritten(variable):
    """Whether the optimizer sets `variable` to its "gradient" (`split_overwritten`)."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def variable_names(model, variables=None, called=None):
    """Name each trainable variable of `model` by its layer and role.

    Example:

    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> [(n.layer, n.tensor) for n in variable_names(model)]
    [('dense', 'kernel'), ('dense', 'bias')]

    Args:
        model: A built Keras model.
        variables: The variables to name, in the order wanted. Defaults to
            `model.trainable_variables`.
        called: Layer paths in the order a forward pass called them, as
            `capture.LayerOutputs.paths` records them; see `layer_order`.

    Returns:
        A list of `VariableName`, aligned with `variables`. A variable owned by
        no leaf layer (one a subclassed model created itself) gets the model's
        own name as `layer` and `layer_index` past the last leaf.
    """
    leaves = _ordered_leaves(model, called)
    owner = {}
    for index, (path, layer) in enumerate(leaves):
        for variable in own_trainable_variables(layer):
            owner.setdefault(id(variable), (path, index, layer))
    if variables is None:
        variables = model.trainable_variables
    names = []
    for variable in variables:
        if id(variable) in owner:
            path, index, layer = owner[id(variable)]
            names.append(VariableName(path, index, _tensor_name(layer, variable), variable.path))
        else:
            names.append(VariableName(model.name, len(leaves), variable.name, variable.path))
    return names


def layer_order(model, called=None):
    """Leaf-layer paths in gradflow's one consistent order (0 nearest the input).

    That is the order in which the forward pass called them, when `called`
    (the recorded paths of one pass: `capture.LayerOutputs.paths`) says it.
    Otherwise, and for layers the pass did not call, the order in which the
    model tracks them: for Sequential and Functional models the same, but a
    subclassed model tracks its layers in the order `__init__` created them,
    which may be head first. Numbered so, a non-finite gradient's origin
    (the layer nearest the loss that has one) and a heatmap's rows would
    follow the attribute order instead of the data's path.

    Args:
        model: A Keras model (or layer).
        called: Optional layer paths (`path` or `path#2` for a second call)
            in call order.
    """
    return [path for path, _ in _ordered_leaves(model, called)]


def _ordered_leaves(model, called):
    leaves = leaf_layers(model)
    if not called:
        return leaves
    first_call = {}
    for position, path in enumerate(called):
        first_call.setdefault(path.split("#")[0], position)
    # Stable: layers never called keep their tracking order, after the others.
    return sorted(leaves, key=lambda leaf: first_call.get(leaf[0], len(called)))
