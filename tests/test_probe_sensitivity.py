"""input_sensitivity against an eager per-layer loop written here."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradflow.probe.sensitivity import InputSensitivity, input_sensitivity


def per_layer_loop(layers_in_order, x):
    """max |d sum(layer output)/dx| with one plain persistent tape."""
    x = (
        {k: tf.constant(v, tf.float32) for k, v in x.items()}
        if isinstance(x, dict)
        else tf.constant(x, tf.float32)
    )
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        sums = [tf.reduce_sum(h) for h in layers_in_order(x)]
    maxima = []
    for total in sums:
        gradients = tf.nest.flatten(tape.gradient(total, x, unconnected_gradients="zero"))
        maxima.append(max(np.abs(g.numpy()).max() for g in gradients))
    return maxima


def deep_tanh_mlp():
    layers = [keras.layers.Dense(6, activation="tanh", name=f"d{i}") for i in range(4)]
    model = keras.Sequential([keras.Input((3,))] + layers)
    x = np.random.default_rng(0).normal(size=(5, 3))

    def outputs(x):
        found, h = [], x
        for layer in layers:
            h = layer(h)
            found.append(h)
        return found

    return model, x, outputs, [f"d{i}" for i in range(4)]


class Tower(keras.Model):
    def __init__(self):
        super().__init__(name="tower")
        self.conv = keras.layers.Conv2D(2, 3, activation="relu", name="conv")
        self.pool = keras.layers.GlobalAveragePooling2D(name="pool")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.pool(self.conv(x)))


def subclassed_cnn():
    model = Tower()
    x = np.random.default_rng(1).normal(size=(3, 5, 5, 1))

    def outputs(x):
        c = model.conv(x)
        p = model.pool(c)
        return [c, p, model.head(p)]

    return model, x, outputs, ["conv", "pool", "head"]


def two_inputs():
    a_in, b_in = keras.Input((2,), name="a"), keras.Input((3,), name="b")
    left = keras.layers.Dense(2, name="left")
    joined = keras.layers.Concatenate(name="join")
    out = keras.layers.Dense(1, name="out")
    model = keras.Model({"a": a_in, "b": b_in}, out(joined([left(a_in), b_in])))
    rng = np.random.default_rng(2)
    x = {"a": rng.normal(size=(4, 2)), "b": rng.normal(size=(4, 3))}

    def outputs(x):
        branch = left(x["a"])
        j = joined([branch, x["b"]])
        return [branch, j, out(j)]

    return model, x, outputs, ["left", "join", "out"]


CASES = [deep_tanh_mlp, subclassed_cnn, two_inputs]


@pytest.mark.parametrize("build", CASES, ids=[c.__name__ for c in CASES])
def test_matches_per_layer_tape(build):
    model, x, outputs, paths = build()
    table = input_sensitivity(model, x)
    assert list(table.columns) == ["layer", "layer_index", "max_abs"]
    assert list(table["layer"]) == paths
    np.testing.assert_allclose(table["max_abs"], per_layer_loop(outputs, x), rtol=1e-5, atol=1e-7)


def test_reused_probe_follows_new_batches_and_batch_sizes():
    model, x, outputs, _ = deep_tanh_mlp()
    probe = InputSensitivity(model)
    for batch in (x, 3.0 * x, x[:2]):
        np.testing.assert_allclose(
            probe(batch)["max_abs"], per_layer_loop(outputs, batch), rtol=1e-5
        )


def test_training_pass_restores_batchnorm_statistics():
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)]
    )
    before = [v.numpy().copy() for v in model.non_trainable_variables]
    input_sensitivity(model, np.random.default_rng(3).normal(size=(4, 3)) + 5.0, training=True)
    for variable, value in zip(model.non_trainable_variables, before, strict=True):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_integer_input_is_explained():
    model = keras.Sequential(
        [keras.Input((4,), dtype="int32"), keras.layers.Embedding(5, 2), keras.layers.Flatten()]
    )
    with pytest.raises(ValueError, match="int32.*Embedding|Embedding.*int32"):
        input_sensitivity(model, np.zeros((2, 4), "int32"))


def test_softmax_outputs_are_noted_not_read_as_deaf():
    """A softmax output sums to 1, so d(sum)/dx is 0 for any input: the table
    and the chart say so instead of suggesting the layer ignores its input."""
    from gradflow.figures.lessons import sensitivity_bars

    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            hidden,
            keras.layers.Dense(3, name="logits"),
            keras.layers.Softmax(name="probabilities"),
        ]
    )
    x = np.random.default_rng(2).normal(size=(4, 3))
    table = input_sensitivity(model, x)
    rows = table.set_index("layer")
    assert rows.loc["probabilities", "max_abs"] < 1e-6  # 0 up to rounding
    assert "softmax" in rows.loc["probabilities", "note"]
    assert rows.loc["hidden", "note"] == "" and rows.loc["logits", "note"] == ""
    assert rows.loc["hidden", "max_abs"] > 1e-3
    assert "softmax" in sensitivity_bars(table).description

    dense_softmax = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, activation="softmax")]
    )
    assert "softmax" in input_sensitivity(dense_softmax, x)["note"].iloc[0]
    assert "note" not in input_sensitivity(deep_tanh_mlp()[0], x)
    assert "softmax" not in sensitivity_bars(input_sensitivity(deep_tanh_mlp()[0], x)).description


def test_normalization_layers_are_noted_not_read_as_deaf():
    """A LayerNormalization read about 2e-7 between neighbours of about 2, and 52 of
    ResNet50's BatchNormalization layers read 0 in training mode, with no note."""
    from gradflow.figures.lessons import sensitivity_bars

    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(6, activation="tanh", name="hidden"),
            keras.layers.LayerNormalization(name="layer_norm"),
            keras.layers.Dense(6, name="more"),
            keras.layers.BatchNormalization(name="batch_norm"),
            keras.layers.Dense(2, name="logits"),
        ]
    )
    x = np.random.default_rng(3).normal(size=(8, 3))
    for training in (False, True):
        rows = input_sensitivity(model, x, training=training).set_index("layer")
        assert rows.loc["layer_norm", "max_abs"] < 1e-5 < rows.loc["hidden", "max_abs"]
        assert "LayerNormalization" in rows.loc["layer_norm", "note"]
        assert rows.loc["hidden", "note"] == rows.loc["more", "note"] == ""
        if training:
            assert rows.loc["batch_norm", "max_abs"] < 1e-5
            assert "BatchNormalization" in rows.loc["batch_norm", "note"]
        else:  # on its moving statistics it is an affine map: its value means something
            assert rows.loc["batch_norm", "note"] == "" and rows.loc["batch_norm", "max_abs"] > 1e-3
    assert "normalization's output" in sensitivity_bars(rows.reset_index()).description
