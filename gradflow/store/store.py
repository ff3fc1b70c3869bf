"""The run store: runs, their statistics and their control requests in SQLite."""

import contextlib
import json
import os
import pathlib
import re
import socket
import sqlite3
import threading
import time
import uuid

import numpy as np
import pandas as pd

from gradflow import schema
from gradflow.checks import flag, positive_number, whole_number
from gradflow.store import blocks, migrate, tables
from gradflow.store.trouble import NotARunStoreError
from gradflow.store.writer import RunWriter

_SERIES_CACHE_SIZE = 256
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_RUNS_COLUMNS = (
    "run_id",
    "name",
    "status",
    "source",
    "created_at",
    "updated_at",
    "heartbeat_at",
    "progress_step",
    "total_steps",
    "tags",
    "message",
    "pid",
    "host",
)


class UnknownRunError(ValueError):
    """Raised when a run id is not in the store."""


class RunStore:
    """All runs, their statistics and their control requests, in one SQLite file.

    The file is in WAL mode: one writer per run (`writer()`) and any number of
    readers in other processes (the dashboard) work at the same time. Readers
    return tidy pandas DataFrames; `after_step` returns only newer rows, for
    live polling.

    Example:

    ```python
    store = RunStore("runs.db")
    run_id = store.create_run({"depth": 4}, name="relu, 4 layers")
    with store.writer(run_id) as w:
        w.add_layer_stats(rows)          # tidy DataFrame
        w.add_metrics(1, {"loss": 0.7})
    store.set_status(run_id, "completed")
    store.layer_stats(run_id, after_step=0)
    ```

    Args:
        path: the database file, default `$GRADFLOW_DB` or
            `./gradflow-data/runs.db`. Its folder is created if needed.
        arrow_reads: kept so that existing code keeps working; it changes
            nothing. It used to read layer statistics through Arrow's ADBC
            SQLite driver, which was faster for the row-per-series format of
            schema version 1 but unsafe beside `sqlite3` in one process (two
            SQLite libraries drop each other's POSIX locks,
            sqlite.org/howtocorrupt.html 2.2.1). Since version 2 stores
            columnar blocks, `sqlite3` reads them faster than ADBC read the
            old rows, so every read goes through `sqlite3`.

    Raises:
        NewerStoreError: a `RuntimeError`, if the file was written by a
            newer gradflow.
        RuntimeError: if a file of an older gradflow could not be upgraded
            (see `gradflow.store.migrate`).
    """

    def __init__(self, path=None, arrow_reads=False):
        self.arrow_reads = flag("arrow_reads", arrow_reads)
        self.path = pathlib.Path(path) if path is not None else tables.default_path()
        check_store_path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._series_cache = {}  # run key -> _SeriesTable
        self._made = False  # the file exists: later connections must not make a new one
        # Measured before SQLite opens it: opening a new file writes its first page.
        held_something = self.path.is_file() and self.path.stat().st_size > 0
        try:
            migrate.upgrade(self._conn(), self.path, held_something=held_something)
        except BaseException:
            self.close()  # a '-wal' then put beside the file must meet no open connection
            raise
        self._made = True

    def __repr__(self):
        return f"RunStore({str(self.path)!r})"

    def __getstate__(self):
        # Connections belong to the thread that opened them, and a pickle
        # cannot hold one: KerasTuner deep-copies its callbacks (a used
        # GradientMonitor holds its store) for every trial. A copy opens its own.
        state = dict(self.__dict__)
        state["_local"] = None
        state["_series_cache"] = {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    # Runs ---------------------------------------------------------------

    def create_run(
        self, config, name=None, source="lab", total_steps=None, tags=(), status="running", pid=None
    ):
        """Adds a run and returns its new id.

        Args:
            config: the run's settings: a dict, or an object with `to_dict()`
                (such as `RunConfig`). Stored as JSON.
            name: a label for people, default `"run N"`; no control
                characters (a `ValueError` says so).
            source: who logs it: `"lab"`, `"monitor"` or `"cli"`.
            total_steps: the planned number of steps, if known.
            tags: strings to find the run by.
            status: the first status, default `"running"` (the runner uses
                `"queued"`).
            pid: the process that owns the run now, default this one. `recover()`
                marks the run interrupted once that process is gone.

        Returns:
            The run id, 12 hex characters.
        """
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        if not isinstance(config, dict):
            raise TypeError(
                f"`config` must be a dict or have .to_dict(), got {type(config).__name__}."
            )
        if source not in tables.SOURCES:
            raise ValueError(f"`source` must be one of {tables.SOURCES}, got {source!r}.")
        _check_status(status)
        tags = _check_tags(tags)
        total_steps = whole_number("total_steps", total_steps)
        pid = whole_number("pid", pid, least=1)
        if name:
            check_name(str(name))
        if name and len(str(name)) > MAX_NAME_LENGTH:
            # Made from settings (an A/B launch names a run after every setting
            # that differs): shortened, not refused, which would fail the launch.
            name = shortened(str(name), MAX_NAME_LENGTH)
        run_id = uuid.uuid4().hex[:12]
        now = time.time()
        conn = self._conn()
        with tables.write_transaction(conn):
            (number,) = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM runs").fetchone()
            conn.execute(
                "INSERT INTO runs (run_id, name, status, source, created_at, updated_at, "
                "heartbeat_at, total_steps, tags, config, pid, host) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    str(name) if name else f"run {number}",
                    status,
                    source,
                    now,
                    now,
                    now,
                    total_steps,
                    json.dumps(tags),
                    json.dumps(config, default=str),
                    os.getpid() if pid is None else pid,
                    socket.gethostname(),
                ),
            )
        return run_id

    def writer(self, run_id, flush_interval=0.5, background_flush=True):
        """Returns the batched writer of one run (see `RunWriter`).

        Args:
            run_id: the run to write.
            flush_interval: seconds between writes to disk, default 0.5.
            background_flush: write from a daemon thread, default True.
        """
        return RunWriter(self.path, self._key(run_id), run_id, flush_interval, background_flush)

    def set_status(self, run_id, status, message=None, pid=None, only_from=None):
        """Sets a run's status (and why, for people).

        Args:
            run_id: the run.
            status: one of `queued, running, paused, completed, stopped,
                diverged, interrupted, failed`.
            message: a reason to show next to the status, or None.
            pid: the process that now owns the run (the worker), or None to
                keep the current one.
            only_from: if given, a tuple of statuses: change the status only
                when the run is in one of them (so a late writer cannot
                overwrite a final status). Default None: always.

        Returns:
            True if the status was changed.
        """
        _check_status(status)
        pid = whole_number("pid", pid, least=1)
        if message is not None and not isinstance(message, str):
            raise ValueError(f"`message` must be a string or None, got {message!r:.80}.")
        key = self._key(run_id)
        now = time.time()
        sql = (
            "UPDATE runs SET status = ?, message = ?, updated_at = ?, heartbeat_at = ?, "
            "pid = COALESCE(?, pid), host = CASE WHEN ? IS NULL THEN host ELSE ? END WHERE id = ?"
        )
        params = [status, message, now, now, pid, pid, socket.gethostname(), key]
        if only_from is not None:
            only_from = (only_from,) if isinstance(only_from, str) else tuple(only_from)
            for value in only_from:
                _check_status(value)
            sql += f" AND status IN ({', '.join('?' * len(only_from))})"
            params.extend(only_from)
        changed = self._conn().execute(sql, params).rowcount > 0
        if changed and status in tables.FINAL_STATUSES:
            self._into_main_file()
        return changed

    def _into_main_file(self):
        """Move what the '-wal' file holds into the store's main file, if no reader is in the way.

        A run's writer does it as it closes, but the lab sets the final status
        after: a copy of `runs.db` made once the run had ended (the usual way
        to hand a store over) read `interrupted`. Renames and deletions too.
        """
        with contextlib.suppress(sqlite3.Error):
            self._conn().execute("PRAGMA wal_checkpoint(PASSIVE)")

    def heartbeat(self, run_id, step=None):
        """Records that the run's process is alive (and its progress).

        Args:
            run_id: the run.
            step: the last finished step, or None.
        """
        step = whole_number("step", step)
        self._conn().execute(
            "UPDATE runs SET heartbeat_at = ?, progress_step = MAX(progress_step, COALESCE(?, 0)) "
            "WHERE id = ?",
            (time.time(), step, self._key(run_id)),
        )

    def runs(self, with_config=False):
        """Lists all runs, newest first.

        Args:
            with_config: Also read each run's config (a `config` column of
                dicts, as `run_info` gives), for a list that says what each
                run trained.

        Returns:
            A DataFrame with columns `run_id, name, status, source, created_at,
            updated_at, heartbeat_at, progress_step, total_steps, tags, message,
            pid, host`; times are UTC timestamps and `tags` are lists.
        """
        columns = list(_RUNS_COLUMNS) + (["config"] if with_config else [])
        rows = (
            self._conn()
            # Newest made first: after `gradflow import` the runs added last came
            # first (`gradflow runs --last 3`, the Runs page's picker).
            .execute(f"SELECT {', '.join(columns)} FROM runs ORDER BY created_at DESC, id DESC")
            .fetchall()
        )
        frame = pd.DataFrame(rows, columns=columns)
        if with_config:
            frame["config"] = [json.loads(c) for c in frame["config"]]
        for column in ("created_at", "updated_at", "heartbeat_at"):
            frame[column] = pd.to_datetime(frame[column].astype("float64"), unit="s", utc=True)
        frame["tags"] = [json.loads(t) for t in frame["tags"]]
        frame["progress_step"] = frame["progress_step"].astype("int64")
        frame["total_steps"] = frame["total_steps"].astype("Int64")
        frame["pid"] = frame["pid"].astype("Int64")
        return frame

    def run_info(self, run_id):
        """Everything known about one run.

        Returns:
            A dict with the columns of `runs()` (times as unix seconds) plus
            `"config"`, the config dict the run was created with.
        """
        self._check_id(run_id)
        row = (
            self._conn()
            .execute(
                f"SELECT {', '.join(_RUNS_COLUMNS)}, config FROM runs WHERE run_id = ?", (run_id,)
            )
            .fetchone()
        )
        if row is None:
            raise self._unknown(run_id)
        info = dict(zip(_RUNS_COLUMNS + ("config",), row, strict=True))
        info["tags"] = json.loads(info["tags"])
        info["config"] = json.loads(info["config"])
        return info

    def status(self, run_id):
        """The run's current status string."""
        return self._run_row(run_id, "status")

    def rename(self, run_id, name):
        """Gives a run a new name.

        Raises:
            ValueError: if `name` is empty, too long or holds a control character.
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"`name` must be a non-empty string, got {name!r}.")
        self._update(run_id, "name", _check_name(name.strip()))
        self._into_main_file()

    def update_config(self, run_id, entries):
        """Adds `entries` (a dict) to the run's stored config, replacing those of the same name.

        What a run learns once it runs (the `GradientMonitor` learns which of
        a model's layers reads which when its step is traced).
        """
        if not isinstance(entries, dict):
            raise ValueError(f"`entries` must be a dict, got {type(entries).__name__}.")
        key = self._key(run_id)
        conn = self._conn()
        with tables.write_transaction(conn):
            (config,) = conn.execute("SELECT config FROM runs WHERE id = ?", (key,)).fetchone()
            merged = {**json.loads(config), **entries}
            conn.execute(
                "UPDATE runs SET config = ? WHERE id = ?",
                (json.dumps(merged, default=str), key),
            )

    def set_total_steps(self, run_id, total_steps):
        """Sets the step a run is planned to end at (None: not known).

        A `GradientMonitor` given to another `fit` trains its run on, so the
        run's end moves.

        Raises:
            ValueError: if `total_steps` is not None or a non-negative integer.
        """
        self._update(run_id, "total_steps", whole_number("total_steps", total_steps))

    def tag(self, run_id, tags):
        """Replaces a run's tags.

        Args:
            tags: an iterable of strings (a single string is one tag).
        """
        self._update(run_id, "tags", json.dumps(_check_tags(tags)))

    def delete(self, run_id, *more):
        """Deletes runs and all their rows, in one transaction.

        The store keeps each deleted run's id, name and creation time, and
        when it was deleted (`deleted_runs`): importing a store that still
        holds the run skips it, so that a teacher's deletions stay deleted
        when a student sends the same store again (`copy_runs(...,
        restore_deleted=True)` brings it back).

        Args:
            run_id: The run to delete.
            *more: Other runs to delete with it (a teacher's end-of-term
                clean-up): all or none are deleted.
        """
        keys = [self._key(run) for run in (run_id, *more)]
        conn = self._conn()
        now = time.time()
        with tables.write_transaction(conn):
            for key in keys:
                for table in (
                    "layer_stats",
                    "series",
                    "metrics",
                    "events",
                    "histograms",
                    "requests",
                ):
                    conn.execute(f"DELETE FROM {table} WHERE run = ?", (key,))
                conn.execute(
                    "INSERT OR REPLACE INTO deleted_runs (run_id, name, created_at, deleted_at) "
                    "SELECT run_id, name, created_at, ? FROM runs WHERE id = ?",
                    (now, key),
                )
                conn.execute("DELETE FROM runs WHERE id = ?", (key,))
        # The file gives the run's pages back (a store made with incremental
        # auto-vacuum, see `tables.connect`; in an older one this does nothing
        # until `compact`). `executescript` steps the pragma to its end: one
        # `execute` frees a single page.
        conn.executescript("PRAGMA incremental_vacuum;")
        self._into_main_file()

    def compact(self):
        """Gives the file's unused space back to the disk.

        Deleting a run gives its space back in a store this version of
        gradflow made. A store made before it (or by another program's
        writes) keeps it until this rewrites the file once; afterwards its
        deletes give space back too. It takes the store's write lock for
        as long as the rewrite takes (about a second per 100 MB here), so
        training runs wait for it to write their rows.

        Returns:
            The file's size in bytes before and after, as a pair.
        """
        conn = self._conn()
        before = self.path.stat().st_size
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # a store made before it, from now on
        conn.execute("VACUUM")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return before, self.path.stat().st_size

    # Control ------------------------------------------------------------

    def request(self, run_id, action):
        """Asks the run's worker to `"pause"`, `"resume"`, `"stop"` or do one `"step"`.

        The worker polls for requests; see `pending_request`.
        """
        if action not in tables.REQUESTS:
            raise ValueError(f"`action` must be one of {tables.REQUESTS}, got {action!r}.")
        self._queue(run_id, action)

    def request_pace(self, run_id, pace):
        """Asks the run's worker to train at most `pace` steps a second from now on.

        Args:
            run_id: the run.
            pace: steps a second, greater than 0, or None for full speed.
        """
        if pace is not None:
            pace = positive_number("pace", pace, unit="of steps a second")
        self._queue(run_id, tables.pace_request(pace))

    def _queue(self, run_id, action):
        self._conn().execute(
            "INSERT INTO requests (run, action, created_at) VALUES (?, ?, ?)",
            (self._key(run_id), action, time.time()),
        )

    def pending_request(self, run_id, consume=True):
        """The oldest request not yet handled, or None.

        Args:
            run_id: the run.
            consume: remove the request from the queue, default True.
        """
        consume = flag("consume", consume)
        key = self._key(run_id)
        conn = self._conn()
        # Workers poll often: look without taking the write lock first.
        if conn.execute("SELECT 1 FROM requests WHERE run = ? LIMIT 1", (key,)).fetchone() is None:
            return None
        with tables.write_transaction(conn):
            row = conn.execute(
                "SELECT id, action FROM requests WHERE run = ? ORDER BY id LIMIT 1", (key,)
            ).fetchone()
            if row is not None and consume:
                conn.execute("DELETE FROM requests WHERE id = ?", (row[0],))
        return None if row is None else row[1]

    def recover(self, stale_after=60.0, other_hosts=True):
        """Marks runs whose process is gone as `interrupted`.

        A queued, running or paused run is interrupted when its process (the
        worker, or the process that queued it) is no longer alive on this host
        (a zombie counts as gone). A run owned by another host is interrupted
        when it has sent no heartbeat for `stale_after` seconds. A store this
        process cannot write (a read-only file, a full disk) is left as it
        is: the dashboard and `gradflow runs` call this before they list runs,
        and a listing must not fail for it.

        Args:
            stale_after: seconds without a heartbeat after which a run of
                another host counts as gone, default 60.
            other_hosts: also judge runs of other hosts by their heartbeat
                (default True). False: only runs of this host, whose process
                table says for sure (a server checking again and again).

        Returns:
            The list of run ids marked interrupted.
        """
        host = socket.gethostname()
        now = time.time()
        conn = self._conn()
        marks = ", ".join("?" * len(tables.ACTIVE_STATUSES))
        rows = conn.execute(
            f"SELECT id, run_id, pid, host, heartbeat_at, status FROM runs "
            f"WHERE status IN ({marks})",
            tables.ACTIVE_STATUSES,
        ).fetchall()
        interrupted = []
        for key, run_id, pid, run_host, heartbeat, status in rows:
            if run_host == host and pid is not None:
                # On this host the process table is the truth: a live process
                # in a long step must not be declared gone.
                dead, stale = not process_alive(pid), False
            elif not other_hosts:
                continue
            else:
                dead, stale = False, heartbeat is None or now - heartbeat > stale_after
            if not (dead or stale):
                continue
            reason = (
                f"its process (pid {pid}) ended while the run was {status}"
                if dead
                else f"no heartbeat for {now - (heartbeat or 0):.0f} s while {status}"
            )
            try:
                # Only if nobody finished it meanwhile.
                cursor = conn.execute(
                    f"UPDATE runs SET status = 'interrupted', message = ?, updated_at = ? "
                    f"WHERE id = ? AND status IN ({marks})",
                    (f"Interrupted: {reason}.", now, key) + tables.ACTIVE_STATUSES,
                )
            except sqlite3.OperationalError:
                break  # cannot be written now: the next call tries again
            if cursor.rowcount:
                interrupted.append(run_id)
        return interrupted

    # Reading statistics ---------------------------------------------------

    def layer_stats(self, run_id, after_step=None, tensors=None, columns=None):
        """The run's per-layer statistics, tidy.

        Args:
            run_id: the run.
            after_step: only rows with `step > after_step` (for live polling);
                default None reads all.
            tensors: only these tensors, by name or kind (`["kernel"]` also
                takes an RNN cell's `simple_rnn_cell/kernel`), default all.
            columns: the statistic columns to read, default all of
                `tables.STAT_COLUMNS`; fewer columns read faster.

        Returns:
            A DataFrame with `step, layer, layer_index, tensor, variable` and the
            statistic columns (float64, NaN where missing), sorted by step, then
            in the order the layers were first written. `layer`, `tensor` and `variable` are categoricals
            (group with `observed=True`).
        """
        key = self._key(run_id)
        columns = tables.STAT_COLUMNS if columns is None else tuple(columns)
        unknown = [c for c in columns if c not in tables.STAT_COLUMNS]
        if unknown:
            raise ValueError(
                f"`columns` must be among {list(tables.STAT_COLUMNS)}, got unknown {unknown}."
            )
        series = self._series(key)
        # Blocks are picked by their newest step; the rows within are filtered below.
        where, params = _newer_than("run = ?", [key], after_step, column="last_step")
        rows = (
            self._conn()
            .execute(
                f"SELECT steps, series, {', '.join(columns)} FROM layer_stats WHERE {where} "
                f"ORDER BY id",
                params,
            )
            .fetchall()
        )
        data = blocks.unpack(rows, columns)
        if len(data["series"]) and data["series"].max() >= series.size:
            # A writer committed new series between our two reads.
            series = self._series(key)
        keep = None
        if after_step is not None:
            keep = data["step"] > int(after_step)
        if tensors is not None:
            tensors = [tensors] if isinstance(tensors, str) else list(tensors)
            frame = series.frame
            wanted = frame["tensor"].map(lambda n: any(schema.is_tensor(n, t) for t in tensors))
            ids = frame.loc[wanted.astype(bool), "series"].to_numpy(dtype=np.int64)
            chosen = np.isin(data["series"], ids)
            keep = chosen if keep is None else keep & chosen
        if keep is not None and not keep.all():
            data = {name: array[keep] for name, array in data.items()}
        return _name_series(data, series, columns)

    def metrics(self, run_id, after_step=None, names=None):
        """The run's per-step scalars in long form.

        Args:
            run_id: the run.
            after_step: only rows with `step > after_step`, default all.
            names: only these metric names, default all.

        Returns:
            A DataFrame with columns `step, name, value`, sorted by step.
        """
        key = self._key(run_id)
        where, params = "run = ?", [key]
        where, params = _newer_than(where, params, after_step)
        if names is not None:
            names = [names] if isinstance(names, str) else list(names)
            where += f" AND name IN ({', '.join('?' * len(names))})"
            params.extend(names)
        rows = (
            self._conn()
            .execute(
                f"SELECT step, name, value FROM metrics WHERE {where} ORDER BY step, name", params
            )
            .fetchall()
        )
        frame = pd.DataFrame(rows, columns=list(schema.METRICS_COLUMNS))
        frame["step"] = frame["step"].astype("int64")
        frame["name"] = frame["name"].astype(object)
        frame["value"] = frame["value"].astype("float64")
        return frame

    def events(self, run_id, after_step=None):
        """The run's events (NaN origin, rule alerts), in the order they happened.

        Returns:
            A DataFrame with columns `step, layer, kind, message`.
        """
        key = self._key(run_id)
        where, params = "run = ?", [key]
        where, params = _newer_than(where, params, after_step)
        rows = (
            self._conn()
            .execute(
                f"SELECT step, layer, kind, message FROM events WHERE {where} ORDER BY step, id",
                params,
            )
            .fetchall()
        )
        frame = pd.DataFrame(rows, columns=list(schema.EVENTS_COLUMNS))
        frame["step"] = frame["step"].astype("int64")
        return frame

    def histograms(self, run_id, layer=None, tensor=None, after_step=None):
        """The run's log10|g| histograms, one row per step x layer x tensor.

        Args:
            run_id: the run.
            layer: only this layer, default all.
            tensor: only this tensor name, default all.
            after_step: only rows with `step > after_step`, default all.

        Returns:
            A DataFrame with `step, layer, layer_index, tensor` and one count
            column per bin, `b0` .. `b{HISTOGRAM_BINS - 1}` (see
            `gradflow.schema.histogram_bin_labels`).
        """
        key = self._key(run_id)
        series = self._series(key)
        frame = series.frame
        keep = pd.Series(True, index=frame.index)
        if layer is not None:
            keep &= frame["layer"] == layer
        if tensor is not None:
            keep &= frame["tensor"] == tensor
        ids = frame.loc[keep, "series"].tolist()
        where, params = f"run = ? AND series IN ({', '.join('?' * len(ids))})", [key] + ids
        where, params = _newer_than(where, params, after_step)
        rows = (
            self._conn()
            .execute(
                f"SELECT step, series, counts FROM histograms WHERE {where} ORDER BY step, series",
                params,
            )
            .fetchall()
            if ids
            else []
        )
        if rows and max(r[1] for r in rows) >= series.size:
            series = self._series(key)
        bins = [f"b{i}" for i in range(schema.HISTOGRAM_BINS)]
        counts = (
            np.frombuffer(b"".join(r[2] for r in rows), dtype="<i8").reshape(-1, len(bins))
            if rows
            else np.zeros((0, len(bins)), dtype=np.int64)
        )
        data = pd.DataFrame(
            {
                "step": np.array([r[0] for r in rows], dtype=np.int64),
                "series": np.array([r[1] for r in rows], dtype=np.int64),
            }
        )
        named = _name_series(data, series, ())
        named = named.drop(columns=["variable"])
        return pd.concat(
            [named.reset_index(drop=True), pd.DataFrame(counts.astype(np.int64), columns=bins)],
            axis=1,
        )

    def close(self):
        """Closes this thread's SQLite connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            _close_quietly(conn)
            self._local.conn = None

    # Internals ------------------------------------------------------------

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = tables.connect(self.path, create=not self._made)
        return conn

    def _check_id(self, run_id):
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
            raise ValueError(
                f"`run_id` must be a run id string such as '3f2a9c1b7d04' (letters, digits, "
                f"'-' or '_'), got {run_id!r}."
            )

    def _unknown(self, run_id):
        return UnknownRunError(f"`run_id` {run_id!r} is not in the run store {str(self.path)!r}.")

    def _key(self, run_id):
        self._check_id(run_id)
        row = self._conn().execute("SELECT id FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise self._unknown(run_id)
        return row[0]

    def _run_row(self, run_id, column):
        self._check_id(run_id)
        row = (
            self._conn()
            .execute(f"SELECT {column} FROM runs WHERE run_id = ?", (run_id,))
            .fetchone()
        )
        if row is None:
            raise self._unknown(run_id)
        return row[0]

    def _update(self, run_id, column, value):
        key = self._key(run_id)
        self._conn().execute(
            f"UPDATE runs SET {column} = ?, updated_at = ? WHERE id = ?", (value, time.time(), key)
        )

    def _series(self, key):
        """The run's `series` table as a `_SeriesTable`, cached per process.

        Series are only ever added to a run, so a cached table is current
        while the run's count of series is the same; the run's creation time
        tells a new run from a deleted one that had the same key. Live pages
        read every second, and building the table was a third of a poll.
        """
        conn = self._conn()
        created, count = conn.execute(
            "SELECT (SELECT created_at FROM runs WHERE id = ?), "
            "(SELECT COUNT(*) FROM series WHERE run = ?)",
            (key, key),
        ).fetchone()
        cached = self._series_cache.get(key)
        if cached is not None and cached.created == created and len(cached) == count:
            return cached
        rows = conn.execute(
            "SELECT series, layer, layer_index, tensor, variable FROM series WHERE run = ? "
            "ORDER BY series",
            (key,),
        ).fetchall()
        table = _SeriesTable(
            pd.DataFrame(rows, columns=["series", "layer", "layer_index", "tensor", "variable"]),
            created,
        )
        if len(self._series_cache) >= _SERIES_CACHE_SIZE:
            self._series_cache.clear()
        self._series_cache[key] = table
        return table


class _SeriesTable:
    """A run's series (`frame`) with what naming rows needs, computed once."""

    def __init__(self, frame, created):
        self.frame = frame
        self.created = created
        ids = frame["series"].to_numpy(dtype=np.int64)
        self.size = int(ids.max()) + 1 if len(ids) else 0
        self.position = np.zeros(self.size, dtype=np.int64)
        self.position[ids] = np.arange(len(ids))
        self.codes = {name: _codes(frame[name]) for name in ("layer", "tensor", "variable")}
        self.layer_index = frame["layer_index"].to_numpy(dtype=np.int64)

    def __len__(self):
        return len(self.frame)


_SQLITE_HEADER = b"SQLite format 3\x00"


def check_store_path(path, argument="path"):
    """Raise unless `path` can be a run store: a new or empty file, or an SQLite file.

    SQLite's own words come later and name neither the argument nor the file
    ("unable to open database file", "file is not a database").

    Args:
        path: The path to check.
        argument: The argument's name for the message.

    Raises:
        NotARunStoreError: a `ValueError` (and `sqlite3.DatabaseError`)
            naming `argument` and the path.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        raise NotARunStoreError(
            f"`{argument}` must be a run-store file, got the folder {str(path)!r}: "
            f"e.g. {str(path / 'runs.db')!r}."
        )
    if not path.is_file() or path.stat().st_size == 0:
        return
    # Only through SQLite: closing any descriptor of the file drops every
    # lock this process holds on it (POSIX), so a plain `open` of a store a
    # connection of this process has open let another process's close take
    # the write-ahead log away under it, and this process's writes were lost.
    names = _tables_in(path)
    if names is None:
        # Not an SQLite file, so no connection of ours holds locks on it.
        with open(path, "rb") as file:
            head = file.read(len(_SQLITE_HEADER))
        raise NotARunStoreError(
            f"`{argument}`={str(path)!r} is not a gradflow run store (an SQLite file): "
            f"it starts with {head[:8]!r}. Give a new file name, e.g. 'runs.db'."
        )
    others = [] if not names or "runs" in names else names
    if others:
        # The store would have added its tables beside them, silently.
        raise NotARunStoreError(
            f"`{argument}`={str(path)!r} is an SQLite database of something else (its "
            f"tables: {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}), not a "
            "gradflow run store; gradflow leaves it alone. Give a new file name, e.g. "
            "'runs.db'."
        )


def _tables_in(path):
    """The table names of the SQLite file at `path`, or None if it is not one.

    Other SQLite errors (a locked or unreadable file) give [] here: the
    store's own opening says what is wrong with it.
    """
    try:
        conn = sqlite3.connect(f"{pathlib.Path(path).resolve().as_uri()}?mode=ro", uri=True)
        try:
            return [
                row[0]
                for row in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
                )
            ]
        finally:
            conn.close()
    except sqlite3.DatabaseError as error:
        if "not a database" in str(error):
            return None
        return []
    except sqlite3.Error:
        return []


def _newer_than(where, params, after_step, column="step"):
    """Add the live-polling filter `column > after_step` to a WHERE clause (None: no filter)."""
    if after_step is None:
        return where, params
    return f"{where} AND {column} > ?", [*params, whole_number("after_step", after_step)]


def _name_series(data, series, columns):
    """Replaces integer series ids with layer, layer_index, tensor, variable.

    Args:
        data: a dict (or DataFrame) with `step`, `series` and `columns`.
        series: the run's `_SeriesTable`.
        columns: the statistic columns to keep from `data`.
    """
    ids = np.asarray(data["series"])
    if len(ids) and (ids.max() >= series.size):
        raise RuntimeError("The run store has rows for an unknown series; is the file damaged?")
    out = {"step": np.asarray(data["step"], dtype=np.int64)}
    rows = series.position[ids]
    for name in ("layer", "tensor", "variable"):
        categories, codes = series.codes[name]
        out[name] = pd.Categorical.from_codes(codes[rows], categories=categories)
    out["layer_index"] = series.layer_index[rows]
    for c in columns:
        out[c] = np.asarray(data[c], dtype=np.float64)
    return pd.DataFrame(out, columns=[*schema.KEY_COLUMNS, *columns])


def _codes(values):
    codes, uniques = pd.factorize(values, sort=False)
    return pd.Index(uniques, dtype=object), codes.astype(np.int32)


# As `RunConfig.name`: a name is a label in tables, titles and file names.
MAX_NAME_LENGTH = 200


# C0 and C1 control characters and DEL (Unicode's Cc): an ESC in a run name
# acted on the terminal of whoever ran `gradflow runs`, and a BEL made every
# SVG of the run invalid XML and its PNG and PDF fail.


def check_name(name, argument="name"):
    """Refuse a run name that holds a control character (tab, newline, ESC, BEL, ...).

    Args:
        name: The name, a string.
        argument: How the error names it (`run_name`, `--name`). Defaults to `"name"`.

    Returns:
        `name`.

    Raises:
        ValueError: If it holds one; the message shows the name with `!r`.
    """
    if schema.CONTROL_CHARACTERS.search(name) or schema.BIDI_CONTROLS.search(name):
        raise ValueError(
            f"`{argument}` must not contain control characters (tabs, line breaks, "
            f"escape codes, right-to-left overrides), got {name!r}."
        )
    return name


def shortened(text, most):
    """`text` cut to `most` characters, its last one "…" when it was cut."""
    return text if len(text) <= most else text[: most - 1] + "\u2026"


def _check_name(name):
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"`name` must be at most {MAX_NAME_LENGTH} characters, got {len(name):,}: "
            f"{name[:40]!r}..."
        )
    return check_name(name)


def _check_status(status):
    if status not in tables.STATUSES:
        raise ValueError(f"`status` must be one of {tables.STATUSES}, got {status!r}.")


def _check_tags(tags):
    if isinstance(tags, str):
        tags = [tags]
    tags = list(tags)
    bad = [t for t in tags if not isinstance(t, str) or not t]
    if bad:
        raise ValueError(f"`tags` must be non-empty strings, got {bad!r}.")
    return sorted(set(tags))


def process_alive(pid):
    """Whether a process with this pid runs on this host (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _close_quietly(conn):
    try:
        conn.close()
    except Exception:  # Already closed, or its driver is gone.
        pass
