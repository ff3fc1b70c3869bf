"""snapshot() against a plain tf.GradientTape written here, on a table of models.

Every reference below runs the model layer by layer on one eager tape, keeps
each layer's output, and takes the gradients directly; statistics come from
numpy. Nothing in the reference goes through gradflow.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradflow
from gradflow.probe.sensitivity import input_sensitivity
from gradflow.probe.snapshot import Snapshot

RTOL = 1e-5
STATISTICS = ["max_abs", "l2_norm", "mean_abs", "std", "zero_fraction", "nonfinite"]


def numpy_statistics(gradient):
    g = np.asarray(gradient, dtype=np.float64).ravel()
    return [
        np.abs(g).max(),
        np.sqrt(np.sum(g**2)),
        np.abs(g).mean(),
        g.std(),
        np.mean(g == 0),
        np.sum(~np.isfinite(g)),
    ]


def assert_statistics(table, gradients, label):
    assert len(table) == len(gradients), label
    expected = np.array([numpy_statistics(g) for g in gradients])
    # atol: a float32 mean of entries that cancel is only good to ~1e-7 x scale.
    atol = 1e-6 * np.nanmax(np.abs(expected[:, :4]))
    np.testing.assert_allclose(
        table[STATISTICS].to_numpy(np.float64), expected, rtol=RTOL, atol=atol, err_msg=label
    )


# ---------------------------------------------------------------- the models


def sequential_forward(model):
    """Reference forward pass of a Sequential model: each layer by hand."""

    def forward(x):
        h, outputs = x, []
        for layer in model.layers:
            h = layer(h, training=False)
            outputs.append((layer.name, h))
        return outputs, h

    return forward


def mnist_mlp():
    layers = [keras.Input((28, 28)), keras.layers.Flatten(name="flatten")]
    layers += [keras.layers.Dense(32, activation="relu", name=f"hidden_{i}") for i in range(5)]
    layers += [keras.layers.Dense(10, activation="softmax", name="classes")]
    model = keras.Sequential(layers, name="mlp")
    rng = np.random.default_rng(1)
    x = rng.random((8, 28, 28), dtype=np.float32)
    y = keras.utils.to_categorical(rng.integers(0, 10, 8), 10)
    return model, x, y, keras.losses.CategoricalCrossentropy(), sequential_forward(model)


def two_dense_mse():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(20, name="wide"), keras.layers.Dense(5, name="out")]
    )
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 5))
    return model, x, y, "mse", sequential_forward(model)


class MinimalCell(keras.layers.Layer):
    """A hand-written Elman cell: h = tanh(x W + h U + b)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.recurrent_kernel = self.add_weight(
            shape=(self.units, self.units), name="recurrent_kernel"
        )
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

    def call(self, inputs, states):
        h = tf.tanh(inputs @ self.kernel + states[0] @ self.recurrent_kernel + self.bias)
        return h, [h]


class CellModel(keras.Model):
    def __init__(self):
        super().__init__(name="cell_model")
        self.rnn = keras.layers.RNN(MinimalCell(6), name="rnn")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.rnn(x))


def subclassed_rnn_cell():
    model = CellModel()  # never called symbolically
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(5, 7, 3)), rng.normal(size=(5, 2))

    def forward(x):
        h = model.rnn(x)
        out = model.head(h)
        return [("rnn", h), ("head", out)], out

    return model, x, y, keras.losses.MeanSquaredError(), forward


class Nested(keras.Model):
    def __init__(self):
        super().__init__(name="nested")
        self.body = keras.Sequential(
            [keras.layers.Dense(8, activation="tanh", name="d1"), keras.layers.Dense(4, name="d2")],
            name="body",
        )
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.body(x))


def nested_model():
    model = Nested()
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(6, 3)), rng.normal(size=(6, 1))

    def forward(x):
        a = model.body.layers[0](x)
        b = model.body.layers[1](a)
        out = model.head(b)
        return [("body/d1", a), ("body/d2", b), ("head", out)], out

    return model, x, y, "mean_squared_error", forward


def bidirectional_lstm():
    model = keras.Sequential(
        [
            keras.Input((5, 3)),
            keras.layers.Bidirectional(keras.layers.LSTM(4), name="bilstm"),
            keras.layers.Dense(3, activation="softmax", name="classes"),
        ]
    )
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(4, 5, 3)), rng.integers(0, 3, 4)
    return model, x, y, "sparse_categorical_crossentropy", sequential_forward(model)


def recurrent_conv1d():
    model = keras.Sequential(
        [
            keras.Input((8, 2)),
            keras.layers.Conv1D(3, 3, activation="relu", name="conv1d"),
            keras.layers.SimpleRNN(4, return_sequences=True, name="simple_rnn"),
            keras.layers.GRU(3, name="gru"),
            keras.layers.Dense(1, activation="sigmoid", name="prob"),
        ]
    )
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(4, 8, 2)), rng.integers(0, 2, (4, 1)).astype("float32")
    return model, x, y, "binary_crossentropy", sequential_forward(model)


def residual_conv_bn():
    conv_a = keras.layers.Conv2D(4, 3, padding="same", name="conv_a")
    norm = keras.layers.BatchNormalization(name="norm")
    relu = keras.layers.Activation("relu", name="relu")
    conv_b = keras.layers.Conv2D(4, 3, padding="same", name="conv_b")
    add = keras.layers.Add(name="add")
    pool = keras.layers.MaxPooling2D(name="pool")
    drop = keras.layers.Dropout(0.5, name="drop")
    flat = keras.layers.Flatten(name="flat")
    head = keras.layers.Dense(2, name="head")
    inputs = keras.Input((6, 6, 1))
    a = relu(norm(conv_a(inputs)))
    outputs = head(flat(drop(pool(add([a, conv_b(a)])))))
    model = keras.Model(inputs, outputs, name="residual")
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(4, 6, 6, 1)), rng.normal(size=(4, 2))
    # Give the moving statistics values that differ from batch statistics.
    norm.moving_mean.assign(np.full(4, 0.3, np.float32))
    norm.moving_variance.assign(np.full(4, 2.0, np.float32))

    def forward(x):
        c = conv_a(x)
        n = norm(c, training=False)
        r = relu(n)
        b = conv_b(r)
        s = add([r, b])
        p = pool(s)
        d = drop(p, training=False)
        f = flat(d)
        out = head(f)
        names = ["conv_a", "norm", "relu", "conv_b", "add", "pool", "drop", "flat", "head"]
        return list(zip(names, [c, n, r, b, s, p, d, f, out], strict=True)), out

    return model, x, y, "mse", forward


MODELS = [
    mnist_mlp,
    two_dense_mse,
    subclassed_rnn_cell,
    nested_model,
    bidirectional_lstm,
    recurrent_conv1d,
    residual_conv_bn,
]


def output_loss(loss, y, y_pred):
    """The loss as a plain function of the output values, written out here."""
    name = loss if isinstance(loss, str) else type(loss).__name__
    p = tf.convert_to_tensor(y_pred)
    y = tf.cast(y, p.dtype)
    eps = keras.backend.epsilon()
    if name in ("mse", "mean_squared_error", "MeanSquaredError"):
        return tf.reduce_mean(tf.square(y - p))
    if name == "CategoricalCrossentropy":
        p = tf.clip_by_value(p / tf.reduce_sum(p, -1, keepdims=True), eps, 1 - eps)
        return -tf.reduce_mean(tf.reduce_sum(y * tf.math.log(p), -1))
    if name == "sparse_categorical_crossentropy":
        p = tf.clip_by_value(p / tf.reduce_sum(p, -1, keepdims=True), eps, 1 - eps)
        picked = tf.gather(p, tf.cast(y, tf.int32), batch_dims=1)
        return -tf.reduce_mean(tf.math.log(picked))
    if name == "binary_crossentropy":
        p = tf.clip_by_value(p, eps, 1 - eps)
        return -tf.reduce_mean(y * tf.math.log(p) + (1 - y) * tf.math.log(1 - p))
    raise AssertionError(name)


def reference(model, x, y, loss, forward):
    """Plain-tape gradients: weights, each layer output, input sensitivity."""
    loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    x = tf.constant(x, tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        outputs, y_pred = forward(x)
        value = tf.reduce_mean(loss_fn(y, y_pred))
        shown = output_loss(loss, y, y_pred)
        sums = [tf.reduce_sum(h) for _, h in outputs]
    weights = tape.gradient(value, model.trainable_variables)
    activations = [tape.gradient(value, h) for _, h in outputs[:-1]]
    activations.append(tape.gradient(shown, y_pred))
    sensitivity = [np.abs(tape.gradient(s, x).numpy()).max() for s in sums]
    return float(value), weights, [p for p, _ in outputs], activations, sensitivity


@pytest.mark.parametrize("build", MODELS, ids=[m.__name__ for m in MODELS])
def test_snapshot_matches_plain_tape(build):
    model, x, y, loss, forward = build()
    shot = gradflow.snapshot(model, x, y, loss=loss)
    assert isinstance(shot, Snapshot)
    value, weights, paths, activations, sensitivity = reference(model, x, y, loss, forward)

    assert shot.loss == pytest.approx(value, rel=RTOL)
    # Weights: one row per trainable variable, in model order.
    assert list(shot.weights["variable"]) == [v.path for v in model.trainable_variables]
    assert list(shot.weights["shape"]) == [tuple(v.shape) for v in model.trainable_variables]
    assert (shot.weights["step"] == 0).all()
    assert_statistics(shot.weights, [g.numpy() for g in weights], "weights")
    # Activations: one row per layer call, in call order, by path.
    assert list(shot.activations["layer"]) == paths
    assert (shot.activations["tensor"] == "activation").all()
    assert_statistics(shot.activations, [g.numpy() for g in activations], "activations")
    # Inputs: max |d(sum of layer output)/dx|.
    assert list(shot.inputs["layer"]) == paths
    np.testing.assert_allclose(shot.inputs["max_abs"], sensitivity, rtol=RTOL, atol=1e-7)
    # Every row of the weights and activations has its histogram of all entries.
    counts = shot.histograms.filter(regex=r"^b\d+$").to_numpy().sum(axis=1)
    sizes = [g.numpy().size for g in weights] + [g.numpy().size for g in activations]
    np.testing.assert_array_equal(counts, sizes)


def masked_sequence_model():
    """Token ids with padding (0) into an LSTM whose every step has an output and a target."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(6, 3, mask_zero=True, name="embed")(tokens)
    h = keras.layers.LSTM(4, return_sequences=True, name="lstm")(h)
    model = keras.Model(tokens, keras.layers.Dense(2, name="out")(h))
    x = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    y = np.random.default_rng(0).normal(size=(3, 5, 2)).astype(np.float32)
    return model, x, y


def test_the_output_row_of_a_masked_sequence_is_the_gradient_of_the_masked_loss():
    """The copy of the output values keeps the mask the loss weighs the steps by.

    Without it the output row was the gradient of the unmasked loss: nonzero at
    the padded steps (zero_fraction 0), and a third smaller in max_abs.
    """
    model, x, y = masked_sequence_model()
    loss = keras.losses.MeanSquaredError()
    shot = gradflow.snapshot(model, x, y, loss=loss, sensitivity=False)
    with tf.GradientTape() as tape:
        y_pred = model(x)
        value = loss(y, y_pred)
    expected = tape.gradient(value, y_pred).numpy()
    assert shot.loss == pytest.approx(float(value), rel=RTOL)
    assert np.mean(expected == 0) == pytest.approx(5 / 15)  # the padded steps
    assert_statistics(shot.activations[shot.activations["layer"] == "out"], [expected], "out")


def test_layer_index_follows_leaf_order_for_weights_and_activations():
    model, x, y, loss, _ = nested_model()
    shot = gradflow.snapshot(model, x, y, loss=loss)
    weights = dict(zip(shot.weights["layer"], shot.weights["layer_index"], strict=True))
    assert weights == {"body/d1": 0, "body/d2": 1, "head": 2}
    assert list(shot.activations["layer_index"]) == [0, 1, 2]
    assert list(shot.weights["tensor"]) == ["kernel", "bias"] * 3


@pytest.mark.parametrize("training", [False, True])
def test_snapshot_changes_no_variable(training):
    model, x, y, loss, _ = residual_conv_bn()
    model.compile(optimizer="sgd", loss=loss)
    before = [v.numpy().copy() for v in model.variables]
    shot = gradflow.snapshot(model, x, y, training=training)
    assert shot.training is training
    for variable, value in zip(model.variables, before, strict=True):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)


def test_training_true_matches_a_training_pass_with_batch_statistics():
    model = keras.Sequential(
        # No bias before BN: its gradient is exactly 0 in theory, rounding noise in practice.
        [
            keras.Input((3,)),
            keras.layers.Dense(5, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(6, 3)).astype("float32"), rng.normal(size=(6, 1)).astype("float32")
    moving = [v.numpy().copy() for v in model.non_trainable_variables]
    with tf.GradientTape() as tape:
        value = tf.reduce_mean(tf.square(y - model(x, training=True)))
    gradients = tape.gradient(value, model.trainable_variables)
    for variable, saved in zip(model.non_trainable_variables, moving, strict=True):
        variable.assign(saved)  # the reference pass moved them

    shot = gradflow.snapshot(model, x, y, loss="mse", training=True)
    assert shot.loss == pytest.approx(float(value), rel=RTOL)
    assert_statistics(shot.weights, [g.numpy() for g in gradients], "training weights")
    evaluation = gradflow.snapshot(model, x, y, loss="mse")
    assert evaluation.loss != pytest.approx(shot.loss, rel=1e-3)


def test_compiled_loss_is_used_when_loss_is_none():
    model, x, y, loss, _ = two_dense_mse()
    model.compile(loss="mae")
    shot = gradflow.snapshot(model, x, y)
    expected = np.mean(np.abs(y - model.predict(x, verbose=0)))
    assert shot.loss == pytest.approx(expected, rel=RTOL)


def test_integer_inputs_give_nan_sensitivity_with_reason():
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(10, 3),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    x = np.arange(20).reshape(4, 5) % 10
    shot = gradflow.snapshot(model, x, np.zeros((4, 1)), loss="mse")
    assert shot.inputs["max_abs"].isna().all()
    assert "integer" in shot.inputs["note"][0]
    assert (shot.weights["l2_norm"] > 0).any()
    with pytest.raises(ValueError, match="Embedding"):
        input_sensitivity(model, x)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda m, x, y: gradflow.snapshot(m, x, y), ValueError, "not compiled"),
        (
            lambda m, x, y: gradflow.snapshot(m, x, y[:3], loss="mse"),
            ValueError,
            "same number of samples",
        ),
        (
            lambda m, x, y: gradflow.snapshot(m, x, y, loss="mean_squared_eror"),
            ValueError,
            "Unknown loss",
        ),
        (lambda m, x, y: gradflow.snapshot(m, x, y, loss=3), TypeError, "`loss`"),
        (lambda m, x, y: gradflow.snapshot(m, {"a": object()}, y, loss="mse"), TypeError, "`x`"),
    ],
    ids=["uncompiled", "batch_mismatch", "unknown_loss", "loss_type", "x_type"],
)
def test_errors_name_the_argument(call, error, words):
    model, x, y, _, _ = two_dense_mse()
    with pytest.raises(error, match=words):
        call(model, x, y)


def test_a_model_compiled_with_a_loss_per_output_gets_words_not_keras_internals():
    """The message read "got a _DictWrapper of losses (DictWrapper({...}))"."""
    inputs = keras.Input((3,))
    model = keras.Model(
        inputs,
        {
            "o1": keras.layers.Dense(1, name="o1")(inputs),
            "o2": keras.layers.Dense(1, name="o2")(inputs),
        },
    )
    model.compile(optimizer="sgd", loss={"o1": "mse", "o2": "mae"})
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    with pytest.raises(ValueError) as caught:
        gradflow.snapshot(model, x, {"o1": y, "o2": y})
    message = str(caught.value)
    assert "got a dict of losses, one per output ({'o1': 'mse', 'o2': 'mae'})" in message
    assert "Wrapper" not in message and "keras.Model(model.input, model.outputs[0])" in message


def test_snapshot_is_deterministic_and_nonfinite_is_counted():
    model, x, y, loss, _ = two_dense_mse()
    x = x.copy()
    x[0, 0] = np.nan
    shot = gradflow.snapshot(model, x, y, loss=loss)
    assert (shot.weights["nonfinite"] > 0).all()
    assert shot.weights["max_abs"].isna().all()
    assert shot.weights["nonfinite"].dtype == np.int64


class SharedTwice(keras.Model):
    def __init__(self):
        super().__init__(name="shared_twice")
        self.inner = keras.layers.Dense(3, activation="tanh", name="inner")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.inner(self.inner(x)))


def test_shared_layer_gets_one_row_per_call():
    model = SharedTwice()
    rng = np.random.default_rng(9)
    x, y = rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(4, 1)).astype("float32")
    shot = gradflow.snapshot(model, x, y, loss="mse")
    with tf.GradientTape() as tape:
        first = model.inner(x)
        second = model.inner(first)
        value = tf.reduce_mean(tf.square(y - model.head(second)))
    expected = tape.gradient(value, [first, second])
    assert list(shot.activations["layer"]) == ["inner", "inner#2", "head"]
    assert list(shot.activations["layer_index"]) == [0, 0, 1]
    assert_statistics(shot.activations.iloc[:2], [g.numpy() for g in expected], "shared calls")


def test_reused_probe_reports_each_batch_shape():
    from gradflow.probe.snapshot import GradientProbe

    model, x, y, loss, _ = two_dense_mse()
    probe = GradientProbe(model, loss=loss)
    shapes = [probe(x[:n], y[:n]).activations["shape"][0] for n in (6, 2, 6)]
    assert shapes == [(6, 20), (2, 20), (6, 20)]


def test_sensitivity_can_be_skipped():
    model, x, y, loss, _ = two_dense_mse()
    shot = gradflow.snapshot(model, x, y, loss=loss, sensitivity=False, histograms=False)
    assert shot.inputs["max_abs"].isna().all()
    assert "sensitivity=False" in shot.inputs["note"][0]
    assert shot.histograms.empty
    assert len(shot.weights) == 4


def test_diagnose_reads_a_snapshot_of_dead_relus():
    dead = keras.initializers.Constant(-5.0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="alive")]
        + [keras.layers.Dense(8, activation="relu", bias_initializer=dead, name="dead")]
        + [keras.layers.Dense(1, name="out")]
    )
    x = np.random.default_rng(10).normal(size=(8, 4)).astype("float32")
    events = gradflow.diagnose(gradflow.snapshot(model, x, np.zeros((8, 1)), loss="mse"))
    found = set(zip(events["layer"], events["kind"], strict=True))
    assert ("dead", "dead_relu") in found
    # Nothing flows back through the dead layer: the layer below it starves.
    assert ("alive", "vanishing") in found


def test_wrapped_layers_name_their_variables_by_role_not_by_made_up_names():
    """Keras names a wrapped layer itself (`dense`, then `dense_1` for the same model built
    again), so two runs of one model with named wrappers did not line up by `tensor`."""

    def build():
        return keras.Sequential(
            [
                keras.Input((4, 3)),
                keras.layers.TimeDistributed(keras.layers.Dense(2), name="td"),
                keras.layers.Bidirectional(keras.layers.GRU(3), name="bi"),
                keras.layers.Dense(1, name="out"),
            ]
        )

    first, second = build(), build()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2, 4, 3)), rng.normal(size=(2, 1))
    keys = [
        gradflow.snapshot(model, x, y, loss="mse").weights[["layer", "tensor"]].values.tolist()
        for model in (first, second)
    ]
    assert keys[0] == keys[1]
    cell = ["kernel", "recurrent_kernel", "bias"]
    assert keys[0] == (
        [["td", "kernel"], ["td", "bias"]]
        + [["bi", f"{side}/gru_cell/{name}"] for side in ("forward", "backward") for name in cell]
        + [["out", "kernel"], ["out", "bias"]]
    )


def test_weights_no_gradient_reaches_have_no_rows_and_are_named():
    """Summarized as zeros, a layer whose output `call` drops read as vanishing."""
    from tests.test_monitor_edges import UnusedBranch

    keras.utils.set_random_seed(0)
    model = UnusedBranch()
    model.build((None, 5))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = x[:, :1] - x[:, 1:2]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(y - model(x)))
    variables = [*model.trunk.trainable_variables, *model.head.trainable_variables]
    reference = tape.gradient(loss, variables)

    shot = gradflow.snapshot(model, x, y, loss="mse")
    assert shot.no_gradient == {"unused": ("kernel", "bias", "output")}
    assert shot.weights[["layer", "tensor"]].values.tolist() == [
        ["trunk", "kernel"],
        ["trunk", "bias"],
        ["head", "kernel"],
        ["head", "bias"],
    ]
    for (_, row), gradient in zip(shot.weights.iterrows(), reference, strict=True):
        np.testing.assert_allclose(row["l2_norm"], np.linalg.norm(gradient), rtol=1e-5)
        np.testing.assert_allclose(row["max_abs"], np.abs(gradient).max(), rtol=1e-5)
    assert list(shot.activations["layer"]) == ["trunk", "head"]
    assert shot.activations["max_abs"].gt(0).all()
    assert shot.histograms[["layer", "tensor"]].values.tolist() == (
        shot.layer_stats[["layer", "tensor"]].values.tolist()
    )
    assert gradflow.diagnose(shot.layer_stats).empty


def test_a_binary_classifier_takes_one_label_per_sample_as_fit_does():
    """The bare `binary_crossentropy` function refused labels of shape (n,) for an (n, 1) output."""
    keras.utils.set_random_seed(6)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, activation="sigmoid")]
    )
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    y = (np.arange(8) % 2).astype("float32")
    with tf.GradientTape() as tape:
        loss = keras.losses.BinaryCrossentropy()(y[:, None], model(x))
    expected = [np.linalg.norm(g) for g in tape.gradient(loss, model.trainable_variables)]
    shot = gradflow.snapshot(model, x, y, loss="binary_crossentropy")
    np.testing.assert_allclose(shot.loss, float(loss), rtol=1e-6)
    np.testing.assert_allclose(shot.weights["l2_norm"], expected, rtol=1e-5)


@pytest.mark.parametrize(
    ("model_name", "layer_name", "said"),
    [
        ("my model!", "dense", "The model name 'my model!'"),
        ("net", "dense 1 (hidden)", "The layer name"),
    ],
)
def test_names_tensorflow_cannot_scope_are_refused_in_words(model_name, layer_name, said):
    """They failed deep in the traced pass, and left Keras's name scope open for later models."""
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name=layer_name)], name=model_name
    )
    x = np.ones((2, 3), "float32")
    with pytest.raises(ValueError, match="Rename the") as caught:
        gradflow.snapshot(model, x, x[:, :2], loss="mse")
    assert said in str(caught.value)
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fresh")])
    assert not fresh.weights[0].path.startswith(model_name)


class RunningMax(keras.layers.Layer):
    """Keeps the largest input it has seen in a non-trainable weight, in any mode."""

    def build(self, input_shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x):
        self.seen.assign(tf.maximum(self.seen, tf.reduce_max(x)))
        return x


def stateful_rnn_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5, 3), batch_size=4),
            keras.layers.SimpleRNN(4, stateful=True, name="rnn"),
            RunningMax(name="watch"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    model.compile(loss="mse")
    return model


@pytest.mark.parametrize("training", [False, True])
def test_a_snapshot_leaves_a_stateful_rnns_state_and_a_layers_counter_alone(training):
    """Two snapshots of one batch disagreed (the carried state moved), and a layer's
    counter kept what the snapshot's pass had assigned."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 5, 3)).astype("float32")
    y = rng.normal(size=(4, 1)).astype("float32")
    model = stateful_rnn_model()
    model.predict(x, verbose=0)  # a state that is not the initial one
    state = model.get_layer("rnn").states[0].numpy()
    seen = float(model.get_layer("watch").seen.numpy())
    first = gradflow.snapshot(model, 10 * x, y, training=training)
    second = gradflow.snapshot(model, 10 * x, y, training=training)
    assert first.loss == second.loss
    np.testing.assert_array_equal(model.get_layer("rnn").states[0].numpy(), state)
    assert float(model.get_layer("watch").seen.numpy()) == seen
    # The snapshot's loss is the model's on that state: a tape on a copy says so.
    copy = stateful_rnn_model()
    copy.set_weights(model.get_weights())
    copy.get_layer("rnn").states[0].assign(state)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(y - copy(10 * x, training=training)))
    np.testing.assert_allclose(first.loss, float(loss), rtol=1e-6)
    grads = tape.gradient(loss, copy.trainable_variables)
    np.testing.assert_allclose(
        first.weights["l2_norm"].to_numpy(), [np.linalg.norm(g) for g in grads], rtol=1e-5
    )


def test_a_snapshot_of_an_unbuilt_stateful_rnn_leaves_its_initial_state():
    rng = np.random.default_rng(0)
    model = stateful_rnn_model()
    x = rng.normal(size=(4, 5, 3)).astype("float32")
    gradflow.snapshot(model, x, rng.normal(size=(4, 1)).astype("float32"))
    assert not model.get_layer("rnn").states[0].numpy().any()


def classifier_of_three():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy")
    return model


_X = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
_Y = np.random.default_rng(1).integers(0, 3, 8)


@pytest.mark.parametrize(
    "x, y, loss, error, message",
    [
        (_X, _Y + 5, None, ValueError, "The labels run from 5 to 7, but this model has 3 outputs"),
        (_X, _Y - 1, None, ValueError, "takes class numbers 0 to 2"),
        (_X, np.eye(3)[_Y], None, ValueError, r"look one-hot \(shape \(8, 3\)\)"),
        (_X, _Y, "categorical_crossentropy", ValueError, r"one-hot labels of shape \(batch, 3\)"),
        (_X, _Y, "mse", ValueError, r"one number per example, but this model gives 3 outputs"),
        (_X.astype(str), _Y, None, TypeError, "`x` must be a numeric array .* strings"),
        (_X, np.array(["cat"] * 8), None, TypeError, "Turn text labels into class numbers"),
        (_X, _Y, keras.losses.MeanSquaredError, TypeError, r"MeanSquaredError\(\)\."),
        ([_X, _X], _Y, None, ValueError, "`x` is a list of 2 arrays, but model"),
        (_X, None, None, TypeError, "`y` is None"),
        (tf.data.Dataset.from_tensor_slices(_X).batch(4), _Y, None, TypeError, "tf.data.Dataset"),
        ((batch for batch in [_X]), _Y, None, TypeError, "`x` is a generator"),
    ],
    ids=[
        "labels past the classes",
        "negative labels",
        "one-hot labels, sparse loss",
        "class numbers, one-hot loss",
        "class numbers, mse on three outputs",
        "strings in x",
        "text labels",
        "a loss class",
        "two inputs for one",
        "no labels",
        "a dataset",
        "a generator",
    ],
)
def test_a_mistaken_batch_or_loss_is_said_in_words_not_in_tensorflows(x, y, loss, error, message):
    """Each came as a traceback of TensorFlow's graph, or as 'an array of Python objects'."""
    with pytest.raises(error, match=message):
        gradflow.snapshot(classifier_of_three(), x, y, loss=loss)


def test_a_batch_given_as_python_lists_is_one_array():
    """`x.tolist()` was read as a structure of scalars: "must have a batch dimension"."""
    model = classifier_of_three()
    from_lists = gradflow.snapshot(model, _X.tolist(), _Y.tolist())
    from_arrays = gradflow.snapshot(model, _X, _Y)
    assert from_lists.loss == from_arrays.loss


class NamedOutput(keras.Model):
    """One output, returned in a dict, as many subclassed models do."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3, name="dense")

    def call(self, x):
        return {"logits": self.dense(x)}


@pytest.mark.parametrize("compiled", [True, False])
def test_a_model_with_its_one_output_in_a_dict_is_probed(compiled):
    """It was refused as a model of several outputs, or failed inside the traced pass."""
    keras.utils.set_random_seed(0)
    model = NamedOutput()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if compiled:
        model.compile(loss={"logits": loss})
    shot = gradflow.snapshot(model, _X, _Y, loss=None if compiled else loss)
    with tf.GradientTape() as tape:
        reference = loss(_Y, model(_X)["logits"])
    grads = tape.gradient(reference, model.trainable_variables)
    np.testing.assert_allclose(shot.loss, float(reference), rtol=1e-6)
    np.testing.assert_allclose(
        shot.weights["l2_norm"].to_numpy(), [np.linalg.norm(g) for g in grads], rtol=1e-5
    )
