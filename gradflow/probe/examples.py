"""Small ready-made models with a batch, for the Inspect page and for trying gradflow.

Each example is the kind of model people get stuck on: a subclassed model
whose layers were never called symbolically, a recurrent network with a
hand-written cell, a nested model, a residual CNN with BatchNorm.

Every layer is float32 and channels-last (`_F32`, `_LAST`), whatever the
global Keras config (`~/.keras/keras.json`, `keras.config.set_floatx`,
`set_image_data_format`): the examples show the same numbers everywhere.
"""

import dataclasses

import keras
import numpy as np
import tensorflow as tf

_F32 = {"dtype": "float32"}
_LAST = {"data_format": "channels_last"}


@dataclasses.dataclass
class Example:
    """A model, one batch and the loss to differentiate."""

    model: keras.Model
    x: np.ndarray
    y: np.ndarray
    loss: keras.losses.Loss


class MinimalCell(keras.layers.Layer):
    """A hand-written Elman cell, as in the Keras RNN guide."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.recurrent_kernel = self.add_weight(
            shape=(self.units, self.units), name="recurrent_kernel"
        )

    def call(self, inputs, states):
        output = tf.tanh(inputs @ self.kernel + states[0] @ self.recurrent_kernel)
        return output, [output]


class SequenceClassifier(keras.Model):
    """A subclassed model around `keras.layers.RNN` with a hand-written cell."""

    def __init__(self, units=16, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.rnn = keras.layers.RNN(MinimalCell(units, **_F32), name="rnn", **_F32)
        self.head = keras.Sequential(
            [
                keras.layers.Dense(units, activation="relu", **_F32),
                keras.layers.Dense(classes, **_F32),
            ],
            name="head",
        )

    def call(self, inputs):
        return self.head(self.rnn(inputs))


def _mnist_mlp(rng):
    model = keras.Sequential(
        [keras.Input((28, 28), **_F32), keras.layers.Flatten(**_LAST, **_F32)]
        + [keras.layers.Dense(32, activation="relu", **_F32) for _ in range(5)]
        + [keras.layers.Dense(10, activation="softmax", **_F32)]
    )
    x = rng.random((32, 28, 28), dtype=np.float32)
    y = keras.utils.to_categorical(rng.integers(0, 10, 32), 10)
    return Example(model, x, y, keras.losses.CategoricalCrossentropy(**_F32))


def _subclassed_rnn(rng):
    model = SequenceClassifier(**_F32)
    x = rng.normal(size=(16, 12, 4)).astype("float32")
    y = rng.integers(0, 3, 16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, **_F32)
    return Example(model, x, y, loss)


def _bidirectional_lstm(rng):
    model = keras.Sequential(
        [
            keras.Input((20, 3), **_F32),
            keras.layers.Bidirectional(keras.layers.LSTM(8, return_sequences=True, **_F32), **_F32),
            keras.layers.GRU(8, **_F32),
            keras.layers.Dense(1, **_F32),
        ]
    )
    x = rng.normal(size=(16, 20, 3)).astype("float32")
    y = x.sum(axis=(1, 2))[:, None].astype("float32")
    return Example(model, x, y, keras.losses.MeanSquaredError(**_F32))


def _residual_cnn(rng):
    inputs = keras.Input((8, 8, 1), **_F32)
    h = keras.layers.Conv2D(
        8, 3, padding="same", activation="relu", name="conv_1", **_LAST, **_F32
    )(inputs)
    r = keras.layers.Conv2D(8, 3, padding="same", name="conv_2", **_LAST, **_F32)(h)
    r = keras.layers.BatchNormalization(name="batch_norm", **_F32)(r)  # axis -1: channels
    h = keras.layers.Add(name="residual_add", **_F32)([h, r])
    h = keras.layers.Activation("relu", name="relu", **_F32)(h)
    h = keras.layers.MaxPooling2D(name="pool", **_LAST, **_F32)(h)
    h = keras.layers.Flatten(name="flatten", **_LAST, **_F32)(h)
    h = keras.layers.Dropout(0.2, name="dropout", **_F32)(h)
    outputs = keras.layers.Dense(10, activation="softmax", name="output", **_F32)(h)
    x = rng.random((32, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, 32)
    loss = keras.losses.SparseCategoricalCrossentropy(**_F32)
    return Example(keras.Model(inputs, outputs, name="residual_cnn"), x, y, loss)


EXAMPLES = {
    "MNIST-shaped MLP (5 × Dense 32, relu)": _mnist_mlp,
    "Subclassed model: RNN with a hand-written cell": _subclassed_rnn,
    "Bidirectional LSTM + GRU (regression)": _bidirectional_lstm,
    "Residual CNN with BatchNorm and Dropout": _residual_cnn,
}


def load_example(name, seed=0):
    """Build one of `EXAMPLES` with its batch.

    Args:
        name: A key of `EXAMPLES`.
        seed: Seed for the weights and the batch. Defaults to 0.

    Returns:
        An `Example`.

    Raises:
        ValueError: for an unknown name.
    """
    if name not in EXAMPLES:
        raise ValueError(f"`name` must be one of {list(EXAMPLES)}, got {name!r}.")
    keras.utils.set_random_seed(seed)
    return EXAMPLES[name](np.random.default_rng(seed))
