"""A run store in trouble: a full disk, a lock, a damaged or newer file, a run deleted mid-fit.

Each test began as a fault of the store audit (forty-third session). A full
disk is SQLite's own: `PRAGMA max_page_count` at the file's size makes the
next write fail with SQLITE_FULL ("database or disk is full"), as a full disk
does, without mounting one. The promise: training is never killed by the
store, nothing recorded is lost, and what went wrong is said in words.
"""

import pathlib
import shutil
import sqlite3
import threading
import warnings

import keras
import numpy as np
import pytest

from gradflow import GradientMonitor
from gradflow.cli import main
from gradflow.store import RunStore, tables
from gradflow.store.trouble import explain

REPO = pathlib.Path(__file__).resolve().parent.parent
NO_LIMIT = 1_073_741_823  # SQLite's largest max_page_count


class DiskFull(keras.callbacks.Callback):
    """Fills the store's "disk" after step `at`, and frees it after step `until`."""

    def __init__(self, monitor, at, until=None):
        super().__init__()
        self.monitor, self.at, self.until = monitor, at, until

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step == self.at:
            fill(self.monitor._writer._conn)
        if step == self.until:
            self.monitor._writer._conn.execute(f"PRAGMA max_page_count = {NO_LIMIT}")
        if self.at <= step:
            # Slow enough that the writer's half-second ticks meet the full disk.
            threading.Event().wait(0.03)


def fill(conn):
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")


def fitted(tmp_path, *callbacks_after, epochs=2, monitor=None, model=None):
    """A 60-step fit (2 epochs) of a small classifier with a monitor storing to tmp_path/runs.db."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 5)).astype("float32")
    y = rng.integers(0, 3, 240)
    if model is None:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)]
        )
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    monitor = monitor or GradientMonitor(store=tmp_path / "runs.db")
    callbacks = [monitor] + [make(monitor) for make in callbacks_after]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)
    return model, monitor, [str(w.message) for w in caught if "GradientMonitor" in str(w.message)]


def test_a_disk_full_for_a_while_loses_nothing_and_is_told_once(tmp_path):
    """Nothing was said while the disk was full; the rows waited and were written later."""
    model, monitor, said = fitted(tmp_path, lambda m: DiskFull(m, at=5, until=40))
    told = [s for s in said if "cannot write run" in s]
    assert len(told) == 1
    assert "is full: free some space there" in told[0] and "Training goes on" in told[0]
    store = RunStore(tmp_path / "runs.db")
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["progress_step"]) == ("completed", 60)
    assert sorted(store.layer_stats(monitor.run_id)["step"].unique()) == list(range(1, 61))


def test_a_disk_still_full_when_fit_ends_lets_fit_return_and_flush_writes_the_rest(tmp_path):
    """`fit` ended in a bare "sqlite3.OperationalError: database or disk is full" after
    training, the user's next line never ran, and the run stayed "running"."""
    model, monitor, said = fitted(tmp_path, lambda m: DiskFull(m, at=5))
    assert int(model.optimizer.iterations.numpy()) == 60  # `fit` returned
    assert sorted(monitor.history["step"].unique()) == list(range(1, 61))
    ending = [s for s in said if "could not write the end of run" in s]
    assert len(ending) == 1 and "Call `monitor.flush()`" in ending[0]
    store = RunStore(tmp_path / "runs.db")
    assert store.run_info(monitor.run_id)["status"] == "running"
    writer = monitor._unwritten[0][0]
    with pytest.raises(RuntimeError, match="still cannot write run .* is full"):
        monitor.flush()
    writer._conn.execute(f"PRAGMA max_page_count = {NO_LIMIT}")  # space freed
    monitor.flush()
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["progress_step"]) == ("completed", 60)
    assert sorted(store.layer_stats(monitor.run_id)["step"].unique()) == list(range(1, 61))
    monitor.flush()  # nothing left: a no-op


class DeleteRun(keras.callbacks.Callback):
    """Deletes the monitor's run from another connection (the dashboard's Delete) at step 3."""

    def __init__(self, monitor):
        super().__init__()
        self.monitor = monitor

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == 3:
            RunStore(self.monitor._store.path).delete(self.monitor.run_id)


def test_a_run_deleted_while_its_script_trains_only_warns(tmp_path):
    """With EarlyStopping, `fit` ended in UnknownRunError at its end; without, nothing was said."""
    stop = lambda m: keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0)  # noqa: E731
    model, monitor, said = fitted(tmp_path, DeleteRun, stop, epochs=5)
    assert int(model.optimizer.iterations.numpy()) == 60  # stopped after 2 epochs of 30
    assert sorted(monitor.history["step"].unique()) == list(range(1, 61))
    assert [s for s in said if "was deleted from the run store" in s]
    assert len(RunStore(tmp_path / "runs.db").runs()) == 0


def store_with_runs(path, runs=12):
    store = RunStore(path)
    for number in range(runs):
        run_id = store.create_run({"depth": 2}, name=f"run {number}", status="completed")
        with store.writer(run_id) as writer:
            for step in range(1, 150):
                writer.add_metrics(step, {"loss": 1.0 / step})
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return store


def damaged(path):
    """A store cut in half (a copy that stopped, a disk that failed)."""
    # Closed before the cut: while a connection of this process is open, SQLite
    # keeps the '-shm' index of the whole file and reads past the cut as zeros.
    # Left to the garbage collector, the test's outcome hung on when it ran
    # (in this file's order it had by then on Python 3.12, not on 3.13).
    store_with_runs(path).close()
    size = path.stat().st_size
    with open(path, "r+b") as file:
        file.truncate(size // 2)
    return path


def test_explain_says_what_real_sqlite_failures_mean(tmp_path):
    path = tmp_path / "runs.db"
    store_with_runs(path, runs=1)
    errors = {}
    conn = tables.connect(path)
    fill(conn)
    with pytest.raises(sqlite3.OperationalError) as full:
        conn.execute("INSERT INTO metrics VALUES (1, 1, 'x', zeroblob(100000))")
    errors["full"] = full.value
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    with pytest.raises(sqlite3.OperationalError) as locked:
        # In WAL mode readers go on: a writer meets the lock.
        sqlite3.connect(path, timeout=0, isolation_level=None).execute("BEGIN IMMEDIATE")
    errors["locked"] = locked.value
    holder.execute("ROLLBACK")
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as read_only:
        reader.execute("DELETE FROM runs")
    errors["read-only"] = read_only.value
    with pytest.raises(sqlite3.DatabaseError) as broken:
        sqlite3.connect(damaged(tmp_path / "cut.db")).execute("SELECT * FROM metrics").fetchall()
    errors["damaged"] = broken.value
    said = {kind: explain(error, path) for kind, error in errors.items()}
    assert said["full"] == f"the disk that holds {str(path)!r} is full: free some space there"
    assert said["locked"].startswith(f"another program holds the lock of {str(path)!r}")
    assert said["read-only"].startswith(f"{str(path)!r} can only be read here")
    assert said["damaged"].startswith(f"{str(path)!r} is damaged (")
    assert "sqlite3" in said["damaged"] and ".recover" in said["damaged"]


def test_the_command_line_tells_a_damaged_store_from_one_that_is_not_a_store(tmp_path, capsys):
    """Every SQLite error read "is not a gradflow run store", exit 2 (a bad command line)."""
    path = damaged(tmp_path / "runs.db")
    assert main(["runs", "--db", str(path)]) == 1
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"gradflow: could not use the run store: {str(path)!r} is damaged")
    assert "not a gradflow run store" not in said
    text = tmp_path / "notes.db"
    text.write_text("my notes\n")
    assert main(["runs", "--db", str(text)]) == 2
    assert "is not a gradflow run store" in capsys.readouterr().err


def test_the_command_line_says_a_newer_store_in_one_line(tmp_path, capsys):
    """It printed a Python traceback around the right sentence, exit 1."""
    path = tmp_path / "runs.db"
    store_with_runs(path, runs=1)
    conn = sqlite3.connect(path)
    conn.execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version'", (tables.SCHEMA_VERSION + 1,)
    )
    conn.commit()
    conn.close()
    assert main(["runs", "--db", str(path)]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "written by a newer gradflow" in said[0], said


def dashboard_errors(tmp_path, make_store):
    """The errors the dashboard's first page shows on the store `make_store(path)` writes."""
    from streamlit.testing.v1 import AppTest

    from tests.conftest import pages_on

    with pages_on(tmp_path / "runs.db") as db:
        make_store(db)
        # The first page (a switch to pages/ could run the page without app.py:
        # Streamlit's first run of a script beside a pages/ folder is its
        # multipage v1 mode, set per process).
        app = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        app.run()
        assert not app.exception, [e.value for e in app.exception]
        return db, [e.value for e in app.error]


def test_a_damaged_store_is_said_in_words_on_the_dashboard(tmp_path):
    """Every page showed Streamlit's "This app has encountered an error"."""
    db, errors = dashboard_errors(
        tmp_path, lambda db: shutil.copy(damaged(tmp_path / "cut.db"), db)
    )
    assert any(
        e.startswith(f"gradflow cannot use its run store: {str(db)!r}") and "is damaged" in e
        for e in errors
    ), errors


def test_a_store_that_cannot_be_upgraded_is_said_in_words_on_the_dashboard(tmp_path):
    """A store of an older gradflow is upgraded at its first open; one that could not be
    showed Streamlit's "This app has encountered an error" on every page."""
    from tests.test_store_format import V1_ROWS, write_v1_store

    db, errors = dashboard_errors(
        tmp_path, lambda db: write_v1_store(db, V1_ROWS + [(3, 0, "not a number", 1.0, 0)])
    )
    assert any(
        e.startswith(f"Could not upgrade the run store {str(db)!r}") and "unchanged" in e
        for e in errors
    ), errors


def test_the_write_ahead_log_shrinks_after_an_outside_reader_lets_go(tmp_path, monkeypatch):
    """A reader left in a transaction made the '-wal' file grow, and it kept its largest
    size for as long as any connection was open (the store audit: 14 MB)."""
    monkeypatch.setattr(tables, "WAL_SIZE_LIMIT", 64 << 10, raising=False)
    path = tmp_path / "runs.db"
    store = RunStore(path)
    run_id = store.create_run({"depth": 2}, name="long")
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM runs").fetchone()  # holds its snapshot
    wal = path.with_name("runs.db-wal")
    with store.writer(run_id) as writer:
        for step in range(1, 3000):
            writer.add_metrics(step, {"loss": 1.0 / step, "accuracy": 0.5})
            if step % 500 == 0:
                writer.flush()
        writer.flush()
        grown = wal.stat().st_size
        reader.execute("COMMIT")
        reader.close()
        writer.add_metrics(3000, {"loss": 0.1})
    # The writer's close checkpointed everything: the next write starts the log again.
    store.set_status(run_id, "completed")
    assert grown > 256 << 10
    assert wal.stat().st_size <= 64 << 10, (grown, wal.stat().st_size)


class FlushAt(keras.callbacks.Callback):
    """Calls `monitor.flush()` at step `at` (a pause in the lab does)."""

    def __init__(self, monitor, at):
        super().__init__()
        self.monitor, self.at = monitor, at

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.at:
            self.monitor.flush()


def test_an_earlier_fits_unwritten_end_neither_stops_nor_overrides_a_later_fit(tmp_path):
    """The same monitor again while the store still owed the first fit's end: a `flush()`
    in the second fit raised and ended it, a second unwritten end dropped the first's rows,
    and the first fit's "completed" replaced the second's status when written (the review)."""
    model, monitor, _ = fitted(tmp_path, lambda m: DiskFull(m, at=5))
    first = monitor._unwritten[0][0]
    stop = lambda m: keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0)  # noqa: E731
    # Another connection: this fit's writer can write, the first's still cannot.
    _, _, said = fitted(
        tmp_path, lambda m: FlushAt(m, at=62), stop, epochs=3, monitor=monitor, model=model
    )
    assert any("still cannot write run" in message for message in said)
    store = RunStore(tmp_path / "runs.db")
    after_second = store.run_info(monitor.run_id)
    assert after_second["status"] == "completed"
    assert after_second["message"].startswith("Training ended at step 120 of the 150 planned")
    first._conn.execute(f"PRAGMA max_page_count = {NO_LIMIT}")  # space freed
    monitor.flush()
    assert not monitor._unwritten
    info = store.run_info(monitor.run_id)
    assert (info["status"], info["message"]) == ("completed", after_second["message"])
    assert sorted(store.layer_stats(monitor.run_id)["step"].unique()) == list(range(1, 121))


def test_a_copy_made_without_its_log_is_refused_and_left_as_it_was(tmp_path, capsys):
    """`cp runs.db` while the runs were still in `runs.db-wal` gave "No runs yet", and
    made empty tables in the copy, which the '-wal' brought after could not mend."""
    source = tmp_path / "runs.db"
    store = RunStore(source)
    run_id = store.create_run({"depth": 2}, name="still training")
    writer = store.writer(run_id)
    writer.add_metrics(1, {"loss": 0.5})
    writer.flush()  # in the '-wal' file: nothing has moved it into runs.db yet
    copy = tmp_path / "copy" / "runs.db"
    copy.parent.mkdir()
    shutil.copy(source, copy)
    before = copy.read_bytes()
    with pytest.raises(sqlite3.DatabaseError, match=r"copy made without its '-wal' file"):
        RunStore(copy)
    assert main(["runs", "--db", str(copy)]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "runs.db-wal" in said[0], said
    assert copy.read_bytes() == before  # nothing written to it
    # With its '-wal' beside it, the copy holds the run.
    shutil.copy(source.with_name("runs.db-wal"), copy.with_name("runs.db-wal"))
    assert list(RunStore(copy).runs()["run_id"]) == [run_id]
    writer.close()
    # A new store, and an empty file, are still made into stores.
    (tmp_path / "empty.db").touch()
    assert RunStore(tmp_path / "empty.db").runs().empty
    assert RunStore(tmp_path / "new.db").runs().empty


def test_a_copy_made_once_the_run_ended_reads_its_final_status(tmp_path):
    """With a reader holding the store open (the dashboard), a lab run's final status
    stayed in the '-wal' file: a copy of runs.db made after the run read `interrupted`."""
    source = tmp_path / "runs.db"
    store = RunStore(source)
    reader = RunStore(source)
    reader.runs()
    run_id = store.create_run({"depth": 2}, name="finished")
    with store.writer(run_id) as writer:
        writer.add_metrics(1, {"loss": 0.5})
    store.set_status(run_id, "completed", "Done.")  # after its writer closed, as the lab does
    store.rename(run_id, "finished, renamed")
    copy = tmp_path / "copy.db"
    shutil.copy(source, copy)  # the main file alone
    info = RunStore(copy).run_info(run_id)
    assert (info["status"], info["name"]) == ("completed", "finished, renamed")
    reader.close()


_OPEN_AT = """
import sys, time
from gradflow.store import RunStore
start = float(sys.argv[1])
for path in sys.argv[2:]:
    while time.time() < start:
        pass
    start += 0.3
    try:
        RunStore(path)
        print("ok")
    except Exception as error:
        print(type(error).__name__, error)
"""


def test_processes_opening_a_new_store_at_once_all_get_it(tmp_path):
    """The first process's switch to WAL wrote the file's first page before its tables:
    the others, opening the file in that moment, took it for a copy that lost its '-wal'
    (15 of 60 opens failed in the review's bursts of four)."""
    import subprocess
    import sys
    import time

    paths = [str(tmp_path / f"new-{i}.db") for i in range(8)]
    start = time.time() + 3.0  # after every process has imported gradflow.store
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AT, str(start), *paths],
            cwd=pathlib.Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    said = [process.communicate(timeout=120)[0].split("\n")[:-1] for process in processes]
    assert said == [["ok"] * len(paths)] * 4
