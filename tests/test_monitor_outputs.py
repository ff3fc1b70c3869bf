"""GradientMonitor: non-finite origin, stopping, run store, TensorBoard, fallback."""

import gc
import glob
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradflow import first_nonfinite, schema, snapshot
from gradflow.monitor import GradientMonitor, deferred
from gradflow.monitor import callback as monitor_callback
from gradflow.store import RunStore

N, BATCH = 24, 4  # 6 steps per epoch


@keras.saving.register_keras_serializable("gradflow_tests")
class BlowUp(keras.layers.Layer):
    """Scales its input by a weight; its gradients turn infinite on big inputs.

    The backward pass multiplies by inf when |input| > 100, so the first
    non-finite gradient starts here (its own weight) and flows down to the
    layers below it, while the layers above it stay finite.
    """

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        @tf.custom_gradient
        def scaled(x, scale):
            factor = tf.where(tf.reduce_max(tf.abs(x)) > 100.0, np.inf, 1.0)

            def grad(upstream):
                return upstream * scale * factor, tf.reduce_sum(upstream * x, 0) * factor

            return x * scale, grad

        # A tensor, not the variable: eager custom gradients refuse variables.
        return scaled(x, tf.convert_to_tensor(self.scale))


def blow_up_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="below"),
            BlowUp(name="blowup"),
            keras.layers.Dense(1, name="above"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def blow_up_data(bad_step=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype("float32")
    x[(bad_step - 1) * BATCH : bad_step * BATCH] *= 1e4  # only this batch is huge
    y = rng.normal(size=(N, 1)).astype("float32")
    return x, y


@pytest.mark.parametrize("activations", [False, True])
def test_nonfinite_origin_is_the_layer_nearest_the_loss(activations):
    x, y = blow_up_data(bad_step=3)
    monitor = GradientMonitor(activations=activations)
    blow_up_model().fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    events = monitor.events.query("kind == 'nonfinite'")
    assert events[["step", "layer"]].values.tolist() == [[3, "blowup"]]
    assert "step 3" in events["message"].iloc[0]
    step3 = monitor.history.query("step == 3").set_index(["layer", "tensor"])["nonfinite"]
    assert step3[("blowup", "scale")] > 0 and step3[("below", "kernel")] > 0
    assert step3[("above", "kernel")] == 0
    assert monitor.history.query("step < 3")["nonfinite"].sum() == 0
    # A NaN made in backprop, below a finite layer: its origin is named.
    assert "nearest the loss" in events["message"].iloc[0]


class ForwardLog(keras.layers.Layer):
    """log(x): NaN in the forward pass where x < 0."""

    def call(self, x):
        return keras.ops.log(x)


def test_a_nan_made_in_the_forward_pass_is_not_blamed_on_the_layer_nearest_the_loss():
    """A log of a negative number in a middle layer was reported as starting in the output
    layer, "the layers below only inherit it"."""
    from gradflow import diagnose

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(3, kernel_initializer="identity", name="pre"),
            ForwardLog(name="log"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.uniform(1.0, 2.0, size=(N, 3)).astype("float32")
    x[2 * BATCH] = -1.0  # in the batch of step 3
    y = rng.normal(size=(N, 1)).astype("float32")
    monitor = GradientMonitor(stop_on_nonfinite=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])

    event = monitor.events.query("kind == 'nonfinite'").iloc[0]
    assert event["step"] == 3
    assert "The loss itself was NaN at step 3" in event["message"]
    assert "forward pass" in event["message"] and "nearest the loss" not in event["message"]
    found = diagnose(monitor.history).query("kind == 'nonfinite'").iloc[0]
    assert "Every layer's gradient turned NaN/Inf at once" in found["message"]
    assert "only inherit" not in found["message"]


class HeadFirst(keras.Model):
    """The model of `blow_up_model`, subclassed, its layers created head first.

    Keras tracks a subclassed model's layers in the order `__init__` made
    them; numbered so, `above` was layer 0 and the origin was put at `below`.
    """

    def __init__(self):
        super().__init__(name="head_first")
        self.above = keras.layers.Dense(1, name="above")
        self.blowup = BlowUp(name="blowup")
        self.below = keras.layers.Dense(4, name="below")

    def call(self, x):
        return self.above(self.blowup(self.below(x)))


@pytest.mark.parametrize("activations", [False, True])
def test_layers_are_numbered_in_the_order_the_forward_pass_calls_them(activations):
    x, y = blow_up_data(bad_step=3)
    keras.utils.set_random_seed(0)
    model = HeadFirst()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    shot = snapshot(model, x[:BATCH], y[:BATCH])
    monitor = GradientMonitor(activations=activations)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])

    order = {"below": 0, "blowup": 1, "above": 2}
    history = monitor.history
    assert dict(zip(history["layer"], history["layer_index"], strict=True)) == order
    for table in (shot.weights, shot.activations, shot.inputs):
        assert dict(zip(table["layer"], table["layer_index"], strict=True)) == order
    events = monitor.events.query("kind == 'nonfinite'")
    assert events[["step", "layer"]].values.tolist() == [[3, "blowup"]]
    assert first_nonfinite(history).layer == "blowup"


def sequence_to_sequence():
    """Keras's seq2seq recipe: the decoder starts from the encoder LSTM's states alone."""
    keras.utils.set_random_seed(0)
    source, target = keras.Input((7, 3)), keras.Input((4, 5))
    encoder = keras.layers.LSTM(6, return_state=True, name="encoder")
    decoder = keras.layers.LSTM(6, return_sequences=True, name="decoder")
    head = keras.layers.Dense(5, name="head")
    _, h, c = encoder(source)
    model = keras.Model([source, target], head(decoder(target, initial_state=[h, c])))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    # The same layers past the encoder, from its states as inputs: dLoss/dh.
    h_in, c_in = keras.Input((6,)), keras.Input((6,))
    rest = keras.Model([target, h_in, c_in], head(decoder(target, initial_state=[h_in, c_in])))
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(N, 7, 3)).astype("float32"), rng.normal(size=(N, 4, 5)).astype("float32")]
    y = rng.normal(size=(N, 4, 5)).astype("float32")
    _, h_value, c_value = encoder(x[0][:BATCH])
    with tf.GradientTape() as tape:
        tape.watch(h_value)
        loss = keras.losses.MeanSquaredError()(
            y[:BATCH], rest([tf.constant(x[1][:BATCH]), h_value, c_value])
        )
    return model, x, y, float(tf.norm(tape.gradient(loss, h_value)))


@pytest.mark.parametrize("in_step", [False, True])
def test_an_encoder_read_through_its_states_alone_has_its_gradient(in_step, monkeypatch):
    """Its row read the unused first output: zeros, and an event that no gradient reached it."""
    if in_step:
        monkeypatch.setattr(deferred, "MAX_PARAMETERS", 0)
    model, x, y, expected = sequence_to_sequence()
    shot = snapshot(model, [t[:BATCH] for t in x], y[:BATCH])
    monitor = GradientMonitor(activations=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])

    assert monitor._plan.deferred is not in_step
    first = monitor.history.query("step == 1 and tensor == 'activation'").set_index("layer")
    assert list(first.index) == ["encoder", "decoder", "head"]
    np.testing.assert_allclose(first.loc["encoder", "l2_norm"], expected, rtol=1e-5)
    assert monitor.events.query("kind == 'no_gradient'").empty
    assert shot.no_gradient == {}
    outputs = shot.activations.set_index("layer")
    np.testing.assert_allclose(outputs.loc["encoder", "l2_norm"], expected, rtol=1e-5)


def weight_free_first_layers():
    """A model whose first layers depend on no variable, and dLoss/d(their outputs) at step 1."""
    keras.utils.set_random_seed(2)
    left, right = keras.Input((3,), name="left"), keras.Input((2,), name="right")
    joined = keras.layers.Concatenate(name="joined")([left, right])
    scaled = keras.layers.Rescaling(2.0, name="scaled")(joined)
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(scaled)
    model = keras.Model([left, right], keras.layers.Dense(1, name="out")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(2)
    x = [rng.normal(size=(N, 3)).astype("float32"), rng.normal(size=(N, 2)).astype("float32")]
    y = rng.normal(size=(N, 1)).astype("float32")
    # Reference: the first batch through the same layers, outputs watched.
    with tf.GradientTape() as tape:
        joined_value = model.get_layer("joined")([x[0][:BATCH], x[1][:BATCH]])
        tape.watch(joined_value)
        scaled_value = model.get_layer("scaled")(joined_value)
        tape.watch(scaled_value)
        prediction = model.get_layer("out")(model.get_layer("hidden")(scaled_value))
        loss = keras.losses.MeanSquaredError()(y[:BATCH], prediction)
    expected = [float(tf.norm(g)) for g in tape.gradient(loss, [joined_value, scaled_value])]
    return model, x, y, dict(zip(["joined", "scaled"], expected, strict=True))


@pytest.mark.parametrize("in_step", [False, True])
def test_layers_that_depend_on_no_variable_have_their_output_gradient(in_step, monkeypatch):
    """A Rescaling or a Concatenate of the inputs first had no row and an event saying the
    loss did not depend on it: the tape had never seen their outputs."""
    if in_step:
        monkeypatch.setattr(deferred, "MAX_PARAMETERS", 0)
    model, x, y, expected = weight_free_first_layers()
    monitor = GradientMonitor(activations=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])

    assert monitor._plan.deferred is not in_step
    first = monitor.history.query("step == 1 and tensor == 'activation'").set_index("layer")
    assert list(first.index) == ["joined", "scaled", "hidden", "out"]
    for layer, norm in expected.items():
        np.testing.assert_allclose(first.loc[layer, "l2_norm"], norm, rtol=1e-5)
    assert monitor.events.query("kind == 'no_gradient'").empty


# every=1 takes the deferred path of small models (a finiteness check of the
# copied gradients), or with `in_step` reads finiteness off the statistics
# computed before the update; every=5 checks the gradients on their own (the
# step may not be recorded). jit_compile: Keras's default when a GPU is present.
@pytest.mark.parametrize(
    "every,steps_per_execution,jit_compile,in_step",
    [
        (1, 1, False, False),
        (1, 2, False, False),
        (1, 1, False, True),
        (1, 2, False, True),
        (5, 1, False, True),
        (5, 2, False, True),
        (1, 2, True, False),
        (1, 2, True, True),
        (5, 1, True, True),
    ],
)
def test_stop_on_nonfinite_stops_at_that_step_with_finite_weights(
    every, steps_per_execution, jit_compile, in_step, monkeypatch
):
    if in_step:
        monkeypatch.setattr(deferred, "MAX_PARAMETERS", 0)
    x, y = blow_up_data(bad_step=3)
    model = blow_up_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss="mse",
        steps_per_execution=steps_per_execution,
        jit_compile=jit_compile,
    )
    before_bad_step = {}

    class Keep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations) == 2:
                before_bad_step["weights"] = self.model.get_weights()

    monitor = GradientMonitor(stop_on_nonfinite=True, every=every)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[Keep(), monitor]
    )
    assert monitor._plan.deferred is not in_step
    # The non-finite step is recorded, also when it is not a multiple of `every`.
    assert monitor.history["step"].max() == 3
    assert monitor.events.query("kind == 'nonfinite'")["step"].tolist() == [3]
    assert int(model.optimizer.iterations) == 3
    assert len(history.history["loss"]) == 1  # stopped in the first epoch
    # The non-finite update was skipped: the weights are those after step 2.
    for a, b in zip(model.get_weights(), before_bad_step["weights"], strict=False):
        np.testing.assert_array_equal(a, b)


def test_stop_on_nonfinite_in_a_long_epoch_stops_within_a_read_of_the_ring():
    # The callback finds the halted step when it reads the ring (when it is
    # full or 0.2 s after the last read), not after every batch; the batches
    # in between change nothing. The loss stays finite here: only the
    # gradient is not.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000 * BATCH, 3)).astype("float32")  # 1000 steps per epoch
    x[2 * BATCH : 3 * BATCH] *= 1e4  # step 3
    y = rng.normal(size=(1000 * BATCH, 1)).astype("float32")
    model = blow_up_model()
    seen = {"batches": 0}

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen["batches"] += 1
            seen["loss"] = logs["loss"]
            if seen["batches"] == 2:
                seen["weights"] = self.model.get_weights()

    monitor = GradientMonitor(stop_on_nonfinite=True)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[Watch(), monitor]
    )
    assert np.isfinite(seen["loss"])
    # Stopped within one ring, long before the epoch's 1000 batches.
    assert 3 <= seen["batches"] <= 3 + monitor._plan.capacity < 1000
    assert len(history.history["loss"]) == 1
    assert int(model.optimizer.iterations) == 3
    assert monitor.events.query("kind == 'nonfinite'")["step"].tolist() == [3]
    for a, b in zip(model.get_weights(), seen["weights"], strict=False):
        np.testing.assert_array_equal(a, b)


def test_stop_on_nonfinite_loss_stops_after_that_very_batch():
    x, y = blow_up_data(bad_step=3)
    x[2 * BATCH : 3 * BATCH] = np.inf  # the loss of step 3 is non-finite too
    model = blow_up_model()
    batches = []
    stopper = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    monitor = GradientMonitor(stop_on_nonfinite=True)
    model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor, stopper]
    )
    assert batches == [0, 1, 2]
    assert monitor.events.query("kind == 'nonfinite'")["step"].tolist() == [3]


def test_writes_every_recorded_step_to_the_run_store(store_path):
    x, y = blow_up_data(bad_step=5)
    store = RunStore(store_path)
    monitor = GradientMonitor(store=store, run_name="blow", activations=True)
    blow_up_model().fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])

    stored = store.layer_stats(monitor.run_id)
    recorded = monitor.history
    assert len(stored) == len(recorded) == 6 * 8  # 5 variables + 3 layer outputs
    key = ["step", "layer", "tensor"]
    stored = stored.astype({"layer": str, "tensor": str}).sort_values(key, ignore_index=True)
    recorded = recorded.sort_values(key, ignore_index=True)
    assert stored[key].values.tolist() == recorded[key].values.tolist()
    for column in schema.STATISTICS + schema.EXTRA_COLUMNS:
        np.testing.assert_allclose(
            stored[column].astype(float), recorded[column].astype(float), rtol=1e-6, err_msg=column
        )
    metrics = store.metrics(monitor.run_id)
    assert sorted(metrics.query("name == 'loss'")["step"]) == [1, 2, 3, 4, 5, 6]
    info = store.run_info(monitor.run_id)
    assert info["status"] == "diverged" and info["name"] == "blow"
    events = store.events(monitor.run_id)
    assert events.query("kind == 'nonfinite'")[["step", "layer"]].values.tolist() == [[5, "blowup"]]


def test_attaches_to_an_existing_run_and_leaves_its_status(store_path):
    x, y = blow_up_data(bad_step=99)
    store = RunStore(store_path)
    run_id = store.create_run({"depth": 2}, name="lab run", source="lab")
    monitor = GradientMonitor(store=str(store_path), run_id=run_id, close_run=False)
    blow_up_model().fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor.run_id == run_id
    assert len(store.layer_stats(run_id)) == 6 * 5
    assert store.run_info(run_id)["status"] == "running"


def read_tensorboard(logdir):
    """`(scalars, histograms)`: `{(tag, step): array}` from the event files in `logdir`."""
    scalars, histograms = {}, {}
    for path in glob.glob(str(logdir / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                array = tf.make_ndarray(value.tensor)
                plugin = value.metadata.plugin_data.plugin_name
                target = scalars if plugin == "scalars" else histograms
                target[(value.tag, event.step)] = array
    return scalars, histograms


def test_tensorboard_summaries_hold_the_recorded_values(tmp_path):
    x, y = blow_up_data(bad_step=99)
    monitor = GradientMonitor(tensorboard_dir=tmp_path, histograms=True)
    blow_up_model().fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    scalars, histograms = read_tensorboard(tmp_path)
    expected = monitor.history.set_index(["step", "layer", "tensor"])
    for (step, layer, tensor), row in expected.iterrows():
        tag = f"gradients/{layer}/{tensor}/l2_norm"
        np.testing.assert_allclose(scalars[(tag, step)], row["l2_norm"], rtol=1e-6)
    loss = monitor.metrics.query("name == 'loss'")
    for step, value in zip(loss["step"], loss["value"], strict=False):
        np.testing.assert_allclose(scalars[("gradflow/loss", step)], value, rtol=1e-6)
    buckets = histograms[("log10_abs_gradient/below/kernel", 1)]
    assert buckets.shape == (schema.HISTOGRAM_BINS, 3) and buckets[:, 2].sum() == 12


def test_tensorboard_shows_the_step_that_broke_and_every_metric(tmp_path):
    """NaN values were left out, so the curves ended before the blow-up; compiled and
    validation metrics never reached TensorBoard."""
    x, y = blow_up_data(bad_step=3)
    model = blow_up_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    monitor = GradientMonitor(tensorboard_dir=tmp_path)
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        validation_data=(x[:BATCH], y[:BATCH]),
        callbacks=[monitor],
    )
    scalars, _ = read_tensorboard(tmp_path)
    broken = monitor.history.query("step == 3 and layer == 'blowup'").iloc[0]
    assert not np.isfinite(broken["l2_norm"])
    assert not np.isfinite(scalars[("gradients/blowup/scale/l2_norm", 3)])
    assert scalars[("gradients/blowup/scale/nonfinite", 3)] == broken["nonfinite"] > 0
    assert ("gradients/above/kernel/nonfinite", 3) not in scalars  # finite there
    assert ("gradients/below/kernel/update_ratio", 1) in scalars
    metrics = monitor.metrics
    for name in ("mae", "val_loss", "val_mae"):
        step, value = metrics.query("name == @name")[["step", "value"]].iloc[-1]
        np.testing.assert_allclose(scalars[(f"gradflow/{name}", int(step))], value, rtol=1e-6)


class OwnStep(keras.Model):
    """A model with its own train step: the monitor can only probe it."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="tanh", name="hidden")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y - self(x, training=True)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=False))
        return {"loss": loss}


def _squared_error(y_true, y_pred):
    return tf.square(y_true - y_pred)


# A model that computes its loss in its own `train_step` is often compiled
# without one (a GAN); its probe then takes the loss from `probe_loss`.
@pytest.mark.parametrize(
    "compiled_loss, probe_loss",
    [("mse", None), (None, "mse"), (None, _squared_error)],
    ids=["compiled loss", "probe_loss name", "probe_loss function"],
)
def test_own_train_step_falls_back_to_a_probe_every_n_steps(compiled_loss, probe_loss):
    x, y = blow_up_data(bad_step=99)
    keras.utils.set_random_seed(0)
    model = OwnStep()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=compiled_loss)
    model(x[:1])
    weights_at = {0: [v.numpy() for v in model.trainable_variables]}

    class Keep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations)
            weights_at[step] = [v.numpy() for v in self.model.trainable_variables]

    monitor = GradientMonitor(probe_every=2, probe_loss=probe_loss)
    with pytest.warns(UserWarning, match="overrides `train_step`"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[Keep(), monitor])
    assert sorted(monitor.history["step"].unique()) == [2, 4, 6]
    # The probe saw the weights before step 4's update, on step 4's batch.
    probe = OwnStep()
    probe(x[:1])
    for variable, value in zip(probe.trainable_variables, weights_at[3], strict=False):
        variable.assign(value)
    xb, yb = x[3 * BATCH : 4 * BATCH], y[3 * BATCH : 4 * BATCH]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(yb - probe(xb)))
    grads = tape.gradient(loss, probe.trainable_variables)
    recorded = monitor.history.query("step == 4")
    for variable, grad in zip(model.trainable_variables, grads, strict=False):
        row = recorded[recorded["variable"] == variable.path].iloc[0]
        np.testing.assert_allclose(row["l2_norm"], np.linalg.norm(grad.numpy()), rtol=1e-5)
        np.testing.assert_allclose(row["max_abs"], np.abs(grad.numpy()).max(), rtol=1e-5)
    assert "train_step" not in model.__dict__


def test_own_train_step_without_any_loss_trains_and_says_what_the_probe_needs():
    """Keras's `compute_loss` raised "No loss to compute" from the probe and ended `fit`."""
    x, y = blow_up_data(bad_step=99)
    keras.utils.set_random_seed(0)
    model = OwnStep()
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    model(x[:1])
    before = [v.numpy() for v in model.trainable_variables]
    monitor = GradientMonitor()
    with pytest.warns(UserWarning) as caught:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    told = [w for w in caught if "GradientMonitor" in str(w.message)]
    assert any("overrides `train_step`" in str(w.message) for w in told)
    assert any(
        "records nothing" in str(w.message) and "probe_loss=" in str(w.message) for w in told
    )
    # Shown at the `fit` line above, not inside Keras's callback list or TensorFlow.
    assert {w.filename for w in told} == {__file__}
    assert int(model.optimizer.iterations) == N // BATCH
    assert not np.allclose(model.trainable_variables[0].numpy(), before[0])
    assert monitor.history.empty
    assert "train_step" not in model.__dict__


class NoCallModel(keras.Model):
    """Keras's GAN recipe: its own optimizers (`model.optimizer` never steps), no `call`."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="tanh", name="hidden")
        self.out = keras.layers.Dense(1, name="out")

    def compile(self):
        super().compile()
        self.own_optimizer = keras.optimizers.SGD(0.05)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y - self.out(self.hidden(x))))
        grads = tape.gradient(loss, self.trainable_variables)
        self.own_optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"g_loss": loss}  # a GAN's logs: no "loss"


class TwoOptimizerModel(NoCallModel):
    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("probe_every", [1, 2])
def test_a_model_with_its_own_optimizers_is_probed_at_the_steps_it_trains(probe_every):
    """A GAN-like model: every probe was filed under step 1 (each replacing the one
    before), or, every 2 steps, nothing was recorded and nothing said."""
    x, y = blow_up_data(bad_step=99)
    keras.utils.set_random_seed(0)
    model = TwoOptimizerModel()
    model.compile()
    model(x[:1])
    first = [v.numpy() for v in model.trainable_variables]
    monitor = GradientMonitor(probe_every=probe_every, probe_loss="mse")
    with pytest.warns(UserWarning, match="overrides `train_step`"):
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    steps = 2 * N // BATCH
    assert int(model.optimizer.iterations) == 0  # as in the GAN recipe
    assert sorted(monitor.history["step"].unique()) == list(
        range(probe_every, steps + 1, probe_every)
    )
    # What its step returns is numbered by batch across epochs too.
    g_loss = monitor.metrics.query("name == 'g_loss'")
    assert g_loss["step"].tolist() == list(range(1, steps + 1))
    if probe_every == 1:
        # Step 1 probed the first weights on the first batch.
        with tf.GradientTape() as tape:
            probe = TwoOptimizerModel()
            probe(x[:1])
            for variable, value in zip(probe.trainable_variables, first, strict=True):
                variable.assign(value)
            loss = tf.reduce_mean(tf.square(y[:BATCH] - probe(x[:BATCH])))
        grads = tape.gradient(loss, probe.trainable_variables)
        recorded = monitor.history.query("step == 1")
        for variable, grad in zip(model.trainable_variables, grads, strict=True):
            row = recorded[recorded["variable"] == variable.path].iloc[0]
            np.testing.assert_allclose(row["l2_norm"], np.linalg.norm(grad.numpy()), rtol=1e-5)


def test_a_model_with_no_call_trains_on_and_is_told_what_to_probe():
    """Keras's GAN has no `call()`: the probe's forward pass ended `fit` with
    NotImplementedError."""
    x, y = blow_up_data(bad_step=99)
    keras.utils.set_random_seed(0)
    model = NoCallModel()
    model.compile()
    monitor = GradientMonitor(probe_loss="mse")
    with pytest.warns(UserWarning) as caught:
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert any("no `call()`" in str(w.message) for w in caught)
    assert int(model.own_optimizer.iterations) == 2 * N // BATCH
    with warnings.catch_warnings(record=True) as read:
        warnings.simplefilter("always")
        assert monitor.history.empty
        g_loss = monitor.metrics.query("name == 'g_loss'")
    assert g_loss["step"].tolist() == list(range(1, 2 * N // BATCH + 1))
    assert not [w for w in read if issubclass(w.category, FutureWarning)]  # pandas's concat


class StatefulOwnStep(OwnStep):
    """A stateful RNN with its own train step."""

    def __init__(self):
        keras.Model.__init__(self)
        self.hidden = keras.layers.SimpleRNN(4, stateful=True, name="rnn")
        self.out = keras.layers.Dense(1, name="out")


def test_the_probe_leaves_a_stateful_rnns_state_to_the_models_own_step():
    """The probe's forward pass advanced the carried state before the model's step:
    the model trained to other weights with the monitor than without it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 5, 3)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    trained = []
    for callbacks in ([], [GradientMonitor(probe_every=1, probe_loss="mse")]):
        keras.utils.set_random_seed(0)
        model = StatefulOwnStep()
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        model(x[:BATCH])
        model.hidden.reset_state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
        trained.append([v.numpy() for v in model.trainable_variables])
    for plain, monitored in zip(*trained, strict=True):
        np.testing.assert_allclose(monitored, plain, rtol=1e-6, atol=1e-7)


class PerSampleAddedLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.01 * tf.reduce_sum(tf.square(x), axis=-1))  # one value a sample
        return x


def test_the_probe_adds_a_per_sample_added_loss_as_keras_does():
    """`add_loss` of a per-sample tensor ended `fit`: "Shapes must be equal rank"."""
    x, y = blow_up_data(bad_step=99)
    keras.utils.set_random_seed(0)
    model = OwnStep()
    model.hidden = keras.Sequential([keras.layers.Dense(4, name="inner"), PerSampleAddedLoss()])
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    model(x[:1])
    before = [v.numpy() for v in model.trainable_variables]
    monitor = GradientMonitor(probe_every=1, probe_loss="mse")
    with pytest.warns(UserWarning, match="overrides `train_step`"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    reference = OwnStep()
    reference.hidden = keras.Sequential([keras.layers.Dense(4), PerSampleAddedLoss()])
    reference(x[:1])
    for variable, value in zip(reference.trainable_variables, before, strict=True):
        variable.assign(value)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(y[:BATCH] - reference(x[:BATCH])))
        loss += tf.add_n([tf.reduce_sum(v) for v in reference.losses])
    np.testing.assert_allclose(
        monitor.metrics.query("name == 'loss' and step == 1")["value"].iloc[0],
        float(loss),
        rtol=1e-5,
    )
    assert tape.gradient(loss, reference.trainable_variables)[0] is not None


# The same checks, and words, as `snapshot(loss=...)` (`snapshot.resolve_loss`).
@pytest.mark.parametrize(
    "bad, error, message",
    [
        ("not_a_loss", ValueError, r"Unknown loss name `probe_loss`='not_a_loss'"),
        (3, TypeError, r"`probe_loss` must be a Keras loss object.*got int: 3"),
        (
            ["mse", "mae"],
            ValueError,
            r"`probe_loss` must be one loss, got a list of losses, one per output",
        ),
    ],
)
def test_a_probe_loss_that_is_no_loss_is_refused_by_name(bad, error, message):
    with pytest.raises(error, match=message):
        GradientMonitor(probe_loss=bad)


def test_flush_writes_the_latest_step_to_the_store_at_once(store_path, monkeypatch):
    # Without flush, nothing would be read before the 16th batch.
    monkeypatch.setattr(monitor_callback, "_READ_INTERVAL_S", 1e9)
    x, y = blow_up_data(bad_step=99)
    store = RunStore(store_path)
    monitor = GradientMonitor(store=store)
    seen = []

    class Pause(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                monitor.flush()
                seen.append(sorted(store.layer_stats(monitor.run_id)["step"].unique()))

    blow_up_model().fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor, Pause()]
    )
    assert seen == [[1, 2, 3]]


def _step_graphs():
    """Traced Keras train steps still alive (after a garbage collection)."""
    from tensorflow.python.framework.func_graph import FuncGraph

    gc.collect()
    return sum(isinstance(o, FuncGraph) and o.name == "one_step_on_data" for o in gc.get_objects())


@pytest.mark.parametrize("activations", [False, True], ids=["deferred ring", "in-step ring"])
def test_a_finished_fit_frees_its_traced_step_and_ring(activations):
    # TensorFlow's gradient registry kept every traced train step alive
    # (tensorflow/tensorflow#97697), and with it the monitor's ring: 12 MB a
    # fit of the lab's MLP that `clear_session()` could not free.
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    before = _step_graphs()
    for _ in range(3):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        monitor = GradientMonitor(activations=activations)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
        assert monitor.history["step"].max() == 4  # it recorded, and still reads back after
        del model, monitor
    assert _step_graphs() == before


def test_a_tensorflow_without_the_gradient_registry_still_monitors(monkeypatch):
    # The registry is private TensorFlow state: should it move, nothing is
    # dropped and the monitor works as before.
    from gradflow.monitor import trace_gradients

    monkeypatch.setattr(trace_gradients, "_registry", lambda: None)
    x = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    monitor = GradientMonitor()
    model.fit(x, x[:, :3], batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3, 4]


def test_the_run_keeps_which_layer_reads_which_for_the_saturation_rule(tmp_path):
    """The dashboard's and the exports' saturation rule took a layer's input gradient
    from the layer called before it: a Transformer's value projection, which reads the
    embedding as the key projection does, was "probably saturated"."""
    from gradflow.diagnosis import run_layer_inputs

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    x = keras.layers.Dense(16, name="embed")(inputs)
    x = keras.layers.MultiHeadAttention(2, 8, name="mha")(x, x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(4, activation="softmax", name="out")(x)
    model = keras.Model(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x_data = rng.normal(size=(32, 8, 16)).astype("float32")
    monitor = GradientMonitor(activations=True, store=tmp_path / "runs.db")
    model.fit(x_data, rng.integers(0, 4, 32), batch_size=16, verbose=0, callbacks=[monitor])
    reads = run_layer_inputs(RunStore(tmp_path / "runs.db").run_info(monitor.run_id)["config"])
    assert reads == {
        "embed": None,
        "mha/query": "embed",
        "mha/key": "embed",
        "mha/value": "embed",
        "mha/attention_output": None,  # reads the attention's einsum, no layer's output
        # A pool over 8 time steps spreads each output's gradient over 8 entries: not compared.
        "pool": None,
        "out": "pool",
    }


def test_a_global_pool_is_not_called_saturated(tmp_path):
    """A pool over 28x28 spreads each output's gradient over 784 entries, so the
    mean |gradient| at its input is 784 times smaller: the saturation rule said the
    pool's "units are probably saturated" in almost every CNN recorded with
    `activations=True` (the fine-tuning audit). And `gradflow.diagnose(monitor.history)`,
    as the README writes it, compares the layers the monitor compares."""
    from gradflow import diagnose, diagnose_new
    from gradflow.lab.training import Run

    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(8, 3, activation="relu", name="c1")(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu", name="c2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(x))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x_data, y_data = rng.random((64, 32, 32, 3)).astype("float32"), rng.integers(0, 4, 64)
    monitor = GradientMonitor(activations=True, store=tmp_path / "runs.db")
    model.fit(x_data, y_data, batch_size=16, verbose=0, callbacks=[monitor])

    history = monitor.history
    outputs = history[(history["tensor"] == "activation") & (history["step"] == 1)]
    mean = dict(zip(outputs["layer"], outputs["mean_abs"], strict=True))
    assert mean["c2"] / mean["pool"] == pytest.approx(1 / 784, rel=1e-3)  # the count alone
    reads = {"c1": None, "c2": "c1", "pool": None, "out": "pool"}
    assert history.attrs["layer_inputs"] == reads
    assert not (monitor.events["kind"] == "saturation").any()
    assert not (diagnose(history)["kind"] == "saturation").any()
    assert not (diagnose_new(history, after_step=0)["kind"] == "saturation").any()
    # Compared as a chain, the pool is "saturated": what the attrs spare.
    bare = history.copy()
    bare.attrs = {}
    assert (diagnose(bare)["layer"] == "pool").any()
    assert (diagnose_new(bare, after_step=0)["layer"] == "pool").any()
    run = Run(monitor.run_id, tmp_path / "runs.db")
    assert run.layer_stats.attrs["layer_inputs"] == reads
    assert not (diagnose(run.layer_stats)["kind"] == "saturation").any()


def test_pools_over_images_of_any_size_are_not_called_saturated_in_a_fit_or_a_snapshot():
    """Inputs of any size keep a 12x12 pool's rank, `(batch, None, None, 4)` in and out,
    so the shapes alone did not say it spreads its gradient; and `diagnose` of a snapshot
    compared a chain (the review of the pooling fix)."""
    from gradflow import diagnose

    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, None, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu", name="c1")(inputs)
    x = keras.layers.AveragePooling2D(12, name="avg")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gp")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(x))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x_data, y_data = rng.random((32, 26, 26, 3)).astype("float32"), rng.integers(0, 4, 32)
    # Batches whose images may be of any size, as a pipeline of varied images gives.
    batches = tf.data.Dataset.from_generator(
        lambda: ((x_data[i : i + 16], y_data[i : i + 16]) for i in (0, 16)),
        output_signature=(
            tf.TensorSpec((None, None, None, 3), tf.float32),
            tf.TensorSpec((None,), tf.int64),
        ),
    )
    monitor = GradientMonitor(activations=True)
    model.fit(batches, shuffle=False, verbose=0, callbacks=[monitor])
    reads = {"c1": None, "avg": None, "gp": None, "out": "gp"}
    assert monitor.history.attrs["layer_inputs"] == reads
    assert not (monitor.events["kind"] == "saturation").any()

    shot = snapshot(model, x_data[:16], y_data[:16])
    assert shot.layer_inputs == reads
    assert not (diagnose(shot)["kind"] == "saturation").any()
    assert not (diagnose(shot.layer_stats)["kind"] == "saturation").any()
    chain = shot.layer_stats
    chain.attrs = {}
    assert (diagnose(chain)["kind"] == "saturation").any()  # what the pairs spare
