"""Batched writer of one run's statistics into the run store."""

import contextlib
import sqlite3
import threading
import time

import numpy as np
import pandas as pd

from gradflow import schema
from gradflow.checks import positive_number
from gradflow.store import blocks, tables

_SERIES_KEY = ("layer", "layer_index", "tensor", "variable")


class RunWriter:
    """Buffers one run's rows and writes them in one transaction at a time.

    Rows are kept in memory and written in a single transaction at least
    every `flush_interval` seconds, so a killed process loses at most that
    much. Layer, tensor and variable names are stored once per run as integer
    series ids; layer statistics go to disk as columnar blocks (see
    `gradflow.store.blocks`), which is what makes reading them back fast.

    Use `RunStore.writer(run_id)` rather than building one directly. One
    writer per run; its methods may be called from several threads.

    Example:

    ```python
    store = RunStore("runs.db")
    run_id = store.create_run({"depth": 4})
    with store.writer(run_id) as w:
        w.add_metrics(1, {"loss": 0.7})
        w.progress(1)
    ```

    Args:
        path: the database file.
        run_key: the run's integer key in the `runs` table.
        run_id: the run's public id.
        flush_interval: seconds between writes, default 0.5.
        background_flush: write from a daemon thread (default True), so the
            training thread never waits on the disk and rows reach the store
            even when no new rows arrive. When False, `add_*` calls write
            once the interval has passed.

    Raises:
        ValueError: if `flush_interval` is not a positive number of seconds.
    """

    def __init__(self, path, run_key, run_id, flush_interval=0.5, background_flush=True):
        self.run_id = run_id
        # Set once a write found the run deleted: its rows are dropped, not written.
        self.run_deleted = False
        # The last background write's error (a full disk, a lock held too
        # long), None once a write gets through: the rows wait in memory, and
        # the monitor tells its user once.
        self.write_error = None
        self.flush_interval = positive_number("flush_interval", flush_interval, unit="of seconds")
        self._run = run_key
        self._conn = tables.connect(path, create=False)
        # Re-entrant: `batch()` holds it around the add calls it contains.
        self._buffer_lock = threading.RLock()
        self._batch_depth = 0
        self._write_lock = threading.Lock()
        self._series = {}
        self._series_by_tensor = {}
        for sid, layer, index, tensor, variable in self._conn.execute(
            "SELECT series, layer, layer_index, tensor, variable FROM series WHERE run = ?",
            (run_key,),
        ):
            self._remember_series((layer, index, tensor, variable), sid)
        self._next_series = max(self._series.values(), default=-1) + 1
        self._reset_buffers()
        self._last_flush = time.monotonic()
        self._closed = threading.Event()
        self._finished = False  # closed for good: everything written
        self._wake = threading.Event()
        self._wrote_rows = False
        self._thread = None
        if background_flush:
            self._thread = threading.Thread(
                target=self._flush_periodically, name=f"gradflow-writer-{run_id}", daemon=True
            )
            self._thread.start()

    # Adding rows ------------------------------------------------------------

    def add_layer_stats(self, rows):
        """Adds tidy layer-statistics rows.

        Args:
            rows: a DataFrame (or a list of dicts) with the columns of
                `gradflow.schema.LAYER_STATS_COLUMNS`; missing statistic
                columns are stored as NaN, `variable` defaults to `""`.
        """
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
        if frame.empty:
            return
        missing = [c for c in ("step", "layer", "layer_index", "tensor") if c not in frame]
        if missing:
            raise ValueError(
                f"`rows` must have the columns {list(schema.KEY_COLUMNS)}; missing {missing}."
            )
        steps = frame["step"].to_numpy(dtype=np.int64)
        values = frame.reindex(columns=list(tables.STAT_COLUMNS)).to_numpy(
            dtype=np.float64, na_value=np.nan
        )
        variables = frame["variable"].fillna("") if "variable" in frame else [""] * len(frame)
        keys = (
            frame["layer"].astype(str).to_numpy(dtype=object),
            frame["layer_index"].to_numpy(dtype=np.int64),
            frame["tensor"].astype(str).to_numpy(dtype=object),
            np.asarray(variables, dtype=object).astype(str).astype(object),
        )
        # One dictionary lookup per distinct series rather than per row: a
        # monitor hands over many steps of the same few series at once.
        # `combined` numbers the distinct keys 0, 1, ... in order of first
        # appearance, so new series get ids in the order they were written.
        combined = np.zeros(len(frame), dtype=np.int64)
        for column in keys:
            codes, uniques = pd.factorize(column)
            combined = pd.factorize(combined * len(uniques) + codes)[0]
        _, first = np.unique(combined, return_index=True)
        with self._buffer_lock:
            ids = np.array(
                [
                    self._series_id(
                        (str(keys[0][row]), int(keys[1][row]), str(keys[2][row]), str(keys[3][row]))
                    )
                    for row in first
                ],
                dtype=np.int64,
            )
            self._stats.append((steps, ids[combined], values))
            self._note_progress(steps)
        self._maybe_flush()

    def add_layer_stats_array(self, steps, values, series):
        """Adds the statistics of several steps of the same series, as arrays.

        What `add_layer_stats` does for a DataFrame, without one: a
        `GradientMonitor` hands over every step in the same row layout, so
        the series ids are looked up once per call and the rest is numpy.

        Example:

        ```python
        series = [("dense", 0, "kernel", "dense/kernel"), ("dense", 0, "bias", "dense/bias")]
        values = np.zeros((3, 2, len(gradflow.store.tables.STAT_COLUMNS)))
        writer.add_layer_stats_array([1, 2, 3], values, series)
        ```

        Args:
            steps: ints `[n]`, the steps.
            values: floats `[n, len(series), len(tables.STAT_COLUMNS)]`,
                columns in the order of `tables.STAT_COLUMNS`.
            series: one `(layer, layer_index, tensor, variable)` tuple per
                row of a step.

        Raises:
            ValueError: if the shapes of `steps`, `values` and `series`
                disagree.
        """
        steps = np.asarray(steps, dtype=np.int64)
        values = np.asarray(values, dtype=np.float64)
        expected = (len(steps), len(series), len(tables.STAT_COLUMNS))
        if values.shape != expected:
            raise ValueError(
                f"`values` must have the shape (steps, series, statistics) = {expected}, "
                f"got {values.shape}."
            )
        if not len(steps) or not len(series):
            return
        keys = [
            (str(layer), int(index), str(tensor), str(variable or ""))
            for layer, index, tensor, variable in series
        ]
        with self._buffer_lock:
            ids = np.array([self._series_id(key) for key in keys], dtype=np.int64)
            self._stats.append(
                (
                    np.repeat(steps, len(keys)),
                    np.tile(ids, len(steps)),
                    values.reshape(len(steps) * len(keys), -1),
                )
            )
            self._note_progress(steps)
        self._maybe_flush()

    def add_metrics(self, step, values):
        """Adds per-step scalars such as `{"loss": 0.3, "accuracy": 0.9}`.

        Args:
            step: the 1-based optimizer step.
            values: a mapping from metric name to a number (NaN and inf kept).
        """
        step = int(step)
        rows = [(self._run, step, str(name), _to_float(value)) for name, value in values.items()]
        with self._buffer_lock:
            self._metrics.extend(rows)
        self._maybe_flush()

    def add_event(self, step, layer, kind, message):
        """Adds an event such as the origin of a NaN.

        Args:
            step: the step it happened at.
            layer: the layer it concerns (`""` for the whole model).
            kind: one of `gradflow.schema.EVENT_KINDS`.
            message: a sentence for people.
        """
        if kind not in schema.EVENT_KINDS:
            raise ValueError(f"`kind` must be one of {schema.EVENT_KINDS}, got {kind!r}.")
        with self._buffer_lock:
            self._events.append((self._run, int(step), str(layer or ""), kind, str(message)))
        self._maybe_flush()

    def add_histograms(self, step, rows):
        """Adds log10|g| histograms with the fixed bins of `gradflow.schema`.

        Args:
            step: the step they belong to.
            rows: an iterable of `(layer, layer_index, tensor, counts)` where
                counts has `schema.HISTOGRAM_BINS` entries.
        """
        step = int(step)
        with self._buffer_lock:
            for layer, layer_index, tensor, counts in rows:
                counts = np.asarray(counts)
                if counts.shape != (schema.HISTOGRAM_BINS,):
                    raise ValueError(
                        f"histogram `counts` must have shape ({schema.HISTOGRAM_BINS},), "
                        f"got {counts.shape} for layer {layer!r} tensor {tensor!r}."
                    )
                sid = self._series_by_tensor.get((str(layer), str(tensor)))
                if sid is None:
                    sid = self._series_id((str(layer), int(layer_index), str(tensor), ""))
                blob = counts.astype("<i8").tobytes()
                self._histograms.append((self._run, step, sid, blob))
        self._maybe_flush()

    def _note_progress(self, steps):
        # A run's progress is never behind its newest stored statistics, so a
        # live reader can skip the statistics while the progress stands still.
        self._progress = max(int(steps.max()), self._progress or 0)

    @contextlib.contextmanager
    def batch(self):
        """Everything added inside reaches the store in the same transaction.

        A reader never sees a step's statistics without the metrics and
        histograms added with them (a live page reads only rows newer than
        what it has, so a step split over two flushes could lose its loss).

        Example:

        ```python
        with writer.batch():
            writer.add_layer_stats_array(steps, values, series)
            writer.add_metrics(steps[-1], {"loss": 0.3})
        ```
        """
        with self._buffer_lock:
            self._batch_depth += 1
            try:
                yield self
            finally:
                self._batch_depth -= 1
        self._maybe_flush()

    def progress(self, step=None):
        """Records the run's progress and that its process is alive.

        Args:
            step: the last finished step, or None for a heartbeat only.
        """
        with self._buffer_lock:
            if step is not None:
                self._progress = max(int(step), self._progress or 0)
            self._heartbeat = True
        self._maybe_flush()

    # Writing ----------------------------------------------------------------

    def flush(self):
        """Writes everything buffered so far in one transaction."""
        with self._write_lock:
            with self._buffer_lock:
                pending = self._take_buffers()
            self._last_flush = time.monotonic()
            if pending is None:
                return
            try:
                self._write(*pending)
            except Exception:
                with self._buffer_lock:
                    self._restore_buffers(pending)
                raise

    def close(self, status=None, message=None):
        """Flushes, optionally sets the run's final status, and closes.

        When the store cannot be written (a full disk, a lock held longer
        than 30 s), this raises SQLite's error and keeps the unwritten rows
        and the connection: calling `close` again, once mended, writes them.

        Args:
            status: None to leave the status alone, else one of
                `RunStore` statuses (`"completed"`, `"stopped"`, ...).
            message: why the run ended, for people (kept with the status).
        """
        if status is not None and status not in tables.STATUSES:
            raise ValueError(f"`status` must be one of {tables.STATUSES}, got {status!r}.")
        if self._finished:
            return
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()
        if status is not None:
            with self._write_lock:
                self._conn.execute(
                    "UPDATE runs SET status = ?, message = ?, updated_at = ?, heartbeat_at = ? "
                    "WHERE id = ?",
                    (status, message, time.time(), time.time(), self._run),
                )
        self.write_error = None
        # The finished run into the main file now, not at some later
        # writer's checkpoint: a '-wal' file removed by hand (or a copy of
        # the store without it) lost whole runs that had been written.
        with contextlib.suppress(sqlite3.Error):
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        self._conn.close()
        self._finished = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()

    # Internals --------------------------------------------------------------

    def _remember_series(self, key, sid):
        self._series[key] = sid
        self._series_by_tensor.setdefault((key[0], key[2]), sid)

    def _series_id(self, key):
        sid = self._series.get(key)
        if sid is None:
            sid = self._next_series
            self._next_series += 1
            self._remember_series(key, sid)
            self._new_series.append((self._run, sid) + key)
        return sid

    def _reset_buffers(self):
        self._new_series, self._stats, self._metrics = [], [], []
        self._events, self._histograms = [], []
        self._progress, self._heartbeat = None, False

    def _take_buffers(self):
        pending = (
            self._new_series,
            self._stats,
            self._metrics,
            self._events,
            self._histograms,
            self._progress,
            self._heartbeat,
        )
        if not any(pending[:5]) and pending[5] is None and not pending[6]:
            return None
        self._reset_buffers()
        return pending

    def _restore_buffers(self, pending):
        series, stats, metrics, events, histograms, progress, heartbeat = pending
        self._new_series[:0] = series
        self._stats[:0] = stats
        self._metrics[:0] = metrics
        self._events[:0] = events
        self._histograms[:0] = histograms
        if progress is not None:
            self._progress = max(progress, self._progress or 0)
        self._heartbeat = self._heartbeat or heartbeat

    def _write(self, series, stats, metrics, events, histograms, progress, heartbeat):
        conn = self._conn
        now = time.time()
        if stats:
            # Packed before the transaction, so the write lock is held only for
            # the inserts.
            stats = blocks.pack(
                self._run,
                np.concatenate([s[0] for s in stats]),
                np.concatenate([s[1] for s in stats]),
                np.concatenate([s[2] for s in stats]),
            )
        with tables.write_transaction(conn):
            # The run's row first: no row updated means it was deleted while it
            # trained (`RunStore.delete`), and rows written now would stay in the
            # file with no run; the next run, which gets its row number back,
            # showed them as its own.
            if progress is not None:
                updated = conn.execute(
                    "UPDATE runs SET progress_step = MAX(progress_step, ?), heartbeat_at = ? "
                    "WHERE id = ?",
                    (progress, now, self._run),
                )
            else:
                updated = conn.execute(
                    "UPDATE runs SET heartbeat_at = ? WHERE id = ?", (now, self._run)
                )
            if updated.rowcount == 0:
                self.run_deleted = True
                return
            if series:
                conn.executemany(
                    "INSERT OR IGNORE INTO series (run, series, layer, layer_index, tensor, "
                    "variable) VALUES (?, ?, ?, ?, ?, ?)",
                    series,
                )
            if stats:
                conn.executemany(
                    f"INSERT INTO layer_stats ({', '.join(blocks.INSERT_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(blocks.INSERT_COLUMNS))})",
                    stats,
                )
            if metrics:
                conn.executemany(
                    "INSERT OR REPLACE INTO metrics (run, step, name, value) VALUES (?, ?, ?, ?)",
                    metrics,
                )
            if events:
                conn.executemany(
                    "INSERT INTO events (run, step, layer, kind, message) VALUES (?, ?, ?, ?, ?)",
                    events,
                )
            if histograms:
                conn.executemany(
                    "INSERT OR REPLACE INTO histograms (run, step, series, counts) "
                    "VALUES (?, ?, ?, ?)",
                    histograms,
                )

    def _maybe_flush(self):
        if self._batch_depth:
            return  # batch() flushes when it ends.
        if self._thread is not None:
            if not self._wrote_rows:
                # A new run's first rows go out at once: the dashboard shows
                # the first step without waiting a whole interval.
                self._wrote_rows = True
                self._wake.set()
        elif time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()

    def _flush_periodically(self):
        while not self._closed.is_set():
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.flush()
            except Exception as error:  # The next tick retries; close() raises for real.
                self.write_error = error
            else:
                self.write_error = None


def _to_float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return float(np.asarray(value).reshape(()))
