"""One run store and one run manager per Streamlit server process.

Training never runs in the server: the manager starts worker processes and
the pages only read the store. `st.cache_resource` makes both singletons shared
by every browser session, which is what caps concurrent runs server-wide.
"""

import atexit
import logging
import os
import threading

import streamlit as st

from gradflow.store import RunStore
from gradflow.ui import live_chart
from gradflow.ui.board import RunBoard

DEFAULT_WORKER_NICENESS = 10
# The dashboard gives every run a fresh worker (the library's RunManager lets
# one worker train 25 runs in turn). In a class of 30 on one 2-core machine,
# reused workers finished the short runs faster than the pages could follow
# them: class done in 179-194 s instead of 327 s, with a third of the server's
# CPU, but store -> page p95 12-30 s instead of 4.8 s, since each run start
# and end costs its page a full rerun, and those came two to three times as
# often (docs/reliability.md; again in the forty-ninth session: 129-135 s against
# 261-264 s, a quarter of the CPU, p95 16-23 s against 2.1-3.1 s).
# GRADFLOW_RUNS_PER_WORKER=25 chooses throughput.
DEFAULT_RUNS_PER_WORKER = 1


@st.cache_resource(show_spinner=False)
def run_store():
    """The server's run store (path from $GRADFLOW_DB, else ./gradflow-data/runs.db)."""
    store = RunStore()
    # Runs whose worker died with a previous server show `interrupted`.
    store.recover()
    return store


@st.cache_resource(show_spinner=False)
def run_manager():
    """The server's run manager: a queue, a cap on concurrent runs, warm workers."""
    from gradflow.lab.runner import RunManager

    # GRADFLOW_PREWARM=0 skips the warm spare worker (page smoke tests, tiny servers).
    prewarm = os.environ.get("GRADFLOW_PREWARM", "1") != "0"
    # GRADFLOW_MAX_RUNNING caps concurrent runs (default: one per CPU core).
    max_running = _setting("GRADFLOW_MAX_RUNNING", 0) or None
    # The workers train at a lower CPU priority than the server (nice +10 by
    # default, GRADFLOW_WORKER_NICENESS to change): when runs fill the cores,
    # the server still answers every page at once, and the runs use what the
    # pages leave (bench_classroom.py measures the difference).
    niceness = _setting("GRADFLOW_WORKER_NICENESS", DEFAULT_WORKER_NICENESS)
    # GRADFLOW_RUNS_PER_WORKER: runs one worker trains before a fresh one
    # replaces it (see DEFAULT_RUNS_PER_WORKER).
    runs_per_worker = _setting("GRADFLOW_RUNS_PER_WORKER", DEFAULT_RUNS_PER_WORKER)
    manager = RunManager(
        store=run_store(),
        prewarm=prewarm,
        max_running=max_running,
        worker_niceness=niceness,
        runs_per_worker=runs_per_worker,
    )
    atexit.register(manager.shutdown)
    return manager


def run_board():
    """The server's run board (`gradflow.ui.board`), or None where static files are not served.

    Pages then poll the server with fragment ticks, as they did before it.
    """
    folder = live_chart.published_folder()
    return None if folder is None else _run_board(str(folder), live_chart.static_url())


@st.cache_resource(show_spinner=False)
def _run_board(folder, url):
    try:
        return RunBoard(run_manager(), folder, url)
    except OSError as error:  # a read-only or full disk: pages tick instead
        logging.getLogger(__name__).warning(
            "gradflow: no run board in %s (%s); waiting pages poll.", folder, error
        )
        return None


def open_sessions():
    """Browser sessions connected to this server now (1 outside a server, as in AppTest)."""
    from streamlit.runtime import Runtime

    try:
        return int(Runtime.instance()._session_mgr.num_active_sessions())
    except (RuntimeError, AttributeError, TypeError):  # no server, or AppTest's stand-in runtime
        return 1


class _SpareUploads:
    """The server's one spare upload child (`gradflow.probe.uploads.SpareChild`).

    Started when someone opens the upload form, so that TensorFlow has
    started by the time they click Take snapshot; the click takes it, and
    the page's next run starts another. One for the whole server: a second
    upload at the same moment starts its own child, as without a spare.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._spare = None
        # GRADFLOW_PREWARM=0: no spare processes (page smoke tests, tiny servers).
        self.enabled = os.environ.get("GRADFLOW_PREWARM", "1") != "0"

    def ensure(self, memory_limit):
        """Start a spare unless one with `memory_limit` is ready."""
        if not self.enabled:
            return
        from gradflow.probe.uploads import SpareChild

        with self._lock:
            if self._spare is not None and self._spare.usable(memory_limit):
                return
            if self._spare is not None:
                self._spare.close()
            self._spare = SpareChild(memory_limit)

    def take(self):
        """The spare, now the caller's (None when there is none)."""
        with self._lock:
            spare, self._spare = self._spare, None
        return spare

    def close(self):
        spare = self.take()
        if spare is not None:
            spare.close()


@st.cache_resource(show_spinner=False)
def spare_uploads():
    """The server's spare upload child holder (stopped when the server exits)."""
    holder = _SpareUploads()
    atexit.register(holder.close)
    return holder


@st.cache_resource(show_spinner=False)
def upload_slots():
    """How many uploads the server works out at once: a semaphore, one per core by default.

    Each upload's child starts TensorFlow (about 600 MB) and may use up to
    its memory limit: thirty students clicking at once would have started
    thirty. $GRADFLOW_MAX_UPLOADS changes the number.
    """
    count = _setting("GRADFLOW_MAX_UPLOADS", 0) or os.cpu_count() or 1
    return threading.BoundedSemaphore(count), count


def upload_limits():
    """`(timeout in seconds, memory limit in bytes)` of the child that differentiates an upload.

    $GRADFLOW_UPLOAD_TIMEOUT_S and $GRADFLOW_UPLOAD_MEMORY_GIB change them
    (a server for one lecturer's large models, or a small shared one).
    """
    from gradflow.probe.uploads import UPLOAD_MEMORY_LIMIT, UPLOAD_TIMEOUT_S

    timeout = _setting("GRADFLOW_UPLOAD_TIMEOUT_S", 0) or UPLOAD_TIMEOUT_S
    gib = _setting("GRADFLOW_UPLOAD_MEMORY_GIB", 0)
    return float(timeout), (gib * 2**30 if gib else UPLOAD_MEMORY_LIMIT)


def _setting(name, default):
    """An integer from environment variable `name`, or `default` when unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"The environment variable {name} must be a whole number, got {value!r}."
        ) from None
