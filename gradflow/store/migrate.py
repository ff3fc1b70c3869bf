"""Upgrade a run store written by an older gradflow to the current format.

Each step is one transaction: a reader in another process sees the old format
or the new one, never half of each, and a process killed in the middle leaves
the old format in place, to be upgraded by the next open.
"""

import pathlib
import time

import numpy as np

from gradflow.store import blocks, tables, trouble
from gradflow.store.trouble import CopyWithoutLogError, NewerStoreError, StoreUpgradeError


def upgrade(conn, path, held_something=False, read_as_is=True):
    """Bring the store's tables to `tables.SCHEMA_VERSION`, creating them in a new file.

    Args:
        conn: a `sqlite3.Connection` from `tables.connect` (autocommit).
        path: the store's file, for messages.
        held_something: whether the file had bytes before `conn` opened it.
        read_as_is: leave a file of `tables.OLDEST_VERSION_READ_AS_IS` or
            later that this process may only read as it is, to be read so
            (default True). False for a caller about to write it: SQLite's
            read-only error is raised instead.

    Raises:
        NewerStoreError: a `RuntimeError`, if the file was written by a newer gradflow.
        StoreUpgradeError: a `RuntimeError`, if an upgrade failed (the file
            is then left as it was).
        sqlite3.OperationalError: if `read_as_is` is False and the file can
            only be read.
        CopyWithoutLogError: if the file had bytes but no tables: a copy of
            a store made without its '-wal' file. Nothing is written to it.
    """
    version = stored_version(conn)
    if version == tables.SCHEMA_VERSION:
        return  # The common case: no schema statements, no write lock.
    _refuse_newer(version, path)
    if version is None and held_something and not _tables_soon(conn):
        # Tables made in it would hide the loss ("No runs yet"), and a '-wal'
        # brought over afterwards could no longer be read with it.
        raise copy_without_log(path)
    try:
        with tables.write_transaction(conn):
            # Read again under the write lock: another process may have just done it.
            version = detected_version(conn)
            _refuse_newer(version, path)
            if version is None:
                tables.create_tables(conn)
            elif version == 1:
                _from_version_1(conn)
            elif version == 2:
                _from_version_2(conn)
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(tables.SCHEMA_VERSION),),
            )
    except BaseException as error:
        if (
            version is not None
            and version >= tables.OLDEST_VERSION_READ_AS_IS
            and trouble.cause(error) == "read-only"
        ):
            # Last term's store on a read-only disk: read as it is; the first
            # gradflow that may write it upgrades it.
            if read_as_is:
                return
            raise
        if version is None or not isinstance(error, Exception) or isinstance(error, RuntimeError):
            raise
        raise StoreUpgradeError(
            f"Could not upgrade the run store {str(path)!r} from schema version {version} to "
            f"{tables.SCHEMA_VERSION}: {error}. The file is unchanged; fix the cause (free disk "
            f"space, stop other gradflow processes using it) and open it again, or use another "
            f"store path (--db or $GRADFLOW_DB)."
        ) from error


def stored_version(conn):
    """The schema version recorded in the file, or None for a new (empty) store."""
    has_meta = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
    ).fetchone()
    if not has_meta:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


def detected_version(conn):
    """`stored_version`, or 1 for a version-1 file, which made its tables before it
    recorded its version; None for a new (empty) store."""
    version = stored_version(conn)
    if version is None and "step" in _columns(conn, "layer_stats"):
        return 1
    return version


def copy_without_log(path):
    """The `CopyWithoutLogError` for `path`: bytes, no tables (`RunStore` and `gradflow import`)."""
    path = pathlib.Path(path)
    return CopyWithoutLogError(
        f"The run store {str(path)!r} holds no tables though the file is not empty: it "
        f"looks like a copy made without its '-wal' file ({path.name}-wal), which holds "
        "the runs not yet moved into the main file. Copy the store again with that file "
        "beside it (all gradflow processes using it stopped), or copy it safely while it "
        "is in use with `gradflow import` (see `gradflow import --help`). If it is an "
        "empty store no run was ever written to, delete the file."
    )


def _any_table(conn):
    return conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is not None


# How long a new file without tables may wait for another process to make them.
_TABLES_WAIT_SECONDS = 2.0


def _tables_soon(conn):
    """Whether the store has tables, or another process makes them within a moment.

    Processes opening a new store at once: the first one's switch to WAL
    writes the file's first page before its transaction makes the tables,
    and the others found a file with bytes and no tables (the review: 15 of
    60 opens in a burst of four processes failed).
    """
    deadline = time.monotonic() + _TABLES_WAIT_SECONDS
    while not _any_table(conn):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _columns(conn, table):
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def _refuse_newer(version, path):
    if version is not None and version > tables.SCHEMA_VERSION:
        raise NewerStoreError(
            f"The run store {str(path)!r} has schema version {version}, written by a "
            f"newer gradflow; this gradflow reads up to version {tables.SCHEMA_VERSION}. "
            f"Upgrade gradflow, or use another store path (--db or $GRADFLOW_DB)."
        )


def _from_version_1(conn):
    """Version 1 kept one layer_stats row per step x series: repack it as blocks."""
    conn.execute("ALTER TABLE layer_stats RENAME TO layer_stats_v1")
    tables.create_tables(conn)
    columns = ", ".join(tables.STAT_COLUMNS)
    insert = (
        f"INSERT INTO layer_stats ({', '.join(blocks.INSERT_COLUMNS)}) "
        f"VALUES ({', '.join('?' * len(blocks.INSERT_COLUMNS))})"
    )
    runs = [r[0] for r in conn.execute("SELECT DISTINCT run FROM layer_stats_v1 ORDER BY run")]
    for run in runs:
        cursor = conn.execute(
            f"SELECT step, series, {columns} FROM layer_stats_v1 WHERE run = ? "
            f"ORDER BY step, series",
            (run,),
        )
        while rows := cursor.fetchmany(tables.BLOCK_ROWS):
            # NULL (how version 1 stored NaN) becomes NaN here.
            values = np.array([r[2:] for r in rows], dtype=np.float64)
            conn.executemany(
                insert,
                blocks.pack(
                    run,
                    np.array([r[0] for r in rows], dtype=np.int64),
                    np.array([r[1] for r in rows], dtype=np.int64),
                    values.reshape(len(rows), len(tables.STAT_COLUMNS)),
                ),
            )
    conn.execute("DROP TABLE layer_stats_v1")


def _from_version_2(conn):
    """Version 2 kept no record of deleted runs: add its table, empty."""
    tables.create_tables(conn)
