"""`RunControl`: the callback that lets the dashboard pause, step and stop a run."""

import math
import time

import keras

from gradflow.checks import positive_int, positive_number
from gradflow.store import tables


class RunControl(keras.callbacks.Callback):
    """Obeys pause, resume, step and stop requests that arrive through the run store.

    It looks at the store at most every `poll_interval` seconds, so it costs
    nothing measurable per training step. While paused it waits inside the
    batch callback: training is held between two optimizer steps, and the
    dashboard can ask for one more step (`"step"`), to `"resume"` or to
    `"stop"`. It also stops training after `max_steps` optimizer steps, and
    as soon as the loss is NaN or infinite.

    With `model.steps_per_execution` above 1, Keras calls the callbacks once
    every few steps: a pause, a stop and the step limit take effect at the
    end of such a call (`max_steps` should be a multiple of it), but a
    `"step"` is still one optimizer step. For that the control wraps the
    model's train function: while stepping, a call runs its steps one at a
    time through a one-step version of the same function (traced on the
    first `"step"`), pausing after each.

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
        pace: at most this many optimizer steps a second, or None (default)
            for full speed: the runner trains the lab's small models at
            about 1,000 steps a second (`bench/bench_runner.py`, thirty-first
            session), so a run of a few hundred steps ends before a teacher
            can say what the heatmap shows. After a pause the pace starts
            afresh (no burst to catch up). `RunStore.request_pace` changes
            it during the run; a run of several steps per call then runs
            them one at a time (a one-step trace, as for `"step"`), each
            published (`on_pause`) as it is made.

    Attributes:
        steps: optimizer steps done in this `fit`.
        stop_reason: None, `"stop"` (asked to), or `"nonfinite"` (the loss
            was NaN or infinite at step `nonfinite_step`).

    Raises:
        ValueError: `max_steps` is not a positive integer or None, or an
            interval is not a positive number of seconds.
    """

    def __init__(
        self,
        store,
        run_id,
        max_steps=None,
        poll_interval=0.1,
        heartbeat_interval=1.0,
        on_pause=None,
        pace=None,
    ):
        super().__init__()
        self.store = store
        self.run_id = run_id
        self.max_steps = positive_int("max_steps", max_steps, allow_none=True)
        self.poll_interval = positive_number("poll_interval", poll_interval, unit="of seconds")
        self.heartbeat_interval = positive_number(
            "heartbeat_interval", heartbeat_interval, unit="of seconds"
        )
        self.on_pause = on_pause
        self.pace = (
            None if pace is None else positive_number("pace", pace, unit="of steps a second")
        )
        self._due = 0.0
        self.steps = 0
        self.stop_reason = None
        self.nonfinite_step = None
        self._stepping = False

    def on_train_begin(self, logs=None):
        self.steps = 0
        self._due = 0.0
        self._stepping = False
        self._next_poll = 0.0
        self._next_heartbeat = time.monotonic() + self.heartbeat_interval
        self._wrap_train_function()

    def on_train_end(self, logs=None):
        model = self.model
        if model.train_function is self._train_function:
            # The next fit builds its own again.
            model.train_function = None

    def _wrap_train_function(self):
        """Puts `_train_function` in place of the model's; it counts steps and can step one at a time."""
        model = self.model
        self._steps_per_call = max(1, int(model.steps_per_execution))
        self._whole_call = model.train_function
        self._one_step = self._whole_call if self._steps_per_call == 1 else None
        model.train_function = self._train_function

    def _train_function(self, iterator):
        if not (self._stepping or self._paced_in_steps()):
            logs = self._whole_call(iterator)
            self.steps += self._steps_per_call
            return logs
        if self._one_step is None:
            self._one_step = self._one_step_function()
        for done in range(1, self._steps_per_call + 1):
            logs = self._step_once(iterator)
            self.steps += 1
            if done == self._steps_per_call:
                break
            if self._stepping:
                self._pause()
            elif self._paced_in_steps():
                # A speed limit set during a run of several steps a call: one
                # step at a time, each shown, not a burst of five every five
                # seconds at 1 step a second.
                if self.on_pause is not None:
                    self.on_pause()
                self._keep_pace()
                self._obey(self.store.pending_request(self.run_id))
            if self.stop_reason is not None:
                # Keras takes this call for a whole one: keep its
                # metrics, which belong to this step, out of the logs.
                return {"loss": logs["loss"]} if "loss" in logs else {}
        # The call's last step pauses in `on_train_batch_end`, once the other
        # callbacks have seen its logs.
        return logs

    def _paced_in_steps(self):
        """Whether a call's steps run one at a time to keep the pace."""
        return self.pace is not None and self._steps_per_call > 1

    def _one_step_function(self):
        """A new trace of the model's current train function; `_step_once` runs it one step a call."""
        model = self.model
        model.make_train_function(force=True)
        one_step, model.train_function = model.train_function, self._train_function
        return one_step

    def _step_once(self, iterator):
        # Keras's train function reads `steps_per_execution` when it is
        # traced, at its first call.
        model = self.model
        model.steps_per_execution = 1
        try:
            return self._one_step(iterator)
        finally:
            model.steps_per_execution = self._steps_per_call

    def on_train_batch_end(self, batch, logs=None):
        if self.max_steps is not None and self.steps >= self.max_steps:
            self.model.stop_training = True
        if self._stepping:
            self._pause()
            return
        self._keep_pace()
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

    def _keep_pace(self):
        """Wait until this call's steps are due at `pace` steps a second."""
        if self.pace is None:
            return
        now = time.monotonic()
        if self._due > now:
            time.sleep(self._due - now)
            now = self._due
        self._due = now + (1 if self._paced_in_steps() else self._steps_per_call) / self.pace

    def _obey(self, action):
        if self._new_pace(action):
            return
        if action == "stop":
            self._stop("stop")
        elif action == "pause":
            self._pause()
        elif action == "step":
            # While running, "step" means: do this one, then pause.
            self._pause()

    def _new_pace(self, action):
        """Takes a pace request (the Speed limit moved during the run); True if it was one."""
        is_pace, pace = tables.requested_pace(action)
        if is_pace:
            self.pace = pace
            self._due = 0.0  # the new pace starts now, with no burst to catch up
        return is_pace

    def _stop(self, reason):
        self.stop_reason = self.stop_reason or reason
        self.model.stop_training = True

    def _pause(self):
        """Waits between two steps until asked to resume, step (one more, then pause) or stop."""
        self._stepping = False
        if self.on_pause is not None:
            self.on_pause()
        self.store.set_status(self.run_id, "paused", only_from=("running",))
        last_heartbeat = time.monotonic()
        while True:
            action = self.store.pending_request(self.run_id)
            self._new_pace(action)  # takes effect after the pause
            if action == "resume":
                self.store.set_status(self.run_id, "running", only_from=("paused",))
                return
            if action == "stop":
                self._stop("stop")
                return
            if action == "step":
                self._stepping = True
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
        # The first recorded step comes at the latest `every` steps from here.
        self._first_recorded = int(self.model.optimizer.iterations.numpy()) + self.monitor.every

    def on_train_batch_end(self, batch, logs=None):
        if self.published:
            return
        # With several steps per call, a call may end past a recorded step.
        if int(self.model.optimizer.iterations.numpy()) < self._first_recorded:
            return  # no recorded step yet
        self.monitor.flush()
        self.published = True
