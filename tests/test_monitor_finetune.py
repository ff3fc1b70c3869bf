"""LoRA, quantized and rematerialized models against a tf.GradientTape written here.

Keras 3's fine-tuning features change which variables train: `enable_lora`
freezes a kernel and adds `lora_kernel_a`/`lora_kernel_b` (`lora_kernel_b`
starts at 0, so `lora_kernel_a`'s first gradient is exactly 0);
`quantize("int8")` freezes the kernel as int8 and runs the layer through
`quantized_call` instead of `call`; `quantize("float8")` adds scales and amax
histories that are trainable but set to their "gradient" by the optimizer
(`overwrite_with_gradient`). Each reference below trains its own copy with
its own tape and computes the statistics with numpy.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradflow

N, BATCH = 16, 8  # 2 steps per epoch


def data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, 6)).astype("float32"), rng.normal(size=(N, 1)).astype("float32")


def mlp(quantize=None, lora=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="d0"),
            keras.layers.Dense(4, activation="relu", name="d1"),
            keras.layers.Dense(1, name="d2"),
        ],
        name="mlp",
    )
    if quantize:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "InputLayer does not have a `quantize` method"
            model.quantize(quantize)
    if lora:
        model.get_layer("d0").enable_lora(2)
        model.get_layer("d1").enable_lora(2)
    return model


def norm(array):
    return float(np.sqrt(np.sum(np.asarray(array, np.float64) ** 2)))


def reference_steps(model, optimizer, x, y):
    """Train `model` one batch at a time: per step, {tensor path: (gradient, before, after)}
    for the learned variables and {layer: dLoss/d(output)}."""
    learned = [v for v in model.trainable_variables if not v.overwrite_with_gradient]

    # Traced: Keras's float8 gradient takes its variables only inside a function.
    @tf.function
    def gradients(xb, yb):
        with tf.GradientTape() as tape:
            h, outputs = xb, []
            for layer in model.layers:
                h = layer(h, training=True)
                outputs.append(h)
            loss = tf.reduce_mean(tf.square(yb - h))
        return tape.gradient(loss, model.trainable_variables + outputs)

    steps = []
    for start in range(0, N, BATCH):
        grads = gradients(x[start : start + BATCH], y[start : start + BATCH])
        count = len(model.trainable_variables)
        before = [v.numpy() for v in learned]
        optimizer.apply(grads[:count], model.trainable_variables)
        by_variable = {v.path: g for v, g in zip(model.trainable_variables, grads, strict=False)}
        weights = {
            v.path.split("/", 1)[1]: (by_variable[v.path].numpy(), b, v.numpy())
            for v, b in zip(learned, before, strict=True)
        }
        outputs = {
            layer.name: g.numpy() for layer, g in zip(model.layers, grads[count:], strict=True)
        }
        steps.append((weights, outputs))
    return steps


def assert_rows_match(history, steps, atol=1e-6):
    for step, (weights, outputs) in enumerate(steps, start=1):
        rows = history[history["step"] == step]
        kept = rows[rows["tensor"] != "activation"]
        assert [f"{r.layer}/{r.tensor}" for r in kept.itertuples()] == list(weights)
        for row in kept.itertuples():
            gradient, before, after = weights[f"{row.layer}/{row.tensor}"]
            np.testing.assert_allclose(row.l2_norm, norm(gradient), rtol=1e-5, atol=atol)
            np.testing.assert_allclose(row.max_abs, np.abs(gradient).max(), rtol=1e-5, atol=atol)
            np.testing.assert_allclose(row.zero_fraction, np.mean(gradient == 0))
            np.testing.assert_allclose(row.weight_norm, norm(after), rtol=1e-5, atol=atol)
            if norm(before) > 0:
                ratio = norm(after - before) / norm(before)
                np.testing.assert_allclose(row.update_ratio, ratio, rtol=1e-4, atol=atol)
        activations = rows[rows["tensor"] == "activation"]
        if len(activations):
            assert list(activations["layer"]) == list(outputs)
            expected = [norm(g) for g in outputs.values()]
            np.testing.assert_allclose(activations["l2_norm"], expected, rtol=1e-5, atol=atol)


def fit_with_monitor(model, optimizer, **settings):
    x, y = data()
    model.compile(optimizer=optimizer, loss="mse")
    monitor = gradflow.GradientMonitor(every=1, **settings)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[monitor], verbose=0)
    return monitor


@pytest.mark.parametrize("quantize", [None, "int8"], ids=["lora", "qlora"])
def test_lora_rows_equal_a_tape_and_the_zero_first_gradient_is_no_alert(quantize):
    monitor = fit_with_monitor(
        mlp(quantize, lora=True), keras.optimizers.Adam(0.01), activations=True
    )
    reference = mlp(quantize, lora=True)
    x, y = data()
    steps = reference_steps(reference, keras.optimizers.Adam(0.01), x, y)
    history = monitor.history
    # Named as every variable is: the layer, then the variable's name in it.
    first = history[(history["step"] == 1) & (history["layer"] == "d0")]
    assert list(first["tensor"]) == ["bias", "lora_kernel_a", "lora_kernel_b", "activation"]
    assert_rows_match(history, steps)
    # lora_kernel_b starts at 0, so lora_kernel_a's first gradient is exactly 0:
    # the layer's norm joins its tensors, and nothing calls it vanishing or dead.
    assert first.set_index("tensor").loc["lora_kernel_a", "l2_norm"] == 0
    assert monitor.events.empty
    assert gradflow.diagnose(history).empty


def test_a_quantized_models_layer_outputs_are_recorded():
    # A quantized layer runs `quantized_call`, not `call`: its output had no
    # row, and `snapshot` of an all-quantized model failed on an empty list.
    x, y = data()
    model = mlp("int8")
    model.compile(optimizer="sgd", loss="mse")
    steps = reference_steps(mlp("int8"), keras.optimizers.SGD(), x[:BATCH], y[:BATCH])
    shot = gradflow.snapshot(model, x[:BATCH], y[:BATCH])
    weights, outputs = steps[0]
    assert list(shot.weights["variable"].str.split("/", n=1).str[1]) == list(weights)
    np.testing.assert_allclose(shot.weights["l2_norm"], [norm(g) for g, _, _ in weights.values()])
    assert list(shot.activations["layer"]) == list(outputs)
    np.testing.assert_allclose(
        shot.activations["l2_norm"], [norm(g) for g in outputs.values()], rtol=1e-5
    )
    assert shot.inputs["max_abs"].notna().all() and (shot.inputs["max_abs"] > 0).all()
    monitor = fit_with_monitor(mlp("int8"), keras.optimizers.SGD(0.1), activations=True)
    reference = reference_steps(mlp("int8"), keras.optimizers.SGD(0.1), x, y)
    assert_rows_match(monitor.history, reference)


@pytest.mark.parametrize("clipping", [None, 1.0], ids=["plain", "global_clipnorm"])
def test_float8_scales_are_applied_and_not_recorded_as_gradients(clipping):
    # Their "gradient" is their next value (an amax history of about 3); as a
    # row it joined the layer's norm, and global clipping left it out.
    x, y = data()
    model, plain = mlp("float8"), mlp("float8")
    plain.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=clipping), loss="mse")
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    monitor = fit_with_monitor(model, keras.optimizers.SGD(0.1, global_clipnorm=clipping))
    # The monitor's step sets the scales as Keras's own step does.
    for mine, theirs in zip(model.variables, plain.variables, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-6, err_msg=mine.path)
    history = monitor.history
    assert set(history["tensor"]) == {"kernel", "bias"}
    if clipping is None:
        steps = reference_steps(mlp("float8"), keras.optimizers.SGD(0.1), x, y)
        assert_rows_match(history, steps)
    else:
        clipped = history.groupby("step")["l2_norm_clipped"].apply(lambda c: norm(c))
        np.testing.assert_allclose(clipped, 1.0, rtol=1e-5)
    shot = gradflow.snapshot(mlp("float8"), x[:BATCH], y[:BATCH], loss="mse")
    assert set(shot.weights["tensor"]) == {"kernel", "bias"}
    assert list(shot.activations["layer"]) == ["d0", "d1", "d2"]


def test_a_float8_loops_log_leaves_the_scales_out():
    x, y = data()
    model = mlp("float8")
    optimizer = keras.optimizers.SGD(0.1)
    log = gradflow.GradientLog(model, optimizer=optimizer)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(yb - model(xb, training=True)))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return loss, gradients

    with log:
        for start in range(0, N, BATCH):
            loss, gradients = train_step(x[start : start + BATCH], y[start : start + BATCH])
            log.record(gradients, loss=loss)
    learned = [
        (v, g)
        for v, g in zip(model.trainable_variables, gradients, strict=True)
        if not v.overwrite_with_gradient
    ]
    last = log.history[log.history["step"] == 2]
    assert list(last["tensor"]) == ["kernel", "bias"] * 3
    np.testing.assert_allclose(last["l2_norm"], [norm(g) for _, g in learned], rtol=1e-5)
    assert log.events.empty  # no "no gradient reaches" for the scales


def test_a_transformer_with_lora_on_embedding_and_attention_equals_a_tape():
    vocabulary, length = 30, 5

    def build():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((length,), dtype="int32")
        e = keras.layers.Embedding(vocabulary, 8, name="emb")(tokens)
        a = keras.layers.MultiHeadAttention(2, 4, name="mha")(e, e)
        h = keras.layers.LayerNormalization(name="ln")(keras.layers.Add(name="add")([e, a]))
        h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
        model = keras.Model(tokens, keras.layers.Dense(3, name="head")(h))
        model.get_layer("emb").enable_lora(2)
        attention = model.get_layer("mha")
        attention.query_dense.enable_lora(2)
        attention.value_dense.enable_lora(2)
        return model

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, vocabulary, (BATCH, length)).astype("int32"), rng.integers(0, 3, BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = build()
    with tf.GradientTape() as tape:
        value = loss(y, reference(x, training=True))
    expected = {
        v.path: norm(g)
        for v, g in zip(
            reference.trainable_variables,
            tape.gradient(value, reference.trainable_variables),
            strict=True,
        )
    }
    model = build()
    model.compile(optimizer="sgd", loss=loss)
    shot = gradflow.snapshot(model, x, y)
    monitor = gradflow.GradientMonitor(every=1)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[monitor], verbose=0)
    first = monitor.history[monitor.history["step"] == 1]
    for table in (shot.weights, first):
        named = set(zip(table["layer"], table["tensor"], strict=True))
        assert ("emb", "lora_embeddings_a") in named
        assert ("mha/query", "lora_kernel_b") in named
        assert "kernel" not in set(table[table["layer"] == "mha/value"]["tensor"])
        np.testing.assert_allclose(
            table["l2_norm"], [expected[v] for v in table["variable"]], rtol=1e-5, atol=1e-7
        )
    assert monitor.events.empty


def test_lora_enabled_between_two_fits_of_one_monitor_is_said():
    # Keras's recipe: train, `enable_lora`, `compile()` again, fit again. The
    # layers stay the same, but what trains in them does not.
    x, y = data()
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    monitor = gradflow.GradientMonitor(every=1)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    model.get_layer("d0").enable_lora(2)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    history = monitor.history
    assert list(history[(history["step"] == 3) & (history["layer"] == "d0")]["tensor"]) == [
        "bias",
        "lora_kernel_a",
        "lora_kernel_b",
    ]
    told = monitor.events[monitor.events["step"] == 3]["message"].str.cat(sep=" ")
    assert "Training other weights than in the last fit" in told
    assert "d0 (bias, lora_kernel_a, lora_kernel_b; was kernel, bias)" in told
    assert "d1" not in told.split("Training other weights")[1]


class GradientReversal(keras.layers.Layer):
    """The domain-adaptation layer: identity forward, -0.5 x the gradient backward."""

    def call(self, x):
        @keras.ops.custom_gradient
        def reverse(t):
            def gradient(*args, upstream=None):
                upstream = args[0] if upstream is None else upstream
                return -0.5 * upstream

            return t, gradient

        return reverse(x)


class RematBlock(keras.layers.Layer):
    """A block whose inner Dense runs inside `keras.remat`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(8, activation="tanh", name="inner")

    def call(self, x):
        return keras.remat(self.inner)(x)


def test_remat_and_a_custom_gradient_equal_a_tape_and_say_why_a_row_is_missing():
    def build(remat):
        keras.utils.set_random_seed(0)
        # Keras 3.15's other RematScope modes fail in its own `fit` on TensorFlow.
        with keras.RematScope(mode="activations" if remat else None):
            return keras.Sequential(
                [
                    keras.Input((6,)),
                    keras.layers.Dense(8, activation="tanh", name="d0"),
                    GradientReversal(name="reverse"),
                    RematBlock(name="block") if remat else keras.layers.Dense(8, "tanh"),
                    keras.layers.Dense(1, name="d2"),
                ]
            )

    x, y = data()
    x, y = x[:BATCH], y[:BATCH]
    reference = build(remat=True)
    with tf.GradientTape() as tape:
        h, outputs = tf.constant(x), {}
        for layer in reference.layers:
            h = layer(h, training=True)
            outputs[layer.name] = h
        loss = tf.reduce_mean(tf.square(y - h))
    gradients = tape.gradient(loss, reference.trainable_variables + list(outputs.values()))
    count = len(reference.trainable_variables)
    weights = [norm(g) for g in gradients[:count]]
    # The reversal's own output gradient; d0's is -0.5 times it.
    by_output = dict(zip(outputs, (norm(g) for g in gradients[count:]), strict=True))
    np.testing.assert_allclose(by_output["d0"], 0.5 * by_output["reverse"], rtol=1e-6)
    expected = [by_output["d0"], by_output["reverse"], by_output["d2"]]

    model = build(remat=True)
    model.compile(optimizer="sgd", loss="mse")
    shot = gradflow.snapshot(model, x, y)
    monitor = gradflow.GradientMonitor(every=1, activations=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[monitor], verbose=0)
    history = monitor.history
    for table in (shot.layer_stats, history[history["step"] == 1]):
        kept = table[table["tensor"] != "activation"]
        assert list(kept["layer"].unique()) == ["d0", "block/inner", "d2"]
        np.testing.assert_allclose(kept["l2_norm"], weights, rtol=1e-5, atol=1e-7)
        activations = table[table["tensor"] == "activation"]
        assert list(activations["layer"]) == ["d0", "reverse", "d2"]
        np.testing.assert_allclose(activations["l2_norm"], expected, rtol=1e-5)
    # The inner Dense's output is made where the tape is stopped: its weights
    # train, so "no gradient reaches ... leaves its weights as they are" was wrong.
    assert shot.no_gradient == {}
    assert np.isnan(shot.inputs.set_index("layer").loc["block/inner", "max_abs"])
    assert list(monitor.events["kind"]) == ["info"]
    assert "runs inside `keras.remat`" in monitor.events["message"].iloc[0]
