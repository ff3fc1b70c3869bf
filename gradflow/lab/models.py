"""Build the lab's Keras models, optimizers and losses from a `RunConfig`.

Layers get names people can read in a heatmap: `dense_1` ... `dense_N` (or
`conv_1`, `lstm_1`, ...), `batch_norm_k`, `layer_norm_k`, `activation_k`,
`dropout_k`, `projection_k`, `add_k` and `output`, with 1 nearest the input.

Example:

```python
from gradflow.lab.config import RunConfig
from gradflow.lab.datasets import load_dataset
from gradflow.lab.models import build_model

config = RunConfig(depth=6, activation="sigmoid")
data = load_dataset(config)
model = build_model(config, data)
model.fit(data.x_train, data.y_train, batch_size=config.batch_size, epochs=1)
```

A lab run's model does not depend on the process's global Keras settings
(`~/.keras/keras.json`, `keras.config.set_floatx`, a mixed-precision policy,
`set_image_data_format`): every layer is float32 and channels-last (`_LAYER`,
`_IMAGE`), and so are its loss, metrics and optimizer. A float16 lab model
made the lessons' vanishing-gradient alerts fire on rounding, and a
channels-first CNN read an (8, 8, 1) digit as 8 channels.
"""

import contextlib

import keras

_RNN_LAYERS = {
    "simple_rnn": keras.layers.SimpleRNN,
    "lstm": keras.layers.LSTM,
    "gru": keras.layers.GRU,
}
_OPTIMIZERS = {
    "sgd": (keras.optimizers.SGD, {}),
    "momentum": (keras.optimizers.SGD, {"momentum": 0.9}),
    "nesterov": (keras.optimizers.SGD, {"momentum": 0.9, "nesterov": True}),
    "rmsprop": (keras.optimizers.RMSprop, {}),
    "adam": (keras.optimizers.Adam, {}),
    "adamw": (keras.optimizers.AdamW, {}),
    "adagrad": (keras.optimizers.Adagrad, {}),
    "nadam": (keras.optimizers.Nadam, {}),
}
# Given to every layer the lab builds (see the module docstring).
_LAYER = {"dtype": "float32"}
_IMAGE = {"data_format": "channels_last"}
_CLIPPING_ARGUMENTS = {"value": "clipvalue", "norm": "clipnorm", "global_norm": "global_clipnorm"}
_LOSSES = {
    "sparse_categorical_crossentropy": keras.losses.SparseCategoricalCrossentropy,
    "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
    "binary_crossentropy": keras.losses.BinaryCrossentropy,
    "mse": keras.losses.MeanSquaredError,
    "mae": keras.losses.MeanAbsoluteError,
    "huber": keras.losses.Huber,
}


def build_model(config, dataset):
    """A compiled Keras model for `config`, sized for `dataset`.

    Calls `keras.utils.set_random_seed(config.seed)` first, so the same
    config always starts from the same weights.

    Example:

    ```python
    model = build_model(RunConfig(architecture="cnn", depth=2), data)
    [layer.name for layer in model.layers]
    # ['input', 'conv_1', 'conv_2', 'flatten', 'output']
    ```

    Args:
        config: A `RunConfig`.
        dataset: The `Dataset` from `load_dataset(config)`; gives the input
            shape, the number of classes and the task.

    Returns:
        A compiled functional `keras.Model`: hidden layers as configured
        (`mlp`/`residual_mlp`: Dense, `cnn`: 3x3 Conv2D then Flatten,
        `rnn`: stacked recurrent layers, the last returning its final state),
        then an `output` Dense layer (softmax for classification with a
        cross-entropy or regression loss, sigmoid for binary cross-entropy,
        linear for regression), compiled with `build_optimizer(config)`,
        `build_loss(config, dataset)` and `["accuracy"]` for classification,
        with the variables of its optimizer and metrics already created.

    Raises:
        ValueError: If the loss does not suit the data set's task.
    """
    # The Input, the model, its metrics and the optimizer's learning rate take
    # their dtype from the global settings when they are made: all of it here.
    with _float32_default():
        return _build_model(config, dataset)


def _build_model(config, dataset):
    keras.utils.set_random_seed(config.seed)
    inputs = keras.Input(dataset.input_shape, name="input", dtype="float32")
    hidden = inputs
    if config.architecture != "rnn" and config.architecture != "cnn" and len(inputs.shape) > 2:
        hidden = keras.layers.Flatten(name="flatten", **_IMAGE, **_LAYER)(hidden)
    for index in range(1, config.depth + 1):
        hidden = _hidden_block(config, hidden, index)
    if config.architecture == "cnn":
        hidden = keras.layers.Flatten(name="flatten", **_IMAGE, **_LAYER)(hidden)
    units, activation = _output_units(config, dataset)
    outputs = keras.layers.Dense(
        units, activation=activation, name="output", **_kernel_arguments(config), **_LAYER
    )(hidden)
    model = keras.Model(
        inputs, outputs, name=f"{config.architecture}_{config.depth}x{config.width}"
    )
    model.compile(
        optimizer=build_optimizer(config),
        loss=build_loss(config, dataset),
        metrics=["accuracy"] if dataset.task == "classification" else None,
    )
    _build_for_training(model, dataset)
    return model


@contextlib.contextmanager
def _float32_default():
    """`keras.config.floatx()` and the global dtype policy are float32 inside (put back after).

    The policy too: under `mixed_float16`, `compile` wrapped the optimizer in a
    `LossScaleOptimizer` and the model itself took the mixed policy.
    """
    before, policy = keras.config.floatx(), keras.config.dtype_policy()
    if before == "float32" and policy.name == "float32":
        yield
        return
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("float32")
    try:
        yield
    finally:
        keras.config.set_floatx(before)
        keras.config.set_dtype_policy(policy)


def _build_for_training(model, dataset):
    """Creates the optimizer's and the compiled metrics' variables now.

    Left alone, Keras (TensorFlow backend, no distribution strategy) creates
    them inside the first traced train step, and TensorFlow traces a function
    that creates variables a second time: about 40% of the wait for a run's
    first step. Keras's own symbolic build, which it runs under a
    distribution strategy, creates the same variables without running a step
    (no weight, metric state or random state changes).
    """
    symbolic_build = getattr(model, "_symbolic_build", None)
    if symbolic_build is None:  # A Keras without it: the optimizer at least.
        model.optimizer.build(model.trainable_variables)
        return
    symbolic_build(data_batch=(dataset.x_train[:1], dataset.y_train[:1], None))


def build_optimizer(config):
    """The Keras optimizer that `config` names, with its learning rate and clipping.

    Example:

    >>> build_optimizer(RunConfig(optimizer="nesterov", clipping="norm", clip_value=1.0))
    # SGD(momentum=0.9, nesterov=True, clipnorm=1.0)

    Args:
        config: A `RunConfig`; reads `optimizer`, `learning_rate`, `clipping`
            and `clip_value`.

    Returns:
        A fresh `keras.optimizers.Optimizer`. `"momentum"` is SGD with
        momentum 0.9 and `"nesterov"` adds `nesterov=True`. Clipping maps to
        Keras's `clipvalue` (`"value"`), `clipnorm` (`"norm"`, per variable)
        or `global_clipnorm` (`"global_norm"`).
    """
    optimizer_class, arguments = _OPTIMIZERS[config.optimizer]
    arguments = dict(arguments, learning_rate=config.learning_rate)
    if config.clipping != "none":
        arguments[_CLIPPING_ARGUMENTS[config.clipping]] = config.clip_value
    return optimizer_class(**arguments)


def build_loss(config, dataset):
    """The Keras loss for `config` and the task of `dataset`.

    Args:
        config: A `RunConfig`; reads `loss`.
        dataset: A `Dataset`; `"auto"` means sparse categorical cross-entropy
            (on probabilities, `from_logits=False`) for classification and
            mean squared error for regression.

    Returns:
        A `keras.losses.Loss`.

    Raises:
        ValueError: If a cross-entropy loss is asked for a regression task.
    """
    name = config.loss
    if name == "auto":
        name = "sparse_categorical_crossentropy" if dataset.task == "classification" else "mse"
    if dataset.task == "regression" and "crossentropy" in name:
        raise ValueError(
            f"`loss={config.loss!r}` is for classification, but the data set is a regression "
            "task; use 'auto', 'mse', 'mae' or 'huber'."
        )
    return _LOSSES[name](dtype="float32")


def _hidden_block(config, inputs, index):
    """One hidden layer with its normalization, activation, dropout and skip."""
    last = index == config.depth
    normalized = config.normalization != "none"
    # BatchNorm subtracts the batch mean, and with it any bias added before it:
    # that bias's gradient is float32 round-off (1e-8), a row that looked
    # vanished on the heatmaps of a lesson about normalization. Its beta is
    # the bias. (LayerNorm keeps a bias that differs between features.)
    bias = config.normalization != "batch"
    if config.architecture == "rnn":
        layer = _RNN_LAYERS[config.rnn_cell](
            config.width,
            activation=config.activation,
            return_sequences=not last,
            name=f"{config.rnn_cell}_{index}",
            **_kernel_arguments(config),
            **_LAYER,
        )
    elif config.architecture == "cnn":
        layer = keras.layers.Conv2D(
            config.width,
            3,
            padding="same",
            activation=None if normalized else config.activation,
            use_bias=bias,
            name=f"conv_{index}",
            **_kernel_arguments(config, filters=True),
            **_IMAGE,
            **_LAYER,
        )
    else:
        layer = keras.layers.Dense(
            config.width,
            activation=None if normalized else config.activation,
            use_bias=bias,
            name=f"dense_{index}",
            **_kernel_arguments(config),
            **_LAYER,
        )
    outputs = layer(inputs)
    if config.normalization == "batch":
        # axis=-1 (the default) is the channels of a channels-last convolution.
        outputs = keras.layers.BatchNormalization(name=f"batch_norm_{index}", **_LAYER)(outputs)
    elif config.normalization == "layer":
        outputs = keras.layers.LayerNormalization(name=f"layer_norm_{index}", **_LAYER)(outputs)
    # A recurrent cell applies its activation itself; Dense and Conv2D get it
    # after the normalization, as in the BatchNorm paper.
    if normalized and config.architecture != "rnn":
        outputs = keras.layers.Activation(config.activation, name=f"activation_{index}", **_LAYER)(
            outputs
        )
    if config.dropout > 0:
        outputs = keras.layers.Dropout(config.dropout, name=f"dropout_{index}", **_LAYER)(outputs)
    # The last recurrent layer returns only its final state, which has no
    # sequence axis to add the input to.
    if config.residual_connections and not (config.architecture == "rnn" and last):
        outputs = keras.layers.Add(name=f"add_{index}", **_LAYER)(
            [_skip(config, inputs, index), outputs]
        )
    return outputs


def _skip(config, inputs, index):
    """The identity, or a linear projection where the width changes."""
    if inputs.shape[-1] == config.width:
        return inputs
    if config.architecture == "cnn":
        projection = keras.layers.Conv2D(
            config.width,
            1,
            use_bias=False,
            name=f"projection_{index}",
            **_kernel_arguments(config, filters=True),
            **_IMAGE,
            **_LAYER,
        )
    else:
        projection = keras.layers.Dense(
            config.width,
            use_bias=False,
            name=f"projection_{index}",
            **_kernel_arguments(config),
            **_LAYER,
        )
    return projection(inputs)


def _kernel_arguments(config, filters=False):
    """Initializer and max-norm of a kernel; `filters`: a convolution's (h, w, in, out) kernel."""
    if config.initializer == "random_normal":
        initializer = keras.initializers.RandomNormal(stddev=config.init_stddev)
    else:
        initializer = keras.initializers.get(config.initializer)
    arguments = {"kernel_initializer": initializer}
    if config.max_norm is not None:
        # MaxNorm caps each unit's incoming weights: a Dense kernel's columns
        # (axis 0, the default), a convolution's whole filters (axes 0-2;
        # with the default it capped each filter's columns of height only).
        axis = [0, 1, 2] if filters else 0
        arguments["kernel_constraint"] = keras.constraints.MaxNorm(config.max_norm, axis=axis)
    return arguments


def _output_units(config, dataset):
    if dataset.task == "regression":
        return int(dataset.y_train.shape[-1]), "linear"
    if config.loss == "binary_crossentropy":
        return 1, "sigmoid"
    return int(dataset.n_classes), "softmax"
