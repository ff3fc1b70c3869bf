"""`gradflow.train(config)` and the `Run` it returns."""

import math
import time

from gradflow import checks
from gradflow.diagnosis import run_layer_inputs
from gradflow.store import ACTIVE_STATUSES, RunStore


def train(config, background=False, store=None, name=None):
    """Trains a lab network and records its gradient statistics in the run store.

    In the foreground (the default) the run trains in this process and the
    finished `Run` is returned. With `background=True` it trains in a worker
    process and `train` returns at once; the run may first wait as `queued`
    when as many runs as CPUs are already training. A background run ends with
    the process that started it (it becomes `interrupted`): a script should
    call `run.wait()` before it exits.

    Example:

    ```python
    run = gradflow.train(gradflow.RunConfig(depth=8, activation="sigmoid", steps=200))
    run.status                                  # "completed"
    run.layer_stats.groupby("layer", observed=True)["l2_norm"].mean()

    live = gradflow.train(gradflow.RunConfig(steps=5000), background=True)
    live.pause(); live.step_once(); live.resume(); live.stop()
    ```

    Args:
        config: a `gradflow.RunConfig` (or a dict of its fields).
        background: train in a worker process and return at once. Defaults
            to False.
        store: a `gradflow.RunStore` or a path; default `$GRADFLOW_DB` or
            `./gradflow-data/runs.db`.
        name: a name for the run; default `config.name` or `"run N"`.

    Returns:
        A `Run`.

    Raises:
        TypeError: if `config` is not a `RunConfig` or a dict.
        ValueError: if a config field is invalid.
        RuntimeError: in the foreground, if this process's Keras is not
            Keras 3 on the TensorFlow backend (e.g. `KERAS_BACKEND=jax`).
    """
    from gradflow.lab.config import RunConfig

    if isinstance(config, dict):
        config = RunConfig.from_dict(config)
    if not isinstance(config, RunConfig):
        raise TypeError(
            f"`config` must be a gradflow.RunConfig or a dict of its fields, "
            f"got {type(config).__name__}."
        )
    background = checks.flag("background", background)  # "no" would start a worker
    store = store if isinstance(store, RunStore) else RunStore(store)
    if background:
        from gradflow.lab.runner import RunManager

        manager = RunManager.for_store(store)
        return Run(manager.start(config, name=name), store, manager)

    # A background run trains in a worker, which uses TensorFlow whatever
    # this process's Keras backend; this one must use it itself.
    checks.check_backend("gradflow.train")
    from gradflow.lab.worker import execute

    run_id = store.create_run(
        config.to_dict(),
        name=name or config.name,
        source="lab",
        total_steps=None if config.epochs else config.steps,
        status="running",
    )
    execute(store, run_id)
    return Run(run_id, store)


class Run:
    """One run in the run store: its status, its statistics, and its controls.

    Everything is read from the store when asked for, so a `Run` shows a
    background run's progress live, and any process can open one:
    `Run(run_id, store)`.

    Example:

    ```python
    run = gradflow.train(config, background=True)
    run.wait(timeout=60)
    run.metrics.query("name == 'loss'")
    ```

    Args:
        run_id: the run's id.
        store: the `RunStore` (or its path) that holds it.
        manager: the `RunManager` running it, if any (used to notice a
            worker that died).

    Raises:
        ValueError: if the run id is malformed or not in the store.
    """

    def __init__(self, run_id, store=None, manager=None):
        self.store = store if isinstance(store, RunStore) else RunStore(store)
        self.run_id = run_id
        self._manager = manager
        self._recovered_at = -math.inf
        self._info = self.store.run_info(run_id)

    def __repr__(self):
        return f"Run({self.run_id!r}, name={self.name!r}, status={self.status!r})"

    @property
    def status(self):
        """`queued`, `running`, `paused`, `completed`, `stopped`, `diverged`,
        `interrupted` or `failed` (read now)."""
        if self._manager is not None:
            self._manager.poll()
        elif time.monotonic() - self._recovered_at > 1.0:
            # A run whose process is gone (a `kill -9` of `gradflow train`)
            # read "running" for ever, and `wait()` never returned.
            self.store.recover()
            self._recovered_at = time.monotonic()
        return self.store.status(self.run_id)

    @property
    def name(self):
        return self._info["name"]

    @property
    def message(self):
        """Why the run ended, when it did not complete (read at the last `refresh`)."""
        return self._info["message"]

    @property
    def progress_step(self):
        """The last step the worker reported (read at the last `refresh`)."""
        return self._info["progress_step"]

    @property
    def config(self):
        """The run's `RunConfig`."""
        from gradflow.lab.config import RunConfig

        return RunConfig.from_dict(self._info["config"])

    @property
    def layer_stats(self):
        """Tidy per-layer statistics (see `RunStore.layer_stats`).

        A run its monitor recorded with `activations=True` carries which layer
        reads which in `attrs["layer_inputs"]`, for `gradflow.diagnose`.
        """
        table = self.store.layer_stats(self.run_id)
        layer_inputs = run_layer_inputs(self.store.run_info(self.run_id)["config"])
        if layer_inputs:
            table.attrs["layer_inputs"] = layer_inputs
        return table

    @property
    def metrics(self):
        """Per-step metrics in long form: `step, name, value`."""
        return self.store.metrics(self.run_id)

    @property
    def events(self):
        """Events such as the origin of a NaN: `step, layer, kind, message`."""
        return self.store.events(self.run_id)

    @property
    def histograms(self):
        """log10|g| histograms, one count column per bin (see `RunStore.histograms`)."""
        return self.store.histograms(self.run_id)

    def refresh(self):
        """Re-reads the run's name, message and progress; returns self."""
        if self._manager is not None:
            self._manager.poll()
        self._info = self.store.run_info(self.run_id)
        return self

    def pause(self):
        """Asks the worker to hold training between two steps."""
        self.store.request(self.run_id, "pause")

    def resume(self):
        """Asks a paused run to go on."""
        self.store.request(self.run_id, "resume")

    def step_once(self):
        """Asks a paused run for exactly one more optimizer step."""
        self.store.request(self.run_id, "step")

    def set_pace(self, pace):
        """Asks the run to train at most `pace` steps a second from now on (None: full speed)."""
        self.store.request_pace(self.run_id, pace)

    def stop(self):
        """Stops the run: a queued run at once, a training one after its current step."""
        if not self.store.set_status(
            self.run_id, "stopped", "Stopped before it started.", only_from=("queued",)
        ):
            self.store.request(self.run_id, "stop")

    def wait(self, timeout=None):
        """Waits until the run has ended.

        Args:
            timeout: seconds to wait at most, default None (no limit).

        Returns:
            The final status.

        Raises:
            TimeoutError: if the run is still active after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status
            if status not in ACTIVE_STATUSES:
                self.refresh()
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Run {self.run_id} is still {status} after {timeout} s.")
            time.sleep(0.05)
