"""`RunControl`: the callback that lets the dashboard pause, step and stop a run."""

import math
import time

import keras


class RunControl(keras.callbacks.Callback):
    """Obeys pause, resume, step and stop requests that arrive through the run store.

    It looks at the store at most every `poll_interval` seconds, so it costs
    nothing measurable per training step. While paused it waits inside the
    batch callback: training is held between two optimizer steps, and the
    dashboard can ask for one more step (`"step"`), to `"resume"` or to
    `"stop"`. It also stops training after `max_steps` optimizer steps, and
    as soon as the loss is NaN or infinite.

    Example:

    ```python
    control = RunControl(store, run_id, max_steps=300)
    model.fit(x, y, epochs=10, callbacks=[monitor, control])
    control.stop_reason      # None, "stop" or "nonfinite"
    ```

    Args:
        store: the `RunStore` holding the run.
        run_id: the run whose requests to obey.
        max_steps: stop after this many steps, default None (let `fit` end).
        poll_interval: seconds between looks at the store, default 0.1.
        heartbeat_interval: seconds between heartbeats, default 1.
        on_pause: called with no arguments when training pauses, e.g. to
            publish the steps a monitor still holds. Default None.

    Attributes:
        steps: optimizer steps done in this `fit`.
        stop_reason: None, `"stop"` (asked to), or `"nonfinite"` (the loss
            was NaN or infinite at step `nonfinite_step`).
    """

    def __init__(
        self,
        store,
        run_id,
        max_steps=None,
        poll_interval=0.1,
        heartbeat_interval=1.0,
        on_pause=None,
    ):
        super().__init__()
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"`max_steps` must be a positive integer or None, got {max_steps!r}.")
        if not poll_interval > 0:
            raise ValueError(f"`poll_interval` must be a positive number, got {poll_interval!r}.")
        self.store = store
        self.run_id = run_id
        self.max_steps = max_steps
        self.poll_interval = float(poll_interval)
        self.heartbeat_interval = float(heartbeat_interval)
        self.on_pause = on_pause
        self.steps = 0
        self.stop_reason = None
        self.nonfinite_step = None
        self._pause_after_step = False

    def on_train_begin(self, logs=None):
        self.steps = 0
        self._next_poll = 0.0
        self._next_heartbeat = time.monotonic() + self.heartbeat_interval

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.max_steps is not None and self.steps >= self.max_steps:
            self.model.stop_training = True
        if self._pause_after_step:
            self._pause_after_step = False
            self._pause()
            return
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + self.poll_interval
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self.nonfinite_step = self.steps
            self._stop("nonfinite")
            return
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval
            self.store.heartbeat(self.run_id, self.steps)
        self._obey(self.store.pending_request(self.run_id))

    def _obey(self, action):
        if action == "stop":
            self._stop("stop")
        elif action == "pause":
            self._pause()
        elif action == "step":
            # While running, "step" means: do this one, then pause.
            self._pause()

    def _stop(self, reason):
        self.stop_reason = self.stop_reason or reason
        self.model.stop_training = True

    def _pause(self):
        """Waits between two steps until asked to resume, step or stop."""
        if self.on_pause is not None:
            self.on_pause()
        self.store.set_status(self.run_id, "paused", only_from=("running",))
        last_heartbeat = time.monotonic()
        while True:
            action = self.store.pending_request(self.run_id)
            if action == "resume":
                self.store.set_status(self.run_id, "running", only_from=("paused",))
                return
            if action == "stop":
                self._stop("stop")
                return
            if action == "step":
                self._pause_after_step = True
                return
            if time.monotonic() - last_heartbeat >= self.heartbeat_interval:
                last_heartbeat = time.monotonic()
                self.store.heartbeat(self.run_id, self.steps)
            time.sleep(self.poll_interval)


class FirstStepPublisher(keras.callbacks.Callback):
    """Writes a run's first recorded step to the store as soon as it exists.

    The dashboard draws its first heatmap column when the first step's layer
    statistics are in the store. The store writer sends a new run's first
    rows at once, but in a lab run those are the compiled metrics (accuracy,
    read from `logs`), which reach the writer a moment before the layer
    statistics of the same step; the statistics then wait a whole flush
    interval (0.5 s). Placed after the `GradientMonitor`, this callback makes
    the monitor write the first recorded step (the first step whose
    `optimizer.iterations` is a multiple of `monitor.every`) at once, then
    does nothing: later steps keep the writer's batching, so training never
    waits on the disk.

    Example:

    ```python
    model.fit(x, y, callbacks=[monitor, FirstStepPublisher(monitor), control])
    ```

    Args:
        monitor: the run's `gradflow.GradientMonitor`.

    Attributes:
        published: whether the first recorded step has been written.
    """

    def __init__(self, monitor):
        super().__init__()
        self.monitor = monitor
        self.published = False

    def on_train_begin(self, logs=None):
        self.published = False

    def on_train_batch_end(self, batch, logs=None):
        if self.published:
            return
        if int(self.model.optimizer.iterations.numpy()) % self.monitor.every:
            return  # not a recorded step
        self.monitor.flush()
        self.published = True
