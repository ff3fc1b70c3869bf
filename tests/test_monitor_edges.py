"""GradientMonitor where a practitioner's own setup strays from the plain case.

Each test here began as a fault found by using the library the way the
README invites, on models and `fit` options it does not mention: a softmax
output under cross-entropy, two monitors, an error in the middle of training,
a short last execution, gradient accumulation, a gradient too large for
float32's sum of squares, and constructor arguments of the wrong kind.
"""

import warnings

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

from gradflow import diagnosis, schema, snapshot
from gradflow.monitor import GradientMonitor, deferred
from gradflow.monitor import callback as monitor_callback
from gradflow.monitor import step as monitor_step
from gradflow.store import RunStore
from tests.test_monitor_refit import Broken

N, BATCH, CLASSES = 32, 8, 3


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 5)).astype("float32")
    y = rng.integers(0, CLASSES, N)
    return x, y


def classifier(output_activation="softmax", units=CLASSES, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(6, activation="tanh", name="hidden"),
            keras.layers.Dense(units, activation=output_activation, name="out"),
        ]
    )


def compile_for_logits(model):
    """Plain SGD on a head without softmax, as the subclassed-model tests train."""
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def rows(monitor, layer, tensor):
    history = monitor.history
    return history[(history["layer"] == layer) & (history["tensor"] == tensor)].sort_values("step")


@pytest.mark.parametrize(
    "activation,loss",
    [
        ("softmax", "sparse_categorical_crossentropy"),
        ("sigmoid", "binary_crossentropy"),
    ],
)
def test_output_gradient_is_dloss_doutput_when_the_loss_reads_logits(activation, loss):
    """Keras's cross-entropies read a softmax/sigmoid output's logits, off the output's path.

    The monitor once recorded that output's gradient as all zeros (and then
    called its units dead). The reference is dLoss/d(output) by hand.
    """
    x, y = data()
    units = CLASSES if activation == "softmax" else 1
    targets = y if activation == "softmax" else (y > 0).astype("float32")[:, None]
    model = classifier(activation, units)
    model.compile(keras.optimizers.SGD(0.0), loss)  # the weights stay put
    monitor = GradientMonitor(activations=True)
    model.fit(x, targets, batch_size=N, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])

    p = model.predict(x, verbose=0).astype("float64")
    if activation == "softmax":
        onehot = np.eye(CLASSES)[y]
        # Keras's loss on probabilities is -log(p_y / sum p): d/dp = 1 - onehot / p_y.
        expected = (1 - onehot / p) / N
    else:
        expected = (p - targets) / (p * (1 - p)) / N  # d mean BCE / dp
    recorded = rows(monitor, "out", schema.ACTIVATION).iloc[0]
    np.testing.assert_allclose(recorded["l2_norm"], np.linalg.norm(expected), rtol=1e-4)
    np.testing.assert_allclose(recorded["max_abs"], np.abs(expected).max(), rtol=1e-4)
    assert recorded["zero_fraction"] == 0.0
    assert "dead_relu" not in set(monitor.events["kind"])


def test_two_monitors_in_one_fit_are_refused():
    x, y = data()
    model = classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="Two GradientMonitors were given to one `fit`"):
        model.fit(x, y, verbose=0, callbacks=[GradientMonitor(), GradientMonitor(every=2)])
    # The first monitor's step is gone: a plain fit trains with Keras's own.
    model.fit(x, y, verbose=0)
    assert "train_step" not in model.__dict__


class FailingBatches(keras.utils.PyDataset):
    """Batches of (x, y) that raise on batch `fail_at` (0-based) of the first epoch."""

    def __init__(self, x, y, fail_at):
        super().__init__()
        self.x, self.y, self.fail_at = x, y, fail_at

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        if index == self.fail_at:
            raise RuntimeError("the disk went away")
        return self.x[index * BATCH : (index + 1) * BATCH], self.y[
            index * BATCH : (index + 1) * BATCH
        ]


def stored_classifier(tmp_path):
    """Data, a store, a compiled classifier and a monitor storing its runs there."""
    x, y = data()
    store = RunStore(tmp_path / "runs.db")
    model = classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    return x, y, store, model, GradientMonitor(store=store)


def test_an_error_inside_training_keeps_the_recorded_steps_and_closes_the_run(tmp_path):
    x, y, store, model, monitor = stored_classifier(tmp_path)
    with pytest.raises(Exception, match="the disk went away"):
        model.fit(FailingBatches(x, y, fail_at=3), epochs=1, verbose=0, callbacks=[monitor])

    trained = int(model.optimizer.iterations.numpy())
    assert trained == 3
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3]
    info = store.run_info(monitor.run_id)
    assert info["status"] == "failed"
    assert "the disk went away" in info["message"]
    stored = store.layer_stats(monitor.run_id)
    assert sorted(stored["step"].unique()) == [1, 2, 3]
    # The model is Keras's own again: a plain fit records nothing more.
    assert "train_step" not in model.__dict__
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3]


def test_a_run_early_stopping_ends_says_where_it_ended(tmp_path):
    """A stored run EarlyStopping ended at step 8 of 40 read "step 8 / 40" for ever."""
    x, y, store, model, monitor = stored_classifier(tmp_path)
    # No epoch improves the loss by 1e9: the second epoch ends the fit.
    stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0)
    model.fit(x, y, batch_size=BATCH, epochs=10, verbose=0, callbacks=[monitor, stopper])
    steps = N // BATCH
    assert int(model.optimizer.iterations.numpy()) == 2 * steps
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["total_steps"]) == ("completed", 2 * steps)
    assert info["message"] == (
        f"Training ended at step {2 * steps} of the {10 * steps} planned: a callback stopped "
        "it (such as EarlyStopping)."
    )
    # A fit that runs to its end says nothing of the kind.
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["total_steps"], info["message"]) == ("completed", 3 * steps, None)


class InterruptedModel(keras.Sequential):
    """A model whose train function raises KeyboardInterrupt on its `interrupt_at`-th call.

    Ctrl-C arrives while the train function runs (that is where `fit`
    spends its time); raising it from inside that function is the same
    thing, at a known step.
    """

    interrupt_at = 4

    def make_train_function(self, force=False):
        super().make_train_function(force)
        keras_function = self.train_function
        calls = []

        def train_function(iterator):
            calls.append(1)
            if len(calls) == self.interrupt_at:
                raise KeyboardInterrupt
            return keras_function(iterator)

        self.train_function = train_function
        return train_function


def test_keyboard_interrupt_marks_the_run_interrupted_and_keeps_its_steps(tmp_path):
    x, y = data()
    keras.utils.set_random_seed(0)
    model = InterruptedModel(
        [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(CLASSES)]
    )
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[monitor])
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3]
    info = store.run_info(monitor.run_id)
    assert info["status"] == "interrupted"
    assert sorted(store.layer_stats(monitor.run_id)["step"].unique()) == [1, 2, 3]
    assert "train_step" not in model.__dict__


@pytest.mark.parametrize("in_step", [False, True])
def test_a_fit_another_callback_ends_keeps_its_steps_in_the_history(in_step, monkeypatch):
    """The steps stayed in the monitor's ring: `history` read empty after the error."""
    if in_step:
        monkeypatch.setattr(deferred, "MAX_PARAMETERS", 0)
    x, y = data()
    model = classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    monitor = GradientMonitor()
    with pytest.raises(RuntimeError, match="a bug in someone's callback"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor, Broken(at=2)])
    assert monitor._plan.deferred is not in_step
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3]
    assert sorted(monitor.metrics.query("name == 'loss'")["step"]) == [1, 2, 3]
    # The next fit gives the model its own step back and keeps the record.
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert "train_step" not in model.__dict__
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3]


def test_a_failing_diagnosis_rule_warns_and_loses_nothing(tmp_path, monkeypatch):
    def broken_rules(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(monitor_callback, "diagnose", broken_rules)
    x, y = data()
    model = classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store)
    # The warnings the monitor gives, recorded where it gives them: once in a
    # full CI run `pytest.warns` saw none ("Emitted warnings: []"). Its
    # `catch_warnings` swaps process-wide state that another thread's
    # `catch_warnings` can restore under it (not thread-safe before 3.14).
    given = []
    warn = monitor_callback.warn_user

    def recording_warn(message, *args, **kwargs):
        given.append(str(message))
        return warn(message, *args, **kwargs)

    monkeypatch.setattr(monitor_callback, "warn_user", recording_warn)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    failed = [m for m in given if "the diagnosis rules failed (ZeroDivisionError" in m]
    assert len(failed) == 1, (given, len(monitor.history))
    assert store.run_info(monitor.run_id)["status"] == "completed"
    assert sorted(store.layer_stats(monitor.run_id)["step"].unique()) == [1, 2, 3, 4]


class _KerasLogs(keras.callbacks.Callback):
    """Each batch's compiled accuracy with the optimizer's step count after it (waits for it)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        self.rows.append((step, float(logs["accuracy"])))


@pytest.mark.parametrize("length", ["known", "unknown"])
def test_compiled_metrics_of_a_short_last_execution_land_on_steps_that_ran(length):
    """6 batches an epoch at 4 steps per execution: calls of 4 and 2 steps. Of a
    dataset of unknown length (a generator) Keras reports the call of 2 as batch 7:
    the epoch's accuracy was put on step 8, in the next epoch, and the last on step
    14 of a 12-step run (the optimizer audit)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 5)).astype("float32")
    y = rng.integers(0, CLASSES, 48)
    model = classifier()
    model.compile(
        "sgd", "sparse_categorical_crossentropy", metrics=["accuracy"], steps_per_execution=4
    )
    monitor, logs = GradientMonitor(), _KerasLogs()
    if length == "known":
        data = {"x": x, "y": y, "batch_size": BATCH}
    else:
        batches = tf.data.Dataset.from_generator(
            lambda: ((x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, 48, BATCH)),
            output_signature=(
                tf.TensorSpec((None, 5), tf.float32),
                tf.TensorSpec((None,), tf.int64),
            ),
        )
        data = {"x": batches}
    model.fit(**data, epochs=2, shuffle=False, verbose=0, callbacks=[monitor, logs])
    accuracy = monitor.metrics.query("name == 'accuracy'")
    assert accuracy["step"].tolist() == [4, 6, 10, 12]
    assert list(zip(accuracy["step"], accuracy["value"], strict=True)) == logs.rows


def test_gradient_accumulation_records_every_batch_under_its_own_step():
    x, y = data()
    model = classifier("linear")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss)
    start = [v.numpy() for v in model.trainable_variables]
    monitor = GradientMonitor()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])

    # Reference: every batch's own gradient; the weights move after batches 2 and 4.
    reference = keras.models.clone_model(model)
    reference.set_weights(start)
    kernel = reference.trainable_variables[0]
    expected, summed = [], None
    for b in range(N // BATCH):
        xb, yb = x[b * BATCH : (b + 1) * BATCH], y[b * BATCH : (b + 1) * BATCH]
        with tf.GradientTape() as tape:
            value = loss(yb, reference(xb, training=True))
        grads = tape.gradient(value, reference.trainable_variables)
        expected.append(float(tf.norm(grads[0])))
        summed = grads if summed is None else [s + g for s, g in zip(summed, grads, strict=True)]
        if b % 2 == 1:
            for v, g in zip(reference.trainable_variables, summed, strict=True):
                v.assign_sub(0.1 * g / 2)
            summed = None
    recorded = rows(monitor, "hidden", "kernel")
    assert recorded["step"].tolist() == [1, 2, 3, 4]
    np.testing.assert_allclose(recorded["l2_norm"], expected, rtol=1e-5)
    # Only the batches that close an accumulation move the weights.
    assert (recorded["update_ratio"].to_numpy()[[0, 2]] == 0).all()
    assert (recorded["update_ratio"].to_numpy()[[1, 3]] > 0).all()
    np.testing.assert_allclose(kernel.numpy(), model.trainable_variables[0].numpy(), rtol=1e-5)


@pytest.mark.parametrize("clipping", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_gradient_accumulation_records_the_clipped_mean_its_updates_apply(clipping):
    """The clipped columns clipped each batch's gradient; Keras clips the mean of two."""
    x, y = data()
    model = classifier("linear")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    limit = 0.05 if clipping == "clipvalue" else 0.3
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2, **{clipping: limit})
    model.compile(optimizer, loss)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    monitor = GradientMonitor()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])

    applied = {}  # step -> the clipped mean gradient of each variable, by hand
    summed = None
    for b in range(N // BATCH):
        xb, yb = x[b * BATCH : (b + 1) * BATCH], y[b * BATCH : (b + 1) * BATCH]
        with tf.GradientTape() as tape:
            value = loss(yb, reference(xb, training=True))
        grads = [g.numpy() for g in tape.gradient(value, reference.trainable_variables)]
        summed = grads if summed is None else [s + g for s, g in zip(summed, grads, strict=True)]
        if b % 2 == 1:
            mean = [s / 2 for s in summed]
            if clipping == "clipvalue":
                clipped = [np.clip(g, -limit, limit) for g in mean]
            elif clipping == "clipnorm":
                clipped = [g * min(1.0, limit / np.linalg.norm(g)) for g in mean]
            else:
                total = np.sqrt(sum(np.sum(g * g) for g in mean))
                clipped = [g * min(1.0, limit / total) for g in mean]
            applied[b + 1] = clipped
            for v, g in zip(reference.trainable_variables, clipped, strict=True):
                v.assign_sub(0.1 * g)
            summed = None
    np.testing.assert_allclose(
        model.trainable_variables[0].numpy(), reference.trainable_variables[0].numpy(), rtol=1e-5
    )
    history = monitor.history.set_index(["step", "variable"])
    for step, clipped in applied.items():
        for v, g in zip(model.trainable_variables, clipped, strict=True):
            row = history.loc[(step, v.path)]
            np.testing.assert_allclose(row["l2_norm_clipped"], np.linalg.norm(g), rtol=1e-5)
            np.testing.assert_allclose(row["max_abs_clipped"], np.abs(g).max(), rtol=1e-5)
    # The batches that only accumulate apply nothing: no clipped gradient to show.
    accumulating = monitor.history.query("step in [1, 3]")
    assert accumulating[["l2_norm_clipped", "max_abs_clipped"]].isna().all().all()
    metrics = monitor.metrics.pivot(index="step", columns="name", values="value")
    assert metrics.loc[[1, 3], ["global_norm_clipped", "clipped"]].isna().all().all()
    assert (metrics.loc[[2, 4], "clipped"] == 1).all()
    for step, clipped in applied.items():
        total = np.sqrt(sum(np.sum(g * g) for g in clipped))
        np.testing.assert_allclose(metrics.loc[step, "global_norm_clipped"], total, rtol=1e-5)


class Amplify(keras.layers.Layer):
    """Identity forward; multiplies the gradient passing back by `factor` (1e25: finite, but huge)."""

    def __init__(self, factor=1e25, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        @tf.custom_gradient
        def amplified(x):
            return tf.identity(x), lambda upstream: upstream * self.factor

        return amplified(x)


def test_a_finite_gradient_too_large_for_float32_squares_is_exploding_not_broken():
    """|g| ~ 1e25: its squares overflow float32, every entry is finite.

    The step must not halt as if it were non-finite, the row keeps a zero
    NaN/Inf count and a finite norm (once +inf: the float32 sum of squares
    overflowed), and the rules call the layer exploding.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, name="below"),
            Amplify(name="amplify"),
            keras.layers.Dense(1, name="top"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.0), "mse")
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    y = np.ones((8, 1), "float32")
    # Activations keep the statistics in the step, where the halt reads them.
    monitor = GradientMonitor(stop_on_nonfinite=True, activations=True)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[monitor])
    assert int(model.optimizer.iterations.numpy()) == 3  # no halt
    below = rows(monitor, "below", "kernel")
    assert (below["nonfinite"] == 0).all()
    assert np.isfinite(below["max_abs"]).all() and (below["max_abs"] > 1e20).all()
    assert np.isfinite(below["l2_norm"]).all()
    assert (below["l2_norm"] >= below["max_abs"]).all()
    assert (below["l2_norm"] <= below["max_abs"] * np.sqrt(5 * 4)).all()
    events = monitor.events
    assert "nonfinite" not in set(events["kind"])
    exploding = events[(events["kind"] == "exploding") & (events["layer"] == "below")]
    assert len(exploding) == 1 and "e+2" in exploding["message"].iloc[0]


def amplified(factor):
    """Two Dense layers whose gradients `Amplify` scales by `factor`."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, name="below"),
            keras.layers.Dense(1, name="top"),
            Amplify(factor, name="amplify"),
        ]
    )


@pytest.mark.parametrize("factor", [1e25, 1e-25], ids=["huge", "tiny"])
@pytest.mark.parametrize(
    "path", ["deferred-numpy", "deferred-tensorflow", "in-step"], ids=lambda p: p
)
def test_the_global_norm_of_finite_gradients_is_finite_and_not_zero(factor, path, monkeypatch):
    """Every gradient scaled by 1e25 or 1e-25: the layers' norms are exact, and the
    global norm, summed from their float32 squares, read +inf or 0."""
    if path == "in-step":
        monkeypatch.setattr(deferred, "MAX_PARAMETERS", 0)
    model = amplified(factor)
    model.compile(keras.optimizers.SGD(0.0), "mse")  # the weights stay: one reference
    x = np.random.default_rng(0).normal(size=(16, 5)).astype("float32")
    y = np.ones((16, 1), "float32")
    monitor = GradientMonitor(histograms=path == "deferred-tensorflow")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor._plan.deferred is (path != "in-step")

    recorded = monitor.metrics.query("name == 'global_norm'").set_index("step")["value"]
    assert list(recorded.index) == [1, 2]
    for step, start in ((1, 0), (2, 8)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y[start : start + 8] - model(x[start : start + 8])))
        gradients = tape.gradient(loss, model.trainable_variables)
        expected = np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in gradients))
        assert 0 < expected < np.inf and 1e-30 < expected / factor < 1e30
        np.testing.assert_allclose(recorded[step], expected, rtol=1e-5)


class Shrink(keras.layers.Layer):
    """Multiplies by `factor` going forward and passes the gradient back unchanged.

    After a Dense with 1e25 weights it keeps the loss finite while the Dense
    still gets gradients of order 1: the weights of a run about to diverge.
    """

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        @tf.custom_gradient
        def shrunk(x):
            return x * self.factor, lambda upstream: upstream

        return shrunk(x)


class WeightsEachStep(keras.callbacks.Callback):
    """The model's weights (float64) before the first step and after every step."""

    def on_train_begin(self, logs=None):
        self.seen = [self.weights()]

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.weights())

    def weights(self):
        return [v.numpy().astype(np.float64) for v in self.model.trainable_variables]


def _far_from_one(scale, inputs=5, units=4):
    """A Dense whose weights are about `scale`, and an SGD that moves them by a few %."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((inputs,)), keras.layers.Dense(units, name="far")]
    if scale > 1:
        layers.append(Shrink(1 / scale, name="shrink"))
    layers.append(keras.layers.Dense(1, name="top", use_bias=False))
    model = keras.Sequential(layers)
    far = model.get_layer("far")
    rng = np.random.default_rng(1)
    far.kernel.assign(rng.uniform(1, 2, size=(inputs, units)).astype("float32") * scale)
    far.bias.assign(rng.uniform(1, 2, size=units).astype("float32") * scale)
    top = model.get_layer("top")
    top.kernel.assign(np.full((units, 1), 4 / units, "float32"))
    top.trainable = False  # an SGD step of 0.01 x scale would blow it up
    # Gradients of order 1 (`Shrink` passes them back unshrunk; tiny weights
    # leave the output near 0 against a target of 1).
    return model, keras.optimizers.SGD(0.01 * scale * units / 4)


@pytest.mark.parametrize("scale", [1e25, 1e-24], ids=["huge", "tiny"])
@pytest.mark.parametrize(
    "path",
    ["deferred-numpy", "deferred-tensorflow", "in-step", "in-step-difference", "in-step-large"],
    ids=lambda p: p,
)
def test_weight_norms_and_update_ratios_of_weights_far_from_one(scale, path, monkeypatch):
    """Weights about 1e25 (a run about to diverge) or 1e-24 (a bias that has
    barely moved from zero in a deep sigmoid net).

    Their float32 squares overflow or flush to zero: the weight norm read
    +inf or 0, and the update ratio NaN. `in-step-large`: a 256 x 256 kernel,
    reduced on its own (`statistics.sum_of_squares`).
    """
    if path.startswith("in-step"):
        monkeypatch.setattr(deferred, "MAX_PARAMETERS", 0)
    if path == "in-step-difference":
        # The norms of the weights before and after, not of the optimizer's increments.
        monkeypatch.setattr(monitor_step._UpdateCapture, "KNOWN", ())
    inputs, units = (256, 256) if path == "in-step-large" else (5, 4)
    model, optimizer = _far_from_one(scale, inputs, units)
    model.compile(optimizer, "mse")
    x = np.random.default_rng(0).normal(size=(16, inputs)).astype("float32")
    y = np.ones((16, 1), "float32")
    monitor = GradientMonitor(histograms=path == "deferred-tensorflow")
    seen = WeightsEachStep()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[seen, monitor])
    assert monitor._plan.deferred is path.startswith("deferred")

    for index, tensor in enumerate(("kernel", "bias")):
        recorded = rows(monitor, "far", tensor).set_index("step")
        assert list(recorded.index) == [1, 2]
        for step in (1, 2):
            before, after = seen.seen[step - 1][index], seen.seen[step][index]
            change = np.linalg.norm(after - before)
            assert 1e-3 < change / np.linalg.norm(before) < 1  # the weights moved
            np.testing.assert_allclose(
                recorded.loc[step, "weight_norm"], np.linalg.norm(after), rtol=1e-5
            )
            np.testing.assert_allclose(
                recorded.loc[step, "update_ratio"], change / np.linalg.norm(before), rtol=1e-4
            )


@pytest.mark.parametrize(
    "factor,clipping",
    # Not clipnorm with 1e25 gradients: Keras's `clip_by_norm` sums float32
    # squares and turns such gradients into NaN (1e25 x clipnorm / inf).
    [(1e25, {"clipvalue": 1e30}), (1e-25, {"clipnorm": 1.0})],
    ids=["huge", "tiny"],
)
def test_clipped_norms_of_gradients_far_from_one_are_exact(factor, clipping):
    """With clipping far above the gradients nothing is clipped.

    The clipped gradients' norms were float32 squares: 1e-25 gradients read
    0 after clipping (and the step counted as clipped), 1e25 ones +inf.
    """
    model = amplified(factor)
    model.compile(keras.optimizers.SGD(0.0, **clipping), "mse")
    x = np.random.default_rng(0).normal(size=(16, 5)).astype("float32")
    y = np.ones((16, 1), "float32")
    monitor = GradientMonitor()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    history = monitor.history.query("tensor != 'activation'")
    assert len(history) == 2 * 4 and (history["l2_norm"] > 0).all()
    assert np.isfinite(history["l2_norm"]).all()
    np.testing.assert_allclose(history["l2_norm_clipped"], history["l2_norm"], rtol=1e-5)
    metrics = monitor.metrics.pivot(index="step", columns="name", values="value")
    assert (metrics["clipped"] == 0).all()
    np.testing.assert_allclose(metrics["global_norm_clipped"], metrics["global_norm"], rtol=1e-5)


def test_diagnose_tells_overflowed_norms_from_broken_ones():
    table = pd.DataFrame(
        {
            "step": [1, 1],
            "layer": ["overflowed", "broken"],
            "layer_index": [0, 1],
            "tensor": ["kernel", "kernel"],
            "l2_norm": [np.inf, np.inf],
            "nonfinite": [0, 3],
        }
    )
    found = diagnosis.diagnose(table)
    assert found.query("kind == 'exploding'")["layer"].tolist() == ["overflowed"]


def test_a_layer_that_passes_back_nothing_is_not_called_saturated():
    """An input gradient of exactly 0 once divided by zero in the saturation rule."""
    table = pd.DataFrame(
        {
            "step": [1, 1, 1],
            "layer": ["dead", "relu", "relu"],
            "layer_index": [0, 1, 1],
            "tensor": [schema.ACTIVATION, schema.ACTIVATION, "kernel"],
            "l2_norm": [0.0, 1.0, 1.0],
            "mean_abs": [0.0, 0.5, 0.5],
            "zero_fraction": [1.0, 0.0, 0.0],
            "nonfinite": [0, 0, 0],
        }
    )
    found = diagnosis.diagnose(table)
    assert found["kind"].tolist() == ["dead_relu"]
    # The rule cannot see the activation: saturated tanh units give these zeros too, and
    # "many ReLU units are dead" with ReLU advice was wrong for them.
    message = found["message"].iloc[0]
    assert (
        "With ReLU they are dead" in message
        and "With tanh or sigmoid they are saturated" in message
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"activations": "no"}, "`activations` must be True or False, got 'no'"),
        ({"stop_on_nonfinite": 1}, "`stop_on_nonfinite` must be True or False, got 1"),
        ({"store": 123}, "`store` must be a gradflow.RunStore, the path of one, or None"),
        ({"tensorboard_dir": 123}, "`tensorboard_dir` must be a string or None"),
        ({"rules": {"vanishing_norm": 1e-6}}, "`rules` must be a gradflow.diagnosis.Thresholds"),
    ],
)
def test_constructor_refuses_arguments_of_the_wrong_kind(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradientMonitor(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"store": "{tmp}"}, "`store` must be a run-store file, got the folder"),
        ({"store": "{tmp}/notes.csv"}, "`store`='.*notes.csv' is not a gradflow run store"),
        ({"tensorboard_dir": "{tmp}/notes.csv"}, "`tensorboard_dir` must be a folder"),
    ],
)
def test_paths_that_cannot_be_used_are_refused_by_name_before_fit(tmp_path, kwargs, message):
    """They failed at the start of `fit` in SQLite's or TensorFlow's words, naming neither."""
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    kwargs = {key: value.replace("{tmp}", str(tmp_path)) for key, value in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        GradientMonitor(**kwargs)


def test_snapshot_refuses_an_empty_batch_and_a_missing_model():
    from gradflow import snapshot

    x, y = data()
    model = classifier()
    with pytest.raises(ValueError, match=r"`x` holds no samples \(shape \(0, 5\)\)"):
        snapshot(model, x[:0], y[:0], loss="sparse_categorical_crossentropy")
    with pytest.raises(TypeError, match="`model` must be a Keras model, got NoneType"):
        snapshot(None, x, y, loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning leaks either
        shot = snapshot(model, x, y, loss="sparse_categorical_crossentropy")
    assert len(shot.weights) == 4


@pytest.fixture
def mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def loss_scaled_regressor(initial_scale):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(1, dtype="float32", name="out"),
        ]
    )
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=initial_scale
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer


def test_loss_scale_overflows_are_skipped_batches_not_nans(mixed_precision):
    """Mixed precision: LossScaleOptimizer skips a batch whose scaled gradients
    overflow float16 and halves its scale. Once, that attempt's Inf statistics
    overwrote the step before's record (it does not advance `iterations`), and
    `stop_on_nonfinite` halted training at the first overflow as if it were a NaN."""
    x, _ = data()
    y = x.sum(axis=1, keepdims=True)
    model, optimizer = loss_scaled_regressor(initial_scale=2.0**24)
    monitor = GradientMonitor(stop_on_nonfinite=True)
    epochs = 5
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[monitor])
    batches = epochs * N // BATCH
    skipped = int(np.log2(2.0**24 / float(optimizer.dynamic_scale.numpy())))
    assert 0 < skipped < batches  # some overflowed, and training went on after them
    applied = int(optimizer.iterations.numpy())
    assert applied == batches - skipped
    history = monitor.history
    assert sorted(history["step"].unique()) == list(range(1, applied + 1))
    assert history.groupby("step").size().nunique() == 1  # one record a step
    assert np.isfinite(history[["max_abs", "l2_norm"]].to_numpy()).all()
    assert (history["nonfinite"] == 0).all()
    events = monitor.events
    assert "nonfinite" not in set(events["kind"])
    notes = events[events["message"].str.startswith("Loss-scale overflow")]
    counted = notes["message"].str.extract(r"(\d+) batch")[0].astype(int).sum()
    assert counted == skipped


@pytest.mark.parametrize("scale", [2.0**15, 2.0**16])
def test_activation_gradients_under_a_loss_scale_past_float16s_range(mixed_precision, scale):
    """A float16 layer output's gradient was unscaled in float16: 65536 is Inf there, so
    every activation row read 0 ("dead ReLUs") once the scale had doubled from 32768,
    after about 2,000 finite steps of a mixed-precision `fit`."""
    x, _ = data()
    y = x.sum(axis=1, keepdims=True)[:BATCH]
    model, optimizer = loss_scaled_regressor(initial_scale=scale)
    optimizer.inner_optimizer.learning_rate.assign(0.0)  # the weights the reference sees
    monitor = GradientMonitor(activations=True)
    model.fit(x[:BATCH], y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    with tf.GradientTape() as tape:
        hidden = model.get_layer("hidden")(tf.constant(x[:BATCH]))
        tape.watch(hidden)
        loss = keras.losses.MeanSquaredError()(y, model.get_layer("out")(hidden))
    expected = tf.cast(tape.gradient(loss, hidden), tf.float32).numpy()
    row = monitor.history.query("tensor == 'activation' and layer == 'hidden'").iloc[0]
    np.testing.assert_allclose(row["max_abs"], np.abs(expected).max(), rtol=2e-3)
    np.testing.assert_allclose(row["l2_norm"], np.linalg.norm(expected), rtol=2e-3)
    assert "dead_relu" not in set(monitor.events["kind"])


def test_a_nan_under_loss_scaling_still_halts_at_its_step(mixed_precision):
    x, _ = data()
    y = x.sum(axis=1, keepdims=True)
    x[2 * BATCH + 1, 0] = np.nan  # the third batch: a NaN loss, not an overflow
    model, optimizer = loss_scaled_regressor(initial_scale=2.0**8)
    monitor = GradientMonitor(stop_on_nonfinite=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    nonfinite = monitor.events.query("kind == 'nonfinite'")
    assert nonfinite["step"].tolist() == [3]
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3]
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize(
    "clip", [{"clipvalue": 0.02}, {"clipnorm": 0.05}, {"global_clipnorm": 0.05}], ids=str
)
def test_clipped_embedding_gradients_are_recorded_as_applied(clip):
    """Keras clips an Embedding's gradient slice by slice, before repeated rows
    are summed; the monitor once clipped the summed gradient and recorded other
    numbers than the ones applied (found by the twenty-seventh session's audit)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(5, 3, name="emb"),
            keras.layers.Flatten(),
            keras.layers.Dense(1, name="out"),
        ]
    )
    x = np.array([[1, 1, 1, 2], [1, 1, 3, 3]], "int32")  # row 1 looked up five times
    y = np.array([[5.0], [-3.0]], "float32")
    model.compile(keras.optimizers.SGD(0.1, **clip), "mse")
    before = model.get_weights()
    monitor = GradientMonitor()
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    # SGD without momentum: the applied gradient is the weights' change / lr.
    applied = [(b - a) / 0.1 for b, a in zip(before, model.get_weights(), strict=True)]
    history = monitor.history.set_index(["layer", "tensor"])
    for (layer, tensor), gradient in zip(
        [("emb", "embeddings"), ("out", "kernel"), ("out", "bias")], applied, strict=True
    ):
        row = history.loc[(layer, tensor)]
        np.testing.assert_allclose(row["l2_norm_clipped"], np.linalg.norm(gradient), rtol=1e-4)
        np.testing.assert_allclose(row["max_abs_clipped"], np.abs(gradient).max(), rtol=1e-4)
    global_clipped = monitor.metrics.query("name == 'global_norm_clipped'")["value"].iloc[0]
    total = np.sqrt(sum(np.square(g).sum() for g in applied))
    np.testing.assert_allclose(global_clipped, total, rtol=1e-4)


@pytest.mark.parametrize("floatx", [False, True], ids=["one float64 layer", "floatx float64"])
def test_float64_weights_take_the_in_step_path(floatx):
    """A float64 layer among float32 ones of the same shapes (or `set_floatx`)
    once crashed the in-step path: one stack held two float types."""
    keras.config.set_floatx("float64" if floatx else "float32")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(5, dtype="float64", name="d64"),
                keras.layers.Dense(5, name="d32"),
                keras.layers.Dense(1, name="out"),
            ]
        )
        x, _ = data()
        y = x[:, :1]
        model.compile(keras.optimizers.SGD(0.1, clipnorm=0.5), "mse")
        first = [v.numpy() for v in model.trainable_variables]
        monitor = GradientMonitor(every=2)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
        assert monitor._plan.deferred is False
        # Step 2's gradient, replayed by a tape from the weights after step 1.
        reference = keras.models.clone_model(model)
        for variable, value in zip(reference.trainable_variables, first, strict=True):
            variable.assign(value)
        optimizer = keras.optimizers.SGD(0.1, clipnorm=0.5)
        for start in (0, BATCH):
            xb, yb = x[start : start + BATCH], y[start : start + BATCH]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    tf.square(tf.cast(yb, "float64") - tf.cast(reference(xb), "float64"))
                )
            grads = tape.gradient(loss, reference.trainable_variables)
            if start == 0:
                optimizer.apply_gradients(zip(grads, reference.trainable_variables, strict=True))
        recorded = monitor.history.query("step == 2 and tensor == 'kernel'")
        for layer, grad in zip(["d64", "d32", "out"], grads[::2], strict=True):
            row = recorded[recorded["layer"] == layer].iloc[0]
            np.testing.assert_allclose(row["l2_norm"], np.linalg.norm(grad.numpy()), rtol=1e-5)
            np.testing.assert_allclose(row["max_abs"], np.abs(grad.numpy()).max(), rtol=1e-5)
    finally:
        keras.config.set_floatx("float32")


class UnusedBranch(keras.Model):
    """A trunk and a head, and between them a layer whose output `call` drops.

    Its weights and output get no gradient; they sit between recorded rows
    (weights and outputs alike), so leaving them out must not shift the others.
    """

    def __init__(self):
        super().__init__()
        self.trunk = keras.layers.Dense(6, activation="relu", name="trunk")
        self.unused = keras.layers.Dense(3, activation="relu", name="unused")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        h = self.trunk(x)
        self.unused(h)  # left over from an experiment: the loss never sees it
        return self.head(h)


@pytest.mark.parametrize(
    "in_step,activations",
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["deferred", "deferred-activations", "in-step", "in-step-activations"],
)
def test_weights_no_gradient_reaches_are_not_recorded_as_vanishing(
    in_step, activations, tmp_path, monkeypatch
):
    """Recorded as all zeros, such a layer read as vanishing and as dead ReLUs."""
    if in_step:
        monkeypatch.setattr(deferred, "MAX_PARAMETERS", 0)
    keras.utils.set_random_seed(0)
    x, _ = data()
    y = x[:, :1] - x[:, 1:2]
    model = UnusedBranch()
    model.build((None, 5))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with tf.GradientTape() as tape:
        prediction = model(x[:BATCH])
        loss = tf.reduce_mean(tf.square(y[:BATCH] - prediction))
    variables = [*model.trunk.trainable_variables, *model.head.trainable_variables]
    reference = dict(
        zip(
            ["trunk kernel", "trunk bias", "head kernel", "head bias"],
            tape.gradient(loss, variables),
            strict=True,
        )
    )
    output_gradient = 2.0 * (prediction.numpy() - y[:BATCH]) / BATCH  # d mse / d output
    unused_before = [v.numpy() for v in model.unused.trainable_variables]

    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(activations=activations, store=store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Keras's own "Gradients do not exist"
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor._plan.deferred is not in_step

    for table in (monitor.history, store.layer_stats(monitor.run_id)):
        assert set(table["layer"]) == {"trunk", "head"}
        assert bool((table["tensor"] == "activation").any()) is activations
        first = table[table["step"] == 1]
        for key, gradient in reference.items():
            layer, tensor = key.split()
            row = first[(first["layer"] == layer) & (first["tensor"] == tensor)].iloc[0]
            np.testing.assert_allclose(row["max_abs"], np.abs(gradient).max(), rtol=1e-5)
            np.testing.assert_allclose(row["l2_norm"], np.linalg.norm(gradient), rtol=1e-5)
        if activations:
            row = first[(first["layer"] == "head") & (first["tensor"] == "activation")].iloc[0]
            np.testing.assert_allclose(row["max_abs"], np.abs(output_gradient).max(), rtol=1e-5)
            trunk = first[(first["layer"] == "trunk") & (first["tensor"] == "activation")]
            assert trunk["max_abs"].iloc[0] > 0

    tensors = "kernel, bias, output" if activations else "kernel, bias"
    for events in (monitor.events, store.events(monitor.run_id)):
        assert list(events["kind"]) == ["no_gradient"]
        assert events["layer"].iloc[0] == "unused"
        assert f"No gradient reaches layer 'unused' ({tensors})" in events["message"].iloc[0]
    for before, variable in zip(unused_before, model.unused.trainable_variables, strict=True):
        np.testing.assert_array_equal(before, variable.numpy())  # Keras left them alone


class UnusedBranchOwnStep(UnusedBranch):
    def train_step(self, data):  # its own step: the monitor probes instead
        return super().train_step(data)


def test_the_probe_fallback_leaves_out_what_no_gradient_reaches():
    keras.utils.set_random_seed(0)
    x, _ = data()
    model = UnusedBranchOwnStep()
    model.build((None, 5))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    monitor = GradientMonitor(probe_every=2, activations=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the fallback's and Keras's
        model.fit(x, x[:, :1], batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor._plan.probing
    assert sorted(monitor.history["step"].unique()) == [2, 4]
    assert set(monitor.history["layer"]) == {"trunk", "head"}
    assert monitor.history["max_abs"].gt(0).all()
    assert list(monitor.events["kind"]) == ["no_gradient"]
    assert "layer 'unused' (kernel, bias, output)" in monitor.events["message"].iloc[0]


class ScaledBlock(keras.layers.Layer):
    """A custom block with a sub-layer and a trainable weight of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4, activation="tanh", name="inner")

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        return self.inner(x * self.scale)


@pytest.mark.parametrize("activations", [False, True])
def test_a_blocks_own_weight_is_filed_under_the_block(activations):
    """Both blocks' `scale` were filed under the model's name, as one (layer, tensor)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = ScaledBlock(name="block_b")(ScaledBlock(name="block_a")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="out")(hidden), name="net")
    compile_for_logits(model)
    x, y = data()
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    with tf.GradientTape() as tape:
        loss = model.loss(y[:BATCH], reference(x[:BATCH], training=True))
    expected = dict(
        zip(
            [v.path for v in reference.trainable_variables],
            tape.gradient(loss, reference.trainable_variables),
            strict=True,
        )
    )
    shot = snapshot(model, x[:BATCH], y[:BATCH])
    monitor = GradientMonitor(activations=activations)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])

    order = {"block_a/inner": 0, "block_a": 1, "block_b/inner": 2, "block_b": 3, "out": 4}
    first = monitor.history.query("step == 1")
    for table in (first, shot.weights):
        weights = table[table["tensor"] != "activation"]
        assert not weights.duplicated(["layer", "tensor"]).any()
        assert dict(zip(weights["layer"], weights["layer_index"], strict=True)) == order
        scales = weights.query("tensor == 'scale'").set_index("layer")
        assert scales["variable"].to_dict() == {
            "block_a": "block_a/scale",
            "block_b": "block_b/scale",
        }
        for row in weights.itertuples():
            np.testing.assert_allclose(
                row.l2_norm, np.linalg.norm(expected[row.variable].numpy()), rtol=1e-5
            )
    if activations:
        outputs = first.query("tensor == 'activation'")
        assert dict(zip(outputs["layer"], outputs["layer_index"], strict=True)) == order


class TwoOfOneName(keras.Model):
    """Two layers a subclassed model named alike (Keras checks names in Functional models only)."""

    def __init__(self):
        super().__init__(name="twins")
        self.first = keras.layers.Dense(6, activation="tanh", name="proj")
        self.second = keras.layers.Dense(6, activation="tanh", name="proj")
        self.head = keras.layers.Dense(CLASSES, name="head")

    def call(self, x):
        return self.head(self.second(self.first(x)))


@pytest.mark.parametrize("activations", [False, True])
def test_two_layers_of_one_name_are_two_layers(activations):
    """They were one layer `proj` with two weights of each kind, and the second call `proj#2`."""
    keras.utils.set_random_seed(0)
    model = TwoOfOneName()
    compile_for_logits(model)
    x, y = data()
    model(x[:BATCH])
    with tf.GradientTape() as tape:
        loss = model.loss(y[:BATCH], model(x[:BATCH], training=True))
    # By variable, in the model's order: the two `proj/kernel` share a path.
    expected = [np.linalg.norm(g.numpy()) for g in tape.gradient(loss, model.trainable_variables)]
    shot = snapshot(model, x[:BATCH], y[:BATCH])
    monitor = GradientMonitor(activations=activations)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])

    first = monitor.history.query("step == 1")
    order = {"proj": 0, "proj (2)": 1, "head": 2}
    for table in (first, shot.weights):
        weights = table[table["tensor"] != "activation"]
        assert weights["layer"].tolist() == ["proj", "proj", "proj (2)", "proj (2)", "head", "head"]
        assert dict(zip(weights["layer"], weights["layer_index"], strict=True)) == order
        np.testing.assert_allclose(weights["l2_norm"].to_numpy(), expected, rtol=1e-5)
    if activations:
        outputs = first.query("tensor == 'activation'")
        assert dict(zip(outputs["layer"], outputs["layer_index"], strict=True)) == order


class TiedLoop(keras.Model):
    """One layer applied twelve times: more layer calls than activation rows."""

    def __init__(self):
        super().__init__(name="tied")
        self.embed = keras.layers.Dense(4, name="embed")
        self.cell = keras.layers.Dense(4, activation="tanh", name="cell")
        self.head = keras.layers.Dense(CLASSES, name="head")

    def call(self, x):
        h = self.embed(x)
        for _ in range(12):
            h = self.cell(h)
        return self.head(h)


def test_a_layer_called_more_often_than_there_are_rows_keeps_every_layer():
    """The first calls took the rows, so the head, nearest the loss, lost its row."""
    keras.utils.set_random_seed(0)
    model = TiedLoop()
    compile_for_logits(model)
    x, y = data()
    model(x[:1])
    reference = TiedLoop()
    reference(x[:1])
    reference.set_weights(model.get_weights())
    monitor = GradientMonitor(activations=True)
    with pytest.warns(UserWarning, match=r"left out 4 more: cell#9, cell#10, cell#11, cell#12\."):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])

    rows = 2 * 3 + 4  # the monitor's rows for the outputs of 3 layers
    outputs = monitor.history.query("step == 1 and tensor == 'activation'")
    kept = ["embed", "cell", *[f"cell#{n}" for n in range(2, rows - 1)], "head"]
    assert outputs["layer"].tolist() == kept
    assert outputs["layer_index"].tolist() == [0] + [1] * (rows - 2) + [2]
    # The head's row is dLoss/d(logits), from the same pass.
    with tf.GradientTape() as tape:
        logits = reference(x[:BATCH], training=True)
        tape.watch(logits)
        loss = model.loss(y[:BATCH], logits)
    expected = tape.gradient(loss, logits).numpy()
    head = outputs.set_index("layer").loc["head"]
    np.testing.assert_allclose(head["l2_norm"], np.linalg.norm(expected), rtol=1e-5)
    np.testing.assert_allclose(head["max_abs"], np.abs(expected).max(), rtol=1e-5)


class Unbuilt(keras.Model):
    """Subclassed, no `build`: Keras builds it inside the traced step by running
    `call` on placeholders in a scratch graph (`Layer._maybe_build`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(6, activation="relu", name="hidden")
        self.out = keras.layers.Dense(CLASSES, name="out")

    def call(self, x):
        return self.out(self.hidden(x))


def test_an_unbuilt_model_with_a_short_last_batch_keeps_its_real_layer_calls():
    """The scratch graph's layer calls were recorded as the pass's own.

    With activations on, `fit` then ended in `InaccessibleTensorError` on the
    short last batch's trace (found by an audit: 250 samples at 32 a batch).
    """
    x, y = data()
    x, y = np.concatenate([x, x[:3]]), np.concatenate([y, y[:3]])  # a last batch of 3
    keras.utils.set_random_seed(0)
    model = compile_for_logits(Unbuilt())
    first = {}

    class Before(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == len(x) // BATCH:  # the short last batch
                first["weights"] = [v.numpy() for v in self.model.trainable_variables]

    monitor = GradientMonitor(activations=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[Before(), monitor])

    last = monitor.history.query(f"step == {len(x) // BATCH + 1}")
    activations = last[last["tensor"] == schema.ACTIVATION]
    assert activations["layer"].tolist() == ["hidden", "out"], (
        "no `hidden#2` from the scratch graph"
    )
    reference = Unbuilt()
    reference(x[:1])
    for variable, value in zip(reference.trainable_variables, first["weights"], strict=True):
        variable.assign(value)
    xb, yb = x[-3:], y[-3:]
    with tf.GradientTape() as tape:
        hidden = reference.hidden(xb)
        tape.watch(hidden)
        logits = reference.out(hidden)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(yb, logits)
    kernel, _, _, _, d_hidden = tape.gradient(loss, [*reference.trainable_variables, hidden])
    recorded = last.set_index(["layer", "tensor"])
    np.testing.assert_allclose(
        recorded.loc[("hidden", "kernel"), "l2_norm"], np.linalg.norm(kernel), rtol=1e-5
    )
    np.testing.assert_allclose(
        recorded.loc[("hidden", schema.ACTIVATION), "l2_norm"], np.linalg.norm(d_hidden), rtol=1e-5
    )


def test_a_sweep_that_catches_a_failed_fit_keeps_each_runs_steps(tmp_path):
    """A sweep caught each fit's error and went on with a new model and monitor.

    The monitors were held weakly: the garbage collector took each with its
    unsaved steps, and the runs read "running" with none of them.
    """
    import gc

    x, y = data()
    store = RunStore(tmp_path / "runs.db")
    run_ids = []
    for seed in range(3):
        model = classifier(seed=seed)
        model.compile("sgd", "sparse_categorical_crossentropy")
        monitor = GradientMonitor(store=store, run_name=f"sweep {seed}")
        try:
            model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor, Broken(at=1)])
        except RuntimeError:
            pass
        run_ids.append(monitor.run_id)
        del model, monitor
        gc.collect()
    for run_id in run_ids[:-1]:  # closed when the next fit began
        info = store.run_info(run_id)
        assert info["status"] == "failed", info
        assert "outside the train step" in info["message"]
        assert sorted(store.layer_stats(run_id)["step"].unique()) == [1, 2]
    # The last one stays open until the next fit or the program's exit.
    assert store.run_info(run_ids[-1])["status"] == "running"


def test_a_fit_inside_another_fits_callback_leaves_that_one_running(tmp_path):
    x, y = data()
    store = RunStore(tmp_path / "runs.db")
    inner_model = classifier(seed=1)
    inner_model.compile("sgd", "sparse_categorical_crossentropy")
    inner = GradientMonitor(store=store, run_name="inner")

    class FitsAnother(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                inner_model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[inner])

    model = classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    outer = GradientMonitor(store=store, run_name="outer")
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[outer, FitsAnother()])
    info = store.run_info(outer.run_id)
    assert info["status"] == "completed", info
    assert sorted(store.layer_stats(outer.run_id)["step"].unique()) == list(
        range(1, N // BATCH + 1)
    )
    assert store.run_info(inner.run_id)["status"] == "completed"


def test_a_store_it_cannot_write_is_named_and_the_model_is_left_as_it_was(tmp_path, monkeypatch):
    """A read-only store ended `fit` with SQLite's "attempt to write a readonly
    database", naming neither the argument nor the file."""
    import sqlite3

    x, y = data()
    model = classifier(seed=0)
    model.compile("sgd", "sparse_categorical_crossentropy")
    path = tmp_path / "shared.db"
    RunStore(path)  # someone else's store, which this program may read only

    def read_only(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    # (As root, file permissions do not stop a write: SQLite's error is made here.)
    monkeypatch.setattr(RunStore, "create_run", read_only)
    monitor = GradientMonitor(store=str(path))
    with pytest.raises(
        RuntimeError, match=r"could not write to its `store`: '.*shared\.db' can only be read here"
    ):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    assert "train_step" not in model.__dict__
    history = model.fit(x, y, batch_size=BATCH, verbose=0)  # a plain fit after it
    assert np.isfinite(history.history["loss"][-1])


def test_given_to_evaluate_or_predict_it_says_it_records_only_fit():
    x, y = data()
    model = classifier(seed=0)
    model.compile("sgd", "sparse_categorical_crossentropy")
    monitor = GradientMonitor()
    with pytest.warns(UserWarning, match="`evaluate` computes no gradients"):
        model.evaluate(x, y, verbose=0, callbacks=[monitor])
    with pytest.warns(UserWarning, match="`predict` computes no gradients"):
        model.predict(x, verbose=0, callbacks=[monitor])
    # Not in fit's own validation.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, validation_data=(x, y), verbose=0, callbacks=[monitor])
    assert not [w for w in caught if "records training steps only" in str(w.message)]
    assert monitor.history["step"].max() > 0


def test_once_it_recorded_a_fit_evaluate_and_predict_say_nothing():
    """SciKeras gives `predict` and `score` the callbacks of `fit`: each call warned that
    the monitor should be given to `fit`, which the user had done."""
    x, y = data()
    model = classifier(seed=0)
    model.compile("sgd", "sparse_categorical_crossentropy")
    unused = GradientMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.predict(x, verbose=0, callbacks=[unused])
    assert len([w for w in caught if "records training steps only" in str(w.message)]) == 1
    monitor = GradientMonitor()
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.predict(x, verbose=0, callbacks=[monitor])
        model.evaluate(x, y, verbose=0, callbacks=[monitor])
    assert not [w for w in caught if "records training steps only" in str(w.message)]


def test_a_run_continued_after_it_failed_says_so(tmp_path):
    """It read "completed" at the end, with nothing saying it had failed once."""
    x, y = data()
    model = classifier(seed=0)
    model.compile("sgd", "sparse_categorical_crossentropy")
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store)
    with pytest.raises(RuntimeError):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor, Broken(at=1)])
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    assert store.run_info(monitor.run_id)["status"] == "completed"
    told = store.events(monitor.run_id).query("kind == 'info'")
    assert told["message"].tolist() == ["Training went on after step 2, where the run had failed."]
    assert told["step"].tolist() == [2]


@pytest.mark.parametrize("compiled_reads", [False, True], ids=["in_step", "deferred_compiled"])
def test_a_dead_layer_of_a_large_model_has_a_gradient_norm_of_zero(compiled_reads, monkeypatch):
    """A 30,000-step lab run's dead layers read NaN norms: the statistics of a tensor of
    zeros in a group above `statistics._BRANCH_ABOVE` entries squared a scale of 2^126."""
    if compiled_reads:
        # A small model, its ring read by the compiled call (as a long run's is).
        monkeypatch.setattr(deferred, "repays_compiling", lambda *args: True)
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    y = np.zeros((64, 1), "float32")
    width = 400 if not compiled_reads else 120
    model = keras.Sequential(
        [
            keras.Input((16,)),
            # Every unit's input is far below 0: the layer is dead, and so is
            # the gradient of the next layer's kernel (its input is all zeros).
            keras.layers.Dense(
                width, activation="relu", bias_initializer=keras.initializers.Constant(-1e3)
            ),
            keras.layers.Dense(width, activation="relu", name="after_the_dead"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.SGD(0.01), "mse")
    monitor = GradientMonitor()
    model.fit(
        x, y, batch_size=64, epochs=300 if compiled_reads else 2, verbose=0, callbacks=[monitor]
    )
    history = monitor.history
    kernel = history[(history["layer"] == "after_the_dead") & (history["tensor"] == "kernel")]
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, model(x, training=True))
        loss = tf.reduce_mean(loss)
    [reference] = tape.gradient(loss, [model.get_layer("after_the_dead").kernel])
    assert float(tf.norm(reference)) == 0.0
    assert (kernel["max_abs"] == 0).all() and (kernel["zero_fraction"] == 1).all()
    assert (kernel["l2_norm"] == 0).all(), kernel["l2_norm"].unique()
    assert (kernel["std"] == 0).all()


class _FailsWhenTraining(keras.layers.Layer):
    def call(self, inputs, training=None):
        if training:
            raise ValueError("bad input")
        return inputs


def test_a_failed_runs_message_has_no_terminal_codes_or_keras_call_dump(tmp_path):
    """Keras dresses an error raised in a layer's call with terminal bold codes and a
    dump of the call's arguments: the dashboard showed "[1m ... [0m Arguments received
    by Sequential.call(): • inputs=tf.Tensor(...)" (the odd-runs audit)."""
    x, y = data()
    model = keras.Sequential([keras.Input((5,)), _FailsWhenTraining(), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    monitor = GradientMonitor(store=tmp_path / "runs.db")
    with pytest.raises(ValueError, match="bad input") as raised:
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    assert "\x1b[" in str(raised.value) and "Arguments received" in str(raised.value)
    info = RunStore(tmp_path / "runs.db").run_info(monitor.run_id)
    assert info["status"] == "failed"
    assert info["message"].startswith("Training failed: ValueError: ")
    assert "bad input" in info["message"]
    assert "\x1b" not in info["message"] and "Arguments received" not in info["message"]


def test_a_run_recorded_every_50_steps_ends_at_its_last_step_not_its_last_record(tmp_path):
    """64 steps recorded every 50: the run read "Completed · step 50 / 64"."""
    x, y = data()
    model = classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    monitor = GradientMonitor(every=50, store=tmp_path / "runs.db")
    model.fit(x, y, batch_size=2, epochs=4, verbose=0, callbacks=[monitor])
    steps = int(model.optimizer.iterations.numpy())
    assert monitor.history["step"].unique().tolist() == [50] and steps > 50
    info = RunStore(tmp_path / "runs.db").run_info(monitor.run_id)
    assert info["status"] == "completed"
    assert info["progress_step"] == info["total_steps"] == steps


class _FailsAtStep(keras.callbacks.Callback):
    """Raises once the optimizer has applied `step` updates: a pre-empted job."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            raise RuntimeError("pre-empted")


class _AppliedGradients(keras.callbacks.Callback):
    """The gradient plain SGD applied at each step, from the weights before and after it."""

    def __init__(self, learning_rate):
        super().__init__()
        self.learning_rate = learning_rate
        self.norms = {}  # optimizer step -> the first kernel's gradient norm

    def on_train_batch_begin(self, batch, logs=None):
        self.before = self.model.trainable_variables[0].numpy().astype(np.float64)

    def on_train_batch_end(self, batch, logs=None):
        after = self.model.trainable_variables[0].numpy().astype(np.float64)
        step = int(self.model.optimizer.iterations.numpy())
        self.norms[step] = np.linalg.norm((self.before - after) / self.learning_rate)


def _resumed(tmp_path, monitor_first, same_monitor):
    """Three epochs of 4 steps with BackupAndRestore, pre-empted at step 6, then resumed.

    Returns the model, the monitor of the resumed fit, the resumed fit's
    applied gradients and the store.
    """
    x, y = data()
    backup, store = tmp_path / "backup", RunStore(tmp_path / "runs.db")

    def fit(model, monitor, *more):
        restore = keras.callbacks.BackupAndRestore(backup)
        callbacks = [monitor, restore] if monitor_first else [restore, monitor]
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=callbacks + list(more),
        )

    model = compile_for_logits(classifier("linear"))
    monitor = GradientMonitor(store=store)
    with pytest.raises(RuntimeError, match="pre-empted"):
        fit(model, monitor, _FailsAtStep(6))
    if not same_monitor:
        # A new process: a new model and monitor resume from the backup.
        model = compile_for_logits(classifier("linear", seed=1))
        model.build((None, 5))
        monitor = GradientMonitor(store=store)
    applied = _AppliedGradients(0.1)
    # Other inputs than the first fit's, so that its steps 5 and 6 cannot pass for these.
    x *= 1.5
    fit(model, monitor, applied)
    return model, monitor, applied, store


@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "monitor-last"])
def test_a_fit_resumed_by_backup_and_restore_records_every_applied_step(tmp_path, monitor_first):
    """BackupAndRestore loads the weights and the step count in its own `on_train_begin`:
    after the monitor's, the resumed steps at or below the old count were dropped as
    already read, and the run's total was off by the restored steps ("18 of 12")."""
    model, monitor, applied, store = _resumed(tmp_path, monitor_first, same_monitor=False)
    assert sorted(applied.norms) == list(range(5, 13))  # epoch 2 (steps 5-8) again, and 3
    kernel = rows(monitor, "hidden", "kernel").set_index("step")["l2_norm"]
    assert kernel.index.tolist() == list(range(5, 13))
    for step, norm in applied.norms.items():
        assert kernel[step] == pytest.approx(norm, rel=1e-4)
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["progress_step"], info["total_steps"]) == ("completed", 12, 12)


@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "monitor-last"])
def test_one_monitor_across_a_backup_restore_numbers_on_and_says_why(tmp_path, monitor_first):
    """The same monitor kept the first fit's steps 5 and 6, rolled back, and dropped
    the resumed fit's own 5 and 6, or said "a new optimizer, e.g. after compile()"."""
    model, monitor, applied, store = _resumed(tmp_path, monitor_first, same_monitor=True)
    kernel = rows(monitor, "hidden", "kernel").set_index("step")["l2_norm"]
    # Nothing recorded is replaced: the resumed steps 5..12 are numbered 7..14.
    assert kernel.index.tolist() == list(range(1, 15))
    for step, norm in applied.norms.items():
        assert kernel[step + 2] == pytest.approx(norm, rel=1e-4)
    told = monitor.events[monitor.events["message"].str.contains("step count is 4")]
    assert len(told) == 1 and "BackupAndRestore" in told["message"].iloc[0]
    assert "new optimizer" not in told["message"].iloc[0]
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["progress_step"], info["total_steps"]) == ("completed", 14, 14)


def test_a_loss_that_overflows_before_its_gradients_is_a_divergence(tmp_path):
    """A squared error overflowed float32 while every gradient was finite; TerminateOnNaN
    stopped the fit, and the run was stored "completed: a callback stopped it (such
    as EarlyStopping)", with no NaN event."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32") * 1e3
    y = rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, name="out")])
    model.compile(keras.optimizers.SGD(1e4), "mse")
    monitor = GradientMonitor(store=tmp_path / "runs.db")
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=4,
        verbose=0,
        callbacks=[monitor, keras.callbacks.TerminateOnNaN()],
    )
    losses = monitor.metrics[monitor.metrics["name"] == "loss"].set_index("step")["value"]
    first = int(losses.index[~np.isfinite(losses.to_numpy())][0])
    at_first = monitor.history[monitor.history["step"] == first]
    assert np.isfinite(at_first["l2_norm"]).all()  # the case: only the loss overflowed
    assert int(model.optimizer.iterations.numpy()) == first  # TerminateOnNaN stopped there
    events = monitor.events[monitor.events["kind"] == "nonfinite"]
    assert events["step"].tolist() == [first]
    message = events["message"].iloc[0]
    assert message.startswith(f"The loss was infinite at step {first} while every gradient")
    info = RunStore(tmp_path / "runs.db").run_info(monitor.run_id)
    assert (info["status"], info["message"]) == ("diverged", message)


def test_steps_per_execution_auto_is_refused_in_gradflows_words():
    """Python's "invalid literal for int() with base 10: 'auto'" named no argument."""
    x, y = data()
    model = classifier()
    model.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution="auto")
    monitor = GradientMonitor()
    with pytest.raises(ValueError, match=r"`steps_per_execution` .* got 'auto'"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    assert "train_step" not in model.__dict__
    # Mended as the message says, the same monitor records (it failed in `_restore_model`).
    model.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=2)
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3, 4]


def test_a_fit_with_no_epoch_left_to_run_is_stored_as_done(tmp_path):
    """`fit(initial_epoch=3, epochs=3)` runs nothing: its run read "completed · 0 / 12"."""
    x, y, store, model, monitor = stored_classifier(tmp_path)
    model.fit(x, y, batch_size=BATCH, epochs=3, initial_epoch=3, verbose=0, callbacks=[monitor])
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["progress_step"], info["total_steps"]) == ("completed", 0, 0)


def test_a_used_monitor_with_a_store_can_be_copied_and_pickled(tmp_path):
    """KerasTuner deep-copies its callbacks for every trial: a monitor that had
    written to a store raised "cannot pickle '_thread._local' object"."""
    import copy
    import pickle

    x, y, store, model, monitor = stored_classifier(tmp_path)
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    for copied in (copy.deepcopy(monitor), pickle.loads(pickle.dumps(monitor))):
        pd.testing.assert_frame_equal(copied.history, monitor.history)
        # The copy's store opens its own connection and reads the same run.
        assert copied._store.run_info(monitor.run_id)["status"] == "completed"


def test_a_warning_points_past_joblib_and_not_past_the_users_own_keras_named_module(tmp_path):
    """Warnings raised in `cross_val_score`'s folds pointed inside joblib; and a user's own
    module named `keras_utils.py` was skipped as if it were Keras."""
    from gradflow import checks

    assert checks._in_a_library("joblib.parallel")
    assert checks._in_a_library("keras.src.trainers.trainer") and checks._in_a_library("keras")
    assert not checks._in_a_library("keras_utils") and not checks._in_a_library("sklearn_demo")
