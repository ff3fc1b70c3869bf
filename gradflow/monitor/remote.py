"""`DashboardRequests`: Pause, Resume, Step once and Stop from the dashboard, for a script's run.

The lab's runs obey the Live page's buttons through `gradflow.lab.control.
RunControl`, in the worker that trains them. A run a script records into a
store (`GradientMonitor(store=...)`, `GradientLog(store=...)`) trains in the
user's own process: the page's buttons put the same requests in the store,
and this class, called by the monitor after each batch and by the log at
each `record`, takes them there. Looking at the store costs a read at most
every `poll_interval` seconds, nothing measurable per step.
"""

import contextlib
import sqlite3
import sys
import time

from gradflow.store import tables

# Seconds between looks at the store while training, and while paused.
POLL_SECONDS = 0.25
PAUSED_POLL_SECONDS = 0.1
# A paused run tells the store it is alive this often.
HEARTBEAT_SECONDS = 5.0
# A paused run whose store fails this long resumes: no Resume could reach it.
GIVE_UP_SECONDS = 30.0
# At most this many left-over requests dropped when an ended run trains again
# (`drop_left_over`; a click or two each).
_MOST_LEFT_OVER = 100


class DashboardRequests:
    """Takes the dashboard's requests for one run, in the process that trains it.

    `check()` after each step: it returns at once, or after a pause
    (held inside the call, so training waits between two steps) that the
    dashboard ended with Resume, Step once (one more step, then paused
    again) or Stop. A Stop returns `"stop"`: the caller ends training its
    own way (`model.stop_training` for `fit`; the loop's own check for a
    `GradientLog`).

    Example:

    ```python
    requests = DashboardRequests(store, run_id, on_pause=monitor.flush)
    if requests.check() == "stop":
        model.stop_training = True
    ```

    Args:
        store: the `RunStore` holding the run.
        run_id: the run whose requests to take.
        on_pause: called with no arguments before the run pauses, to write
            the steps still held, so the paused charts show the last one.
        poll_interval: seconds between looks at the store while training.
    """

    def __init__(self, store, run_id, on_pause=None, poll_interval=POLL_SECONDS):
        self.store = store
        self.run_id = run_id
        self.on_pause = on_pause
        self.poll_interval = poll_interval
        self.stopped = False  # whether a Stop came
        self._next_poll = 0.0
        self._stepping = False
        self._failing_since = None  # when the store began to fail, while it fails

    def check(self):
        """Take the requests that came since the last look; returns `"stop"` or None."""
        if self.stopped:
            return "stop"
        if self._stepping:
            # Step once: that step is done; paused again.
            return self._pause(quietly=True)
        now = time.monotonic()
        if now < self._next_poll:
            return None
        self._next_poll = now + self.poll_interval
        action = self._take()
        if action == "stop":
            return self._stop()
        if action in ("pause", "step"):
            # While running, Step once means: this step, then pause.
            return self._pause()
        return None  # none, a Resume of a run already running, or a Speed limit (lab runs only)

    def _take(self):
        try:
            action = self.store.pending_request(self.run_id)
        except sqlite3.Error:
            # A store busy or broken now: training goes on, asked again later.
            self._failing_since = self._failing_since or time.monotonic()
            return None
        except ValueError:
            # The run was deleted from the dashboard: no one can press Resume
            # now, and a paused script would wait for ever.
            return "resume"
        self._failing_since = None
        return None if tables.requested_pace(action)[0] else action

    def _stop(self):
        self.stopped = True
        # Stopped while paused: the script now trains to its end (a loop
        # until it reads the flag, `fit` through validation and its callbacks).
        self._set_status("running", ("paused",))
        return "stop"

    def _pause(self, quietly=False):
        """Hold training until Resume, Step once or Stop; returns `"stop"` or None.

        Unless `quietly` (paused again after Step once), the script's
        terminal says so: a `fit` that stops printing at 2 a.m. looks hung.
        """
        self._stepping = False
        if self.on_pause is not None:
            self.on_pause()
        shown = self._set_status("paused", ("running", "paused"))
        if shown is False:
            # No longer running (marked interrupted, or deleted): the page
            # offers no Resume, so waiting would be for ever.
            return None
        if not quietly:
            _say(
                f"gradflow: run {self.run_id} paused from the dashboard. Training waits for "
                "Resume, Step once or Stop there (Ctrl-C here interrupts it)."
            )
        try:
            action = self._wait(shown)
        except BaseException:
            # A Ctrl-C while held: the script goes on with other work (or
            # cleans up), which is not a pause the page may Resume.
            self._set_status("running", ("paused",))
            raise
        if not self._stepping:
            _say(
                f"gradflow: run {self.run_id} "
                + ("stopped from the dashboard." if action == "stop" else "trains again.")
            )
        return action

    def _wait(self, shown):
        """The pause itself; `shown`: whether the store took the status `paused`."""
        beat = since = time.monotonic()
        while True:
            action = self._take()
            if action == "resume":
                self._set_status("running", ("paused",))
                return None
            if action == "stop":
                return self._stop()
            if action == "step":
                self._stepping = True
                return None
            if not shown:
                # The page reads "running" and offers Pause, not Resume: try again.
                shown = self._set_status("paused", ("running", "paused"))
                if shown is False:
                    return None
            failing = self._failing_since or (None if shown else since)
            if failing and time.monotonic() - failing > GIVE_UP_SECONDS:
                # A store that stays broken can bring no Resume: train on.
                self._set_status("running", ("paused",))
                return None
            if time.monotonic() - beat >= HEARTBEAT_SECONDS:
                # A dashboard on another host reads a run that sends nothing
                # for a minute as interrupted (`RunStore.recover`).
                beat = time.monotonic()
                self._beat()
            time.sleep(PAUSED_POLL_SECONDS)

    def _beat(self):
        try:
            self.store.heartbeat(self.run_id)
        except (sqlite3.Error, ValueError):
            pass

    def _set_status(self, status, only_from):
        """True when set, False when the run is not in `only_from` (or gone), None when the
        store failed."""
        try:
            return self.store.set_status(self.run_id, status, only_from=only_from)
        except sqlite3.Error:
            return None
        except ValueError:
            return False  # the run is gone


def _say(line):
    """One line on the script's stderr, beside Keras's progress bar (which is on stdout)."""
    # A script whose stderr is closed (a daemon, a notebook's odd kernel) must not end at a Pause.
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def drop_left_over(store, run_id):
    """Drop the requests a run holds from before (call it while the run is not active).

    A Stop pressed as a monitor's last `fit` ended waited in the store, and
    stopped the same monitor's next `fit` at once.
    """
    for _ in range(_MOST_LEFT_OVER):
        if store.pending_request(run_id) is None:
            return


def stopped_message(step, last=None):
    """The run's message after the dashboard's Stop at `step`; `last`: the loop's last step."""
    if last is not None and last > step:
        return f"Stop was pressed on the dashboard after step {step}; the loop trained on to step {last}."
    return f"Stopped from the dashboard after step {step}."
