"""Crash safety with real kills: a killed worker, a killed launcher, no orphans."""

import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np

from gradflow.lab.config import RunConfig
from gradflow.store import RunStore
from gradflow.store.store import process_alive

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONG = RunConfig(depth=2, width=8, steps=1_000_000)


def env():
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def wait_for(condition, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def recorded_steps(store, run_id):
    return store.layer_stats(run_id, columns=["l2_norm"])


def test_killed_worker_keeps_its_flushed_rows_and_is_recovered_as_interrupted(store_path):
    store = RunStore(store_path)
    run_id = store.create_run(LONG.to_dict(), status="queued")
    worker = subprocess.Popen(
        [sys.executable, "-m", "gradflow.lab.worker", "--db", str(store_path), "--no-warm-up"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env(),
        text=True,
    )
    worker.stdin.write(run_id + "\n")
    worker.stdin.flush()
    wait_for(lambda: recorded_steps(store, run_id)["step"].max() >= 5)
    time.sleep(0.3)
    seen = recorded_steps(store, run_id)
    assert store.status(run_id) == "running"
    assert store.recover() == []  # alive and heartbeating: left alone

    os.kill(worker.pid, signal.SIGKILL)
    # Not reaped on purpose: a zombie must count as dead, too.
    time.sleep(0.2)
    assert store.recover() == [run_id]
    worker.wait()
    info = store.run_info(run_id)
    assert info["status"] == "interrupted" and f"pid {worker.pid}" in info["message"]

    after = recorded_steps(store, run_id)
    series = after.groupby("step").size()
    assert after["step"].max() >= seen["step"].max()  # everything read before is still there
    np.testing.assert_array_equal(series.index, np.arange(1, series.index.max() + 1))
    assert (series == series.iloc[0]).all()  # whole steps only: one transaction per flush
    conn = sqlite3.connect(store_path)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from gradflow.lab.config import RunConfig
    from gradflow.lab.runner import RunManager
    from gradflow.store import RunStore

    store = RunStore(sys.argv[1])
    # Two slots: with one busy, a new run could start at once, so the next
    # spare starts once the run has made its first step.
    manager = RunManager(store, max_running=2, threads_per_run=1)
    run_id = manager.start(RunConfig(depth=2, width=8, steps=1_000_000))
    while store.layer_stats(run_id, columns=["l2_norm"]).empty:
        time.sleep(0.05)
    while len(manager.worker_pids()) < 2:
        time.sleep(0.05)
    print(run_id, *manager.worker_pids(), flush=True)
    time.sleep(600)
    """
)


def test_killed_launcher_takes_its_workers_along(store_path, tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(store_path)],
        stdout=subprocess.PIPE,
        env=env(),
        text=True,
    )
    try:
        line = launcher.stdout.readline().split()
    finally:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
    run_id, pids = line[0], [int(p) for p in line[1:]]
    assert len(pids) == 2  # the run's worker and the warm spare

    # Both workers see their stdin close and exit; none is left behind.
    wait_for(lambda: not any(process_alive(pid) for pid in pids), timeout=30)
    store = RunStore(store_path)
    store.recover()
    info = store.run_info(run_id)
    assert info["status"] == "interrupted", info
    assert not recorded_steps(store, run_id).empty
