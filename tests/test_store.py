"""Run store: round trips, live polling, control requests, recovery, schema version."""

import math
import os
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from gradflow import schema
from gradflow.store import RunStore, UnknownRunError, tables


def tidy_rows(steps, layers=("dense", "dense_1"), tensors=("kernel", "bias")):
    rows = []
    for step in steps:
        for index, layer in enumerate(layers):
            for tensor in tensors:
                rows.append(
                    {
                        "step": step,
                        "layer": layer,
                        "layer_index": index,
                        "tensor": tensor,
                        "variable": f"model/{layer}/{tensor}",
                        "max_abs": step + index + 0.5,
                        "l2_norm": 2.0 * step,
                        "nonfinite": 0,
                    }
                )
    return pd.DataFrame(rows)


@pytest.fixture
def store(store_path):
    return RunStore(store_path)


def test_layer_stats_round_trip_with_names_and_missing_columns(store):
    run_id = store.create_run({"depth": 2})
    rows = tidy_rows([1, 2, 3])
    with store.writer(run_id) as w:
        w.add_layer_stats(rows)
    got = store.layer_stats(run_id)
    assert list(got.columns) == list(schema.LAYER_STATS_COLUMNS)
    assert len(got) == len(rows)
    pd.testing.assert_frame_equal(
        got[["step", "layer_index", "max_abs", "l2_norm", "nonfinite"]],
        rows[["step", "layer_index", "max_abs", "l2_norm", "nonfinite"]].astype(
            {"nonfinite": "float64", "l2_norm": "float64"}
        ),
    )
    assert got["layer"].astype(str).tolist() == rows["layer"].tolist()
    assert got["variable"].astype(str).tolist() == rows["variable"].tolist()
    # Columns the writer was not given come back as NaN.
    assert got["update_ratio"].isna().all() and got["update_ratio"].dtype == np.float64


def test_array_rows_store_the_same_as_a_frame(store):
    # GradientMonitor's fast path: arrays in, the same tidy table out, also
    # when a later call mixes known series with a new one.
    rows = tidy_rows([1, 2, 3])
    rows.loc[4, "max_abs"] = np.nan
    rows.loc[7, "l2_norm"] = np.inf
    series = list(
        rows[["layer", "layer_index", "tensor", "variable"]].head(4).itertuples(index=False)
    )
    values = rows.reindex(columns=list(tables.STAT_COLUMNS)).to_numpy(np.float64).reshape(3, 4, -1)
    from_frame, from_arrays = store.create_run({}), store.create_run({})
    with store.writer(from_frame) as w:
        w.add_layer_stats(rows)
        w.add_layer_stats(tidy_rows([4], layers=("dense_2",)))
    with store.writer(from_arrays) as w:
        w.add_layer_stats_array(rows["step"].unique(), values, series)
        extra = tidy_rows([4], layers=("dense_2",))
        w.add_layer_stats_array(
            [4],
            extra.reindex(columns=list(tables.STAT_COLUMNS)).to_numpy(np.float64)[np.newaxis],
            list(extra[["layer", "layer_index", "tensor", "variable"]].itertuples(index=False)),
        )
    pd.testing.assert_frame_equal(store.layer_stats(from_arrays), store.layer_stats(from_frame))
    assert np.isnan(store.layer_stats(from_arrays)["max_abs"].iloc[4])
    with (
        store.writer(from_arrays) as w,
        pytest.raises(ValueError, match=r"`values` must have the shape"),
    ):
        w.add_layer_stats_array([5, 6], values, series)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 0.0, 1e-300, 1.7e308])
def test_non_finite_values_round_trip(store, value):
    run_id = store.create_run({})
    rows = tidy_rows([1])
    rows["max_abs"] = value
    with store.writer(run_id) as w:
        w.add_layer_stats(rows)
        w.add_metrics(1, {"loss": value})
    got = store.layer_stats(run_id)["max_abs"].to_numpy()
    loss = store.metrics(run_id)["value"].to_numpy()
    for array in (got, loss):
        if math.isnan(value):
            assert np.isnan(array).all()
        else:
            assert (array == value).all()


def test_nan_after_many_missing_rows_still_reads_as_float(store):
    # A column that is NaN for whole blocks and then has a value must still
    # come back as float64, with the value where it was written.
    run_id = store.create_run({})
    rows = tidy_rows(range(1, 1500))  # more than one block
    rows["max_abs_clipped"] = np.nan
    rows.loc[rows.index[-1], "max_abs_clipped"] = 3.25
    with store.writer(run_id) as w:
        w.add_layer_stats(rows)
    got = store.layer_stats(run_id, columns=["max_abs_clipped"])
    assert got["max_abs_clipped"].dtype == np.float64
    assert got["max_abs_clipped"].iloc[-1] == 3.25
    assert got["max_abs_clipped"].iloc[:-1].isna().all()


@pytest.mark.parametrize(
    "after_step, tensors, expected_steps, expected_tensors",
    [
        (None, None, [1, 2, 3, 4], {"kernel", "bias"}),
        (2, None, [3, 4], {"kernel", "bias"}),
        (4, None, [], set()),
        (None, ["kernel"], [1, 2, 3, 4], {"kernel"}),
        (3, "bias", [4], {"bias"}),
        (None, ["gamma"], [], set()),
    ],
)
def test_layer_stats_filters(store, after_step, tensors, expected_steps, expected_tensors):
    run_id = store.create_run({})
    with store.writer(run_id) as w:
        w.add_layer_stats(tidy_rows([1, 2, 3, 4]))
    got = store.layer_stats(run_id, after_step=after_step, tensors=tensors)
    assert sorted(set(got["step"])) == expected_steps
    assert set(got["tensor"].astype(str)) == expected_tensors
    assert got["step"].dtype == np.int64 and got["max_abs"].dtype == np.float64


def test_tensor_filter_takes_a_kind_for_a_recurrent_cell(store):
    run_id = store.create_run({})
    rows = pd.concat(
        [
            tidy_rows(
                [1], layers=("rnn",), tensors=("rnn_cell/kernel", "rnn_cell/recurrent_kernel")
            ),
            tidy_rows([1], layers=("out",), tensors=("kernel",)).assign(layer_index=1),
        ]
    )
    with store.writer(run_id) as w:
        w.add_layer_stats(rows)
    got = store.layer_stats(run_id, tensors=["kernel"])
    assert sorted(got["tensor"].astype(str)) == ["kernel", "rnn_cell/kernel"]


def test_columns_selects_statistics_and_rejects_unknown(store):
    run_id = store.create_run({})
    with store.writer(run_id) as w:
        w.add_layer_stats(tidy_rows([1]))
    got = store.layer_stats(run_id, columns=["l2_norm"])
    assert list(got.columns) == list(schema.KEY_COLUMNS) + ["l2_norm"]
    with pytest.raises(ValueError, match="`columns`.*'loss'"):
        store.layer_stats(run_id, columns=["loss"])


def test_events_and_histograms(store):
    run_id = store.create_run({})
    counts = np.arange(schema.HISTOGRAM_BINS)
    with store.writer(run_id) as w:
        w.add_layer_stats(tidy_rows([1]))
        w.add_histograms(1, [("dense", 0, "kernel", counts), ("dense_1", 1, "kernel", counts * 2)])
        w.add_histograms(2, [("dense", 0, "kernel", counts + 1)])
        w.add_event(2, "dense_1", "nonfinite", "first NaN in dense_1/kernel")
        with pytest.raises(ValueError, match="`kind`"):
            w.add_event(2, "dense_1", "oops", "no")
        with pytest.raises(ValueError, match=r"shape \(34,\)"):
            w.add_histograms(3, [("dense", 0, "kernel", counts[:3])])
    hist = store.histograms(run_id)
    assert len(hist) == 3
    bins = [f"b{i}" for i in range(schema.HISTOGRAM_BINS)]
    np.testing.assert_array_equal(
        hist.loc[hist["layer"] == "dense_1", bins].to_numpy()[0], counts * 2
    )
    one = store.histograms(run_id, layer="dense", after_step=1)
    assert one["step"].tolist() == [2]
    np.testing.assert_array_equal(one[bins].to_numpy()[0], counts + 1)
    assert store.histograms(run_id, tensor="bias").empty
    events = store.events(run_id)
    assert events.to_dict("records") == [
        {
            "step": 2,
            "layer": "dense_1",
            "kind": "nonfinite",
            "message": "first NaN in dense_1/kernel",
        }
    ]


def test_progress_is_never_behind_the_newest_statistics(store):
    # The live page skips reading statistics while a run's progress stands
    # still, so a writer that is never told the progress must still keep it.
    run_id = store.create_run({})
    with store.writer(run_id) as w:
        w.add_layer_stats(tidy_rows([1, 2, 5]))
    assert store.run_info(run_id)["progress_step"] == 5
    with store.writer(run_id) as w:
        w.add_layer_stats_array(
            [7, 8], np.zeros((2, 1, len(tables.STAT_COLUMNS))), [("dense", 0, "kernel", "")]
        )
        w.progress(6)  # behind the statistics: ignored
    assert store.run_info(run_id)["progress_step"] == 8
    with store.writer(run_id) as w:
        w.progress(20)  # trained past the last recorded step: kept
    assert store.run_info(run_id)["progress_step"] == 20


def test_a_batch_reaches_readers_in_one_transaction(store_path):
    writer_store, reader = RunStore(store_path), RunStore(store_path)
    run_id = writer_store.create_run({})
    writer = writer_store.writer(run_id, flush_interval=0.05)
    try:
        with writer.batch():
            # A run's first rows wake the flush thread at once; inside a
            # batch it must wait for the loss of the same step.
            writer.add_layer_stats(tidy_rows([1]))
            time.sleep(0.5)
            assert reader.layer_stats(run_id).empty
            writer.add_metrics(1, {"loss": 0.25})
        deadline = time.monotonic() + 10
        while reader.layer_stats(run_id).empty:
            assert time.monotonic() < deadline, "the batch never reached the store"
            time.sleep(0.02)
        assert reader.metrics(run_id)["value"].tolist() == [0.25]
        assert reader.run_info(run_id)["progress_step"] == 1
    finally:
        writer.close()


def test_a_reader_sees_series_added_after_it_first_read(store_path):
    writer_store, reader = RunStore(store_path), RunStore(store_path)
    run_id = writer_store.create_run({})
    counts = np.arange(schema.HISTOGRAM_BINS)
    with writer_store.writer(run_id) as w:
        w.add_layer_stats(tidy_rows([1], layers=("dense",)))
        w.add_histograms(1, [("dense", 0, "kernel", counts)])
    assert set(reader.layer_stats(run_id)["layer"].astype(str)) == {"dense"}
    assert len(reader.histograms(run_id)) == 1
    # Activation rows, say, start later with new series.
    with writer_store.writer(run_id) as w:
        w.add_layer_stats(tidy_rows([2], layers=("dense", "out"), tensors=("kernel", "activation")))
        w.add_histograms(2, [("out", 1, "activation", counts * 3)])
    new = reader.layer_stats(run_id, after_step=1, tensors=["activation"])
    assert new["layer"].astype(str).tolist() == ["dense", "out"]
    assert new["tensor"].astype(str).tolist() == ["activation", "activation"]
    hist = reader.histograms(run_id, after_step=1)
    assert hist["layer"].astype(str).tolist() == ["out"]
    np.testing.assert_array_equal(
        hist[[f"b{i}" for i in range(schema.HISTOGRAM_BINS)]].to_numpy()[0], counts * 3
    )


def test_a_new_run_in_a_deleted_runs_place_gets_its_own_names(store):
    old = store.create_run({})
    with store.writer(old) as w:
        w.add_layer_stats(tidy_rows([1], layers=("conv", "pool")))
    assert set(store.layer_stats(old)["layer"].astype(str)) == {"conv", "pool"}
    old_key = store._key(old)
    store.delete(old)
    new = store.create_run({})
    # SQLite hands the freed row id to the next run: the cached series of
    # the deleted run must not name the new run's rows.
    assert store._key(new) == old_key
    with store.writer(new) as w:
        w.add_layer_stats(tidy_rows([1], layers=("dense", "dense_1")))
    assert set(store.layer_stats(new)["layer"].astype(str)) == {"dense", "dense_1"}


def test_runs_listing_rename_tag_delete(store):
    first = store.create_run({"a": 1}, name="relu", total_steps=10, tags=["demo"])
    second = store.create_run({"a": 2}, source="monitor")
    runs = store.runs()
    assert runs["run_id"].tolist() == [second, first]
    assert runs.loc[runs["run_id"] == first, "total_steps"].item() == 10
    store.rename(first, "sigmoid")
    store.tag(first, ["b", "a", "a"])
    info = store.run_info(first)
    assert (info["name"], info["tags"], info["config"]) == ("sigmoid", ["a", "b"], {"a": 1})
    with store.writer(first) as w:
        w.add_layer_stats(tidy_rows([1]))
        w.add_metrics(1, {"loss": 1.0})
    store.delete(first)
    assert store.runs()["run_id"].tolist() == [second]
    with pytest.raises(UnknownRunError, match=first):
        store.layer_stats(first)
    conn = sqlite3.connect(store.path)
    assert conn.execute("SELECT COUNT(*) FROM layer_stats").fetchone() == (0,)


def _runs_seen_by_another_process(path):
    """The run names another process reads from the store (it opens and closes it)."""
    code = (
        "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
        "print(sorted(r[0] for r in c.execute('SELECT name FROM runs'))); c.close()"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_opening_the_store_again_keeps_this_processs_writes(store):
    """A notebook that opened the store twice (a RunStore, then a monitor on
    the same file) lost its later writes: the path check read the file with
    `open`, and closing that descriptor dropped the process's SQLite locks, so
    another process's close (the dashboard, `gradflow runs`) took the
    write-ahead log away under it."""
    store.create_run({}, name="first")
    RunStore(store.path)  # checks the path again, as `GradientMonitor(store=path)` does
    assert _runs_seen_by_another_process(store.path) == "['first']"
    store.create_run({}, name="second")
    assert _runs_seen_by_another_process(store.path) == "['first', 'second']"
    assert sorted(store.runs()["name"]) == ["first", "second"]


class _FailingDisk:
    """A connection whose INSERT fails the way a full or failing disk does:
    SQLite rolls the transaction back itself and reports the I/O error."""

    def __init__(self, conn):
        self._conn = conn

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def execute(self, sql, *args):
        if sql.startswith("INSERT"):
            self._conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)


def test_a_failed_write_says_what_failed_not_that_it_could_not_roll_back(store):
    store._local.conn = _FailingDisk(store._conn())
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        store.create_run({})
    store._local.conn = store._local.conn._conn
    assert store.runs().empty
    store.create_run({}, name="after")  # the connection is usable again


def test_several_runs_are_deleted_together_or_not_at_all(store):
    first, second, third = (store.create_run({}, name=n) for n in ("a", "b", "c"))
    with pytest.raises(UnknownRunError, match="0123456789ab"):
        store.delete(first, "0123456789ab")
    assert len(store.runs()) == 3
    store.delete(first, third)
    assert store.runs()["run_id"].tolist() == [second]


def _write_long_run(store, steps=3_000):
    run_id = store.create_run({})
    with store.writer(run_id) as w:
        w.add_layer_stats(tidy_rows(range(1, steps + 1), layers=[f"dense_{i}" for i in range(8)]))
    return run_id


def _file_size(store):
    """The store's file size once its write-ahead log is written back into it."""
    with sqlite3.connect(store.path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return os.path.getsize(store.path)


def test_deleting_a_run_gives_its_space_back(store):
    """A teacher deleting last term's runs saw the file stay as large (117 MB
    where 4.6 MB were in use)."""
    kept = _write_long_run(store, steps=300)
    small = _file_size(store)
    gone = _write_long_run(store)
    large = _file_size(store)
    assert large > 5 * small
    store.delete(gone)
    assert _file_size(store) < 1.5 * small
    assert len(store.layer_stats(kept)) == 300 * 16


def test_compact_gives_an_older_stores_space_back_and_its_deletes_then_do(store):
    run_id = _write_long_run(store)
    # A store made before incremental auto-vacuum: rewritten without it.
    with sqlite3.connect(store.path) as conn:
        conn.execute("PRAGMA auto_vacuum = NONE")
        conn.execute("VACUUM")
        assert conn.execute("PRAGMA auto_vacuum").fetchone() == (0,)
    old = RunStore(store.path)
    large = _file_size(old)
    old.delete(run_id)
    assert _file_size(old) == large  # the pages are free, the file as large
    before, after = old.compact()
    assert before >= large and after < large / 5 and _file_size(old) == after
    again = _write_long_run(old)
    large = _file_size(old)
    old.delete(again)
    assert _file_size(old) < large / 5
    assert old.runs().empty


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s, r: s.layer_stats("../etc"), "`run_id`"),
        (lambda s, r: s.metrics(42), "`run_id`"),
        (lambda s, r: s.set_status(r, "done"), "`status`"),
        (lambda s, r: s.request(r, "rewind"), "`action`"),
        (lambda s, r: s.rename(r, " "), "`name`"),
        (lambda s, r: s.set_total_steps(r, -1), "`total_steps`"),
        (lambda s, r: s.set_total_steps(r, 2.5), "`total_steps`"),
        (lambda s, r: s.create_run({}, source="web"), "`source`"),
        (lambda s, r: s.create_run([1]), "`config`"),
        (lambda s, r: s.writer(r, flush_interval=0), "`flush_interval`"),
    ],
)
def test_errors_name_the_argument(store, call, match):
    run_id = store.create_run({})
    with pytest.raises((ValueError, TypeError), match=match):
        call(store, run_id)


def test_requests_are_consumed_in_order(store):
    run_id = store.create_run({})
    other = store.create_run({})
    assert store.pending_request(run_id) is None
    for action in ("pause", "step", "resume", "stop"):
        store.request(run_id, action)
    store.request(other, "stop")
    assert store.pending_request(run_id, consume=False) == "pause"
    got = [store.pending_request(run_id) for _ in range(5)]
    assert got == ["pause", "step", "resume", "stop", None]
    assert store.pending_request(other) == "stop"


def test_recover_marks_runs_of_dead_processes_and_stale_heartbeats(store):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = store.create_run({}, pid=gone.pid)
    queued_dead = store.create_run({}, pid=gone.pid, status="queued")
    alive = store.create_run({})  # this process
    finished = store.create_run({}, pid=gone.pid)
    store.set_status(finished, "completed")
    stale = store.create_run({})
    busy = store.create_run({})  # alive here: a long step is no reason to give up on it
    conn = sqlite3.connect(store.path)
    conn.execute(
        "UPDATE runs SET heartbeat_at = ?, host = 'elsewhere' WHERE run_id = ?",
        (time.time() - 120, stale),
    )
    conn.execute("UPDATE runs SET heartbeat_at = ? WHERE run_id = ?", (time.time() - 120, busy))
    conn.commit()
    # What a server checks every 30 s: this host's runs, by their process, only.
    assert sorted(store.recover(stale_after=60, other_hosts=False)) == sorted([dead, queued_dead])
    assert store.status(stale) == "running"
    assert store.recover(stale_after=60) == [stale]
    assert store.status(dead) == "interrupted"
    assert f"pid {gone.pid}" in store.run_info(dead)["message"]
    assert "heartbeat" in store.run_info(stale)["message"]
    assert (store.status(alive), store.status(finished)) == ("running", "completed")
    assert store.status(busy) == "running"
    assert store.recover() == []


def test_background_flush_makes_rows_visible_without_flush(store):
    run_id = store.create_run({})
    w = store.writer(run_id, flush_interval=0.1)
    w.add_layer_stats(tidy_rows([1]))
    w.progress(1)
    reader = RunStore(store.path)
    deadline = time.monotonic() + 5
    while reader.layer_stats(run_id).empty and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(reader.layer_stats(run_id)) == 4
    assert reader.run_info(run_id)["progress_step"] == 1
    w.close(status="completed", message="done")
    assert reader.run_info(run_id)["message"] == "done"


def test_time_based_flush_on_add_without_thread(store):
    run_id = store.create_run({})
    w = store.writer(run_id, flush_interval=0.2, background_flush=False)
    w.add_metrics(1, {"loss": 1.0})
    assert store.metrics(run_id).empty  # buffered
    time.sleep(0.25)
    w.add_metrics(2, {"loss": 0.5})  # the interval passed: this add writes both
    assert store.metrics(run_id)["step"].tolist() == [1, 2]
    w.close()


def test_reader_in_another_process_sees_committed_rows(store):
    run_id = store.create_run({})
    with store.writer(run_id) as w:
        w.add_layer_stats(tidy_rows([1, 2]))
    code = (
        "import sys; from gradflow.store import RunStore; "
        f"df = RunStore({str(store.path)!r}).layer_stats({run_id!r}, after_step=1); "
        "print(len(df), sorted(set(df['step'])), 'tensorflow' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.stdout.split() == ["4", "[2]", "False"]


def test_newer_schema_is_refused(store_path):
    RunStore(store_path)
    conn = sqlite3.connect(store_path)
    conn.execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(tables.SCHEMA_VERSION + 1),)
    )
    conn.commit()
    with pytest.raises(RuntimeError, match="newer gradflow"):
        RunStore(store_path)


def test_default_path_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADFLOW_DB", str(tmp_path / "x" / "env.db"))
    assert RunStore().path == tmp_path / "x" / "env.db"
    monkeypatch.delenv("GRADFLOW_DB")
    monkeypatch.chdir(tmp_path)
    assert str(RunStore().path) == os.path.join("gradflow-data", "runs.db")


def test_arrow_reads_is_still_accepted_and_reads_the_same_frames(tmp_path):
    # `arrow_reads=True` is kept for existing callers; since schema version 2
    # every read goes through sqlite3 (see RunStore's docstring).
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({"depth": 2}, name="same either way")
    rows = pd.DataFrame(
        {
            "step": [1, 1, 2, 2],
            "layer": ["a", "b", "a", "b"],
            "layer_index": [0, 1, 0, 1],
            "tensor": ["kernel"] * 4,
            "variable": ["a/kernel", "b/kernel"] * 2,
            "max_abs": [1.0, np.nan, np.inf, 2.0],
            "l2_norm": [3.0, 4.0, -np.inf, 5.0],
        }
    )
    with store.writer(run_id) as writer:
        writer.add_layer_stats(rows)
    plain = store.layer_stats(run_id)
    arrow = RunStore(tmp_path / "runs.db", arrow_reads=True).layer_stats(run_id)
    pd.testing.assert_frame_equal(plain, arrow)
    assert np.isnan(plain["max_abs"].iloc[1]) and np.isposinf(plain["max_abs"].iloc[2])


def test_an_sqlite_file_of_something_else_is_refused_and_left_alone(tmp_path):
    """`gradflow runs --db contacts.db` added the store's tables beside the contacts."""
    from gradflow.store import RunStore
    from gradflow.store.store import NotARunStoreError

    path = tmp_path / "contacts.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE contacts (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(
        NotARunStoreError, match=r"SQLite database of something else \(its tables: contacts\)"
    ):
        RunStore(path)
    conn = sqlite3.connect(path)
    tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    conn.close()
    assert tables == ["contacts"]
    # An empty SQLite file, and a store, are taken.
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    store = RunStore(empty)
    store.create_run({})
    assert len(RunStore(empty).runs()) == 1


def test_numpy_integers_are_stored_as_numbers_and_bad_counts_are_refused(tmp_path):
    """`heartbeat(run, step=np.int64(5))` was stored as an 8-byte blob: every later
    `runs()` and `recover()` of the file failed, for every run in it."""
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, total_steps=np.int64(10), pid=np.int32(os.getpid()))
    store.heartbeat(run_id, step=np.int64(5))
    store.set_status(run_id, "running", pid=np.int64(os.getpid()), only_from="running")
    store.set_total_steps(run_id, np.int64(12))
    runs = store.runs()
    assert runs.loc[0, "progress_step"] == 5 and runs.loc[0, "total_steps"] == 12
    assert store.recover() == []
    assert len(store.layer_stats(run_id, after_step=np.int64(0))) == 0
    for call, name, value in [
        (lambda v: store.heartbeat(run_id, step=v), "step", "abc"),
        (lambda v: store.heartbeat(run_id, step=v), "step", 2.5),
        (lambda v: store.heartbeat(run_id, step=v), "step", -1),
        (lambda v: store.set_status(run_id, "running", pid=v), "pid", "x"),
        (lambda v: store.create_run({}, total_steps=v), "total_steps", True),
        (lambda v: store.create_run({}, total_steps=v), "total_steps", 10**30),
        (lambda v: store.set_total_steps(run_id, v), "total_steps", -5),
        (lambda v: store.metrics(run_id, after_step=v), "after_step", float("nan")),
        (lambda v: store.set_status(run_id, "running", message=v), "message", object()),
    ]:
        with pytest.raises(ValueError, match=f"`{name}` must be"):
            call(value)
    assert store.runs()["progress_step"].tolist() == [5]  # nothing half-written


def test_switches_take_only_true_or_false(tmp_path):
    """`pending_request(run, consume="no")` consumed the request; bool("no") is True."""
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({})
    store.request(run_id, "pause")
    with pytest.raises(ValueError, match="`consume` must be True or False, got 'no'"):
        store.pending_request(run_id, consume="no")
    assert store.pending_request(run_id, consume=False) is not None
    with pytest.raises(ValueError, match="`arrow_reads` must be True or False"):
        RunStore(tmp_path / "runs.db", arrow_reads="no")
    # train(background="no") started a worker process.
    import gradflow

    with pytest.raises(ValueError, match="`background` must be True or False, got 'no'"):
        gradflow.train(gradflow.RunConfig(steps=1), background="no", store=store)
    assert len(store.runs()) == 1


def test_a_store_this_process_may_only_read_is_read(tmp_path, monkeypatch):
    """Every new connection set the file's auto-vacuum, a write: on a store the server
    may only read, every page failed with "attempt to write a readonly database"."""
    path = tmp_path / "runs.db"
    run_id = RunStore(path).create_run({"depth": 2}, name="last term", status="completed")
    connect = sqlite3.connect

    def read_only(database, *args, uri=False, **kwargs):  # as SQLite opens a read-only file
        if not uri:
            database, uri = f"file:{database}?mode=ro", True
        return connect(database, *args, uri=uri, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", read_only)
    store = RunStore(path)
    assert store.runs()["name"].tolist() == ["last term"]
    assert store.run_info(run_id)["config"] == {"depth": 2} and store.recover() == []
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        store.rename(run_id, "this term")


def test_a_run_deleted_while_it_trains_leaves_no_rows_for_the_next_run(tmp_path):
    """The worker's next write put a step-58 block and four metrics under the deleted
    run's row number; the next run got that number back and showed them as its own
    ("loss 2.212 (at step 58)" on a 40-step run)."""
    store = RunStore(tmp_path / "runs.db")
    doomed = store.create_run({}, name="deleted while training")
    writer = store.writer(doomed, background_flush=False)
    writer.add_layer_stats(tidy_rows([1]))
    writer.flush()
    store.delete(doomed)
    writer.add_layer_stats(tidy_rows([58]))
    writer.add_metrics(58, {"loss": 2.212})
    writer.progress(58)
    writer.close(status="completed")
    assert writer.run_deleted
    fresh = store.create_run({}, name="next")
    assert store.layer_stats(fresh).empty and store.metrics(fresh).empty
    assert store.run_info(fresh)["progress_step"] == 0
    conn = sqlite3.connect(tmp_path / "runs.db")
    for table in ("layer_stats", "metrics", "series"):
        assert conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone() == (0,), table


def test_a_store_file_moved_away_is_said_gone_not_made_again_empty(tmp_path):
    """Moved or deleted under a running server, the file was made again, empty, by the
    next thread's connection: every page failed with "no such table: runs" while the
    runs went on into the moved file."""
    import threading

    from gradflow.store import StoreGoneError

    path = tmp_path / "runs.db"
    store = RunStore(path)
    run_id = store.create_run({}, name="before")
    path.rename(tmp_path / "moved.db")
    failures = []

    def read_from_another_thread():  # each thread has its own connection
        try:
            store.runs()
        except StoreGoneError as error:
            failures.append(str(error))

    thread = threading.Thread(target=read_from_another_thread)
    thread.start()
    thread.join()
    assert failures and "is gone: it was moved or deleted" in failures[0]
    assert str(path) in failures[0] and not path.exists()
    with pytest.raises(StoreGoneError):
        store.writer(run_id)
    assert store.runs()["name"].tolist() == ["before"]  # a connection made before still reads it


def test_run_names_are_at_most_200_characters_as_a_run_configs(tmp_path):
    """`rename`, `GradientMonitor(run_name=...)` and `train(name=...)` took 10,000
    characters while RunConfig caps a name at 200."""
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, name="x" * 200)
    with pytest.raises(ValueError, match="`name` must be at most 200 characters, got 10,000"):
        store.rename(run_id, "y" * 10_000)
    # A name made from settings is shortened: refused, it failed an A/B launch.
    long = store.create_run({}, name="z" * 201)
    assert store.run_info(long)["name"] == "z" * 199 + "…"
    store.delete(long)
    from gradflow import GradientMonitor

    # A script's name made from settings too: KerasTuner's `str(hp.values)` failed every trial.
    GradientMonitor(run_name="m" * 201)
    assert store.runs()["name"].tolist() == ["x" * 200]
