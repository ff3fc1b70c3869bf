"""Several outputs, masks, input pipelines and float8 against a tf.GradientTape written here.

Each reference trains a copy of the model (same initial weights, same batches
in the same order) with plain SGD and its own tape: the weighted total loss
of every output, the mask passed by hand to the recurrent layer, the batches
taken from the same arrays the pipeline under test serves. Per step it keeps,
with numpy, each weight gradient's statistics, the weight norm after the
update, the update ratio and each layer output's gradient. The monitor's,
snapshot's and GradientLog's rows must equal it.
"""

import warnings

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import gradflow
from gradflow import schema
from gradflow.diagnosis import Thresholds

BATCH = 8
LEARNING_RATE = 0.1
STATISTICS = ["max_abs", "l2_norm", "mean_abs", "std", "zero_fraction"]


def norm(array):
    return float(np.sqrt(np.sum(np.asarray(array, np.float64) ** 2)))


def numpy_stats(g):
    g = np.asarray(tf.convert_to_tensor(g), np.float64).ravel()
    return {
        "max_abs": np.abs(g).max(),
        "l2_norm": np.sqrt(np.sum(g * g)),
        "mean_abs": np.abs(g).mean(),
        "std": g.std(),
        "zero_fraction": np.mean(g == 0.0),
    }


def weight_row(gradient, before, after):
    """A weight's row: its gradient's statistics, its norm after the update, the update ratio."""
    row = numpy_stats(gradient)
    row["weight_norm"] = norm(after)
    # Undefined from zero weights (a bias before its first update), as in the monitor.
    row["update_ratio"] = norm(after - before) / norm(before) if norm(before) > 0 else np.nan
    return row


def reference_run(model, batches, forward):
    """Train `model` with SGD on `batches`; return per-step rows and losses.

    `forward(model, x, y, tape)` returns the total loss and {layer name:
    output}; it watches an output that depends on no variable.
    Rows are keyed (step, variable path) for the weights the loss reaches and
    (step, layer name) for layer outputs.
    """
    optimizer = keras.optimizers.SGD(LEARNING_RATE)
    variables = model.trainable_variables
    rows, losses = {}, []
    for step, (xb, yb) in enumerate(batches, start=1):
        with tf.GradientTape() as tape:
            loss, outputs = forward(model, xb, yb, tape)
        gradients = tape.gradient(loss, variables + list(outputs.values()))
        reached = [(g, v) for g, v in zip(gradients, variables, strict=False) if g is not None]
        before = [v.numpy() for _, v in reached]
        optimizer.apply_gradients(reached)
        for (g, v), start in zip(reached, before, strict=True):
            rows[(step, v.path)] = weight_row(g, start, v.numpy())
        for name, g in zip(outputs, gradients[len(variables) :], strict=True):
            rows[(step, name)] = numpy_stats(g)
        losses.append(float(loss))
    return rows, losses


def largest_difference(history, rows):
    """Assert `history` holds exactly `rows`; return the largest relative difference."""
    kept = history[history["tensor"] != schema.TIME_STEP]
    keys = [
        (r.step, r.layer if r.tensor == schema.ACTIVATION else r.variable)
        for r in kept.itertuples()
    ]
    assert sorted(keys, key=str) == sorted(rows, key=str)
    worst = 0.0
    for key, record in zip(keys, kept.to_dict("records"), strict=True):
        for column, expected in rows[key].items():
            got = record[column]
            np.testing.assert_allclose(
                got, expected, rtol=1e-4, atol=1e-7, err_msg=f"{key} {column}"
            )
            if np.isfinite(expected) and abs(expected) > 1e-7:
                worst = max(worst, abs(got - expected) / abs(expected))
    return worst


def monitored_fit(model, x, y, loss, monitor=None, **fit_settings):
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss)
    monitor = monitor or gradflow.GradientMonitor(activations=True)
    fit_settings = {"batch_size": BATCH, "epochs": 1, "shuffle": False} | fit_settings
    model.fit(x, y, verbose=0, callbacks=[monitor], **fit_settings)
    return monitor


# --- 1. several outputs -------------------------------------------------------


def two_headed(form):
    keras.utils.set_random_seed(0)
    features = keras.Input((4,), name="features")
    trunk = keras.layers.Dense(6, activation="tanh", name="trunk")(features)
    amount = keras.layers.Dense(1, name="amount")(trunk)
    kind = keras.layers.Dense(3, activation="softmax", name="kind")(trunk)
    outputs = [amount, kind] if form == "list" else {"amount": amount, "kind": kind}
    return keras.Model(features, outputs, name="two_headed")


def two_headed_data(n=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    amount = rng.normal(size=(n, 1)).astype("float32")
    kind = rng.integers(0, 3, size=n).astype("int32")
    return x, amount, kind


WEIGHTS = {"amount": 0.5, "kind": 2.0}


def two_headed_forward(model, x, y, tape):
    amount, kind = y
    trunk = model.get_layer("trunk")(tf.constant(x), training=True)
    outputs = {
        "trunk": trunk,
        "amount": model.get_layer("amount")(trunk),
        "kind": model.get_layer("kind")(trunk),
    }
    # tf.identity drops the logits Keras hangs on a softmax output: the
    # cross-entropy is then dLoss/d(probabilities), which the monitor records.
    probabilities = tf.identity(outputs["kind"])
    loss = WEIGHTS["amount"] * tf.reduce_mean(tf.square(amount - outputs["amount"]))
    loss += WEIGHTS["kind"] * tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(kind, probabilities)
    )
    return loss, outputs


def two_headed_settings(form):
    """compile() arguments: a loss, a loss weight and a metric per output."""
    if form == "list":
        return {
            "loss": ["mse", "sparse_categorical_crossentropy"],
            "loss_weights": [WEIGHTS["amount"], WEIGHTS["kind"]],
            "metrics": [["mae"], ["accuracy"]],
        }
    return {
        "loss": {"amount": "mse", "kind": "sparse_categorical_crossentropy"},
        "loss_weights": dict(WEIGHTS),
        "metrics": {"amount": "mae", "kind": "accuracy"},
    }


@pytest.mark.parametrize("form", ["list", "dict"])
def test_several_outputs_with_weighted_losses_equal_a_tape(form):
    x, amount, kind = two_headed_data()
    settings = two_headed_settings(form)
    y = [amount, kind] if form == "list" else {"amount": amount, "kind": kind}
    model = two_headed(form)
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), **settings)
    monitor = gradflow.GradientMonitor(activations=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])

    batches = [(x[s : s + BATCH], (amount[s : s + BATCH], kind[s : s + BATCH])) for s in (0, 8)]
    rows, losses = reference_run(two_headed(form), batches, two_headed_forward)
    assert largest_difference(monitor.history, rows) < 1e-4
    metrics = monitor.metrics.pivot(index="step", columns="name", values="value")
    # `loss` is each batch's weighted total; the per-output losses and
    # metrics are Keras's logs: running means over the epoch so far.
    np.testing.assert_allclose(metrics["loss"], losses, rtol=1e-5)
    assert {"amount_loss", "kind_loss", "amount_mae", "kind_accuracy"} <= set(metrics.columns)
    total = WEIGHTS["amount"] * metrics["amount_loss"] + WEIGHTS["kind"] * metrics["kind_loss"]
    np.testing.assert_allclose(total, np.cumsum(losses) / [1, 2], rtol=1e-5)
    assert monitor.events.empty


# --- 2. masks -----------------------------------------------------------------

LENGTH, VOCABULARY = 7, 12


def padded_tokens(n=16, seed=0):
    """Token sequences padded with 0 at the end; the last two steps are padding in every one."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCABULARY, size=(n, LENGTH)).astype("int32")
    lengths = rng.integers(1, LENGTH - 1, size=n)
    x[np.arange(LENGTH) >= lengths[:, None]] = 0
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def padded_features(n=16, seed=0):
    x, y = padded_tokens(n, seed)
    rng = np.random.default_rng(seed + 1)
    features = rng.normal(size=(n, LENGTH, 2)).astype("float32")
    features[x == 0] = 0.0  # what `Masking` masks
    return features, y


RECURRENT = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU, "rnn": keras.layers.SimpleRNN}


def masked_model(front, recurrent):
    keras.utils.set_random_seed(0)
    if front == "embedding":
        inputs = keras.Input((None,), dtype="int32")  # `padded_batch` pads to each batch's longest
        first = keras.layers.Embedding(VOCABULARY, 3, mask_zero=True, name="front")
    else:
        inputs = keras.Input((LENGTH, 2))
        first = keras.layers.Masking(0.0, name="front")
    sequence = first(inputs)
    state = RECURRENT[recurrent](4, name="recurrent")(sequence)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(state))


def masked_forward(model, x, y, tape):
    front = model.get_layer("front")
    x = tf.convert_to_tensor(x)
    sequence = front(x, training=True)
    tape.watch(sequence)  # `Masking` has no weights
    mask = front.compute_mask(x)
    state = model.get_layer("recurrent")(sequence, mask=mask, training=True)
    outputs = {"front": sequence, "recurrent": state, "out": model.get_layer("out")(state)}
    return tf.reduce_mean(tf.square(y - outputs["out"])), outputs


MASKED = [("embedding", "lstm"), ("embedding", "gru"), ("masking", "rnn"), ("masking", "lstm")]


@pytest.mark.parametrize("front,recurrent", MASKED, ids=["-".join(c) for c in MASKED])
def test_masked_sequences_equal_a_tape(front, recurrent):
    x, y = padded_tokens() if front == "embedding" else padded_features()
    monitor = monitored_fit(masked_model(front, recurrent), x, y, "mse")
    batches = [(x[s : s + BATCH], y[s : s + BATCH]) for s in (0, 8)]
    rows, _ = reference_run(masked_model(front, recurrent), batches, masked_forward)
    assert largest_difference(monitor.history, rows) < 1e-4
    assert monitor.events.empty


def test_a_layer_reading_mostly_padding_is_not_called_saturated():
    # Sequences padded to 40 steps, 1 to 3 tokens long: the embedding's output
    # gradient is exactly 0 at the padded steps, so its mean |gradient| is
    # about 20 times below the unpadded entries'. Read as the LSTM's input
    # gradient, that was a 120-fold "shrink" through the LSTM: "saturated".
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCABULARY, size=(16, 40)).astype("int32")
    x[np.arange(40) >= rng.integers(1, 4, size=16)[:, None]] = 0
    y = rng.normal(size=(16, 1)).astype("float32")
    model = masked_model("embedding", "lstm")
    monitor = monitored_fit(model, x, y, "mse")
    assert "saturation" not in set(monitor.events["kind"])
    # The LSTM's input is compared with nothing, as a global pool's is.
    assert monitor.history.attrs["layer_inputs"] == {
        "front": None,
        "recurrent": None,
        "out": "recurrent",
    }
    shot = gradflow.snapshot(model, x[:BATCH], y[:BATCH], histograms=False, sensitivity=False)
    assert shot.layer_inputs["recurrent"] is None
    assert "saturation" not in set(gradflow.diagnose(shot)["kind"])


def per_step_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    sequence = keras.layers.Embedding(VOCABULARY, 3, mask_zero=True, name="front")(inputs)
    states = keras.layers.LSTM(4, return_sequences=True, name="recurrent")(sequence)
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid", name="out")(states))


def test_a_per_step_output_of_a_masked_sequence_records_the_gradient_of_the_masked_loss():
    # A sigmoid output's cross-entropy reads its logits, so the monitor takes
    # dLoss/d(output) from the loss on a copy of the output; that copy lost the
    # Keras mask, and the row was the unmasked loss's gradient: nonzero at the
    # padded steps, and of another size at the others (snapshot and
    # chain_gradients had the same fault: tests/test_probe_snapshot.py).
    x, _ = padded_tokens(n=BATCH)
    y = np.random.default_rng(2).integers(0, 2, size=(BATCH, LENGTH, 1)).astype("float32")
    monitor = monitored_fit(per_step_model(), x, y, "binary_crossentropy")

    reference = per_step_model()
    mask = tf.constant(x != 0, tf.float32)
    with tf.GradientTape() as tape:
        probabilities = tf.identity(reference(x, training=True))  # no logits, no mask
        tape.watch(probabilities)
        per_step = keras.losses.binary_crossentropy(y, probabilities)  # (batch, time)
        loss = tf.reduce_sum(per_step * mask) / tf.reduce_sum(mask)  # padded steps weigh nothing
    expected = numpy_stats(tape.gradient(loss, probabilities))

    np.testing.assert_allclose(
        monitor.metrics.query("step == 1 and name == 'loss'")["value"], float(loss), rtol=1e-5
    )
    history = monitor.history
    row = history[(history["step"] == 1) & (history["layer"] == "out")]
    row = row[row["tensor"] == schema.ACTIVATION].iloc[0]
    assert expected["zero_fraction"] == pytest.approx(float(np.mean(x == 0)))
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-4, abs=1e-9), column


def alternating_sum(y):
    signs = np.where(np.arange(y.shape[-1]) % 2 == 0, 1.0, -1.0).astype("float32")
    return tf.reduce_sum(y * signs)


@pytest.mark.parametrize("front,recurrent", MASKED[::2], ids=["-".join(c) for c in MASKED[::2]])
def test_time_steps_masked_in_every_sequence_are_zero_rows_and_no_alarm(front, recurrent):
    x, y = padded_tokens() if front == "embedding" else padded_features()
    x = x[:, ::-1].copy()  # padded in front, as `pad_sequences` does: t=1 and 2 are all padding
    model = masked_model(front, recurrent)
    reference = masked_model(front, recurrent)
    monitor = gradflow.GradientMonitor(through_time=True)
    monitored_fit(model, x, y, "mse", monitor=monitor, epochs=5)

    # The gradient of the outputs (alternating signs) w.r.t. the sequence the
    # model reads: the embedding's output, or the input that `Masking` masks.
    with tf.GradientTape() as tape:
        inputs = tf.constant(x[:BATCH])
        tape.watch(inputs)
        _, outputs = masked_forward(reference, inputs, y[:BATCH], tape)
        probe = alternating_sum(outputs["out"])
    sequence = outputs["front"] if front == "embedding" else inputs
    expected = tape.gradient(probe, sequence).numpy()
    history = monitor.history
    rows = history[(history["tensor"] == schema.TIME_STEP) & (history["step"] == 1)]
    assert set(rows["variable"]) == {"front" if front == "embedding" else "input"}
    rows = rows.sort_values("layer_index")
    np.testing.assert_allclose(
        rows["l2_norm"], np.sqrt(np.sum(expected**2, axis=(0, 2))), rtol=1e-4
    )
    np.testing.assert_allclose(rows["zero_fraction"], np.mean(expected == 0, axis=(0, 2)))
    masked = history[(history["tensor"] == schema.TIME_STEP) & (history["layer_index"] < 2)]
    assert (masked["l2_norm"] == 0).all() and (masked["zero_fraction"] == 1).all()
    # A zero share would read as a gradient that vanished through time; over
    # padding it says nothing, so no rule compares it, however short its window.
    assert monitor.events.empty
    quick = Thresholds(time_window=5, repeat_after=5)
    assert gradflow.diagnose(history, quick).empty


# --- 3. input pipelines ------------------------------------------------------


class TokenBatches(keras.utils.PyDataset):
    """The padded token batches in order, served by Keras's worker threads or processes."""

    def __init__(self, x, y, **settings):
        super().__init__(**settings)
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        part = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[part], self.y[part]


def endless_batches(x, y):
    while True:
        for start in range(0, len(x), BATCH):
            yield x[start : start + BATCH], y[start : start + BATCH]


def unpadded(x, y):
    """The token sequences of `x` cut to their own lengths, one sample at a time."""
    lengths = (x != 0).sum(axis=1)
    return tf.data.Dataset.from_generator(
        lambda: ((x[i, : lengths[i]], y[i]) for i in range(len(x))),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([1], tf.float32)),
    )


def token_pipeline(source, x, y):
    """(fit's data arguments, the batches the fit trains on in order)."""
    in_order = [(x[s : s + BATCH], y[s : s + BATCH]) for s in range(0, len(x), BATCH)]
    if source == "validation_split":
        # Keras keeps the last third for validation, before any shuffling.
        settings = {"validation_split": 1 / 3, "batch_size": BATCH, "epochs": 2}
        return {"x": x, "y": y} | settings, in_order[:2] * 2
    if source.startswith("py_dataset"):
        batches = TokenBatches(x, y, workers=2, use_multiprocessing=source.endswith("processes"))
        return {"x": batches, "epochs": 2}, in_order * 2
    if source == "generator":
        # The second epoch goes on where the first left the generator.
        settings = {"steps_per_epoch": 2, "epochs": 2}
        return {"x": endless_batches(x, y)} | settings, in_order + in_order[:1]
    dataset = unpadded(x, y).padded_batch(BATCH)  # to each batch's longest sequence
    batches = [(bx.numpy(), by.numpy()) for bx, by in dataset]
    return {"x": dataset.repeat(), "steps_per_epoch": 3, "epochs": 2}, batches * 2


SOURCES = [
    "validation_split",
    "py_dataset_threads",
    "py_dataset_processes",
    "generator",
    "padded_batch_repeated",
]


@pytest.mark.parametrize("source", SOURCES)
def test_every_input_pipeline_numbers_its_steps_one_by_one_and_equals_a_tape(source):
    x, y = padded_tokens(24)
    settings, batches = token_pipeline(source, x, y)
    model = masked_model("embedding", "lstm")
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    monitor = gradflow.GradientMonitor(activations=True)
    data = {k: settings.pop(k) for k in ("x", "y") if k in settings}
    model.fit(**data, shuffle=False, verbose=0, callbacks=[monitor], **settings)

    history = monitor.history
    steps = history["step"].to_numpy()
    assert sorted(set(steps)) == list(range(1, len(batches) + 1))
    assert (history.groupby("step").size() == 9).all()  # 6 weights and 3 outputs a step
    reference = masked_model("embedding", "lstm")
    rows, _ = reference_run(reference, batches, masked_forward)
    assert largest_difference(history, rows) < 1e-4
    if source == "validation_split":
        held_out = keras.losses.MeanSquaredError()(y[16:], reference(x[16:]))
        val_loss = monitor.metrics.query("name == 'val_loss'")
        assert list(val_loss["step"]) == [2, 4]
        np.testing.assert_allclose(val_loss["value"].iloc[-1], float(held_out), rtol=1e-5)


@pytest.mark.parametrize("one_length", [False, True], ids=["each_batchs_longest", "padded_shapes"])
def test_padded_batches_record_through_time_when_they_share_one_length(one_length):
    x, y = padded_tokens(24)
    shapes = ([LENGTH], [1]) if one_length else None
    dataset = unpadded(x, y).padded_batch(BATCH, padded_shapes=shapes).repeat()
    model = masked_model("embedding", "lstm")
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    monitor = gradflow.GradientMonitor(through_time=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(dataset, steps_per_epoch=3, verbose=0, callbacks=[monitor])
    said = [str(w.message) for w in caught if "records nothing through time" in str(w.message)]
    rows = monitor.history[monitor.history["tensor"] == schema.TIME_STEP]
    if one_length:
        assert not said
        assert len(rows) == 3 * LENGTH
    else:
        assert len(said) == 1 and "varying number of time steps in 'front'" in said[0]
        assert rows.empty
    assert sorted(set(monitor.history["step"])) == [1, 2, 3]


# --- 4. float8 under mixed precision --------------------------------------------


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def float8_regressor():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="d0"),
            keras.layers.Dense(4, activation="relu", name="d1"),
            keras.layers.Dense(1, dtype="float32", name="d2"),
        ],
        name="float8",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "InputLayer does not have a `quantize` method"
        model.quantize("float8")
    return model


def float8_reference(model, x, y, scale):
    """The tape's steps with Keras's loss scaling: gradients of the scaled loss, unscaled here."""
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(LEARNING_RATE), initial_scale=scale
    )
    learned = [v for v in model.trainable_variables if not v.overwrite_with_gradient]

    # Traced: Keras's float8 gradient takes its variables only inside a function.
    @tf.function
    def gradients(xb, yb):
        with tf.GradientTape() as tape:
            h, outputs = xb, []
            for layer in model.layers:
                h = layer(h, training=True)
                outputs.append(h)
            loss = tf.reduce_mean(tf.square(yb - tf.cast(h, "float32")))
            scaled = optimizer.scale_loss(loss)
        return tape.gradient(scaled, model.trainable_variables + outputs)

    rows = {}
    for step, start in enumerate(range(0, len(x), BATCH), start=1):
        grads = gradients(x[start : start + BATCH], y[start : start + BATCH])
        count = len(model.trainable_variables)
        before = {v.path: v.numpy() for v in learned}
        optimizer.apply(grads[:count], model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads, strict=False):
            if v.path in before:
                unscaled = tf.cast(g, "float64") / scale
                rows[(step, v.path)] = weight_row(unscaled, before[v.path], v.numpy())
        for layer, g in zip(model.layers, grads[count:], strict=True):
            rows[(step, layer.name)] = numpy_stats(tf.cast(g, "float64") / scale)
    return rows


def test_float8_under_a_loss_scale_records_unscaled_gradients_and_no_scales(mixed_float16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    model, plain = float8_regressor(), float8_regressor()
    plain.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    monitor = monitored_fit(model, x, y, "mse")
    # compile() wrapped SGD in Keras's LossScaleOptimizer (2**15 to start).
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    scale = float(model.optimizer.initial_scale)
    for mine, theirs in zip(model.variables, plain.variables, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-6, err_msg=mine.path)
    history = monitor.history
    assert set(history["tensor"]) == {"kernel", "bias", schema.ACTIVATION}
    rows = float8_reference(float8_regressor(), x, y, scale)
    assert largest_difference(history, rows) < 1e-3
    assert monitor.events.empty


# --- 5. snapshot and GradientLog on several outputs ----------------------------


@pytest.mark.parametrize("form", ["list", "dict"])
def test_a_snapshot_of_several_outputs_is_refused_in_words_and_its_recipe_equals_a_tape(form):
    x, amount, kind = two_headed_data(BATCH)
    y = [amount, kind] if form == "list" else {"amount": amount, "kind": kind}
    model = two_headed(form)
    model.compile(optimizer="sgd", **two_headed_settings(form))
    with pytest.raises(ValueError, match=f"got a {form} of losses, one per output"):
        gradflow.snapshot(model, x, y)

    # What the message says to do: a model of one output, with that output's loss.
    head = keras.Model(model.input, model.outputs[1])
    shot = gradflow.snapshot(head, x, kind, loss="sparse_categorical_crossentropy")

    def kind_alone(model, x, y, tape):
        trunk = model.get_layer("trunk")(tf.constant(x), training=True)
        outputs = {"trunk": trunk, "kind": model.get_layer("kind")(trunk)}
        probabilities = tf.identity(outputs["kind"])  # as in two_headed_forward
        return tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(y[1], probabilities)
        ), outputs

    rows, losses = reference_run(two_headed(form), [(x, (amount, kind))], kind_alone)
    np.testing.assert_allclose(shot.loss, losses[0], rtol=1e-5)
    table = pd.concat([shot.weights.set_index("variable"), shot.activations.set_index("layer")])
    assert sorted(table.index) == sorted(name for _, name in rows)
    for (_, name), expected in rows.items():
        for column in STATISTICS:
            np.testing.assert_allclose(
                table.loc[name, column], expected[column], rtol=1e-4, atol=1e-7, err_msg=name
            )


def test_a_loops_log_of_several_outputs_equals_a_tape():
    x, amount, kind = two_headed_data()
    model = two_headed("dict")
    optimizer = keras.optimizers.SGD(LEARNING_RATE)
    log = gradflow.GradientLog(model, optimizer=optimizer, update_ratio=True)
    losses = {
        "amount": keras.losses.MeanSquaredError(),
        "kind": keras.losses.SparseCategoricalCrossentropy(),
    }

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            predicted = model(xb, training=True)
            loss = sum(WEIGHTS[k] * losses[k](yb[k], predicted[k]) for k in losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return loss, gradients

    with log:
        for start in (0, 8):
            part = slice(start, start + BATCH)
            loss, gradients = train_step(x[part], {"amount": amount[part], "kind": kind[part]})
            log.record(gradients, loss=loss)

    batches = [(x[s : s + BATCH], (amount[s : s + BATCH], kind[s : s + BATCH])) for s in (0, 8)]
    rows, reference_losses = reference_run(two_headed("dict"), batches, two_headed_forward)
    rows = {key: row for key, row in rows.items() if "/" in key[1]}  # no layer outputs in a log
    assert largest_difference(log.history, rows) < 1e-4
    metrics = log.metrics.pivot(index="step", columns="name", values="value")
    np.testing.assert_allclose(metrics["loss"], reference_losses, rtol=1e-5)
    assert log.events.empty


def test_a_float8_loops_log_under_a_loss_scale_unscales_and_leaves_the_scales_out(mixed_float16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    model = float8_regressor()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LEARNING_RATE))
    log = gradflow.GradientLog(model, optimizer=optimizer, update_ratio=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(yb - tf.cast(model(xb, training=True), "float32")))
            scaled = optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return loss, gradients

    with log:
        for start in (0, 8):
            loss, gradients = train_step(x[start : start + BATCH], y[start : start + BATCH])
            log.record(gradients, loss=loss)  # the scaled gradients, as the loop has them

    rows = float8_reference(float8_regressor(), x, y, float(optimizer.initial_scale))
    weights = {key: row for key, row in rows.items() if "/" in key[1]}
    assert largest_difference(log.history, weights) < 1e-4
    assert log.events.empty
