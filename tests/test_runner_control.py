"""RunControl in process: step limit, stop, pause/step/resume, non-finite loss."""

import numpy as np
import pytest

from gradflow.lab.control import RunControl
from gradflow.store import RunStore


def tiny_model(learning_rate=0.01):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    return model


def fit(model, control, epochs=50):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = (100 * x.sum(axis=1, keepdims=True)).astype("float32")
    callbacks = control if isinstance(control, list) else [control]
    history = model.fit(x, y, batch_size=4, epochs=epochs, verbose=0, callbacks=callbacks)
    return int(model.optimizer.iterations.numpy()), history


def controlled_run(store_path, requests, max_steps):
    """A run with `requests` waiting, and a RunControl that notes its step at every pause."""
    store = RunStore(store_path)
    run_id = store.create_run({})
    for action in requests:
        store.request(run_id, action)
    paused = []
    control = RunControl(
        store,
        run_id,
        max_steps=max_steps,
        poll_interval=0.01,
        on_pause=lambda: paused.append(control.steps),
    )
    return store, run_id, control, paused


@pytest.mark.parametrize(
    "requests, max_steps, steps, reason, status, pauses",
    [
        ([], 7, 7, None, "running", 0),
        (["stop"], 7, 1, "stop", "running", 0),
        # Paused at step 1, two single steps, then resumed until the limit.
        (["pause", "step", "step", "resume"], 6, 6, None, "running", 3),
        (["pause", "step", "stop"], 6, 2, "stop", "paused", 2),
    ],
)
def test_requests_and_step_limit(store_path, requests, max_steps, steps, reason, status, pauses):
    store, run_id, control, paused = controlled_run(store_path, requests, max_steps)
    done, _ = fit(tiny_model(), control)
    assert (done, control.steps, control.stop_reason) == (steps, steps, reason)
    assert store.status(run_id) == status
    assert len(paused) == pauses
    assert store.pending_request(run_id) is None  # every request was handled


def test_nonfinite_loss_stops_at_that_step(store_path):
    store = RunStore(store_path)
    run_id = store.create_run({})
    control = RunControl(store, run_id, poll_interval=1e-9)
    done, history = fit(tiny_model(learning_rate=10.0), control, epochs=200)
    assert control.stop_reason == "nonfinite"
    assert done == control.nonfinite_step < 200 * 4


def test_a_pace_spreads_the_steps_evenly_over_time(store_path):
    """300 steps of the default run were over in 3 s, before a class had seen anything."""
    import time

    import keras

    store = RunStore(store_path)
    run_id = store.create_run({})
    control = RunControl(store, run_id, max_steps=12, poll_interval=0.01, pace=40)
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.monotonic())

    done, _ = fit(tiny_model(), [control, Clock()])
    assert done == 12 and len(times) == 12
    # The first step is due at once, each of the others a 40th of a second
    # after the one before was due: a step that oversleeps its time by a few
    # ms makes the next gap that much shorter (a CI run saw 28 then 22 ms),
    # but the steps keep the pace and none comes at once after another.
    assert times[-1] - times[0] >= 0.98 * 11 / 40, np.diff(times)
    assert (np.diff(times) >= 0.5 / 40).all(), np.diff(times)


def clocked_fit(store, run_id, control, steps):
    """Fits `steps` steps under `control`; the times their batches ended."""
    import time

    import keras

    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.monotonic())

    done, _ = fit(tiny_model(), [control, Clock()])
    assert done == steps
    return np.array(times)


@pytest.mark.parametrize("paused", [False, True])
def test_a_speed_limit_moved_during_the_run_takes_effect(store_path, paused):
    """The Speed limit moved in a demo applied only from the next Start, silently."""
    store = RunStore(store_path)
    run_id = store.create_run({})
    if paused:
        store.request(run_id, "pause")
    store.request_pace(run_id, 40)
    if paused:
        store.request(run_id, "resume")
    control = RunControl(store, run_id, max_steps=12, poll_interval=1e-9)
    times = clocked_fit(store, run_id, control, 12)
    assert control.pace == 40.0
    assert times[-1] - times[1] >= 0.98 * 10 / 40, np.diff(times)
    assert store.pending_request(run_id) is None
    # And back to full speed.
    slowed = RunControl(store, run_id, max_steps=12, poll_interval=1e-9, pace=2)
    store.request_pace(run_id, None)
    times = clocked_fit(store, run_id, slowed, 12)
    assert slowed.pace is None and times[-1] - times[0] < 3.0


def test_a_speed_limit_set_during_a_run_of_several_steps_a_call_runs_them_one_by_one(
    store_path,
):
    """At 1 step a second, a run of 3 steps a call trained in bursts of 3 every 3 s."""
    import time

    import keras

    store = RunStore(store_path)
    run_id = store.create_run({})
    plain = fit_in_calls_of_three(RunControl(store, run_id, max_steps=12))
    store.request_pace(run_id, 20)
    published = []
    control = RunControl(
        store, run_id, max_steps=12, poll_interval=1e-9, on_pause=lambda: published.append(1)
    )
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.monotonic())

    assert fit_in_calls_of_three(control, [Clock()]) == plain == 12
    # The first call ran whole (the request is read at its end); then each
    # call's first two steps were published inside it, and all kept the pace.
    assert len(published) == 2 * 3
    # The clock ticks at each call's end. The pace starts afresh at the
    # request (no wait before its first step): the second call waits two
    # 20ths of a second, each later call three.
    gaps = np.diff(times)
    assert gaps[0] >= 0.95 * 2 / 20 and (gaps[1:] >= 0.95 * 3 / 20).all(), gaps
    assert store.pending_request(run_id) is None


def test_a_pace_request_is_checked():
    from gradflow.store import tables

    assert tables.requested_pace(tables.pace_request(2.5)) == (True, 2.5)
    assert tables.requested_pace(tables.pace_request(None)) == (True, None)
    assert tables.requested_pace("pause") == (False, None)


def test_a_bad_pace_is_refused_naming_it(store_path):
    store = RunStore(store_path)
    with pytest.raises(ValueError, match="`pace`"):
        store.request_pace(store.create_run({}), 0)


@pytest.mark.parametrize(
    "arguments, match",
    [
        ({"max_steps": 0}, "`max_steps`"),
        ({"poll_interval": 0}, "`poll_interval`"),
        ({"pace": 0}, "`pace`"),
    ],
)
def test_bad_arguments(store_path, arguments, match):
    with pytest.raises(ValueError, match=match):
        RunControl(RunStore(store_path), "abc", **arguments)


@pytest.mark.parametrize("every", [1, 3])
def test_first_recorded_step_is_in_the_store_when_its_batch_ends(store_path, every):
    import keras

    from gradflow.lab.control import FirstStepPublisher
    from gradflow.monitor import GradientMonitor

    store = RunStore(store_path)
    run_id = store.create_run({})
    monitor = GradientMonitor(every=every, store=store, run_id=run_id, close_run=False)
    seen = {}

    class Look(keras.callbacks.Callback):
        # Runs right after the publisher, before the writer's next interval.
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step <= every:
                seen[step] = sorted(store.layer_stats(run_id, columns=["l2_norm"])["step"].unique())

    model = tiny_model()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])  # metrics reach the writer first
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    publisher = FirstStepPublisher(monitor)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[monitor, publisher, Look()])
    assert publisher.published
    assert seen[every] == [every]


def fit_in_calls_of_three(control, callbacks=(), steps_per_call=3):
    """12 steps of the tiny model, 3 batches an epoch, `steps_per_call` steps a call."""
    model = tiny_model()
    model.steps_per_execution = steps_per_call
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = (x.sum(axis=1, keepdims=True)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=4, verbose=0, callbacks=[*callbacks, control])
    return int(model.optimizer.iterations.numpy())


@pytest.mark.parametrize(
    "requests, steps, status, paused_at",
    [
        # Paused at the end of the first call; each "step" is one optimizer
        # step, inside the next call; then resumed to the limit.
        (["pause", "step", "step", "resume"], 12, "running", [3, 4, 5]),
        # Stopped between two steps of a call: the call ends there.
        (["pause", "step", "stop"], 4, "paused", [3, 4]),
        (["pause", "step", "step", "step", "stop"], 6, "paused", [3, 4, 5, 6]),
    ],
)
def test_a_step_is_one_optimizer_step_with_several_steps_per_call(
    store_path, requests, steps, status, paused_at
):
    store, run_id, control, paused = controlled_run(store_path, requests, max_steps=12)
    done = fit_in_calls_of_three(control)
    assert (done, control.steps) == (steps, steps)
    assert paused == paused_at
    assert store.status(run_id) == status
    assert store.pending_request(run_id) is None


def test_stepping_inside_calls_records_the_steps_of_an_uninterrupted_run(store_path):
    """The monitor's statistics, paused and stepped inside calls of 3, or paced one step at a
    time inside them, equal one step a call's."""
    from gradflow.monitor import GradientMonitor

    store = RunStore(store_path)
    histories = []
    for steps_per_call, requests in (
        (1, []),
        (3, ["pause", "step", "step", "step", "step", "resume"]),
        (3, [200]),  # a Speed limit of 200 steps a second, set during the run
    ):
        run_id = store.create_run({})
        for action in requests:
            if isinstance(action, int):
                store.request_pace(run_id, action)
            else:
                store.request(run_id, action)
        monitor = GradientMonitor(stop_on_nonfinite=True)
        control = RunControl(
            store, run_id, max_steps=12, poll_interval=0.01, on_pause=monitor.flush
        )
        assert fit_in_calls_of_three(control, [monitor], steps_per_call) == 12
        assert store.pending_request(run_id) is None
        histories.append(monitor.history)
    plain, *others = histories
    numeric = ["step", "l2_norm", "max_abs", "weight_norm", "update_ratio"]
    for stepped in others:
        assert sorted(stepped["step"].unique()) == list(range(1, 13))
        np.testing.assert_allclose(
            stepped[numeric].to_numpy(), plain[numeric].to_numpy(), rtol=1e-6
        )
