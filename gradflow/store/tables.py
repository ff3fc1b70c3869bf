"""On-disk format of the run store: schema version, tables, statuses, default path.

Kept apart from the reader and the writer so that both agree on one format,
as TensorBoard keeps its histogram format apart from its reader and writer.
"""

import contextlib
import os
import pathlib

from gradflow import schema

# Bump when a table changes shape. A store written by a newer gradflow is
# refused instead of being misread; an older one is upgraded on open (see
# `gradflow.store.migrate`).
# 1: one layer_stats row per step x series, one REAL column per statistic.
# 2: layer_stats in columnar blocks (see `gradflow.store.blocks`).
# 3: deleted_runs, the runs deleted from the store (importing one again skips it).
SCHEMA_VERSION = 3

# The oldest version whose tables this gradflow reads as they are. Version 3
# only added `deleted_runs`, which only a write uses (a delete, an import into
# the store): a version-2 store this process may only read is read without its
# upgrade, and a version-2 import source without an upgraded copy.
OLDEST_VERSION_READ_AS_IS = 2

STATUSES = (
    "queued",
    "running",
    "paused",
    "completed",
    "stopped",
    "diverged",
    "interrupted",
    "failed",
)
# A run in one of these has a process that owns it (or will soon).
ACTIVE_STATUSES = ("queued", "running", "paused")
FINAL_STATUSES = tuple(s for s in STATUSES if s not in ACTIVE_STATUSES)

SOURCES = ("lab", "monitor", "cli")
REQUESTS = ("pause", "resume", "stop", "step")
# A change of a run's speed limit is the request "pace <steps a second>",
# or "pace full" for full speed (`RunStore.request_pace`).
_PACE = "pace "


def pace_request(pace):
    """The request text that sets a run's pace (steps a second, or None for full speed)."""
    return _PACE + ("full" if pace is None else repr(float(pace)))


def requested_pace(action):
    """`(True, pace)` for a pace request (pace None: full speed), else `(False, None)`."""
    if not isinstance(action, str) or not action.startswith(_PACE):
        return False, None
    value = action[len(_PACE) :]
    return True, None if value == "full" else float(value)


# Statistic columns stored per layer_stats block, in this order.
STAT_COLUMNS = schema.STATISTICS + schema.EXTRA_COLUMNS

# The most tidy rows one layer_stats block holds. Small enough that a live
# poll of the newest step reads a few hundred kB, big enough that a million
# rows are a few hundred SQLite rows (a Python object per value, not the
# bytes, is what made the row-per-series format slow to read).
BLOCK_ROWS = 4096

_stat_ddl = ",\n    ".join(f"{name} BLOB NOT NULL" for name in STAT_COLUMNS)

# layer_stats holds columnar blocks: one SQLite row per run and up to
# BLOCK_ROWS tidy rows, with one little-endian array per column (`steps`
# int64, `series` int32, each statistic float64 with NaN and inf stored as
# they are). `id` is the write order: where two blocks hold the same step and
# series, the later one wins, as INSERT OR REPLACE did in version 1.
# `last_step` lets a live poll read only the blocks with newer rows.
#
# deleted_runs keeps one row per run deleted from this store (`RunStore.delete`),
# its name kept so that a person can tell which run an id was: `gradflow import`
# skips a run of the same run_id and created_at, unless told to restore it. It
# is this store's own record: an export does not copy it, nor does an import,
# but for a whole store moved into an empty one (`transfer.copy_runs`).
#
# Each statement apart, so that a migration can run them inside its own
# transaction (`executescript` would commit it first).
DDL = tuple(
    statement.strip()
    for statement in f"""
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    heartbeat_at REAL,
    progress_step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER,
    tags TEXT NOT NULL DEFAULT '[]',
    message TEXT,
    config TEXT NOT NULL DEFAULT '{{}}',
    pid INTEGER,
    host TEXT
);
CREATE TABLE IF NOT EXISTS series (
    run INTEGER NOT NULL,
    series INTEGER NOT NULL,
    layer TEXT NOT NULL,
    layer_index INTEGER NOT NULL,
    tensor TEXT NOT NULL,
    variable TEXT NOT NULL,
    PRIMARY KEY (run, series)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS layer_stats (
    id INTEGER PRIMARY KEY,
    run INTEGER NOT NULL,
    last_step INTEGER NOT NULL,
    steps BLOB NOT NULL,
    series BLOB NOT NULL,
    {_stat_ddl}
);
CREATE INDEX IF NOT EXISTS layer_stats_by_step ON layer_stats (run, last_step);
CREATE TABLE IF NOT EXISTS metrics (
    run INTEGER NOT NULL,
    step INTEGER NOT NULL,
    name TEXT NOT NULL,
    value REAL,
    PRIMARY KEY (run, step, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    run INTEGER NOT NULL,
    step INTEGER NOT NULL,
    layer TEXT NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run, step);
CREATE TABLE IF NOT EXISTS histograms (
    run INTEGER NOT NULL,
    step INTEGER NOT NULL,
    series INTEGER NOT NULL,
    counts BLOB NOT NULL,
    PRIMARY KEY (run, step, series)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    run INTEGER NOT NULL,
    action TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_by_run ON requests (run, id);
CREATE TABLE IF NOT EXISTS deleted_runs (
    run_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    deleted_at REAL NOT NULL
) WITHOUT ROWID;
""".split(";")
    if statement.strip()
)


def create_tables(conn):
    """Create the tables and indexes that do not exist yet (in the caller's transaction, if any).

    Args:
        conn: a `sqlite3.Connection` from `connect`.
    """
    for statement in DDL:
        conn.execute(statement)


def default_path():
    """Where the run store lives unless a path is given.

    Returns:
        `$GRADFLOW_DB` when set, else `./gradflow-data/runs.db`, as a `pathlib.Path`.
    """
    return pathlib.Path(os.environ.get("GRADFLOW_DB") or "gradflow-data/runs.db")


@contextlib.contextmanager
def write_transaction(conn):
    """`BEGIN IMMEDIATE` around the block, committed at its end, rolled back if it raises.

    A statement that fails may have ended the transaction itself (a full or
    failing disk): nothing is rolled back then, so SQLite's own error is the
    one raised, not "cannot rollback - no transaction is active".
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _into_wal_mode(conn, seconds=30.0):
    """`PRAGMA journal_mode = WAL`, waiting out another process that makes the file now.

    On a new file it needs a lock SQLite's busy handler does not wait for:
    processes opening a new store at once failed with "database is locked"
    on a loaded machine (2 of 32 opens beside a test run).
    """
    import sqlite3
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


# Bytes a '-wal' file is cut back to after a checkpoint empties it.
WAL_SIZE_LIMIT = 4 << 20


class StoreGoneError(RuntimeError):
    """The store's file was moved or deleted while a program had it open."""


def connect(path, create=True):
    """Open a SQLite connection to the store with the pragmas every user needs.

    WAL lets one writer per run and many readers in other processes work at the
    same time; `synchronous=NORMAL` keeps every committed transaction across a
    killed process (only a power cut may lose the last ones).

    Args:
        path: the database file.
        create: make the file if there is none (default). A store already
            opened passes False: SQLite would make a new, empty file where
            the old one was moved or deleted, and every page of the
            dashboard failed on it ("no such table: runs") while the runs
            went on into the moved file.

    Returns:
        A `sqlite3.Connection` in autocommit mode (transactions are explicit),
        usable from any thread that holds the caller's lock.

    Raises:
        StoreGoneError: if `create` is False and the file is not there.
    """
    import sqlite3

    if not create and not os.path.exists(path):
        raise StoreGoneError(
            f"The run store {str(path)!r} is gone: it was moved or deleted while gradflow had "
            "it open. Put it back, or restart gradflow to start a new store there."
        )

    conn = sqlite3.connect(str(path), timeout=30.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 30000")
    # Before WAL, which writes the file's first page: a new store is made
    # with incremental auto-vacuum, so that deleting a run gives its space
    # back (`RunStore.delete`); an older store gets it at its next VACUUM
    # (`RunStore.compact`). Only on an empty file: on a store the process
    # may only read, setting it failed every connection, and every page.
    if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    _into_wal_mode(conn)
    conn.execute("PRAGMA synchronous = NORMAL")
    # SQLite keeps a '-wal' file at its largest size while any connection is
    # open: one outside reader left in a transaction (a database browser)
    # grew it to 14 MB, kept for as long as the server ran.
    conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
    return conn
