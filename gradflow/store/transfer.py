"""Copy whole runs from one run store into another: hand a run over, or bring runs in.

A teacher collects the students' runs into one store, a practitioner trains on
a server and looks on a laptop, a student compares their run with a
classmate's on the Compare page, which shows the runs of one store. Copying a
live store file by file (`cp`) can leave its `-wal` file behind, and with it
the newest rows, or copy the file half written; these functions read the
source through SQLite, in one read transaction, and write the destination in
one write transaction.

Example:

```python
from gradflow.store.transfer import copy_runs, export_runs
copy_runs("alice.db", "class.db")                    # every run of alice.db, into class.db
export_runs("runs.db", "relu-run.db", ["3f2a9c1b7d04"])   # a new one-run store, to send
```

What is copied: each run's `runs` row and all its rows in `series`,
`layer_stats`, `metrics`, `events` and `histograms`. Not its `requests` (a
Pause or Stop meant for the process that trains it in the source store). The
source's `deleted_runs` (its own deletions) only when the whole store moves
into a store that holds no runs and no deletions yet (a new machine, a new
file): its deletions go with it, so that a student's store imported again
later does not bring back what was deleted before the move. A run deleted
from the destination is not copied again unless `restore_deleted` says so.
"""

import contextlib
import dataclasses
import os
import pathlib
import shlex
import shutil
import sqlite3
import tempfile
import time

from gradflow.checks import flag
from gradflow.store import migrate, source_checks, tables, trouble
from gradflow.store.source_checks import UntrustedStoreError
from gradflow.store.store import (
    _RUN_ID,
    _RUNS_COLUMNS,
    MAX_NAME_LENGTH,
    RunStore,
    UnknownRunError,
    check_name,
    check_store_path,
    shortened,
)
from gradflow.store.trouble import NewerStoreError, NotARunStoreError

__all__ = [
    "RunCopies",
    "RunCopy",
    "RunIdConflictError",
    "SourceStoreError",
    "UntrustedStoreError",
    "copy_runs",
    "export_runs",
    "open_read_only",
]

# The tables of a run's rows, with the columns copied (the `run` key apart),
# in the order they are read. Tables with an `id` are read in its order and
# renumbered by the destination: `layer_stats.id` is the write order (the
# later of two blocks with the same step and series wins), `events.id` the
# order of events within a step.
RUN_TABLES = (
    ("series", ("series", "layer", "layer_index", "tensor", "variable"), "series"),
    ("layer_stats", ("last_step", "steps", "series", *tables.STAT_COLUMNS), "id"),
    ("metrics", ("step", "name", "value"), "step, name"),
    ("events", ("step", "layer", "kind", "message"), "id"),
    ("histograms", ("step", "series", "counts"), "step, series"),
)

# The `runs` columns copied as they are (its `id` is the destination's): what
# `RunStore.runs()` reads, and the config.
RUN_COLUMNS = (*_RUNS_COLUMNS, "config")

# A label's most characters: the rest of a name's 200 are the run's own.
MAX_LABEL_LENGTH = 50

_CHUNK = 256  # rows fetched and inserted at a time (a layer_stats row is a block of 4096)


class RunIdConflictError(ValueError):
    """A run id of the source is taken in the destination by another run (another creation time)."""


class SourceStoreError(RuntimeError):
    """The source store could not be read (damaged, unreadable, locked for too long)."""


@dataclasses.dataclass(frozen=True)
class RunCopy:
    """What `copy_runs` did with one run.

    Attributes:
        run_id: the run's id, the same in both stores.
        name: its name.
        status: its status in the destination (`interrupted` for a run that
            was still queued, running or paused in the source), or in the
            source for a run skipped because it was deleted from the destination.
        progress_step: its last step.
        copied: True if it was copied, False if it was skipped because the
            destination already had it, or had it once and it was deleted.
        note: one sentence for people: why it was skipped, or what its
            status means; "" when there is nothing to say.
        deleted_at: when the run was deleted from the destination (unix
            seconds), for a run skipped for it; None for the others.
    """

    run_id: str
    name: str
    status: str
    progress_step: int
    copied: bool
    note: str = ""
    deleted_at: float | None = None


class RunCopies(list):
    """The `RunCopy` of each run, oldest first, as `copy_runs` returns them.

    Attributes:
        deletions: how many of the source's deletions were carried into the
            destination (a whole store moved into an empty one); 0 otherwise.
    """

    deletions = 0


def copy_runs(source, destination, run_ids=None, label=None, restore_deleted=False):
    """Copy whole runs from the run store `source` into the run store `destination`.

    The source is only read, through a read-only connection (`mode=ro`, or
    `immutable=1` on a read-only disk or folder where SQLite cannot make its
    `-shm` file), in one read transaction: a run still training there is
    copied as it was at one moment. The destination is written in one
    transaction: every run is copied, or none (a full disk, a conflict).

    Run ids are kept, so links and names stay the same; the stores' integer
    keys are renumbered. A run id the destination already has is skipped when
    it is the same run (the same creation time): importing the same store
    twice copies nothing the second time. A run deleted from the destination
    (`RunStore.delete`) is skipped too, unless `restore_deleted`: a teacher's
    deletions stay deleted when a student sends the same store again. When
    every run is copied (`run_ids=None`) into a store with no runs and no
    deletions yet, the source's deletions are carried too: a store moved to
    a new file keeps them. A run
    id the destination has for another run is refused (`RunIdConflictError`,
    nothing copied). A run that is queued, running or paused in the source
    arrives `interrupted`, with a message saying at which step it was copied:
    nothing trains it in the destination. Its Pause/Stop requests are not
    copied.

    A source written by an older gradflow is upgraded in a temporary copy
    (the source file is left as it is); one written by a newer gradflow is
    refused.

    Args:
        source: the run store's file to copy from.
        destination: the run store's file to copy into; made if it does not
            exist, upgraded if it is older (as `RunStore` does).
        run_ids: the ids of the runs to copy (strings), default None: every
            run in the source.
        label: put before each copied run's name (`"Alice"` makes `"Alice:
            relu · depth 4 ..."`, cut to the store's 200 characters), default
            None: names as they are. A class's runs of one default name are
            told apart so.
        restore_deleted: copy the chosen runs that were deleted from
            `destination` too, default False: they are skipped, each with a
            note saying when it was deleted and how to bring it back.

    Returns:
        A `RunCopies` list of `RunCopy`, one per run, oldest first: `[r.run_id
        for r in result if r.copied]` are the runs copied, the others were
        skipped; its `deletions` says how many deletions were carried.

    Raises:
        FileNotFoundError: if `source` does not exist.
        NotARunStoreError: a `ValueError`, if `source` or `destination` is a
            folder or another kind of file.
        NewerStoreError: a `RuntimeError`, if either was written by a newer
            gradflow.
        UnknownRunError: a `ValueError`, if a run id is not in the source.
        RunIdConflictError: a `ValueError`, if a run id is taken in the
            destination by another run.
        ValueError: if a run id is malformed, or both paths are one store.
        SourceStoreError: a `RuntimeError`, if the source cannot be read
            (damaged, locked); the message says what to do.
        sqlite3.Error: if the destination cannot be written (see
            `gradflow.store.trouble.explain`).
    """
    source = pathlib.Path(source)
    destination = pathlib.Path(destination)
    wanted = _check_ids(run_ids)
    restore_deleted = flag("restore_deleted", restore_deleted)
    if label is not None:
        if not isinstance(label, str) or not label.strip():
            raise ValueError(f"`label` must be a non-empty string or None, got {label!r}.")
        if len(label.strip()) > MAX_LABEL_LENGTH:
            # Cut to the store's 200 characters, a longer one left no run its own name.
            raise ValueError(
                f"`label` must be at most {MAX_LABEL_LENGTH} characters (it goes before each "
                f"run's name), got {len(label.strip()):,}."
            )
        check_name(label.strip(), "label")
    if not source.is_file():
        check_store_path(source, "source")  # a folder says so
        raise FileNotFoundError(f"No run store at {str(source)!r}: no such file. Check the path.")
    try:
        check_store_path(source, "source")
    except NotARunStoreError as error:
        # Its advice ("Give a new file name") is for a store to be made.
        raise NotARunStoreError(str(error).split(" Give a new file name")[0]) from None
    check_store_path(destination, "destination")
    if destination.exists() and os.path.samefile(source, destination):
        raise ValueError(
            f"{str(source)!r} is the store to copy into: give another source or destination."
        )
    with _read_source(source) as reader:
        chosen = reader.runs(wanted)
        store = RunStore(destination)  # makes or upgrades it; refuses a newer or foreign file
        store.close()
        conn = tables.connect(store.path, create=False)
        try:
            # `RunStore` reads an older store it may not write as it is: say that it
            # can only be read, before its missing tables do.
            migrate.upgrade(conn, store.path, read_as_is=False)
            with tables.write_transaction(conn):
                # Read before anything is copied: whether this is a move into a new store.
                moving = wanted is None and _holds_nothing(conn)
                copies = RunCopies(_copy(reader, conn, chosen, destination, label, restore_deleted))
                if moving:
                    copies.deletions = _carry_deletions(reader, conn, chosen)
                return copies
        finally:
            conn.close()


def export_runs(source, path, run_ids):
    """Write the runs `run_ids` of the store `source` into a new run store file at `path`.

    What `gradflow export RUN --format store` does: a file to send to someone,
    who imports it (`gradflow import FILE`, `copy_runs`) or opens it as a
    store (`--db FILE`). It is made as a temporary file beside `path` and
    renamed once complete, and holds everything in one file (no `-wal`, in
    SQLite's rollback-journal mode), so that it can be mailed, put on a USB
    stick or read from a read-only disk as it is. A store opened by gradflow
    goes back to WAL mode by itself.

    Args:
        source: the run store to copy from.
        path: the new file; refused if something is there already.
        run_ids: the runs to put in it.

    Returns:
        The `RunCopy` list of `copy_runs`.

    Raises:
        FileExistsError: if `path` exists (it may be someone's store).
        Everything `copy_runs` raises.
    """
    path = pathlib.Path(path)
    if path.exists() or path.is_symlink():
        raise FileExistsError(
            f"{str(path)!r} exists already: give a new file name (gradflow does not write "
            "over a file that may be a store; `gradflow import` adds runs to a store)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        copied = copy_runs(source, partial, run_ids)
        conn = sqlite3.connect(str(partial), isolation_level=None)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode = DELETE")
        finally:
            conn.close()
        if path.exists():
            raise FileExistsError(f"{str(path)!r} was made while the runs were copied")
        os.replace(partial, path)
        return copied
    finally:
        for leftover in (partial, *_sidecars(partial)):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def open_read_only(path):
    """A read-only `sqlite3` connection to the store at `path`, and how it was opened.

    `mode=ro` first: it reads the `-wal` file too, and waits for a writer's
    lock like any reader. Where SQLite cannot open a store that way (a WAL
    store on a read-only disk, or in a folder this user cannot write: SQLite
    needs to make a `-shm` file beside it even to read), `immutable=1`, which
    reads the file without locks or `-shm`: right for a store nothing writes
    any more. That reading would miss what is still in a `-wal` file, so a
    store with a non-empty one is copied (file and `-wal`) to a temporary
    folder and read there instead.

    Returns:
        `(connection, how, temporary)`: `how` is `"ro"`, `"immutable"` or
        `"copy"`; `temporary` is a folder to remove after closing the
        connection, or None.
    """
    path = pathlib.Path(path).resolve()
    try:
        return _connect(path, "mode=ro"), "ro", None
    except sqlite3.OperationalError as error:
        if trouble.cause(error) not in ("read-only", "cannot-open"):
            raise
    wal = path.with_name(path.name + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        temporary = pathlib.Path(tempfile.mkdtemp(prefix="gradflow-import-"))
        try:
            shutil.copyfile(path, temporary / path.name)
            shutil.copyfile(wal, temporary / wal.name)
            return _connect(temporary / path.name, "mode=ro"), "copy", temporary
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
    return _connect(path, "immutable=1"), "immutable", None


def _connect(path, parameter):
    conn = sqlite3.connect(
        f"{pathlib.Path(path).as_uri()}?{parameter}",
        uri=True,
        timeout=30.0,
        isolation_level=None,
        check_same_thread=False,
    )
    try:
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # opens the file now
    except BaseException:
        conn.close()
        raise
    return conn


def _sidecars(path):
    return [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


def _check_ids(run_ids):
    if run_ids is None:
        return None
    if isinstance(run_ids, str):
        run_ids = [run_ids]
    run_ids = list(run_ids)
    for run_id in run_ids:
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            raise ValueError(
                f"`run_ids` must be run id strings such as '3f2a9c1b7d04', got {run_id!r}."
            )
    return list(dict.fromkeys(run_ids))


class _Source:
    """The source store, read in one read transaction; SQLite's errors in words naming it."""

    def __init__(self, conn, path):
        self.conn = conn
        self.path = path

    def rows(self, sql, params=()):
        """The rows of a query, a chunk at a time."""
        try:
            cursor = self.conn.execute(sql, params)
            while chunk := cursor.fetchmany(_CHUNK):
                yield from chunk
        except sqlite3.Error as error:
            raise _unreadable(error, self.path) from error

    def runs(self, wanted):
        """The `runs` rows to copy, as dicts, oldest first."""
        rows = [
            dict(zip(("id", *RUN_COLUMNS), row, strict=True))
            for row in self.rows(f"SELECT id, {', '.join(RUN_COLUMNS)} FROM runs ORDER BY id")
        ]
        if wanted is None:
            return rows
        by_id = {row["run_id"]: row for row in rows}
        missing = [run_id for run_id in wanted if run_id not in by_id]
        if missing:
            raise UnknownRunError(
                f"{'Runs' if len(missing) > 1 else 'Run'} {', '.join(map(repr, missing))} "
                f"{'are' if len(missing) > 1 else 'is'} not in the run store "
                f"{str(self.path)!r}: check the ids its sender gave you, or leave them out to "
                "import every run."
            )
        return [row for row in rows if row["run_id"] in wanted]


def _unreadable(error, path):
    return SourceStoreError(
        f"Could not read the run store {str(path)!r}: {trouble.explain(error, path)}."
    )


@contextlib.contextmanager
def _read_source(path):
    """A `_Source` for the store at `path`, in a read transaction, upgraded in a copy if need be."""
    temporaries = []
    try:
        try:
            conn, _, temporary = open_read_only(path)
        except sqlite3.Error as error:
            raise _unreadable(error, path) from error
        if temporary is not None:
            temporaries.append(temporary)
        try:
            try:
                conn.execute("BEGIN")  # one snapshot for every read below
                version = _version(conn, path)
                # Before an upgrade writes to a copy of it: gradflow makes no views
                # (which compute anything, for ever) and no triggers.
                source_checks.check_no_views_or_triggers(conn, path)
                if version < tables.OLDEST_VERSION_READ_AS_IS:
                    # Upgraded in a copy: the source may be read-only, or someone else's.
                    conn.close()
                    conn, temporary = _upgraded_copy(path)
                    temporaries.append(temporary)
                    conn.execute("BEGIN")
                # Views named like the tables computed anything, for ever.
                source_checks.check_schema(conn, path)
            except NotARunStoreError:
                raise
            except sqlite3.Error as error:
                raise _unreadable(error, path) from error
            # Outside the `except` above: the destination's errors are its own.
            yield _Source(conn, path)
        finally:
            conn.close()
    finally:
        for temporary in temporaries:
            shutil.rmtree(temporary, ignore_errors=True)


def _version(conn, path):
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "runs" not in names:
        if not names and pathlib.Path(path).stat().st_size > 0:
            raise migrate.copy_without_log(pathlib.Path(path))
        raise NotARunStoreError(
            f"`source`={str(path)!r} holds no runs: it is an empty file, not a gradflow run store."
        )
    try:
        # A `runs` table and no version recorded: tables this gradflow made.
        version = migrate.detected_version(conn) or tables.SCHEMA_VERSION
    except ValueError:
        source_checks._refuse(path, "its schema version is not a number")
    if version > tables.SCHEMA_VERSION:
        raise NewerStoreError(
            f"The run store {str(path)!r} has schema version {version}, written by a newer "
            f"gradflow; this gradflow reads up to version {tables.SCHEMA_VERSION}. Upgrade "
            "gradflow here to copy its runs."
        )
    return version


def _upgraded_copy(path):
    """The store at `path` copied to a temporary folder and upgraded there.

    Copied with `VACUUM INTO`, which writes the pages in use only: SQLite's
    backup copied a sparse file of 2 GB (52 KB on disk) page by page.
    """
    temporary = pathlib.Path(tempfile.mkdtemp(prefix="gradflow-import-"))
    try:
        copy = temporary / "upgraded.db"
        original, _, inner = open_read_only(path)
        try:
            original.execute("VACUUM INTO ?", (str(copy),))
        finally:
            original.close()
            if inner is not None:
                shutil.rmtree(inner, ignore_errors=True)
        conn = tables.connect(copy, create=False)
        try:
            migrate.upgrade(conn, path)
        except (RuntimeError, sqlite3.Error) as error:
            conn.close()
            # The upgrade's own words are for one's own store ("use another --db").
            cause = error.__cause__ if isinstance(error.__cause__, Exception) else error
            raise SourceStoreError(
                f"Could not read the run store {str(path)!r}, of an older gradflow: its "
                f"upgrade (in a temporary copy) failed ({cause}). It may be damaged: ask its "
                "sender for a new copy (`gradflow export RUN_ID --format store`)."
            ) from error
        return conn, temporary
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _copy(reader, conn, chosen, destination, label=None, restore_deleted=False):
    """Copy the `chosen` runs (dicts of their `runs` rows) inside the caller's write transaction.

    Every row is checked as it is read (`source_checks`): the source may be a
    stranger's file, and one row gradflow would not write refuses it whole.
    """
    for row in chosen:
        source_checks.check_run(row, reader.path)
        if label is not None:
            row["name"] = shortened(f"{label.strip()}: {row['name']}", MAX_NAME_LENGTH)
    ids = [row["run_id"] for row in chosen]
    if len(set(ids)) != len(ids):
        source_checks._refuse(reader.path, "two runs have one run id")
    try:
        return _copy_checked(reader, conn, chosen, destination, label, restore_deleted)
    except sqlite3.IntegrityError as error:
        # Two rows where gradflow writes one (a metric twice at a step): the source's doing.
        source_checks._refuse(reader.path, f"rows that repeat ({error})")


def _copy_checked(reader, conn, chosen, destination, label=None, restore_deleted=False):
    there, deleted = {}, {}
    for row in chosen:
        found = conn.execute(
            "SELECT created_at, name, status, progress_step FROM runs WHERE run_id = ?",
            (row["run_id"],),
        ).fetchone()
        if found is not None:
            there[row["run_id"]] = found
        gone = conn.execute(
            "SELECT created_at, deleted_at FROM deleted_runs WHERE run_id = ?", (row["run_id"],)
        ).fetchone()
        if gone is not None:
            deleted[row["run_id"]] = gone
    conflicts = [
        row
        for row in chosen
        if row["run_id"] in there and there[row["run_id"]][0] != row["created_at"]
    ]
    if conflicts:
        row = conflicts[0]
        other = there[row["run_id"]]
        raise RunIdConflictError(
            f"Run {row['run_id']} ({row['name']!r}, created {_when(row['created_at'])}) has the "
            f"id of another run in {str(destination)!r} ({other[1]!r}, created "
            f"{_when(other[0])}); nothing was copied"
            + (f" ({len(conflicts)} runs have this trouble)" if len(conflicts) > 1 else "")
            + ". Copy the other runs by naming them, or copy into another store."
        )
    done = []
    for row in chosen:
        if row["run_id"] in there:
            _, name, status, step = there[row["run_id"]]
            note = f"already in {str(destination)!r}"
            newer = step != row["progress_step"] or (
                row["status"] not in tables.ACTIVE_STATUSES and status != row["status"]
            )
            if newer:
                # It was copied while it trained, and trained on since.
                note += (
                    f" (at step {step}, {status}; the source's is at step "
                    f"{row['progress_step']}, {row['status']}): to bring the source's, delete "
                    f"it from {str(destination)!r} (the Runs page's Delete) and import it "
                    f"again (`{_import_command(reader.path, row['run_id'], destination, label)}`)"
                )
            done.append(RunCopy(row["run_id"], name, status, int(step), False, note))
            continue
        if row["run_id"] in deleted:
            created_at, deleted_at = deleted[row["run_id"]]
            if created_at == row["created_at"] and not restore_deleted:
                note = (
                    f"deleted from {str(destination)!r} on {_when(deleted_at)}: to bring it "
                    f"back, `{_import_command(reader.path, row['run_id'], destination, label)}`"
                )
                done.append(
                    RunCopy(
                        row["run_id"],
                        row["name"],
                        row["status"],
                        int(row["progress_step"]),
                        copied=False,
                        note=note,
                        deleted_at=deleted_at,
                    )
                )
                continue
            # Brought back, or another run of that id (another creation time) comes in.
            conn.execute("DELETE FROM deleted_runs WHERE run_id = ?", (row["run_id"],))
        values = dict(row)
        note = ""
        if row["status"] in tables.ACTIVE_STATUSES:
            note = (
                f"Copied while {row['status']} at step {row['progress_step']}: it does not "
                "train in this store."
            )
            values.update(status="interrupted", message=note, updated_at=time.time())
        cursor = conn.execute(
            f"INSERT INTO runs ({', '.join(RUN_COLUMNS)}) "
            f"VALUES ({', '.join('?' * len(RUN_COLUMNS))})",
            [values[column] for column in RUN_COLUMNS],
        )
        key = cursor.lastrowid
        series_ids = set()
        for table, columns, order in RUN_TABLES:
            rows = reader.rows(
                f"SELECT {', '.join(columns)} FROM {table} WHERE run = ? ORDER BY {order}",
                (row["id"],),
            )
            where = (reader.path, row["run_id"])
            if table == "series":
                series_ids, rows = source_checks.check_series(list(rows), *where)
            elif table == "layer_stats":
                rows = source_checks.checked_blocks(rows, *where, series_ids)
            elif table == "metrics":
                rows = source_checks.checked_metrics(rows, *where)
            elif table == "events":
                rows = source_checks.checked_events(rows, *where)
            else:
                rows = source_checks.checked_histograms(rows, *where, series_ids)
            insert = (
                f"INSERT INTO {table} (run, {', '.join(columns)}) "
                f"VALUES (?, {', '.join('?' * len(columns))})"
            )
            conn.executemany(insert, ((key, *values_) for values_ in rows))
        done.append(
            RunCopy(
                row["run_id"], row["name"], values["status"], int(row["progress_step"]), True, note
            )
        )
    return done


def _holds_nothing(conn):
    """Whether the destination has neither runs nor deletions (a new store, or an emptied one)."""
    return not conn.execute(
        "SELECT EXISTS (SELECT 1 FROM runs) OR EXISTS (SELECT 1 FROM deleted_runs)"
    ).fetchone()[0]


def _carry_deletions(reader, conn, chosen):
    """Copy the source's `deleted_runs` rows into the destination; returns how many.

    A source of version 2 has none. A deletion of a run the source still
    holds (made by hand) is left out: the run was copied.
    """
    there = reader.rows(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'deleted_runs'"
    )
    if not list(there):
        return 0
    copied = {row["run_id"] for row in chosen}
    rows = source_checks.checked_deletions(
        reader.rows(
            "SELECT run_id, name, created_at, deleted_at FROM deleted_runs ORDER BY deleted_at"
        ),
        reader.path,
    )
    carried = [row for row in rows if row[0] not in copied]
    conn.executemany(
        "INSERT OR REPLACE INTO deleted_runs (run_id, name, created_at, deleted_at) "
        "VALUES (?, ?, ?, ?)",
        carried,
    )
    return len(carried)


def _import_command(source, run_id, destination, label):
    """The `gradflow import` that brings `run_id` back into `destination` once deleted there."""
    words = ["gradflow", "import", str(source), run_id]
    if label is not None:
        words += ["--label", label.strip()]
    return shlex.join([*words, "--db", str(destination), "--restore-deleted"])


def _when(timestamp):
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
