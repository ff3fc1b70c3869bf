"""The Live page's Pause, Step once and Stop reach a run a script records.

The page puts the same requests in the store for every run; a lab run's
worker obeys them (`tests/test_control.py`). A run a user's script records
(`GradientMonitor(store=...)`, `GradientLog(store=...)`) trains in that
script's process: there `gradflow.monitor.remote.DashboardRequests` takes
them. The scripts here are real processes, driven through a real SQLite
store exactly as the page drives it (`RunStore.request`).
"""

import contextlib
import pathlib
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradflow
from gradflow.monitor import remote
from gradflow.store import RunStore
from tests.test_pages import run_page

REPO = pathlib.Path(__file__).resolve().parent.parent

_MODEL = """
import sys, time
import numpy as np, keras, tensorflow as tf
import gradflow

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
)
x = np.random.rand(64, 4).astype("float32")
y = x.sum(1, keepdims=True)
"""

# `fit` of 8 steps an epoch for 100 epochs, slowed to about 30 steps a
# second so that the test can act between steps.
FIT_SCRIPT = (
    _MODEL
    + """
model.compile("sgd", "mse")

class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.03)

monitor = gradflow.GradientMonitor(store=sys.argv[1], run_name="my script")
history = model.fit(x, y, batch_size=8, epochs=100, callbacks=[monitor, Slow()], verbose=0)
print("EPOCHS", len(history.history["loss"]), "STEPS", int(model.optimizer.iterations.numpy()))
"""
)

LOOP_SCRIPT = (
    _MODEL
    + """
optimizer = keras.optimizers.SGD(0.01)

@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(gradients, model.trainable_variables)
    return loss, gradients

steps = 0
with gradflow.GradientLog(model, optimizer=optimizer, store=sys.argv[1], run_name="my loop") as log:
    for _ in range(100_000):
        loss, gradients = train_step(x[:8], y[:8])
        log.record(gradients, loss=loss)
        steps += 1
        time.sleep(0.03)
        if log.stop_training:
            break
print("STEPS", steps, "OPTIMIZER", int(optimizer.iterations.numpy()))
"""
)


def wait_for(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def has_a_run(db):
    """Whether the store at `db` holds a run yet (it may be half made)."""
    try:
        return db.exists() and len(RunStore(db).runs()) > 0
    except (sqlite3.Error, ValueError):
        return False


def start_script(tmp_path, text):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(text))
    db = tmp_path / "runs.db"
    process = subprocess.Popen(
        [sys.executable, str(script), str(db)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The script makes the run at its first step.
    wait_for(lambda: has_a_run(db), "the script's run")
    store = RunStore(db)
    return process, store, store.runs()["run_id"].iloc[0]


@contextlib.contextmanager
def killed_if_left(process):
    """The script process, killed if the test ends before it does."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def stop_script(process, store, run_id, timeout=60):
    """Press Stop for the script's run; its `(stdout, stderr)` once it ended well."""
    store.request(run_id, "stop")
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return out, err


def pause_step_resume_stop(process, store, run_id):
    """Drive the run as the Live page's buttons do; returns the script's output."""

    def info():
        return store.run_info(run_id)

    with killed_if_left(process):
        wait_for(lambda: info()["progress_step"] >= 3, "a few steps")
        store.request(run_id, "pause")
        wait_for(lambda: info()["status"] == "paused", "Pause")
        held = info()["progress_step"]
        time.sleep(1.0)  # 30 steps, at the script's pace, had it gone on
        assert (info()["status"], info()["progress_step"]) == ("paused", held)

        store.request(run_id, "step")
        wait_for(lambda: info()["progress_step"] == held + 1, "Step once")
        time.sleep(1.0)
        assert (info()["status"], info()["progress_step"]) == ("paused", held + 1)

        store.request(run_id, "resume")
        wait_for(lambda: info()["status"] == "running", "Resume")
        wait_for(lambda: info()["progress_step"] > held + 5, "training again")

        out, err = stop_script(process, store, run_id)
    # The script's terminal says why it stopped printing, once (not again
    # after Step once), and when it goes on.
    said = [line for line in err.splitlines() if line.startswith(f"gradflow: run {run_id}")]
    assert said == [
        f"gradflow: run {run_id} paused from the dashboard. Training waits for Resume, "
        "Step once or Stop there (Ctrl-C here interrupts it).",
        f"gradflow: run {run_id} trains again.",
    ]
    return out


def printed(out, word):
    """The number the script printed after `word`."""
    words = out.split()
    return int(words[words.index(word) + 1])


def assert_stopped_after(store, run_id, steps):
    info = store.run_info(run_id)
    assert info["status"] == "stopped"
    assert info["message"] == f"Stopped from the dashboard after step {steps}."
    # Every step trained is in the store, up to the last.
    assert store.layer_stats(run_id)["step"].max() == steps
    assert store.pending_request(run_id, consume=False) is None


@pytest.mark.slow
def test_the_dashboards_buttons_pause_step_and_stop_a_scripts_fit(tmp_path):
    process, store, run_id = start_script(tmp_path, FIT_SCRIPT)
    out = pause_step_resume_stop(process, store, run_id)
    assert printed(out, "EPOCHS") < 100  # `fit` ended early, and returned: the next line ran
    assert_stopped_after(store, run_id, printed(out, "STEPS"))


@pytest.mark.slow
def test_the_dashboards_buttons_pause_step_and_stop_a_hand_written_loop(tmp_path):
    process, store, run_id = start_script(tmp_path, LOOP_SCRIPT)
    out = pause_step_resume_stop(process, store, run_id)
    steps = printed(out, "STEPS")
    assert steps == printed(out, "OPTIMIZER") < 100_000
    assert_stopped_after(store, run_id, steps)
    # A loop that ends at once needs no word on the page about reading the flag.
    assert "stop_training" not in " ".join(store.events(run_id)["message"])


def small_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])


def a_loop():
    """`(model, optimizer, step)`: `step()` trains one step and returns its gradients."""
    model, optimizer = small_model(), keras.optimizers.SGD(0.1)
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 1), "float32")

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return gradients

    return model, optimizer, step


def test_a_loop_that_reads_the_flag_late_is_told_on_the_page_and_closes_stopped(tmp_path):
    """A loop that reads `log.stop_training` at an epoch's end trains on a while."""
    model, optimizer, step = a_loop()
    store = RunStore(tmp_path / "runs.db")
    with gradflow.GradientLog(model, optimizer=optimizer, store=store) as log:
        log.record(step())
        store.request(log.run_id, "stop")
        time.sleep(remote.POLL_SECONDS + 0.05)
        log.record(step())
        assert log.stop_training
        for _ in range(3):  # the rest of its epoch
            log.record(step())
    info = store.run_info(log.run_id)
    assert info["status"] == "stopped"
    # Not "after step 2" alone: the page shows step 5.
    assert info["message"] == (
        "Stop was pressed on the dashboard after step 2; the loop trained on to step 5."
    )
    events = store.events(log.run_id)
    told = events[events["message"].str.contains("log.stop_training")]
    assert told["step"].tolist() == [3]  # once, at the first step after the Stop
    assert store.layer_stats(log.run_id)["step"].max() == 5  # nothing recorded was dropped


def test_a_loop_that_sets_the_flag_itself_completes(tmp_path):
    model, optimizer, step = a_loop()
    store = RunStore(tmp_path / "runs.db")
    with gradflow.GradientLog(model, optimizer=optimizer, store=store) as log:
        log.record(step())
        log.stop_training = True  # the loop's own early stop
    assert store.run_info(log.run_id)["status"] == "completed"


def test_a_log_without_a_store_has_no_requests_to_take():
    model, optimizer, step = a_loop()
    with gradflow.GradientLog(model, optimizer=optimizer) as log:
        assert log.record(step())
        assert not log.stop_training


def test_a_lab_runs_requests_are_left_to_its_worker(tmp_path):
    """The worker's monitor writes a run it was given; `RunControl` takes its requests."""
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, name="lab run")
    store.request(run_id, "pause")
    model = small_model()
    model.compile("sgd", "mse")
    monitor = gradflow.GradientMonitor(store=store, run_id=run_id, close_run=False)
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=1, callbacks=[monitor], verbose=0)
    assert store.pending_request(run_id, consume=False) == "pause"
    assert store.run_info(run_id)["status"] == "running"  # the worker's to end


def test_a_stop_left_from_the_last_fit_does_not_stop_the_next(tmp_path):
    """A Stop pressed as a fit ended waited in the store for the same monitor's next fit."""
    store = RunStore(tmp_path / "runs.db")
    model = small_model()
    model.compile("sgd", "mse")
    monitor = gradflow.GradientMonitor(store=store)
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=1, callbacks=[monitor], verbose=0)
    store.request(monitor.run_id, "stop")
    history = model.fit(x, y, batch_size=2, epochs=3, callbacks=[monitor], verbose=0)
    assert len(history.history["loss"]) == 3
    assert store.run_info(monitor.run_id)["status"] == "completed"


def a_paused_scripts_run(tmp_path):
    """`(store, run_id, requests)`: a script's run whose Pause waits in the store."""
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, name="mine", source="monitor")
    requests = remote.DashboardRequests(store, run_id)
    store.request(run_id, "pause")
    return store, run_id, requests


def paused_in_a_thread(requests):
    """`requests.check()` run in a thread (it holds while paused); returns (thread, result)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(requests.check()), daemon=True)
    thread.start()
    return thread, result


def test_a_paused_script_whose_run_is_deleted_trains_on(tmp_path):
    """No one can press Resume on a deleted run: the script must not wait for ever."""
    store, run_id, requests = a_paused_scripts_run(tmp_path)
    thread, result = paused_in_a_thread(requests)
    wait_for(lambda: store.status(run_id) == "paused", "the pause")
    assert thread.is_alive()
    store.delete(run_id)
    thread.join(timeout=10)
    assert not thread.is_alive() and result == [None]


def test_a_paused_script_whose_store_breaks_trains_on(tmp_path, monkeypatch):
    store, run_id, requests = a_paused_scripts_run(tmp_path)
    monkeypatch.setattr(remote, "GIVE_UP_SECONDS", 0.5)
    taken = store.pending_request

    def breaks_after_the_pause(run, consume=True):
        if store.status(run) == "paused":
            raise sqlite3.OperationalError("disk I/O error")
        return taken(run, consume)

    monkeypatch.setattr(store, "pending_request", breaks_after_the_pause)
    thread, result = paused_in_a_thread(requests)
    thread.join(timeout=10)
    assert not thread.is_alive() and result == [None]
    monkeypatch.setattr(store, "pending_request", taken)
    assert store.status(run_id) == "running"  # said, if the store takes it


def test_the_live_page_offers_a_scripts_run_its_buttons_after_take_control(page_environment):
    store = RunStore(page_environment)
    run_id = store.create_run(
        {"model": "mine", "recorded_by": "GradientLog"}, name="my loop", source="monitor"
    )
    app = run_page("live_training.py", run=run_id)
    buttons = {b.label: b for b in app.button}
    assert buttons["Pause"].disabled and buttons["Stop"].disabled
    assert any(
        "trains in a script (`GradientLog`)" in c.value and "**Take control**" in c.value
        for c in app.caption
    )
    buttons["Take control"].click().run()
    buttons = {b.label: b for b in app.button}
    assert not buttons["Pause"].disabled
    # A hand-written loop ends on Stop only when it reads the flag: the page says so.
    assert any("log.stop_training" in c.value for c in app.caption)
    buttons["Pause"].click().run()
    assert store.pending_request(run_id) == "pause"


def test_the_live_page_says_what_a_scripts_run_trained(page_environment):
    """KerasTuner's trials arrived as runs of one name, told apart by nothing on the page."""
    from gradflow.monitor.outputs import run_config

    model = small_model()
    optimizer = keras.optimizers.Adam(0.003)
    store = RunStore(page_environment)
    run_id = store.create_run(
        run_config(model, optimizer, every=2, histograms=False, rules=None),
        name="trial",
        source="monitor",
    )
    app = run_page("live_training.py", run=run_id)
    said = [c.value for c in app.caption if "parameters" in c.value]
    assert said == [
        f"model `{model.name}`, {model.count_params()} parameters · Adam: learning_rate 0.003 "
        "· every 2 steps"
    ]


def test_a_paused_script_tells_the_store_it_is_alive(tmp_path, monkeypatch):
    """A dashboard on another host calls a run silent for a minute interrupted."""
    monkeypatch.setattr(remote, "HEARTBEAT_SECONDS", 0.2)
    store, run_id, requests = a_paused_scripts_run(tmp_path)
    thread, result = paused_in_a_thread(requests)
    wait_for(lambda: store.status(run_id) == "paused", "the pause")
    first = store.run_info(run_id)["heartbeat_at"]
    wait_for(lambda: store.run_info(run_id)["heartbeat_at"] > first, "a heartbeat", timeout=10)
    store.request(run_id, "resume")
    thread.join(timeout=10)
    assert result == [None] and store.status(run_id) == "running"


def while_fit_trains(store, actions):
    """Run `actions(run_id)` in a thread once a run is in `store` (it drives a `fit` in this one)."""
    errors = []

    def drive():
        run_id = None
        try:
            wait_for(lambda: len(store.runs()), "the run")
            run_id = store.runs()["run_id"].iloc[0]
            wait_for(lambda: store.run_info(run_id)["progress_step"] >= 1, "a first step")
            actions(run_id)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
            if run_id is not None:
                store.request(run_id, "stop")  # a fit left paused would hold the test

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    return thread, errors


def a_fit(steps_per_execution=1):
    model = small_model()
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    x, y = np.ones((80, 3), "float32"), np.zeros((80, 1), "float32")
    return model, x, y


class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.01)


def paused_step(store, run_id):
    """Pause the run; returns the step it shows once paused."""
    store.request(run_id, "pause")
    wait_for(lambda: store.status(run_id) == "paused", "Pause")
    return store.run_info(run_id)["progress_step"]


def test_a_fit_of_several_steps_per_call_says_what_step_once_trains(tmp_path):
    store = RunStore(tmp_path / "runs.db")
    model, x, y = a_fit(steps_per_execution=4)
    seen = {}

    def actions(run_id):
        seen["paused at"] = paused_step(store, run_id)
        seen["iterations"] = int(model.optimizer.iterations.numpy())
        store.request(run_id, "step")
        wait_for(lambda: store.run_info(run_id)["progress_step"] > seen["paused at"], "a step")
        seen["stepped to"] = store.run_info(run_id)["progress_step"]
        store.request(run_id, "stop")

    monitor = gradflow.GradientMonitor(store=store)
    thread, errors = while_fit_trains(store, actions)
    model.fit(x, y, batch_size=2, epochs=50, callbacks=[monitor, Slow()], verbose=0)
    thread.join(timeout=120)  # past `wait_for`'s own limit: its error says what was awaited
    assert not errors, errors
    assert seen["paused at"] == seen["iterations"] and seen["stepped to"] == seen["paused at"] + 4
    told = store.events(monitor.run_id)["message"]
    assert told.str.contains("Step once trains one call, 4 steps").sum() == 1


def test_paused_with_every_5_the_page_shows_the_step_it_waits_after(tmp_path):
    """Paused after step 17, the badge read "step 15": the last recorded step."""
    store = RunStore(tmp_path / "runs.db")
    model, x, y = a_fit()
    seen = {}

    def actions(run_id):
        store.request(run_id, "pause")
        wait_for(lambda: store.status(run_id) == "paused", "Pause")
        seen["shown"] = store.run_info(run_id)["progress_step"]
        seen["trained"] = int(model.optimizer.iterations.numpy())
        store.request(run_id, "stop")

    monitor = gradflow.GradientMonitor(store=store, every=5, close_run=False)
    thread, errors = while_fit_trains(store, actions)
    model.fit(x, y, batch_size=2, epochs=50, callbacks=[monitor, Slow()], verbose=0)
    thread.join(timeout=120)  # past `wait_for`'s own limit: its error says what was awaited
    assert not errors, errors
    assert seen["shown"] == seen["trained"]
    # `close_run=False` leaves the run's end to its owner, and still takes the page's buttons.
    assert int(model.optimizer.iterations.numpy()) < 50 * 40


def test_stop_pressed_while_paused_says_running_until_the_loop_ends(tmp_path):
    store, run_id, requests = a_paused_scripts_run(tmp_path)
    thread, result = paused_in_a_thread(requests)
    wait_for(lambda: store.status(run_id) == "paused", "the pause")
    store.request(run_id, "stop")
    thread.join(timeout=10)
    assert result == ["stop"] and store.status(run_id) == "running"


def a_logged_step(tmp_path, action):
    """`(store, log, step)`: a log's first step recorded, then `action` pressed on the page,
    seen at the next `record`."""
    model, optimizer, step = a_loop()
    store = RunStore(tmp_path / "runs.db")
    log = gradflow.GradientLog(model, optimizer=optimizer, store=store)
    log.record(step())
    store.request(log.run_id, action)
    time.sleep(remote.POLL_SECONDS + 0.05)  # the log looks again at its next `record`
    return store, log, step


def test_close_stopped_after_the_dashboards_stop_keeps_its_message(tmp_path):
    store, log, step = a_logged_step(tmp_path, "stop")
    log.record(step())
    assert log.stop_training
    log.close(status="stopped")
    assert store.run_info(log.run_id)["message"] == "Stopped from the dashboard after step 2."


@pytest.mark.slow
def test_ctrl_c_while_paused_ends_the_run_interrupted_at_once(tmp_path):
    """The script caught the KeyboardInterrupt to clean up: the run read "paused", then
    "failed: `fit` ended with an error outside the train step"."""
    # A script started from a terminal takes Ctrl-C as KeyboardInterrupt; one
    # started under a shell's `&` (as CI may run the suite) ignores SIGINT, and so
    # would this script, inheriting that.
    interruptible = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    caught = (
        (interruptible + FIT_SCRIPT)
        .replace(
            "history = model.fit(",
            "try:\n    history = model.fit(",
        )
        .replace(
            'print("EPOCHS"',
            'except KeyboardInterrupt:\n    print("CAUGHT", flush=True)\n    time.sleep(30)\n'
            'print("EPOCHS"',
        )
    )
    process, store, run_id = start_script(tmp_path, caught)
    try:
        wait_for(lambda: store.run_info(run_id)["progress_step"] >= 3, "a few steps")
        paused_step(store, run_id)
        process.send_signal(signal.SIGINT)
        wait_for(lambda: store.status(run_id) != "paused", "the end of the pause", timeout=20)
        info = store.run_info(run_id)
        assert process.poll() is None  # still cleaning up
        assert (info["status"], info["message"]) == (
            "interrupted",
            "Training was interrupted (KeyboardInterrupt).",
        )
    finally:
        process.kill()
        process.communicate()


def test_a_request_sent_as_the_run_appears_is_obeyed(tmp_path):
    """Requests were dropped when a run began taking them: a Pause sent at once was lost."""
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, name="mine", source="monitor")
    store.request(run_id, "stop")
    assert remote.DashboardRequests(store, run_id).check() == "stop"


def test_left_over_requests_are_dropped_past_a_speed_limit(tmp_path):
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, name="mine", source="monitor", status="completed")
    store.request_pace(run_id, 2.0)
    store.request(run_id, "stop")
    remote.drop_left_over(store, run_id)
    assert store.pending_request(run_id) is None


def test_a_run_no_longer_running_is_not_held_paused(tmp_path):
    """A run marked interrupted has no Resume on the page: a pause would last for ever."""
    store, run_id, requests = a_paused_scripts_run(tmp_path)
    store.set_status(run_id, "interrupted", "no heartbeat")
    thread, result = paused_in_a_thread(requests)
    thread.join(timeout=10)
    assert not thread.is_alive() and result == [None]
    assert store.status(run_id) == "interrupted"


def test_a_pause_the_store_could_not_show_is_tried_again(tmp_path, monkeypatch):
    """The page read "running" (offering Pause, not Resume) while the script was held."""
    store, run_id, requests = a_paused_scripts_run(tmp_path)
    shown = store.set_status
    failures = [sqlite3.OperationalError("database is locked")] * 3

    def busy_at_first(*args, **kwargs):
        if failures and args[1] == "paused":
            raise failures.pop()
        return shown(*args, **kwargs)

    monkeypatch.setattr(store, "set_status", busy_at_first)
    thread, result = paused_in_a_thread(requests)
    wait_for(lambda: store.status(run_id) == "paused", "the pause, once the store takes it")
    assert thread.is_alive()
    store.request(run_id, "resume")
    thread.join(timeout=10)
    assert result == [None] and store.status(run_id) == "running"


def test_a_pause_the_store_never_shows_ends(tmp_path, monkeypatch):
    store, run_id, requests = a_paused_scripts_run(tmp_path)
    monkeypatch.setattr(remote, "GIVE_UP_SECONDS", 0.5)
    shown = store.set_status

    def never_paused(*args, **kwargs):
        if args[1] == "paused":
            raise sqlite3.OperationalError("database is locked")
        return shown(*args, **kwargs)

    monkeypatch.setattr(store, "set_status", never_paused)
    thread, result = paused_in_a_thread(requests)
    thread.join(timeout=10)
    assert not thread.is_alive() and result == [None]


def test_a_ctrl_c_while_a_loop_is_paused_leaves_no_pause_to_resume(tmp_path):
    """A log used without `with`: the script caught the Ctrl-C and went on; the page
    offered Resume and Step once to a script that was doing something else."""
    store, log, step = a_logged_step(tmp_path, "pause")
    # What a Ctrl-C does while `record` is held: a KeyboardInterrupt from the wait.
    original = time.sleep

    def interrupted(seconds):
        # Python delivers a Ctrl-C to the main thread alone (not the store's writer).
        if threading.current_thread() is threading.main_thread():
            if store.status(log.run_id) == "paused":
                raise KeyboardInterrupt
        original(seconds)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(remote.time, "sleep", interrupted)
        with pytest.raises(KeyboardInterrupt):
            log.record(step())
    assert store.status(log.run_id) == "running"
    log.close("interrupted")


def test_a_pause_pressed_between_two_fits_of_a_monitor_that_leaves_its_run_open(tmp_path):
    """With `close_run=False` the run reads "running" between fits: a Stop pressed then
    was dropped by the next fit."""
    store = RunStore(tmp_path / "runs.db")
    model = small_model()
    model.compile("sgd", "mse")
    monitor = gradflow.GradientMonitor(store=store, close_run=False)
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=1, callbacks=[monitor], verbose=0)
    store.request(monitor.run_id, "stop")
    history = model.fit(x, y, batch_size=2, epochs=3, callbacks=[monitor], verbose=0)
    assert len(history.history["loss"]) == 1


def test_a_run_deleted_between_two_fits_is_made_again(tmp_path):
    """The second `fit` ended in `UnknownRunError` before its first step."""
    store = RunStore(tmp_path / "runs.db")
    model = small_model()
    model.compile("sgd", "mse")
    monitor = gradflow.GradientMonitor(store=store, run_name="mine")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=1, callbacks=[monitor], verbose=0)
    first = monitor.run_id
    store.delete(first)
    with pytest.warns(UserWarning, match="was deleted from its store: this fit records into a new"):
        model.fit(x, y, batch_size=2, epochs=1, callbacks=[monitor], verbose=0)
    assert monitor.run_id != first
    assert store.run_info(monitor.run_id)["status"] == "completed"
    assert store.layer_stats(monitor.run_id)["step"].tolist()


def test_a_busy_store_at_a_pause_warns_and_fit_goes_on(tmp_path, monkeypatch):
    """`fit` ended with "database is locked" from the writer's flush before the pause."""
    from gradflow.store import writer as writers

    store = RunStore(tmp_path / "runs.db")
    model, x, y = a_fit()

    def locked(self):
        raise sqlite3.OperationalError("database is locked")

    def actions(run_id):
        monkeypatch.setattr(writers.RunWriter, "flush", locked)
        store.request(run_id, "pause")
        wait_for(lambda: store.status(run_id) == "paused", "Pause")
        monkeypatch.undo()
        store.request(run_id, "stop")

    monitor = gradflow.GradientMonitor(store=store)
    thread, errors = while_fit_trains(store, actions)
    with pytest.warns(UserWarning, match="could not write run .* before pausing"):
        model.fit(x, y, batch_size=2, epochs=50, callbacks=[monitor, Slow()], verbose=0)
    thread.join(timeout=120)
    assert not errors, errors
    assert store.run_info(monitor.run_id)["status"] == "stopped"


@pytest.mark.parametrize("status", ["running", "paused"])
def test_start_training_leaves_a_scripts_run_taken_control_of_training(
    page_environment, monkeypatch, status
):
    """Take control made the script's run "started here", and Start training stopped it;
    a paused one, left alone, waited for ever out of sight: it is resumed."""
    import types

    from gradflow.ui import resources

    store = RunStore(page_environment)
    script = store.create_run({"model": "mine"}, name="my fit", source="monitor", status=status)

    def start(config, name=None):
        return store.create_run(config, name=name, status="completed")

    manager = types.SimpleNamespace(
        prewarm=False, start=start, queued=lambda: [], running=lambda: {}
    )
    monkeypatch.setattr(resources, "run_manager", lambda: manager)
    app = run_page("live_training.py", run=script)
    next(b for b in app.button if b.label == "Take control").click().run()
    next(b for b in app.button if b.label == "Start training").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert store.status(script) == status
    assert not any(t.value.startswith("Stopped") for t in app.toast)
    resumed = any("Resumed **my fit** (your script)" in t.value for t in app.toast)
    assert store.pending_request(script) == ("resume" if status == "paused" else None)
    assert resumed == (status == "paused")


def test_a_pause_in_a_script_whose_stderr_is_closed_still_pauses(monkeypatch):
    """The line a pause prints ended `fit` with "I/O operation on closed file"."""
    import io

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    remote._say("gradflow: run x paused from the dashboard.")  # says nothing, raises nothing
