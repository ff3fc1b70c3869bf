"""Background lab runs: worker processes, pause/step/resume/stop, the queue, seeds."""

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

import gradflow
from gradflow.lab.config import RunConfig
from gradflow.lab.runner import RunManager
from gradflow.lab.training import Run
from gradflow.store import RunStore

LONG = RunConfig(depth=1, width=4, steps=1_000_000)


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    store = RunStore(tmp_path_factory.mktemp("background") / "runs.db")
    manager = RunManager.for_store(store, max_running=1, threads_per_run=1)
    yield manager
    manager.shutdown()


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def last_step(run):
    stats = run.store.layer_stats(run.run_id, columns=["l2_norm"])
    return int(stats["step"].max()) if len(stats) else 0


def test_pause_step_resume_stop(manager):
    run = Run(manager.start(LONG), manager.store, manager)
    wait_for(lambda: last_step(run) > 0)
    assert run.status == "running"
    run.pause()
    wait_for(lambda: run.status == "paused")
    paused_at = last_step(run)
    time.sleep(1.0)  # two flush intervals: nothing new may arrive
    assert last_step(run) == paused_at
    assert run.refresh().progress_step >= paused_at - 1

    run.step_once()
    wait_for(lambda: last_step(run) == paused_at + 1)
    time.sleep(0.7)
    assert (last_step(run), run.status) == (paused_at + 1, "paused")

    run.resume()
    wait_for(lambda: last_step(run) > paused_at + 3)
    run.stop()
    assert run.wait(timeout=60) == "stopped"
    stats = run.layer_stats
    steps = np.unique(stats["step"])
    np.testing.assert_array_equal(steps, np.arange(1, steps.max() + 1))  # no gaps
    assert "Stopped on request" in run.message


def test_queue_starts_runs_in_order_and_stop_cancels_a_queued_run(manager):
    first = Run(manager.start(LONG, name="first"), manager.store, manager)
    second = Run(manager.start(LONG, name="second"), manager.store, manager)
    third = Run(
        manager.start(RunConfig(depth=1, width=4, steps=5), name="third"), manager.store, manager
    )
    wait_for(lambda: first.status == "running")
    assert (second.status, third.status) == ("queued", "queued")
    assert manager.queued() == [second.run_id, third.run_id]
    listed = manager.store.runs().set_index("run_id")["status"]
    assert listed[second.run_id] == "queued"  # the dashboard sees the queue

    second.stop()  # never starts
    assert second.status == "stopped"
    first.stop()
    assert first.wait(timeout=60) == "stopped"
    assert third.wait(timeout=120) == "completed"
    assert second.status == "stopped" and second.layer_stats.empty
    assert last_step(third) == 5


def test_a_background_run_repeats_the_foreground_exactly(manager, tmp_path):
    config = RunConfig(depth=2, width=8, steps=10, dropout=0.1, seed=11)
    run = gradflow.train(config, background=True, store=manager.store)
    assert run.wait(timeout=120) == "completed"
    foreground = gradflow.train(config, store=tmp_path / "fg.db")
    columns = ["step", "layer_index", "max_abs", "l2_norm", "std", "update_ratio"]
    background = run.layer_stats
    assert len(background) == 10 * 6
    np.testing.assert_array_equal(
        background[columns].to_numpy(), foreground.layer_stats[columns].to_numpy()
    )


def test_a_killed_worker_is_reaped_and_its_run_interrupted(manager):
    import os
    import signal

    run = Run(manager.start(LONG), manager.store, manager)
    wait_for(lambda: last_step(run) > 0)
    pid = manager.running()[run.run_id]
    os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=30) == "interrupted"
    assert "killed by signal 9" in run.message
    assert run.run_id not in manager.running() and pid not in manager.worker_pids()


def run_pid(run):
    return run.store.run_info(run.run_id)["pid"]


def test_a_worker_trains_queued_runs_one_after_another_as_a_fresh_one_would(tmp_path):
    # Thirty queued runs must not pay TensorFlow's import thirty times, and a
    # used worker must train exactly as a new one: same layer names, same numbers.
    manager = RunManager(RunStore(tmp_path / "runs.db"), max_running=1, threads_per_run=1)
    try:
        config = RunConfig(depth=2, width=8, steps=6, dropout=0.1, seed=5)
        first, second = (Run(manager.start(config), manager.store, manager) for _ in range(2))
        assert (first.wait(120), second.wait(120)) == ("completed", "completed")
        assert run_pid(first) == run_pid(second)
        columns = ["step", "layer", "layer_index", "tensor", "max_abs", "l2_norm", "update_ratio"]
        pd.testing.assert_frame_equal(first.layer_stats[columns], second.layer_stats[columns])
        assert first.layer_stats["layer"].iloc[0] == second.layer_stats["layer"].iloc[0]
        # No spare was started beside the runs (the one slot was busy, and its
        # worker took the next run); the worker waits as the spare now.
        assert manager.worker_pids() == [run_pid(first)]
        third = Run(manager.start(RunConfig(depth=1, width=4, steps=3)), manager.store, manager)
        assert third.wait(120) == "completed" and run_pid(third) == run_pid(first)
    finally:
        manager.shutdown()


def test_a_worker_is_replaced_after_runs_per_worker_runs_and_after_a_failed_run(tmp_path):
    manager = RunManager(RunStore(tmp_path / "runs.db"), max_running=1, runs_per_worker=2)
    data = tmp_path / "gone.npz"
    np.savez(data, x=np.zeros((20, 3), "float32"), y=np.zeros(20, "int64"))
    short = RunConfig(depth=1, width=4, steps=2)
    try:
        runs = [Run(manager.start(short), manager.store, manager) for _ in range(3)]
        failing = RunConfig(depth=1, width=4, steps=2, dataset="file", data_path=str(data))
        data.unlink()  # The worker cannot read it: the run fails there.
        runs.append(Run(manager.start(failing), manager.store, manager))
        runs.append(Run(manager.start(short), manager.store, manager))
        assert [run.wait(120) for run in runs] == ["completed"] * 3 + ["failed", "completed"]
        pids = [run_pid(run) for run in runs]
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        # The retired workers exited and were reaped; no process is left behind.
        wait_for(lambda: set(manager.worker_pids()) <= {pids[4]}, timeout=30)
        for pid in pids[:4]:
            assert not pathlib.Path(f"/proc/{pid}").exists()
    finally:
        manager.shutdown()
    assert manager.worker_pids() == []


def test_a_run_handed_out_after_the_waiting_worker_was_killed_still_trains(tmp_path):
    import os
    import signal

    manager = RunManager(RunStore(tmp_path / "runs.db"), max_running=1, threads_per_run=1)
    try:
        first = Run(manager.start(RunConfig(depth=1, width=4, steps=2)), manager.store, manager)
        assert first.wait(120) == "completed"
        wait_for(lambda: manager.worker_pids() == [run_pid(first)], timeout=10)
        os.kill(run_pid(first), signal.SIGKILL)  # the warm worker, between runs
        second = Run(manager.start(RunConfig(depth=1, width=4, steps=2)), manager.store, manager)
        assert second.wait(120) == "completed" and run_pid(second) != run_pid(first)
    finally:
        manager.shutdown()


def test_the_next_spare_waits_for_the_new_runs_first_step(tmp_path):
    # Importing TensorFlow in a new spare would compete with the run's first trace.
    # (One run per worker: a reused worker needs no new spare while the slot is busy.)
    manager = RunManager(
        RunStore(tmp_path / "runs.db"), max_running=1, threads_per_run=1, runs_per_worker=1
    )
    try:
        assert manager.wait_warm(120)
        run = Run(manager.start(LONG), manager.store, manager)
        assert manager.worker_pids() == [manager.running()[run.run_id]]  # no spare yet
        wait_for(lambda: last_step(run) > 0)
        wait_for(lambda: len(manager.worker_pids()) == 2, timeout=5)  # the spare is back
        run.stop()
        assert run.wait(60) == "stopped"
    finally:
        manager.shutdown()


def thread_niceness(pid):
    """The niceness of every thread of process `pid` (Linux: /proc/PID/task/*/stat)."""
    import pathlib

    values = []
    for stat in pathlib.Path(f"/proc/{pid}/task").glob("*/stat"):
        fields = stat.read_text().rsplit(")", 1)[1].split()
        values.append(int(fields[16]))  # Field 19 of stat(5); fields[0] is field 3.
    return values


def test_workers_train_at_the_niceness_asked_for(tmp_path):
    import os

    manager = RunManager(RunStore(tmp_path / "runs.db"), max_running=1, worker_niceness=7)
    try:
        assert manager.wait_warm(120)
        expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
        # Every thread, TensorFlow's pools included, since they start after the nice.
        (spare,) = manager.worker_pids()
        niceness = thread_niceness(spare)
        assert len(niceness) > 3 and set(niceness) == {expected}
        run = Run(manager.start(RunConfig(depth=1, width=4, steps=5)), manager.store, manager)
        assert run.wait(60) == "completed"
    finally:
        manager.shutdown()


@pytest.mark.parametrize("value", [-1, 20, 2.5, True, "10"])
def test_a_bad_worker_niceness_names_the_argument(tmp_path, value):
    with pytest.raises(
        ValueError, match=r"`worker_niceness` must be an integer from 0 .* to 19 .*got"
    ):
        RunManager(RunStore(tmp_path / "runs.db"), prewarm=False, worker_niceness=value)


def test_no_spare_is_said_to_warm_while_the_busy_slot_will_hand_over_its_worker(tmp_path):
    # With reused workers and the one slot busy, no spare is started, and the
    # dashboard must not say "Warming up the trainer" meanwhile.
    manager = RunManager(RunStore(tmp_path / "runs.db"), max_running=1, threads_per_run=1)
    try:
        assert manager.warming()  # the first spare imports TensorFlow
        assert manager.wait_warm(120) and not manager.warming()
        run = Run(manager.start(LONG), manager.store, manager)
        wait_for(lambda: last_step(run) > 0)
        time.sleep(1.0)  # several looks of the manager's thread
        assert not manager.warming() and not manager.wait_warm(0)
        assert manager.worker_pids() == [run_pid(run)]
        run.stop()
        assert run.wait(60) == "stopped"
        wait_for(lambda: manager.wait_warm(0), timeout=10)  # its worker is the spare now
    finally:
        manager.shutdown()


# A worker as RunManager starts it, with its warm-up reported on stderr and an
# exit handler of the user's kind (a log flushed at exit) that must still run.
WORKER = """
import atexit, pathlib, sys
import gradflow.lab.worker as worker
worker._warm_up = lambda: print("warm-up", file=sys.stderr, flush=True)
atexit.register(lambda: pathlib.Path(sys.argv[1]).write_text("exit handlers ran"))
worker.quick_exit(worker.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("handed_at_start", [True, False], ids=["run-waiting", "spare"])
def test_a_worker_warms_up_only_as_a_spare_and_ends_after_its_exit_handlers(
    tmp_path, handed_at_start
):
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run(RunConfig(depth=1, width=4, steps=5).to_dict(), status="queued")
    marker = tmp_path / "exit.txt"
    root = str(pathlib.Path(gradflow.__file__).resolve().parent.parent)
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(marker), "--db", str(store.path), "--runs", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    if handed_at_start:  # As RunManager hands a queued run to the worker it starts for it.
        worker.stdin.write(run_id + "\n")
        worker.stdin.flush()
    assert worker.stdout.readline().split() == ["ready"]
    if not handed_at_start:
        worker.stdin.write(run_id + "\n")
        worker.stdin.flush()
    assert worker.stdout.readline().split() == ["done", run_id, "completed"]
    # With its stdin still open: at end-of-file its lifeline would end it at once (status 3).
    assert worker.wait(timeout=60) == 0
    errors = worker.stderr.read()
    worker.stdin.close()
    assert ("warm-up" in errors) is not handed_at_start
    assert marker.read_text() == "exit handlers ran"
    assert store.status(run_id) == "completed"
    assert store.layer_stats(run_id, columns=["l2_norm"])["step"].max() == 5
