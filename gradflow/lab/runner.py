"""`RunManager`: worker processes for background runs, a visible queue, a warm spare.

Training never runs in a thread of the launching process (Keras does not
support training from threads, TF #39450, and the Streamlit server must stay
responsive): background runs train in worker processes
(`gradflow.lab.worker`), one run at a time each. A worker that finishes a run
takes the next queued one, or waits as the warm spare: importing TensorFlow
costs a core for several seconds, which a class of thirty short runs would
otherwise pay thirty times on the machine that also serves their pages.
Workers are started with `subprocess` rather than `multiprocessing`, so the
launcher's `__main__` (a Streamlit page, a user's script without an
`if __name__ == "__main__"` guard) is never imported again in the worker.
"""

import atexit
import collections
import os
import pathlib
import subprocess
import sys
import threading
import time

from gradflow.checks import flag, positive_int, positive_number
from gradflow.store import ACTIVE_STATUSES, RunStore

_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parent.parent.parent)
# Longest wait for a new run's first step before the next spare is started anyway.
_SPARE_HOLD_S = 15.0
# Runs a worker trains before a fresh one takes its place. Its memory stays
# flat from run to run (30 lab runs in one worker: 767-777 MiB,
# `python3 bench/bench_worker_memory.py`), but whatever
# TensorFlow or a data set might keep after a run ends with the process.
RUNS_PER_WORKER = 25


class RunManager:
    """Starts lab runs in worker processes, at most `max_running` at a time.

    Runs beyond the cap wait with status `queued` (the dashboard shows them)
    and start in order as slots free. One spare worker is kept warm: it has
    already imported TensorFlow and Keras and traced a tiny model, so a new
    run records its first step within about a second or two. When a run
    takes the spare, the next spare is started only once that run has made
    its first step (or after 15 s): importing TensorFlow takes a whole core
    for several seconds, and on a small machine it would slow down the very
    trace the user is waiting for. A worker whose run ends trains the next
    queued run, or becomes the spare (one is kept; others exit), and is
    replaced after `runs_per_worker` runs or a failed one. While every slot
    is busy no new spare is started then: the next run waits for a slot, and
    the worker that frees it takes the run. Workers are reaped
    when they end; a worker whose launcher dies marks its run `interrupted`
    and exits.

    Use one manager per launching process (`RunManager.for_store(store)`).

    Example:

    ```python
    manager = RunManager.for_store(RunStore())
    run_id = manager.start(RunConfig(steps=200))
    manager.wait(run_id)          # "completed"
    ```

    Args:
        store: a `RunStore` or its path, default the default store.
        max_running: the most runs training at once, default `os.cpu_count()`.
        prewarm: keep one warm spare worker, default True.
        threads_per_run: TensorFlow threads per worker, default
            `os.cpu_count() // max_running` (at least 1).
        poll_interval: seconds between looks at finished workers and the
            queue, default 0.2.
        worker_niceness: how much lower than this process's the CPU priority
            of the workers is, 0 (same, the default) to 19 (lowest), as in
            `nice -n`. A server gives its workers a lower priority so that
            pages stay responsive while training fills the cores; a worker
            alone on the machine trains as fast at any niceness.
        runs_per_worker: how many runs one worker process trains, one after
            another, before a fresh one takes its place; default 25. 1 gives
            every run a new process (and pays TensorFlow's import each time).

    Raises:
        ValueError: an argument is out of range; the message names it.
    """

    _managers = {}
    _managers_lock = threading.Lock()

    def __init__(
        self,
        store=None,
        max_running=None,
        prewarm=True,
        threads_per_run=None,
        poll_interval=0.2,
        worker_niceness=0,
        runs_per_worker=RUNS_PER_WORKER,
    ):
        self.store = store if isinstance(store, RunStore) else RunStore(store)
        cpus = os.cpu_count() or 1
        self.max_running = positive_int("max_running", max_running or cpus)
        self.threads_per_run = positive_int(
            "threads_per_run", threads_per_run or max(1, cpus // self.max_running)
        )
        self.worker_niceness = _niceness(worker_niceness)
        self.runs_per_worker = positive_int("runs_per_worker", runs_per_worker)
        self.prewarm = flag("prewarm", prewarm)
        self.poll_interval = positive_number("poll_interval", poll_interval, unit="of seconds")
        self._queue = collections.deque()
        self._running = {}
        # Warm workers without a run: the spare, or one whose run just ended.
        self._idle = []
        self._exiting = []  # workers told to exit (or exiting by themselves), not yet reaped
        self._handed_again = set()  # runs whose worker was killed before it took them
        self._starting = {}  # run id -> when to stop holding the next spare back
        self._lock = threading.RLock()
        self._closed = False
        self._log_path = self.store.path.parent / "workers.log"
        if self.prewarm:
            self._idle.append(self._spawn())
        self._thread = threading.Thread(
            target=self._watch, name="gradflow-run-manager", daemon=True
        )
        self._thread.start()
        atexit.register(self.shutdown)

    @classmethod
    def for_store(cls, store=None, **options):
        """The manager of this process for `store`, created on first use.

        Args:
            store: a `RunStore` or a path, default the default store.
            **options: `RunManager` arguments, used when it is created.
        """
        path = (store.path if isinstance(store, RunStore) else RunStore(store).path).resolve()
        with cls._managers_lock:
            manager = cls._managers.get(path)
            if manager is None or manager._closed:
                manager = cls._managers[path] = cls(store, **options)
            return manager

    def start(self, config, name=None):
        """Queues a run and starts it as soon as a slot is free.

        Args:
            config: a `RunConfig` (or its dict).
            name: a name for the run, default `config.name` or `"run N"`.

        Returns:
            The new run id (status `queued`, soon `running`).
        """
        from gradflow.lab.config import RunConfig

        if isinstance(config, dict):
            config = RunConfig.from_dict(config)
        if not isinstance(config, RunConfig):
            raise TypeError(
                f"`config` must be a gradflow.RunConfig or a dict of its fields, "
                f"got {type(config).__name__}."
            )
        if self._closed:
            raise RuntimeError("This RunManager was shut down; make a new one.")
        run_id = self.store.create_run(
            config.to_dict(),
            name=name or config.name,
            source="lab",
            total_steps=None if config.epochs else config.steps,
            status="queued",
        )
        with self._lock:
            self._queue.append(run_id)
            self._schedule()
        return run_id

    def queued(self):
        """Run ids waiting for a slot, in the order they will start."""
        with self._lock:
            return list(self._queue)

    def running(self):
        """Run ids whose worker process is alive, with the worker's pid."""
        with self._lock:
            return {run_id: proc.pid for run_id, proc in self._running.items()}

    def worker_pids(self):
        """Pids of every worker process of this manager, the warm spare included."""
        with self._lock:
            pids = [proc.pid for proc in self._running.values()]
            pids += [proc.pid for proc in self._idle + self._exiting if _alive(proc)]
            return pids

    def wait_warm(self, timeout=None):
        """Waits until the spare worker has imported TensorFlow; True if it has."""
        spare = next(iter(self._idle), None)
        return spare is not None and spare.ready.wait(timeout)

    def warming(self):
        """Whether a spare worker is on its way: started, TensorFlow not imported yet.

        False while a spare is warm, and while none is coming: with reused
        workers and every slot busy, the worker that frees a slot takes the
        next run (no spare is started then).
        """
        with self._lock:
            return any(_alive(proc) and not proc.ready.is_set() for proc in self._idle)

    def wait(self, run_id, timeout=None):
        """Waits for a run to end and returns its final status.

        Raises:
            TimeoutError: if it is still queued, running or paused after
                `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            status = self.store.status(run_id)
            if status not in ACTIVE_STATUSES:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Run {run_id} is still {status} after {timeout} s.")
            time.sleep(0.05)

    def poll(self):
        """Reaps finished workers and starts queued runs (also done every `poll_interval`)."""
        with self._lock:
            self._schedule()

    def shutdown(self):
        """Ends all workers of this manager: running runs become `interrupted`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for run_id in self._queue:
                self.store.set_status(
                    run_id,
                    "interrupted",
                    "The launcher shut down before the run started.",
                    only_from=("queued",),
                )
            self._queue.clear()
            procs = list(self._running.values()) + self._idle + self._exiting
            self._idle, self._exiting = [], []
            for proc in procs:
                _close_quietly(proc.stdin)  # The worker's lifeline.
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._reap()

    # Internals --------------------------------------------------------------

    def _watch(self):
        while not self._closed:
            time.sleep(self.poll_interval)
            try:
                self.poll()
            except Exception:  # A busy store must not kill the manager; retry.
                pass

    def _schedule(self):
        if self._closed:
            return
        self._reap()
        while self._queue and len(self._running) < self.max_running:
            run_id = self._queue.popleft()
            if self.store.status(run_id) != "queued":  # Stopped or deleted while waiting.
                continue
            worker = self._take_idle() or self._spawn()
            if not _hand(worker, run_id):  # It died while it waited; a fresh one takes the run.
                worker = self._spawn()
                _hand(worker, run_id)
            self._running[run_id] = worker
            self._starting[run_id] = time.monotonic() + _SPARE_HOLD_S
        self._forget_started()
        # One warm worker waits (the readiest); any other exits.
        self._idle.sort(key=lambda proc: not proc.ready.is_set())
        for proc in self._idle[int(self.prewarm) :]:
            self._retire(proc)
        del self._idle[int(self.prewarm) :]
        if self.prewarm and not self._idle and not self._starting and self._spare_useful():
            self._idle.append(self._spawn())

    def _spare_useful(self):
        """Whether a new spare could get a run before a running worker is free again.

        With every slot busy, the next run waits for one; a worker with runs
        left takes it when its own run ends, warm, so a spare started now
        would only take CPU from the runs (importing TensorFlow: seconds of a
        whole core) and wait. A worker on its last run exits instead.
        """
        return len(self._running) < self.max_running or any(
            proc.runs_left == 0 for proc in self._running.values()
        )

    def _take_idle(self):
        """A warm worker without a run (the readiest), or None."""
        self._idle = [proc for proc in self._idle if _alive(proc)]
        if not self._idle:
            return None
        proc = next((proc for proc in self._idle if proc.ready.is_set()), self._idle[0])
        self._idle.remove(proc)
        return proc

    def _retire(self, proc):
        _close_quietly(proc.stdin)  # Its lifeline: the worker exits.
        self._exiting.append(proc)

    def _forget_started(self):
        """Drops the runs that no longer hold the next spare back."""
        now = time.monotonic()
        for run_id, deadline in list(self._starting.items()):
            try:
                info = self.store.run_info(run_id) if run_id in self._running else None
            except ValueError:  # Deleted meanwhile.
                info = None
            if (
                info is None
                or now > deadline
                or info["progress_step"] > 0
                or info["status"] not in ("queued", "running")
            ):
                del self._starting[run_id]

    def _reap(self):
        self._exiting = [proc for proc in self._exiting if proc.poll() is None]
        for run_id, proc in list(self._running.items()):
            if proc.finished is not None:  # The run ended; the worker said so.
                del self._running[run_id]
                proc.run_id = None
                if proc.finished == "next" and _alive(proc):
                    self._idle.append(proc)  # `_schedule` gives it a run, keeps or retires it
                else:
                    self._retire(proc)
                continue
            code = proc.poll()
            if code is None:
                continue
            del self._running[run_id]
            if code < 0 and run_id not in self._handed_again and self._not_taken(run_id):
                # Killed before it took the run (while it waited as the spare):
                # the run has not started, so it goes first to another worker, once.
                self._handed_again.add(run_id)
                self._queue.appendleft(run_id)
                continue
            if code < 0:
                status, why = "interrupted", f"was killed by signal {-code}"
            else:
                status, why = "failed", f"ended unexpectedly with exit code {code}"
            self.store.set_status(
                run_id,
                status,
                f"The worker process {why}; see {self._log_path}.",
                only_from=ACTIVE_STATUSES,
            )

    def _not_taken(self, run_id):
        """Whether no worker has started run `run_id` yet (it still reads `queued`)."""
        try:
            return self.store.status(run_id) == "queued"
        except ValueError:  # Deleted meanwhile.
            return False

    def _spawn(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        # Outright: a user's exported KERAS_BACKEND=jax crashed every worker.
        env["KERAS_BACKEND"] = "tensorflow"
        log = open(self._log_path, "ab")
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gradflow.lab.worker",
                    "--db",
                    str(self.store.path.resolve()),
                    "--threads",
                    str(self.threads_per_run),
                    "--niceness",
                    str(self.worker_niceness),
                    "--runs",
                    str(self.runs_per_worker),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                start_new_session=True,  # Ctrl-C in a terminal goes to the launcher only.
            )
        finally:
            log.close()
        proc.run_id = None
        proc.finished = None  # "next" or "done" once its run ended (`_read_output`)
        proc.runs_left = self.runs_per_worker  # after the run it trains now (`_hand`)
        proc.ready = threading.Event()
        threading.Thread(target=_read_output, args=(proc,), daemon=True).start()
        return proc


def _read_output(proc):
    """Follows what a worker says: `ready`, then `next RUN STATUS` or `done RUN STATUS` per run."""
    for line in proc.stdout:
        words = line.split()
        if words == ["ready"]:
            proc.ready.set()
        elif len(words) == 3 and words[0] in ("next", "done") and words[1] == proc.run_id:
            proc.finished = words[0]


def _hand(proc, run_id):
    """Give a worker its run through its stdin; False if the worker is gone."""
    proc.run_id, proc.finished = run_id, None
    proc.runs_left -= 1
    try:
        proc.stdin.write(f"{run_id}\n")
        proc.stdin.flush()
    except (BrokenPipeError, OSError, ValueError):  # ValueError: stdin already closed
        return False
    return True


def _alive(proc):
    return proc is not None and proc.poll() is None


def _close_quietly(stream):
    try:
        stream.close()
    except OSError:
        pass


def _niceness(value):
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 19:
        raise ValueError(
            f"`worker_niceness` must be an integer from 0 (same priority as the server) "
            f"to 19 (lowest), got {value!r}."
        )
    return value
