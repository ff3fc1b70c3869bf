"""build_model / build_optimizer / build_loss, checked against plain tf.GradientTape updates."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradflow.lab.config import RunConfig
from gradflow.lab.datasets import load_dataset
from gradflow.lab.models import build_loss, build_model, build_optimizer


def _build(**changes):
    config = RunConfig(**changes)
    data = load_dataset(config)
    return config, data, build_model(config, data)


@pytest.mark.parametrize(
    "changes, names",
    [
        ({"depth": 2, "width": 8}, ["input", "dense_1", "dense_2", "output"]),
        (
            {"depth": 2, "width": 8, "normalization": "batch", "dropout": 0.2},
            [
                "input",
                "dense_1",
                "batch_norm_1",
                "activation_1",
                "dropout_1",
                "dense_2",
                "batch_norm_2",
                "activation_2",
                "dropout_2",
                "output",
            ],
        ),
        (
            {"depth": 2, "width": 8, "normalization": "layer"},
            [
                "input",
                "dense_1",
                "layer_norm_1",
                "activation_1",
                "dense_2",
                "layer_norm_2",
                "activation_2",
                "output",
            ],
        ),
        (
            {"architecture": "residual_mlp", "depth": 2, "width": 8},
            ["input", "dense_1", "projection_1", "add_1", "dense_2", "add_2", "output"],
        ),
        (
            {"architecture": "cnn", "depth": 2, "width": 4},
            ["input", "conv_1", "conv_2", "flatten", "output"],
        ),
        (
            {"architecture": "rnn", "rnn_cell": "gru", "depth": 2, "width": 4},
            ["input", "gru_1", "gru_2", "output"],
        ),
    ],
)
def test_layers_are_named_for_people(changes, names):
    _, _, model = _build(**changes)
    assert sorted(layer.name for layer in model.layers) == sorted(names)
    assert model.layers[-1].name == "output"


@pytest.mark.parametrize(
    "changes, output_shape, activation",
    [
        ({}, (None, 10), "softmax"),
        ({"dataset": "moons", "loss": "binary_crossentropy"}, (None, 1), "sigmoid"),
        ({"dataset": "regression"}, (None, 1), "linear"),
        ({"architecture": "rnn", "dataset": "adding", "sequence_length": 5}, (None, 1), "linear"),
    ],
)
def test_output_layer_suits_the_task(changes, output_shape, activation):
    _, data, model = _build(depth=1, width=4, n_samples=40, **changes)
    assert model.output_shape == output_shape
    assert model.get_layer("output").activation.__name__ == activation
    predictions = model.predict(data.x_val[:3], verbose=0)
    assert predictions.shape == (3, output_shape[1])


def test_rnn_stack_returns_sequences_until_the_last_layer():
    _, _, model = _build(architecture="rnn", rnn_cell="lstm", depth=3, width=4, residual=True)
    assert [model.get_layer(f"lstm_{k}").return_sequences for k in (1, 2, 3)] == [True, True, False]
    # Skips around the sequence layers only; the first one needs a projection (8 -> 4).
    assert {layer.name for layer in model.layers if layer.name.startswith(("add", "proj"))} == {
        "projection_1",
        "add_1",
        "add_2",
    }


def test_residual_block_adds_its_input():
    _, data, model = _build(architecture="residual_mlp", depth=2, width=64, activation="tanh")
    x = data.x_val[:5]
    probe = keras.Model(
        model.input, [model.get_layer(name).output for name in ("add_1", "dense_2", "add_2")]
    )
    add_1, dense_2, add_2 = (np.asarray(a) for a in probe(x))
    # Input width 64 = layer width: no projection, the skip is the identity.
    assert "projection_1" not in [layer.name for layer in model.layers]
    np.testing.assert_allclose(add_2, add_1 + dense_2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        add_1
        - np.tanh(
            x @ model.get_layer("dense_1").kernel.numpy() + model.get_layer("dense_1").bias.numpy()
        ),
        x,
        rtol=1e-5,
        atol=1e-5,
    )


def test_same_seed_same_weights_other_seed_other_weights():
    weights = [
        [w.numpy() for w in _build(depth=2, width=8, seed=seed)[2].weights] for seed in (1, 1, 2)
    ]
    for a, b in zip(weights[0], weights[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(weights[0][0], weights[2][0])


@pytest.mark.parametrize("stddev", [0.01, 1.0])
def test_random_normal_uses_init_stddev(stddev):
    _, _, model = _build(depth=1, width=256, initializer="random_normal", init_stddev=stddev)
    kernel = model.get_layer("dense_1").kernel.numpy()
    assert kernel.std() == pytest.approx(stddev, rel=0.05)


@pytest.mark.parametrize(
    "changes, expected_class, attributes",
    [
        ({"optimizer": "sgd"}, keras.optimizers.SGD, {"momentum": 0.0, "nesterov": False}),
        ({"optimizer": "momentum"}, keras.optimizers.SGD, {"momentum": 0.9, "nesterov": False}),
        ({"optimizer": "nesterov"}, keras.optimizers.SGD, {"momentum": 0.9, "nesterov": True}),
        ({"optimizer": "adam"}, keras.optimizers.Adam, {}),
        ({"optimizer": "adamw"}, keras.optimizers.AdamW, {}),
        ({"optimizer": "rmsprop"}, keras.optimizers.RMSprop, {}),
        ({"optimizer": "adagrad"}, keras.optimizers.Adagrad, {}),
        ({"optimizer": "nadam"}, keras.optimizers.Nadam, {}),
        ({"clipping": "value", "clip_value": 0.5}, keras.optimizers.SGD, {"clipvalue": 0.5}),
        ({"clipping": "norm", "clip_value": 2.0}, keras.optimizers.SGD, {"clipnorm": 2.0}),
        ({"clipping": "global_norm"}, keras.optimizers.SGD, {"global_clipnorm": 1.0}),
        ({}, keras.optimizers.SGD, {"clipvalue": None, "clipnorm": None, "global_clipnorm": None}),
    ],
)
def test_build_optimizer(changes, expected_class, attributes):
    optimizer = build_optimizer(RunConfig(learning_rate=0.02, **changes))
    assert type(optimizer) is expected_class
    assert float(optimizer.learning_rate) == pytest.approx(0.02)
    for name, value in attributes.items():
        assert getattr(optimizer, name) == value, name


@pytest.mark.parametrize(
    "changes, expected_class",
    [
        ({}, keras.losses.SparseCategoricalCrossentropy),
        ({"dataset": "regression"}, keras.losses.MeanSquaredError),
        ({"loss": "categorical_crossentropy"}, keras.losses.CategoricalCrossentropy),
        ({"loss": "mae"}, keras.losses.MeanAbsoluteError),
        ({"loss": "huber"}, keras.losses.Huber),
    ],
)
def test_build_loss(changes, expected_class):
    config = RunConfig(n_samples=20, **changes)
    loss = build_loss(config, load_dataset(config))
    assert type(loss) is expected_class
    if expected_class is keras.losses.SparseCategoricalCrossentropy:
        assert loss.get_config()["from_logits"] is False


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"clipping": "global_norm", "clip_value": 0.01},
        {"clipping": "value", "clip_value": 1e-3},
        {"loss": "mse"},
    ],
)
def test_one_training_step_matches_a_plain_tape(changes):
    config, data, model = _build(depth=2, width=8, learning_rate=0.5, **changes)
    x, y = data.x_train[:16], data.y_train[:16]
    before = [v.numpy() for v in model.trainable_variables]
    # Reference: the compiled loss by hand, gradients from a tape, SGD by hand.
    if config.loss == "mse":

        def reference_loss(y_true, y_pred):
            return tf.reduce_mean(tf.reduce_mean(tf.square(y_true - y_pred), axis=-1))
    else:

        def reference_loss(y_true, y_pred):
            picked = tf.gather(y_pred, tf.cast(y_true, tf.int32), batch_dims=1)
            return -tf.reduce_mean(tf.math.log(picked))

    with tf.GradientTape() as tape:
        loss = reference_loss(y, model(x, training=True))
    gradients = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    if config.clipping == "global_norm":
        norm = np.sqrt(sum(np.sum(g**2) for g in gradients))
        gradients = [g * min(1.0, config.clip_value / norm) for g in gradients]
    elif config.clipping == "value":
        gradients = [np.clip(g, -config.clip_value, config.clip_value) for g in gradients]
    reported = model.train_on_batch(x, y, return_dict=True)["loss"]
    assert reported == pytest.approx(float(loss), rel=1e-5)
    for variable, start, gradient in zip(model.trainable_variables, before, gradients, strict=True):
        np.testing.assert_allclose(
            variable.numpy(), start - 0.5 * gradient, rtol=1e-4, atol=1e-6, err_msg=variable.path
        )


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"optimizer": "adam", "normalization": "batch", "dropout": 0.2},
        {"architecture": "cnn", "depth": 1},
    ],
)
def test_the_first_fit_traces_its_train_step_once(changes):
    # Variables first created inside a traced step make TensorFlow trace it again.
    _, data, model = _build(width=8, **changes)
    traced = []
    keras_step = model.train_step

    def counted(batch):
        traced.append(1)  # Python runs only while TensorFlow traces.
        return keras_step(batch)

    model.train_step = counted
    model.fit(data.x_train[:64], data.y_train[:64], batch_size=16, epochs=2, verbose=0)
    assert len(traced) == 1


def test_max_norm_constrains_kernels_after_each_update():
    _, data, model = _build(depth=2, width=8, max_norm=0.5, learning_rate=50.0)
    model.train_on_batch(data.x_train[:32], data.y_train[:32])
    for name in ("dense_1", "dense_2", "output"):
        column_norms = np.linalg.norm(model.get_layer(name).kernel.numpy(), axis=0)
        assert column_norms.max() <= 0.5 + 1e-5, name


def test_max_norm_caps_each_convolution_filter_whole():
    """Keras's default axis capped each filter's columns of height, not the filter."""
    _, data, model = _build(
        architecture="cnn", dataset="digits", depth=2, width=4, max_norm=0.5, learning_rate=50.0
    )
    model.train_on_batch(data.x_train[:32], data.y_train[:32])
    for name in ("conv_1", "conv_2"):
        kernel = model.get_layer(name).kernel.numpy()  # (height, width, in, out)
        filter_norms = np.sqrt((kernel**2).sum(axis=(0, 1, 2)))
        assert filter_norms.max() <= 0.5 + 1e-5, (name, filter_norms)


def test_cross_entropy_on_regression_file_data_is_rejected():
    config = RunConfig(dataset="file", data_path="unused.npz", loss="categorical_crossentropy")
    data = load_dataset(RunConfig(dataset="regression", n_samples=20))
    with pytest.raises(ValueError, match="is for classification, but the data set is a regression"):
        build_model(config, data)


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "residual_mlp"])
def test_a_layer_before_batch_norm_has_no_bias_to_show_as_vanished(architecture):
    """BatchNorm subtracts the batch mean, and a bias added before it with it: its gradient
    was float32 round-off, 1e-8, a row that read as vanished in a normalization lesson."""
    for normalization, biased in (("batch", False), ("layer", True), ("none", True)):
        config, _, model = _build(
            architecture=architecture, depth=2, width=4, normalization=normalization
        )
        hidden = [layer for layer in model.layers if layer.name.startswith(("dense_", "conv_"))]
        assert len(hidden) == 2
        assert all(layer.use_bias == biased for layer in hidden), normalization
    # Batch norm's own beta is the bias, and it learns.
    assert any(
        w.path.endswith("beta")
        for w in _build(architecture=architecture, normalization="batch")[2].trainable_weights
    )
