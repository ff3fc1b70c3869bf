"""`fit` called again and again with a GradientMonitor: the traced step is reused, and still right.

Users call `fit` in loops (one epoch at a time, or again from a notebook
cell); tracing the instrumented step took most of each short `fit`. A later
`fit` reuses the step its model's last monitored `fit` traced, unless
something it depends on changed. Every case is checked against the
hand-written tape loop of `tests/test_monitor.py`.
"""

import os
import pathlib

import keras
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradflow.monitor import GradientMonitor
from gradflow.monitor import step as step_module
from tests.test_monitor import (
    BATCH,
    assert_matches_reference,
    copy_of,
    make_data,
    make_model,
    reference_run,
)


@pytest.fixture
def traces(monkeypatch):
    """How many times an instrumented step has been traced (its Python body runs only then)."""
    count = {"n": 0}
    original = step_module._take_activations

    def counting(plan, outputs):
        count["n"] += 1
        return original(plan, outputs)

    monkeypatch.setattr(step_module, "_take_activations", counting)
    return count


class Joined:
    """The records of several monitors, one after the other, as one monitor's."""

    def __init__(self, monitors):
        self.history = pd.concat([m.history for m in monitors], ignore_index=True)
        self.metrics = pd.concat([m.metrics for m in monitors], ignore_index=True)


@pytest.mark.parametrize("same_monitor", [True, False], ids=["same monitor", "new monitor"])
def test_fits_in_a_loop_trace_once_and_match_the_reference(traces, same_monitor):
    x, y = make_data()
    model = make_model()
    reference = copy_of(model)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    monitors = [GradientMonitor(activations=True)]
    for epoch in range(3):
        if not same_monitor and epoch:
            monitors.append(GradientMonitor(activations=True))
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitors[-1]])
    assert traces["n"] == 1
    rows, metrics = reference_run(reference, keras.optimizers.Adam(0.05), x, y, epochs=3)
    recorded = monitors[0] if same_monitor else Joined(monitors)
    assert sorted(recorded.history["step"].unique()) == list(range(1, 10))
    assert_matches_reference(recorded, rows, metrics, rtol=1e-4)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_recompile_or_a_frozen_layer_traces_anew(traces):
    x, y = make_data()
    model = make_model()
    reference = copy_of(model)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    options = dict(activations=True)
    model.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[GradientMonitor(**options)]
    )
    reference_run(reference, keras.optimizers.SGD(0.05), x, y, epochs=1)
    assert traces["n"] == 1

    # A new optimizer (its own iterations: the steps start at 1 again).
    model.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse")
    monitor = GradientMonitor(**options)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert traces["n"] == 2
    rows, metrics = reference_run(reference, keras.optimizers.SGD(0.02), x, y, epochs=1)
    assert_matches_reference(monitor, rows, metrics, rtol=1e-5)

    # The same optimizer, a frozen first layer: its kernel and bias drop out.
    model.layers[0].trainable = False
    monitor = GradientMonitor(**options)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert traces["n"] == 3
    weights = monitor.history.query("tensor != 'activation'")
    assert set(weights["layer"]) == {"d1", "d2"}

    # Other monitor options: traced anew too.
    monitor = GradientMonitor(every=2, **options)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert traces["n"] == 4


def test_a_fit_after_a_halted_one_trains_again(traces):
    """`stop_on_nonfinite` halted the last fit; the reused step must not stay halted."""
    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    good = model.get_weights()
    bad = np.full_like(x, np.nan)
    first = GradientMonitor(stop_on_nonfinite=True)
    model.fit(bad, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[first])
    assert first._nonfinite_step == 1
    np.testing.assert_array_equal(model.get_weights()[0], good[0])  # the update was skipped

    second = GradientMonitor(stop_on_nonfinite=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[second])
    assert traces["n"] == 1
    assert second._nonfinite_step is None
    assert sorted(second.history["step"].unique()) == [2, 3, 4]
    assert np.isfinite(second.history["l2_norm"]).all()
    assert not np.allclose(model.get_weights()[0], good[0])  # it trained


def clip_by_norm(model):
    model.optimizer.clipnorm = 0.01


def constrain_first_kernel(model):
    model.layers[0].kernel.constraint = keras.constraints.MaxNorm(0.1)


def learning_rate_schedule(model):
    model.optimizer.learning_rate = keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.5)


def recompile_same_optimizer(model):
    model.compile(optimizer=model.optimizer, loss="mse")


CHANGES = [clip_by_norm, constrain_first_kernel, learning_rate_schedule, recompile_same_optimizer]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_what_the_step_reads_when_traced_makes_it_trace_anew(traces, change):
    """Settings the step reads once, when traced: a stale step would ignore them
    (found by an audit: the weights then drifted from Keras's by up to 0.7)."""
    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[GradientMonitor()])
    change(model)
    twin = copy_of(model)  # the same weights, trained by Keras's own step below
    twin.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    twin.optimizer.build(twin.trainable_variables)
    twin.optimizer.iterations.assign(model.optimizer.iterations)
    change(twin)
    for variable, original in zip(twin.trainable_variables, model.trainable_variables, strict=True):
        variable.constraint = original.constraint
    monitor = GradientMonitor()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    twin.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert traces["n"] == 2
    for a, b in zip(model.get_weights(), twin.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_frozen_layer_without_trainable_weights_trains_as_keras_does(traces):
    """Freezing BatchNormalization(center=False, scale=False) changes no trainable
    variable, but the step must stop updating its moving statistics."""
    x, y = make_data()
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="d0"),
            keras.layers.BatchNormalization(center=False, scale=False, name="norm"),
            keras.layers.Dense(1, name="d1"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[GradientMonitor()])
    norm = model.get_layer("norm")
    norm.trainable = False
    moving = norm.moving_mean.numpy().copy()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[GradientMonitor()])
    assert traces["n"] == 2
    np.testing.assert_array_equal(norm.moving_mean.numpy(), moving)


def test_a_recompile_without_a_loss_logs_the_loss_keras_logs(traces):
    """`compile()` with the same optimizer and no loss (the model's own `add_loss`)
    keeps the loss and metrics containers but makes a new loss tracker: a stale
    step fed the old one, and `fit` logged a loss of 0."""

    def build():
        keras.utils.set_random_seed(0)
        regularizer = keras.regularizers.L2(0.5)
        return keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(5, activity_regularizer=regularizer)]
        )

    x, _ = make_data()
    logged = {}
    for monitored in (True, False):
        model = build()
        optimizer = keras.optimizers.SGD(0.01)
        model.compile(optimizer=optimizer)
        callbacks = [GradientMonitor()] if monitored else []
        model.fit(x, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks[:])
        model.compile(optimizer=optimizer)
        callbacks = [GradientMonitor()] if monitored else []
        history = model.fit(x, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
        logged[monitored] = history.history["loss"][0]
    assert traces["n"] == 2
    np.testing.assert_allclose(logged[True], logged[False], rtol=1e-5)
    assert logged[True] > 0


class Broken(keras.callbacks.Callback):
    """Raises at batch `at`: Keras then calls no callback's `on_train_end`."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            raise RuntimeError("a bug in someone's callback")


def fit_broken_by_a_callback(tmp_path, at):
    """A monitored `fit` (with a store) that another callback breaks at batch `at`."""
    from gradflow.store import RunStore

    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store, stop_on_nonfinite=True)
    with pytest.raises(RuntimeError, match="someone's callback"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor, Broken(at)])
    return x, y, model, store, monitor


def test_a_fit_a_callback_broke_is_closed_by_the_next_one(tmp_path):
    """Keras calls no callback when another callback raises, so that fit left the
    model instrumented (and its run "running"); the next monitor once saved that
    step as the model's own and put it back for good, halting later plain fits."""
    x, y, model, store, first = fit_broken_by_a_callback(tmp_path, at=1)
    second = GradientMonitor(store=store)
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[second])
    assert store.status(first.run_id) == "failed"
    assert "outside the train step" in store.run_info(first.run_id)["message"]
    assert store.status(second.run_id) == "completed"
    assert "train_step" not in model.__dict__
    # A plain fit now runs Keras's own step, which does not halt on a NaN.
    model.fit(np.full_like(x, np.nan), y, batch_size=BATCH, verbose=0)
    assert not np.isfinite(model.get_weights()[0]).any()


_SCRIPT_A_CALLBACK_KILLS = """
import sys
import keras, numpy as np
import gradflow

class Broken(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise RuntimeError("a bug in someone's callback")

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
x, y = np.ones((40, 3), "float32"), np.ones((40, 1), "float32")
monitor = gradflow.GradientMonitor(store=sys.argv[1])
model.fit(x, y, batch_size=4, verbose=0, callbacks=[monitor, Broken()])
"""


def test_a_script_that_dies_of_another_callbacks_error_keeps_its_steps_stored(tmp_path):
    """The store kept none of the 3 recorded steps, and the run read "running" for ever:
    no next `fit` came to close it."""
    import subprocess
    import sys

    from gradflow.store import RunStore

    script = tmp_path / "script.py"
    script.write_text(_SCRIPT_A_CALLBACK_KILLS)
    db = tmp_path / "runs.db"
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parent.parent))
    result = subprocess.run(
        [sys.executable, str(script), str(db)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 1 and "someone's callback" in result.stderr
    store = RunStore(db)
    info = store.run_info(store.runs()["run_id"].iloc[0])
    assert info["status"] == "failed" and "someone's callback" in info["message"]
    assert sorted(store.layer_stats(info["run_id"])["step"].unique()) == [1, 2, 3]


@pytest.mark.parametrize("next_call", ["fit", "train_on_batch"])
def test_a_plain_call_after_a_callback_broke_a_monitored_fit_runs_keras_step(tmp_path, next_call):
    """Once, the plain `fit` right after such an error ran the instrumented step:
    it halted on a NaN, and the run said "running" until a monitored `fit` came."""
    x, y, model, store, monitor = fit_broken_by_a_callback(tmp_path, at=0)
    assert store.status(monitor.run_id) == "running"  # nothing of gradflow has run since
    bad = np.full_like(x, np.nan)
    if next_call == "fit":
        model.fit(bad, y, batch_size=BATCH, verbose=0)
    else:
        model.train_on_batch(bad[:BATCH], y[:BATCH])
    assert not np.isfinite(model.get_weights()[0]).any()  # Keras's step: no halt
    assert store.status(monitor.run_id) == "failed"
    assert "outside the train step" in store.run_info(monitor.run_id)["message"]
    assert {"train_step", "make_train_function"}.isdisjoint(model.__dict__)
    assert len(monitor.history) > 0  # the step recorded before the error is kept


def matches_sgd_reference(monitor, reference, x, y, epochs=1):
    """`monitor` recorded what SGD(0.05) on `reference`'s weights applies, from step 1."""
    rows, metrics = reference_run(reference, keras.optimizers.SGD(0.05), x, y, epochs=epochs)
    if not monitor.activations:
        rows = {key: row for key, row in rows.items() if key[2] != "activation"}
    assert_matches_reference(monitor, rows, metrics, rtol=1e-5)


def test_a_monitor_given_to_a_second_model_says_it_needs_one_of_its_own():
    """The second model's steps went on from the first's, and layers of one name shared
    their curves; the only note blamed a new optimizer. Without a store, the first
    model's steps are in `history` only: the monitor keeps them and refuses."""
    x, y = make_data()
    first, second = make_model(), make_model()
    for model in (first, second):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    monitor = GradientMonitor()
    first.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    recorded = len(monitor.history)
    with pytest.raises(ValueError, match=f"recorded model '{first.name}'.*of its own"):
        second.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert len(monitor.history) == recorded
    assert int(second.optimizer.iterations) == 0  # it did not train
    first.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor]
    )  # its own model: fine
    assert len(monitor.history) == 2 * recorded


def test_a_monitor_with_a_store_records_a_second_model_into_a_new_run(tmp_path):
    """SciKeras gives one estimator's monitor to each of its `fit`s, with a new model
    each time: the second `fit` failed. The first model's steps are safe in its closed
    run, so the second goes into a run of its own, with a word of it."""
    from gradflow.store import RunStore

    x, y = make_data()
    first, second = make_model(), make_model()
    reference = copy_of(second)
    for model in (first, second):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store, run_name="estimator")
    first.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    first_run, first_rows = monitor.run_id, store.layer_stats(monitor.run_id)
    with pytest.warns(UserWarning, match=f"into run {first_run}.*goes into a new run"):
        second.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor.run_id != first_run
    # The first run is as it was; the monitor now holds the second model's steps only,
    # numbered from 1, and they are its own.
    pd.testing.assert_frame_equal(store.layer_stats(first_run), first_rows)
    assert store.run_info(monitor.run_id)["status"] == "completed"
    assert store.run_info(monitor.run_id)["name"] == "estimator"
    matches_sgd_reference(monitor, reference, x, y, epochs=2)


def test_a_stored_run_says_which_optimizer_settings_and_model_size_it_had(tmp_path):
    """A KerasTuner search stored runs named alike whose config said `"optimizer": "SGD"`
    only: which trial's learning rate each was could not be told."""
    from gradflow.store import RunStore

    x, y = make_data()
    for rate, schedule in ((0.05, False), (0.01, True)):
        model = make_model()
        learning_rate = (
            keras.optimizers.schedules.ExponentialDecay(rate, 10, 0.5) if schedule else rate
        )
        model.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9), loss="mse")
        monitor = GradientMonitor(store=tmp_path / "runs.db", run_name="trial")
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
        config = RunStore(tmp_path / "runs.db").run_info(monitor.run_id)["config"]
        settings = config["optimizer_settings"]
        assert settings["momentum"] == 0.9 and settings["nesterov"] is False
        assert settings["learning_rate"] == ("ExponentialDecay" if schedule else rate)
        assert "clipnorm" not in settings  # off: left out
        assert config["parameters"] == model.count_params()
    # A model without an `Input` (KerasTuner's tutorials) is built by its first step,
    # after the run was made: its size is stored then.
    unbuilt = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(1)])
    unbuilt.compile(optimizer="sgd", loss="mse")
    monitor = GradientMonitor(store=tmp_path / "runs.db")
    unbuilt.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    stored = RunStore(tmp_path / "runs.db").run_info(monitor.run_id)["config"]
    assert stored["parameters"] == unbuilt.count_params() > 0


def test_a_monitor_given_a_run_id_still_refuses_a_second_model(tmp_path):
    """A run the user named by id is theirs: a second model would join its curves."""
    from gradflow.store import RunStore

    x, y = make_data()
    first, second = make_model(), make_model()
    for model in (first, second):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, name="mine")
    monitor = GradientMonitor(store=store, run_id=run_id)
    first.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    with pytest.raises(ValueError, match="of its own"):
        second.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])


def test_a_copy_of_a_monitor_given_a_run_id_does_not_join_that_run(tmp_path):
    """Every KerasTuner trial wrote its model into the user's one run."""
    import copy

    from gradflow.store import RunStore

    x, y = make_data()
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, name="mine")
    monitor = GradientMonitor(store=store, run_id=run_id)
    first = make_model()
    first.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    first.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    rows = len(store.layer_stats(run_id))
    second = make_model()
    second.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with pytest.raises(ValueError, match=f"copy of one given `run_id={run_id!r}`"):
        second.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[copy.deepcopy(monitor)])
    assert len(store.layer_stats(run_id)) == rows


def test_copies_of_a_monitor_that_never_ran_record_apart(tmp_path):
    """KerasTuner and `sklearn.clone` copy the user's unused monitor for each trial: all
    the copies wrote into one TensorBoard folder, drawn as one run, and with `run_id`
    into that one run, each trial over the last, without a word."""
    import copy

    from gradflow.store import RunStore

    x, y = make_data()
    logs = tmp_path / "logs"
    template = GradientMonitor(store=tmp_path / "runs.db", tensorboard_dir=str(logs))
    trials = [copy.deepcopy(template) for _ in range(3)]
    for trial in trials:
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[trial])
    assert len({trial.run_id for trial in trials}) == 3
    assert len(RunStore(tmp_path / "runs.db").runs()) == 3
    folders = [path for path in logs.iterdir() if path.is_dir()]
    assert len(folders) == 3 and all(list(f.glob("events.out.tfevents.*")) for f in folders)
    assert template.run_id is None and template.history.empty
    store = RunStore(tmp_path / "runs.db")
    given = GradientMonitor(store=store, run_id=store.create_run({}, name="mine"))
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with pytest.raises(ValueError, match="Leave `run_id` out"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[copy.deepcopy(given)])


def test_after_a_fit_another_callback_ended_a_new_model_gets_a_new_run(tmp_path):
    """A notebook's fit ended by another callback's error, the model cell run again: the
    monitor refused the new model ("needs a GradientMonitor of its own"), and the
    first run read `running` for ever."""
    from gradflow.store import RunStore

    class Broken(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("my callback broke")

    x, y = make_data()
    monitor = GradientMonitor(store=tmp_path / "runs.db")
    first = make_model()
    first.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with pytest.raises(RuntimeError, match="my callback broke"):
        first.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor, Broken()])
    ended = monitor.run_id
    second = make_model()
    second.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with pytest.warns(UserWarning, match="goes into a new run"):
        second.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    store = RunStore(tmp_path / "runs.db")
    assert store.run_info(ended)["status"] == "failed"
    assert store.run_info(monitor.run_id)["status"] == "completed" and monitor.run_id != ended
    assert "train_step" not in first.__dict__  # the first model has Keras's own step back
    first.fit(x, y, batch_size=BATCH, verbose=0)


def test_a_monitor_recording_in_another_thread_is_not_closed_by_a_new_model():
    """A `fit` of the same monitor in a background thread was closed `failed` mid-run, and
    broken, when the main thread gave the monitor another model."""
    import threading

    x, y = make_data()
    x, y = np.tile(x, (40, 1)), np.tile(y, (40, 1))
    first, second = make_model(), make_model()
    for model in (first, second):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    monitor = GradientMonitor()
    started, errors = threading.Event(), []

    class Started(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            started.set()

    def train_first():
        try:
            first.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[monitor, Started()])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=train_first)
    thread.start()
    assert started.wait(60)
    with pytest.raises(ValueError, match="of its own"):
        second.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    thread.join(120)
    assert not errors, errors
    assert monitor.history["step"].max() == 3 * len(x) // BATCH


class Tagged(GradientMonitor):
    """A user's own monitor, whose `__init__` takes other arguments."""

    def __init__(self, tag, **options):
        super().__init__(**options)
        self.tag = tag


def test_a_copy_records_a_custom_model_a_subclass_and_into_its_own_tensorboard_folder(tmp_path):
    """The refusal's advice, `copy.deepcopy(monitor)`, failed for a model with a custom
    layer (the copy copied the model through Keras's serialization); a subclass's fresh
    start called its `__init__` without its arguments; two models' TensorBoard steps
    went into one folder, drawn as one run."""
    import copy

    class Doubled(keras.layers.Layer):  # not registered: Keras cannot rebuild it
        def call(self, inputs):
            return 2.0 * inputs

    x, y = make_data()

    def model():
        inputs = keras.Input((x.shape[1],))
        outputs = keras.layers.Dense(1)(Doubled()(keras.layers.Dense(4)(inputs)))
        built = keras.Model(inputs, outputs)
        built.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return built

    logs = tmp_path / "logs"
    monitor = Tagged("mine", store=tmp_path / "runs.db", tensorboard_dir=str(logs))
    model().fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    copied = copy.deepcopy(monitor)
    assert copied.tag == "mine"
    model().fit(x, y, batch_size=BATCH, verbose=0, callbacks=[copied])
    assert copied.run_id != monitor.run_id and copied.tag == "mine"
    assert sorted(copied.history["step"].unique()) == sorted(monitor.history["step"].unique())
    # The copy's events are in a folder of their own inside the monitor's.
    inner = [path for path in logs.iterdir() if path.is_dir()]
    assert len(inner) == 1 and list(inner[0].glob("events.out.tfevents.*"))
    assert list(logs.glob("events.out.tfevents.*"))  # the first model's, where they were
    # A third model: a folder beside the second's, not inside it (a notebook's loop
    # over models nested a folder deeper at every one).
    with pytest.warns(UserWarning, match="goes into a new run"):
        model().fit(x, y, batch_size=BATCH, verbose=0, callbacks=[copied])
    inner = sorted(path for path in logs.iterdir() if path.is_dir())
    assert len(inner) == 2 and all(not any(p.is_dir() for p in path.iterdir()) for path in inner)


def test_two_copies_of_one_monitor_record_apart(tmp_path):
    """`copy.copy` shared the monitor's lists: each copy's `history` held both models'
    rows, and the second copy's run was numbered on from the first's steps."""
    import copy

    from gradflow.store import RunStore

    x, y = make_data()
    template = GradientMonitor(store=tmp_path / "runs.db")
    assert template.history.empty  # a monitor that never ran: an empty table, not an error
    copies = [copy.copy(template), copy.copy(template)]
    references = []
    for monitor in copies:
        model = make_model()
        references.append(copy_of(model))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    store = RunStore(tmp_path / "runs.db")
    for monitor, reference in zip(copies, references, strict=True):
        matches_sgd_reference(monitor, reference, x, y)
        stored = store.layer_stats(monitor.run_id)
        assert sorted(stored["step"].unique()) == sorted(monitor.history["step"].unique())
        assert monitor.events.empty
    assert copies[0].run_id != copies[1].run_id
    assert template.history.empty and template.run_id is None


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_used_monitor_records_a_new_model_afresh(tmp_path, how):
    """KerasTuner copies the callbacks for each trial, `sklearn.clone` for each fold, each
    with a new model: a copy of a monitor that had recorded a `fit` refused them all."""
    import copy
    import pickle

    x, y = make_data()
    first = make_model()
    first.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    monitor = GradientMonitor(store=tmp_path / "runs.db", run_name="trial")
    first.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    before = monitor.history.copy()
    copied = copy.deepcopy(monitor) if how == "deepcopy" else pickle.loads(pickle.dumps(monitor))
    second = make_model()
    reference = copy_of(second)
    second.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    second.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[copied])
    matches_sgd_reference(copied, reference, x, y)
    assert copied.run_id != monitor.run_id
    pd.testing.assert_frame_equal(monitor.history, before)  # the original keeps its own


def test_one_monitor_given_to_several_fits_keeps_its_stored_run_current(tmp_path):
    """The stored run once said "completed" while the second `fit` wrote to it,
    and its planned steps stayed the first fit's (progress past 100%)."""
    from gradflow.store import RunStore

    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    store = RunStore(tmp_path / "runs.db")
    statuses = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            statuses.append(store.status(monitor.run_id))

    monitor = GradientMonitor(store=store)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    first = store.run_info(monitor.run_id)
    assert (first["status"], first["total_steps"]) == ("completed", 3)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[monitor, Watch()])
    assert statuses and set(statuses) == {"running"}
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["total_steps"]) == ("completed", 9)
    assert info["progress_step"] == 9


def test_a_fit_from_an_initial_epoch_plans_the_steps_it_runs(tmp_path):
    """`fit(epochs=4, initial_epoch=2)` runs two epochs; the run once planned four."""
    from gradflow.store import RunStore

    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store)
    model.fit(x, y, batch_size=BATCH, epochs=4, initial_epoch=2, verbose=0, callbacks=[monitor])
    info = store.run_info(monitor.run_id)
    assert (info["progress_step"], info["total_steps"]) == (6, 6)


def test_one_monitor_across_a_freeze_keeps_both_fits_records():
    """The second fit records fewer rows a step; `history` once failed to join them."""
    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    monitor = GradientMonitor(histograms=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    model.layers[0].trainable = False
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    history = monitor.history
    layers_per_step = history.groupby("step")["layer"].apply(lambda s: sorted(set(s)))
    assert layers_per_step.loc[3] == ["d0", "d1", "d2"]
    assert layers_per_step.loc[4] == ["d1", "d2"] and layers_per_step.loc[6] == ["d1", "d2"]
    assert sorted(monitor.metrics.query("name == 'loss'")["step"]) == [1, 2, 3, 4, 5, 6]
    histograms = monitor.histogram_rows
    assert set(histograms.query("step == 5")["layer"]) == {"d1", "d2"}
    told = monitor.events.query("kind == 'info'")
    assert told["step"].tolist() == [4]
    assert told["message"].iloc[0] == (
        "This fit trains 2 layers with weights, the last fit 3. Trained in the last fit and "
        "not now, so without rows from this step on (frozen with `trainable = False`, or "
        "gone): d0."
    )


def test_one_monitor_across_a_new_optimizer_numbers_the_steps_on(tmp_path):
    """Keras's fine-tuning recipe: fit, unfreeze, `compile()` again, fit again.

    The new optimizer counts from 0: the second fit's steps were numbered
    1, 2, 3 again, and in the store they replaced the first fit's rows.
    """
    from gradflow.store import RunStore

    x, y = make_data()
    model = make_model()
    reference = copy_of(model)
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store)
    model.layers[0].trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    first_fit = monitor.history.copy()
    model.layers[0].trainable = True
    model.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])

    assert model.optimizer.iterations.numpy() == 6  # Keras's own count is untouched
    history = monitor.history
    assert sorted(history["step"].unique()) == list(range(1, 10))
    assert not history.duplicated(["step", "layer", "tensor"]).any()
    assert sorted(monitor.metrics.query("name == 'loss'")["step"]) == list(range(1, 10))
    # The first fit's rows are kept as they were, in the history and in the store.
    pd.testing.assert_frame_equal(history[history["step"] <= 3].reset_index(drop=True), first_fit)
    stored = store.layer_stats(monitor.run_id)
    assert len(stored) == len(history)
    key = ["step", "layer", "tensor"]
    joined = history.merge(stored, on=key, suffixes=("", "_stored"))
    np.testing.assert_allclose(joined["l2_norm_stored"], joined["l2_norm"], rtol=1e-6)
    assert store.run_info(monitor.run_id)["total_steps"] == 9
    # The second fit's steps are the reference's steps 1-6 of its own optimizer.
    reference.layers[0].trainable = False
    reference_run(reference, keras.optimizers.SGD(0.05), x, y, epochs=1)
    reference.layers[0].trainable = True
    rows, _ = reference_run(reference, keras.optimizers.SGD(0.02), x, y, epochs=2)
    expected = pd.DataFrame(
        [(*k, row["l2_norm"]) for k, row in rows.items() if k[2] != "activation"],
        columns=[*key, "l2_norm"],
    )
    second = history[history["step"] > 3].assign(step=lambda f: f["step"] - 3)
    joined = expected.merge(second, on=key, suffixes=("", "_recorded"))
    assert len(joined) == len(second) == len(expected) == 6 * 6
    np.testing.assert_allclose(joined["l2_norm_recorded"], joined["l2_norm"], rtol=1e-5)
    told = monitor.events.query("kind == 'info'")
    assert told["step"].tolist() == [3, 4]
    assert "numbered on from step 4" in told["message"].iloc[0]
    assert told["message"].iloc[1] == (
        "This fit trains 3 layers with weights, the last fit 2. "
        "Training now and not in the last fit (unfrozen, or new): d0."
    )
    # Both said on the run's page too: the numbering was told in memory only.
    assert store.events(monitor.run_id)["message"].tolist() == told["message"].tolist()


def test_one_monitor_given_to_several_fits_halts_each_at_its_own_nan():
    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    monitor = GradientMonitor(stop_on_nonfinite=True)
    bad = np.full_like(x, np.nan)
    for data in (bad, x, bad):
        before = model.get_weights()
        model.fit(data, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
        after = model.get_weights()
        assert all(np.isfinite(w).all() for w in after)  # each NaN fit halted
        if data is x:
            assert not np.allclose(after[0], before[0])  # the good fit trained
    events = monitor.events
    nonfinite = events[events["kind"] == "nonfinite"]
    assert len(nonfinite) == 2 and len(events) == len(
        events.drop_duplicates(["step", "layer", "kind"])
    )
    # Each halting fit keeps its halted step's metric, the good fit all three
    # (once dropped: the first fit's halt seemed to apply to later steps).
    assert sorted(monitor.metrics.query("name == 'mae'")["step"]) == [1, 2, 3, 4, 5]


# Rules that fire and stop often on this small model, so that streaks and
# growth windows straddle the fits.
FLICKERING_RULES = dict(exploding_growth=1.02, growth_window=2, vanishing_ratio=1.0, repeat_after=1)


def found_events(events):
    kinds = ("vanishing", "exploding", "dead_relu", "saturation")
    found = events[events["kind"].isin(kinds)]
    return sorted(zip(found["step"].astype(int), found["layer"], found["kind"], strict=True))


def test_a_monitor_given_to_several_fits_diagnoses_only_what_each_fit_added(monkeypatch):
    """Each fit's end once ran the rules over the whole history: a loop of
    one-epoch fits spent more and more of its time there."""
    from gradflow.diagnosis import Thresholds, diagnose
    from gradflow.monitor import callback as monitor_callback

    read = []

    def counting(table, rules=None, layer_inputs=None):
        read.append(table["step"].nunique())
        return diagnose(table, rules, layer_inputs)

    monkeypatch.setattr(monitor_callback, "diagnose", counting)
    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    rules = Thresholds(**FLICKERING_RULES)
    monitor = GradientMonitor(activations=True, rules=rules)
    for _ in range(8):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    steps = monitor.history["step"].nunique()
    assert steps == 24
    # The first fit's 3 steps, then each fit's 3 and the steps before them
    # the rules look back at: the second fit all 3 of the first's, later
    # fits 4 (the newest two, and back `growth_window` = 2 steps from the
    # second newest). The whole history grows to 24 steps.
    assert read == [3, 6] + [7] * 6
    # What the fits found one by one is what the whole history shows.
    whole = found_events(diagnose(monitor.history, rules))
    assert len(whole) >= 8 and {kind for _, _, kind in whole} >= {"exploding", "vanishing"}
    assert found_events(monitor.events) == whole


def test_a_long_fit_is_diagnosed_in_pieces_with_the_whole_historys_events(monkeypatch):
    """The rules read a first fit's whole table at its end: 450 MiB more for a
    162-tensor model's 5,000 steps, at the end of an overnight run."""
    from gradflow.diagnosis import Thresholds, diagnose
    from gradflow.monitor import callback as monitor_callback

    read = []

    def counting(table, rules=None, layer_inputs=None):
        read.append(len(table))
        return diagnose(table, rules, layer_inputs)

    monkeypatch.setattr(monitor_callback, "diagnose", counting)
    monkeypatch.setattr(monitor_callback, "_DIAGNOSED_ROWS", 40)
    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    rules = Thresholds(**FLICKERING_RULES)
    monitor = GradientMonitor(activations=True, rules=rules)
    model.fit(x, y, batch_size=BATCH, epochs=8, shuffle=False, verbose=0, callbacks=[monitor])
    rows = len(monitor.history)
    assert len(read) > 4 and max(read) < rows / 2  # never the whole table
    whole = found_events(diagnose(monitor.history, rules))
    assert len(whole) >= 8 and {kind for _, _, kind in whole} >= {"exploding", "vanishing"}
    assert found_events(monitor.events) == whole


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(st.integers(1, 4), min_size=2, max_size=30).map(
        lambda gaps: list(np.cumsum(gaps))
    ),
    split=st.floats(0.0, 1.0),
    norms=st.lists(st.sampled_from([0.0, 1e-9, 1e-3, 0.5, 1.0, 2.0, 50.0, 2e3]), min_size=60),
    window=st.integers(1, 6),
    quiet=st.integers(1, 6),
)
def test_the_steps_a_later_diagnosis_rereads_give_the_whole_historys_events(
    steps, split, norms, window, quiet
):
    """`context_start`: the rules on (context + new steps) find, at the new
    steps, what they find there in the whole history."""
    from gradflow.diagnosis import Thresholds, context_start, diagnose

    rows = []
    for i, step in enumerate(steps):
        for j, layer in enumerate(["a", "b"]):
            norm = norms[(2 * i + j) % len(norms)]
            rows.append((step, layer, j, "kernel", norm, 0, 0.0, norm / 10))
    columns = ["step", "layer", "layer_index", "tensor", "l2_norm", "nonfinite"]
    table = pd.DataFrame(rows, columns=columns + ["zero_fraction", "mean_abs"])
    cut = min(len(steps) - 1, max(1, int(split * len(steps))))
    old, new = np.array(steps[:cut]), steps[cut:]
    rules = Thresholds(
        exploding_growth=3.0, growth_window=window, vanishing_ratio=0.1, repeat_after=quiet
    )
    start = context_start(old, window, quiet)
    again = diagnose(table[table["step"] >= start], rules)
    whole = diagnose(table, rules)
    assert found_events(again[again["step"].isin(new)]) == found_events(
        whole[whole["step"].isin(new)]
    )
