"""Stop the runs of browser sessions that have gone away.

A student who closes the tab should not leave a worker training for nobody
on a shared classroom server. Each run started from the dashboard is owned by
the browser sessions that started or opened it; a reaper thread stops active
runs whose owners have all been gone for `GRACE_SECONDS`. A page reload keeps
the run: the run id is in the URL, and the new session claims it. A student
who opens the teacher's shared link and closes it again leaves the teacher's
run training: the teacher's own session still owns it.

A run a user's script records is never stopped so: it is theirs. But one
paused from a tab that then went away waited for ever, in a script no one
was watching; it is resumed instead, once the sessions that paused it have
been gone as long.
"""

import os
import threading
import time

import streamlit as st
from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

GRACE_SECONDS = 30.0
CHECK_SECONDS = 5.0
# How often the server also marks runs whose process died as interrupted: a
# second dashboard on the store that was killed left its queued run "queued",
# waiting for ever on this one, until it started again.
RECOVER_SECONDS = 30.0


class SessionOwnership:
    """Which browser session owns which run, and a thread that reaps orphans.

    Args:
        store: The server's `RunStore`.
        grace_seconds: How long a run may outlive its session (reload time).
        trains_here: A function telling whether a run id trains in this
            server's workers, or None (default): every run. Two servers on
            one store each see only their own sessions: a student who closed
            a run's tab on one stopped the run a teacher's tab showed on the
            other. A server stops only the runs it trains.
    """

    def __init__(self, store, grace_seconds=GRACE_SECONDS, trains_here=None):
        self.store = store
        self.grace_seconds = grace_seconds
        self.trains_here = trains_here
        self._owners = _Sessions()  # those that started or opened each run
        self._pausers = _Sessions()  # those that paused or stepped each script's run
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._loop, name="gradflow-session-reaper", daemon=True
        )
        self._thread.start()

    def claim(self, run_id):
        """Make the current browser session one of the owners of `run_id`."""
        self._note(self._owners, run_id)

    def paused_script(self, run_id):
        """Note that the current browser session paused (or stepped) a script's run."""
        self._note(self._pausers, run_id)

    def _note(self, sessions, run_id):
        ctx = get_script_run_ctx()
        if ctx is not None:
            with self._lock:
                sessions.add(run_id, ctx.session_id)

    def reap(self, now=None):
        """Stop active runs whose sessions have all been gone longer than the grace period.

        Also resumes the scripts' runs whose pausers have been gone as long.

        Returns:
            The run ids asked to stop.
        """
        if not Runtime.exists():
            return []
        now = time.monotonic() if now is None else now
        session_manager = Runtime.instance()._session_mgr
        stopped = []
        with self._lock:
            for run_id in self._owners.left(session_manager, now, self.grace_seconds):
                ours = self.trains_here is None or self.trains_here(run_id)
                if ours and self.store.status(run_id) in ("queued", "running", "paused"):
                    self.store.request(run_id, "stop")
                    stopped.append(run_id)
            for run_id in self._pausers.left(session_manager, now, self.grace_seconds):
                try:
                    if self.store.status(run_id) == "paused":
                        self.store.request(run_id, "resume")
                except ValueError:
                    pass  # deleted meanwhile: the script resumes itself (`DashboardRequests`)
        return stopped

    def _loop(self):
        recovered = time.monotonic()
        while True:
            time.sleep(CHECK_SECONDS)
            try:
                self.reap()
                if time.monotonic() - recovered >= RECOVER_SECONDS:
                    recovered = time.monotonic()
                    self.store.recover(other_hosts=False)
            except Exception:  # noqa: BLE001 - a reaper must outlive a bad tick (deleted run, busy db)
                continue


class _Sessions:
    """Browser sessions per run, and since when all of a run's have been gone."""

    def __init__(self):
        self._sessions = {}  # run_id -> session ids
        self._gone_since = {}  # run_id -> monotonic time its last session was first missed

    def add(self, run_id, session_id):
        self._sessions.setdefault(run_id, set()).add(session_id)
        self._gone_since.pop(run_id, None)

    def left(self, session_manager, now, grace_seconds):
        """The runs whose sessions have all been gone `grace_seconds`; forgotten once listed."""
        for run_id, sessions in list(self._sessions.items()):
            # A session that is gone is kept: one whose connection only
            # dropped comes back with its id and claims nothing again.
            if any(session_manager.is_active_session(s) for s in sessions):
                self._gone_since.pop(run_id, None)
                continue
            if now - self._gone_since.setdefault(run_id, now) < grace_seconds:
                continue
            del self._sessions[run_id]
            self._gone_since.pop(run_id, None)
            yield run_id


@st.cache_resource(show_spinner=False)
def session_ownership():
    """The server's one `SessionOwnership`."""
    from gradflow.ui.resources import run_manager, run_store

    def trains_here(run_id):
        manager = run_manager()
        return run_id in manager.running() or run_id in manager.queued()

    grace = float(os.environ.get("GRADFLOW_SESSION_GRACE", GRACE_SECONDS))
    return SessionOwnership(run_store(), grace_seconds=grace, trains_here=trains_here)
