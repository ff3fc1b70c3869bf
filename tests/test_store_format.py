"""Run-store format: columnar layer_stats blocks, upgrade of version-1 files, kill -9 of a writer."""

import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from gradflow.store import RunStore, tables

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The tables that versions 1 and 2 made alike (meta, runs, series; metrics, events,
# histograms, requests), frozen here so that upgrades are tested against real old
# files rather than against today's DDL.
_V1_V2_RUNS = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (
    id INTEGER PRIMARY KEY, run_id TEXT NOT NULL UNIQUE, name TEXT NOT NULL,
    status TEXT NOT NULL, source TEXT NOT NULL, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, heartbeat_at REAL, progress_step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER, tags TEXT NOT NULL DEFAULT '[]', message TEXT,
    config TEXT NOT NULL DEFAULT '{}', pid INTEGER, host TEXT
);
CREATE TABLE series (
    run INTEGER NOT NULL, series INTEGER NOT NULL, layer TEXT NOT NULL,
    layer_index INTEGER NOT NULL, tensor TEXT NOT NULL, variable TEXT NOT NULL,
    PRIMARY KEY (run, series)
) WITHOUT ROWID;
"""
_V1_V2_ROWS = """
CREATE TABLE metrics (
    run INTEGER NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL,
    PRIMARY KEY (run, step, name)
) WITHOUT ROWID;
CREATE TABLE events (
    id INTEGER PRIMARY KEY, run INTEGER NOT NULL, step INTEGER NOT NULL,
    layer TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL
);
CREATE INDEX events_by_run ON events (run, step);
CREATE TABLE histograms (
    run INTEGER NOT NULL, step INTEGER NOT NULL, series INTEGER NOT NULL,
    counts BLOB NOT NULL, PRIMARY KEY (run, step, series)
) WITHOUT ROWID;
CREATE TABLE requests (
    id INTEGER PRIMARY KEY, run INTEGER NOT NULL, action TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX requests_by_run ON requests (run, id);
"""

# The tables of schema version 1 as gradflow 0.1 made them.
V1_DDL = (
    _V1_V2_RUNS
    + """
CREATE TABLE layer_stats (
    run INTEGER NOT NULL, step INTEGER NOT NULL, series INTEGER NOT NULL,
    max_abs REAL, l2_norm REAL, mean_abs REAL, std REAL, zero_fraction REAL, nonfinite REAL,
    weight_norm REAL, weight_norm_unconstrained REAL, update_ratio REAL,
    l2_norm_clipped REAL, max_abs_clipped REAL,
    PRIMARY KEY (run, step, series)
) WITHOUT ROWID;
"""
    + _V1_V2_ROWS
    + "INSERT INTO meta VALUES ('schema_version', '1');\n"
)


def write_v1_store(path, stats_rows):
    """A version-1 file: run "aaaaaaaaaaaa" with two kernels, an activation from step 2."""
    conn = sqlite3.connect(path)
    conn.executescript(V1_DDL)
    conn.execute(
        "INSERT INTO runs (id, run_id, name, status, source, created_at, updated_at) "
        "VALUES (1, 'aaaaaaaaaaaa', 'old run', 'completed', 'lab', 0, 0)"
    )
    conn.executemany(
        "INSERT INTO series VALUES (1, ?, ?, ?, ?, ?)",
        [
            (0, "dense", 0, "kernel", "seq/dense/kernel"),
            (1, "dense_1", 1, "kernel", "seq/dense_1/kernel"),
            (2, "dense", 0, "activation", ""),
        ],
    )
    conn.executemany(
        "INSERT INTO layer_stats (run, step, series, max_abs, l2_norm, nonfinite) "
        "VALUES (1, ?, ?, ?, ?, ?)",
        stats_rows,
    )
    conn.execute("INSERT INTO metrics VALUES (1, 1, 'loss', 0.5)")
    conn.commit()
    conn.close()


V1_ROWS = [
    # step, series, max_abs, l2_norm (NULL is how version 1 stored NaN), nonfinite
    (2, 2, 7.0, 8.0, 0),
    (1, 1, 3.0, None, 0),
    (1, 0, 1.0, 2.0, 0),
    (2, 0, float("inf"), None, 4),
    (2, 1, 5.0, 6.0, 0),
]


# The tables of schema version 2 as gradflow made them until it kept a record of
# deleted runs.
V2_DDL = (
    _V1_V2_RUNS
    + """
CREATE TABLE layer_stats (
    id INTEGER PRIMARY KEY, run INTEGER NOT NULL, last_step INTEGER NOT NULL,
    steps BLOB NOT NULL, series BLOB NOT NULL,
    max_abs BLOB NOT NULL, l2_norm BLOB NOT NULL, mean_abs BLOB NOT NULL, std BLOB NOT NULL,
    zero_fraction BLOB NOT NULL, nonfinite BLOB NOT NULL, weight_norm BLOB NOT NULL,
    weight_norm_unconstrained BLOB NOT NULL, update_ratio BLOB NOT NULL,
    l2_norm_clipped BLOB NOT NULL, max_abs_clipped BLOB NOT NULL
);
CREATE INDEX layer_stats_by_step ON layer_stats (run, last_step);
"""
    + _V1_V2_ROWS
    + "INSERT INTO meta VALUES ('schema_version', '2');\n"
)


def write_v2_store(path):
    """A version-2 file in WAL mode: run "bbbbbbbbbbbb" with one block of two rows and a loss."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.executescript(V2_DDL)
    conn.execute(
        "INSERT INTO runs (id, run_id, name, status, source, created_at, updated_at) "
        "VALUES (1, 'bbbbbbbbbbbb', 'last term', 'completed', 'lab', 100.0, 100.0)"
    )
    conn.execute(
        "INSERT INTO series VALUES (1, 0, 'dense', 0, 'kernel', 'seq/dense/kernel'), "
        "(1, 1, 'dense', 0, 'bias', 'seq/dense/bias')"
    )
    values = np.array([1.5, 2.5]).astype("<f8").tobytes()
    conn.execute(
        f"INSERT INTO layer_stats (run, last_step, steps, series, {', '.join(tables.STAT_COLUMNS)})"
        f" VALUES (1, 1, ?, ?, {', '.join('?' * len(tables.STAT_COLUMNS))})",
        (
            np.array([1, 1], dtype="<i8").tobytes(),
            np.array([0, 1], dtype="<i4").tobytes(),
            *[values] * len(tables.STAT_COLUMNS),
        ),
    )
    conn.execute("INSERT INTO metrics VALUES (1, 1, 'loss', 0.5)")
    conn.close()


def _schema_version(path):
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    finally:
        conn.close()


def test_version_2_file_is_upgraded_on_open_and_remembers_its_deletions(store_path):
    write_v2_store(store_path)
    store = RunStore(store_path)
    assert _schema_version(store_path) == str(tables.SCHEMA_VERSION) == "3"
    stats = store.layer_stats("bbbbbbbbbbbb")
    assert stats["tensor"].astype(str).tolist() == ["kernel", "bias"]
    assert stats["max_abs"].tolist() == [1.5, 2.5]
    assert store.metrics("bbbbbbbbbbbb")["value"].tolist() == [0.5]
    store.delete("bbbbbbbbbbbb")
    conn = sqlite3.connect(store_path)
    assert conn.execute("SELECT run_id, name, created_at FROM deleted_runs").fetchall() == [
        ("bbbbbbbbbbbb", "last term", 100.0)
    ]
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    conn.close()


def test_a_version_2_file_this_process_may_only_read_is_read_as_it_is(store_path, monkeypatch):
    """Its upgrade is a write: a dashboard serving last term's store from a read-only
    disk would fail every page ("attempt to write a readonly database"). What writes it
    says that it can only be read, not that its new table is missing."""
    from gradflow.store.transfer import copy_runs

    write_v2_store(store_path)
    alice = store_path.with_name("alice.db")
    RunStore(alice).create_run({}, name="alice's", status="completed")
    connect = sqlite3.connect

    def read_only(database, *args, uri=False, **kwargs):  # as SQLite opens a read-only file
        if not uri and database != ":memory:":
            database, uri = f"file:{database}?mode=ro", True
        return connect(database, *args, uri=uri, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", read_only)
    store = RunStore(store_path)
    assert store.runs()["name"].tolist() == ["last term"]
    assert store.layer_stats("bbbbbbbbbbbb")["max_abs"].tolist() == [1.5, 2.5]
    for write in (lambda: store.delete("bbbbbbbbbbbb"), lambda: copy_runs(alice, store_path)):
        with pytest.raises(sqlite3.OperationalError, match="attempt to write a readonly database"):
            write()
    monkeypatch.undo()
    assert _schema_version(store_path) == "2"
    RunStore(store_path)  # where it may be written, the next open upgrades it
    assert _schema_version(store_path) == "3"


def test_version_1_file_is_upgraded_on_open_with_the_same_frames(store_path):
    write_v1_store(store_path, V1_ROWS)
    store = RunStore(store_path)
    got = store.layer_stats("aaaaaaaaaaaa", columns=["max_abs", "l2_norm", "nonfinite"])
    expected = pd.DataFrame(
        {
            "step": [1, 1, 2, 2, 2],
            "layer": ["dense", "dense_1", "dense", "dense_1", "dense"],
            "layer_index": [0, 1, 0, 1, 0],
            "tensor": ["kernel", "kernel", "kernel", "kernel", "activation"],
            "variable": [
                "seq/dense/kernel",
                "seq/dense_1/kernel",
                "seq/dense/kernel",
                "seq/dense_1/kernel",
                "",
            ],
            "max_abs": [1.0, 3.0, np.inf, 5.0, 7.0],
            "l2_norm": [2.0, np.nan, np.nan, 6.0, 8.0],
            "nonfinite": [0.0, 0.0, 4.0, 0.0, 0.0],
        }
    )
    pd.testing.assert_frame_equal(
        got.astype({c: str for c in ("layer", "tensor", "variable")}),
        expected.astype({c: str for c in ("layer", "tensor", "variable")}),
    )
    assert store.layer_stats("aaaaaaaaaaaa")["update_ratio"].isna().all()
    assert store.metrics("aaaaaaaaaaaa")["value"].tolist() == [0.5]

    conn = sqlite3.connect(store_path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
        str(tables.SCHEMA_VERSION),
    )
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "layer_stats_v1" not in names
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)

    # The upgraded run takes new rows; known series keep their ids.
    with store.writer("aaaaaaaaaaaa") as w:
        w.add_layer_stats(
            [
                {
                    "step": 3,
                    "layer": "dense",
                    "layer_index": 0,
                    "tensor": "kernel",
                    "variable": "seq/dense/kernel",
                    "max_abs": 9.0,
                }
            ]
        )
    again = RunStore(store_path).layer_stats("aaaaaaaaaaaa", after_step=2)
    assert again[["step", "max_abs"]].values.tolist() == [[3, 9.0]]
    assert conn.execute("SELECT COUNT(*) FROM series").fetchone() == (3,)


def test_version_1_file_that_cannot_be_upgraded_is_left_as_it_was(store_path):
    # A statistic that is not a number cannot become a float64 block.
    write_v1_store(store_path, V1_ROWS + [(3, 0, "not a number", 1.0, 0)])
    with pytest.raises(
        RuntimeError, match=rf"runs\.db.*version 1 to {tables.SCHEMA_VERSION}.*unchanged"
    ):
        RunStore(store_path)
    conn = sqlite3.connect(store_path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("1",)
    assert conn.execute("SELECT COUNT(*) FROM layer_stats").fetchone() == (6,)


def test_the_command_line_says_an_upgrade_failed_in_one_line(store_path, capsys):
    """Every store of the last version is upgraded at its first open by this one: one that
    cannot be ended `gradflow runs` with a traceback."""
    from gradflow import cli

    write_v1_store(store_path, V1_ROWS + [(3, 0, "not a number", 1.0, 0)])
    assert cli.main(["runs", "--db", str(store_path)]) == cli.EXIT_FAILED
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("gradflow: Could not upgrade the run store")
    assert "unchanged" in said[0] and "Traceback" not in said[0]


def test_newer_file_is_refused_with_its_path(store_path):
    RunStore(store_path)
    conn = sqlite3.connect(store_path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    with pytest.raises(RuntimeError, match=r"runs\.db.*version 99.*Upgrade gradflow"):
        RunStore(store_path)


def test_values_round_trip_bit_for_bit_across_blocks(store_path):
    store = RunStore(store_path)
    run_id = store.create_run({})
    special = [np.nan, np.inf, -np.inf, -0.0, 5e-324, 1.7976931348623157e308, 1e-300, 0.1]
    steps = np.arange(1, tables.BLOCK_ROWS)  # more rows than one block: 2 series per step
    rng = np.random.default_rng(1)
    values = rng.choice(special, size=(2 * len(steps), len(tables.STAT_COLUMNS)))
    rows = pd.DataFrame(
        {
            "step": np.repeat(steps, 2),
            "layer": ["dense"] * (2 * len(steps)),
            "layer_index": 0,
            "tensor": np.tile(["kernel", "bias"], len(steps)),
            "variable": np.tile(["d/kernel", "d/bias"], len(steps)),
        }
    )
    for j, column in enumerate(tables.STAT_COLUMNS):
        rows[column] = values[:, j]
    with store.writer(run_id) as w:
        w.add_layer_stats(rows)
    got = store.layer_stats(run_id)
    np.testing.assert_array_equal(
        got[list(tables.STAT_COLUMNS)].to_numpy().view(np.int64), values.view(np.int64)
    )
    assert (got.dtypes[list(tables.STAT_COLUMNS)] == np.float64).all()
    assert got["step"].tolist() == rows["step"].tolist()


def test_series_that_appear_mid_run_keep_their_steps_and_order(store_path):
    store = RunStore(store_path)
    run_id = store.create_run({})

    def rows(step, tensors):
        return [
            {
                "step": step,
                "layer": layer,
                "layer_index": i,
                "tensor": tensor,
                "variable": "" if tensor == "activation" else f"{layer}/{tensor}",
                "max_abs": 100 * step + 10 * i + len(tensor),
            }
            for i, layer in enumerate(["dense", "dense_1"])
            for tensor in tensors
        ]

    w = store.writer(run_id, background_flush=False)
    w.add_layer_stats(rows(1, ["kernel"]))
    w.flush()
    w.add_layer_stats(rows(2, ["kernel", "activation"]))  # activations from step 2 on
    w.flush()
    w.add_layer_stats(rows(3, ["activation"]) + rows(3, ["kernel"]))  # another order
    w.close()
    got = store.layer_stats(run_id)
    assert got.groupby("step").size().tolist() == [2, 4, 4]
    # Within a step, in the order the series were first written.
    assert got.loc[got["step"] == 3, ["layer", "tensor"]].astype(str).values.tolist() == [
        ["dense", "kernel"],
        ["dense_1", "kernel"],
        ["dense", "activation"],
        ["dense_1", "activation"],
    ]
    expected = [
        100 * s + 10 * i + len(t)
        for s, i, t in zip(got["step"], got["layer_index"], got["tensor"].astype(str), strict=True)
    ]
    assert got["max_abs"].tolist() == expected
    active = store.layer_stats(run_id, tensors="activation", after_step=2)
    assert active[["step", "layer_index"]].values.tolist() == [[3, 0], [3, 1]]


@pytest.mark.parametrize("after_step", [None, 0, 1, 2, 3, 4, 5])
def test_after_step_polls_match_filtering_a_full_read(store_path, after_step):
    store = RunStore(store_path)
    run_id = store.create_run({})
    w = store.writer(run_id, background_flush=False)
    for step in range(1, 6):
        w.add_layer_stats(
            [
                {"step": step, "layer": "d", "layer_index": 0, "tensor": t, "max_abs": step}
                for t in ("kernel", "bias")
            ]
        )
        if step in (3, 5):  # blocks of steps 1-3 and 4-5: a poll reads part of a block
            w.flush()
    w.close()
    full = store.layer_stats(run_id)
    polled = store.layer_stats(run_id, after_step=after_step)
    expected = full if after_step is None else full[full["step"] > after_step]
    pd.testing.assert_frame_equal(polled, expected.reset_index(drop=True))


def test_rewritten_steps_read_back_once_with_the_latest_values(store_path):
    # Version 1 replaced a (step, series) row written twice; blocks must too,
    # also when steps arrive out of order.
    store = RunStore(store_path)
    run_id = store.create_run({})
    w = store.writer(run_id, background_flush=False)

    def row(step, value):
        return {"step": step, "layer": "d", "layer_index": 0, "tensor": "kernel", "l2_norm": value}

    w.add_layer_stats([row(2, 20.0), row(1, 10.0), row(2, 21.0)])
    w.flush()
    w.add_layer_stats([row(1, 11.0), row(3, 30.0)])
    w.close()
    got = store.layer_stats(run_id, columns=["l2_norm"])
    assert got[["step", "l2_norm"]].values.tolist() == [[1, 11.0], [2, 21.0], [3, 30.0]]
    assert store.layer_stats(run_id, after_step=1)["l2_norm"].tolist() == [21.0, 30.0]


WRITER = textwrap.dedent(
    """
    import sys
    from gradflow.store import RunStore

    store = RunStore(sys.argv[1])
    writer = store.writer(sys.argv[2], flush_interval=0.05)
    step = 0
    while True:
        step += 1
        writer.add_layer_stats(
            [{"step": step, "layer": f"dense_{i}", "layer_index": i, "tensor": t,
              "max_abs": step + i / 10} for i in range(3) for t in ("kernel", "bias")]
        )
        if step % 50 == 0:
            writer.flush()
            print(step, flush=True)
    """
)


def test_kill_9_of_a_writer_keeps_every_flushed_step_whole(store_path, tmp_path):
    store = RunStore(store_path)
    run_id = store.create_run({})
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    child = subprocess.Popen(
        [sys.executable, str(script), str(store_path), run_id],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        flushed = [int(child.stdout.readline()) for _ in range(5)]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert flushed[-1] == 250
    got = store.layer_stats(run_id, columns=["max_abs"])
    per_step = got.groupby("step").size()
    # Every step the writer had flushed is there, and no step is torn in half
    # (the background flushes after the last printed one may add more).
    assert per_step.index.min() == 1 and per_step.index.max() >= flushed[-1]
    np.testing.assert_array_equal(per_step.index, np.arange(1, per_step.index.max() + 1))
    assert (per_step == 6).all()
    np.testing.assert_array_equal(got["max_abs"], got["step"] + got["layer_index"] / 10)
    conn = sqlite3.connect(store_path)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
