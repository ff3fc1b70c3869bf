"""`GradientLog`: the statistics of the gradients a training loop of your own applies.

`GradientMonitor` rebuilds the train step of `model.fit`. A loop written by
hand (a GAN, reinforcement learning, a research model with a
`tf.GradientTape` of its own) has no step for gradflow to rebuild: it has
the gradients themselves. `GradientLog.record` takes them, as the loop
computed and applied them, and gives them the same statistics, tables,
alerts, run store and TensorBoard output as a monitored `fit`, with no
second forward or backward pass.
"""

import atexit
import contextlib
import math
import os
import sqlite3
import sys
import typing

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

from gradflow import schema
from gradflow.checks import (
    check_backend,
    check_not_legacy,
    flag,
    positive_int,
    warn_user,
    whole_number,
)
from gradflow.diagnosis import diagnose, no_gradient_message
from gradflow.monitor.buffer import ROW_COLUMNS, STEP_METRICS
from gradflow.monitor.outputs import check_outputs, run_config
from gradflow.monitor.records import (
    RowLayout,
    layer_history,
    layer_stats_frame,
    loss_alone_message,
    metrics_frame,
    nonfinite_message,
    nonfinite_origin,
)
from gradflow.monitor.remote import DashboardRequests, stopped_message
from gradflow.monitor.step import WeightSegments
from gradflow.monitor.tensorboard import SummaryWriter
from gradflow.probe.naming import is_overwritten, layer_order, variable_names
from gradflow.statistics import norm_of_norms, summarize
from gradflow.store import trouble

_NAN = float("nan")
_NONFINITE = ROW_COLUMNS.index("nonfinite")
# The metrics a loop's log records at each step (no clipping: the loop clips
# itself, if it does, and the log sees the gradients it is given).
_STEP_METRICS = ("loss", "learning_rate", "global_norm")
# The statistics that scale with the gradients (max_abs, l2_norm, mean_abs, std).
_SIZE_COLUMNS = 4
assert ROW_COLUMNS[:_SIZE_COLUMNS] == ("max_abs", "l2_norm", "mean_abs", "std")


def _value(number):
    """A Keras variable's or a tensor's value in NumPy.

    Not `keras.ops.convert_to_numpy`: it calls a `keras.Variable`'s
    `__array__`, which takes no `copy` argument; NumPy 2 warns of that
    (DeprecationWarning) and is to refuse it.
    """
    read = getattr(number, "numpy", None)
    return read() if callable(read) else keras.ops.convert_to_numpy(number)


class _Seen(typing.NamedTuple):
    """What a `record` read of the optimizer: its loss scale (None: none) and step count."""

    scale: float
    iterations: int


class _Uses(typing.NamedTuple):
    """The learning rate and loss scale (None: none) of one step's update."""

    learning_rate: float
    scale: float


_INSIDE_A_FUNCTION = (
    "GradientLog.record was called inside a tf.function, where it would run once, while "
    "the function is traced, and record nothing after. Return the gradients from your "
    "train step and record them outside it:\n"
    "    loss, gradients = train_step(x, y)\n"
    "    log.record(gradients, loss=loss)"
)


class GradientLog:
    """Per-layer statistics of the gradients a training loop of your own applies.

    For a loop written by hand (a GAN, reinforcement learning, anything with
    a `tf.GradientTape` of its own), which `GradientMonitor` cannot reach:
    give `record` the gradients the loop computed, after it applied them.
    They get the statistics of `gradflow.snapshot` and `GradientMonitor`
    (the same kernel), in `.history`, `.metrics` and `.events`, and in a run
    store the dashboard shows live, with no second forward or backward pass.

    Example:

    ```python
    log = gradflow.GradientLog(model, optimizer=optimizer, store="runs.db",
                               run_name="my loop")

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return loss, gradients

    with log:
        for x, y in dataset:
            loss, gradients = train_step(x, y)
            log.record(gradients, loss=loss)
    print(log.history)
    ```

    `with log:` closes the run at the block's end: completed, interrupted
    after a Ctrl-C, failed with the error. A log left open is closed when
    the script ends, the same way, except that an exit hook cannot tell
    `sys.exit(1)` from a clean end (it reads completed).

    With a `store`, the dashboard's Live page can pause the loop (held inside
    `record`, between two steps), step it once and stop it, after its
    **Take control**. A loop cannot be stopped from outside as `fit` can:
    Stop sets `log.stop_training`, which the loop reads to end (as `fit`
    reads `model.stop_training`), and the run then closes as stopped.

    ```python
    with log:
        for x, y in dataset:
            loss, gradients = train_step(x, y)
            log.record(gradients, loss=loss)
            if log.stop_training:  # Stop, pressed on the dashboard
                break
    ```

    A GAN's two networks take two logs (two runs, which the dashboard's
    Compare page shows side by side), or one log of the combined model with
    `variables=` the ones differentiated.

    What a loop's log cannot record, since it sees only the gradients: the
    activation gradients (`gradflow.snapshot` on a batch now and then gives
    them), and the norms before and after the optimizer's own clipping
    (`clipnorm`, `clipvalue`: the log sees the gradients before it; a loop
    that clips by hand and records the clipped ones sees those).

    Args:
        model: The Keras model (or layer) the gradients are for. It names the
            rows (`layer`, `tensor`, `variable`) as `gradflow.snapshot` does;
            layers are numbered in the order its forward pass calls them
            (for a subclassed model built on one input, a trace on its
            build shape tells; else the order `__init__` made them).
        variables: The variables of the gradients, in the same order.
            Defaults to `model.trainable_variables`.
        optimizer: The loop's Keras optimizer, if it has one: the learning
            rate each step used (a schedule's value then) is recorded. A
            `LossScaleOptimizer` (mixed precision: the loop differentiates
            `optimizer.scale_loss(loss)`) has its gradients recorded unscaled,
            as it applies them, and the steps it skips for overflow are not
            recorded (an `info` event says so): give it, or the statistics
            are those of the scaled gradients, thousands of times too large.
        every: Record every `every`-th step (steps 1, 2, ... count the calls
            of `record`, or are given to it). Defaults to 1.
        histograms: Whether to also record histograms of log10|g|.
        update_ratio: Whether to record ||Δw|| / ||w|| (the update's size
            against the weights'): keeps a reference to the weights of the
            step before each recorded one, which costs a copy of them when
            the optimizer changes them. Needs `record` to be called after the
            optimizer's update, at every step. Defaults to False.
        store: A `gradflow.RunStore` or the path of one: the run is written
            there as it trains, for the dashboard (`gradflow serve`).
        run_name: The run's name in the store.
        total_steps: The number of steps the loop will take, if known: the
            dashboard shows how far along it is.
        stop_on_nonfinite: Raise `FloatingPointError` from `record` at the
            first recorded step with a NaN/Inf gradient or loss (with
            `every > 1`, the steps it skips are not looked at), after storing
            that step and closing the run as diverged (a loop cannot be
            stopped from outside as `fit` can).
        tensorboard_dir: Also write the statistics as TensorBoard summaries there.
        rules: A `gradflow.diagnosis.Thresholds` for the rules run at `close()`.
    """

    def __init__(
        self,
        model,
        variables=None,
        optimizer=None,
        every=1,
        histograms=False,
        update_ratio=False,
        store=None,
        run_name=None,
        total_steps=None,
        stop_on_nonfinite=False,
        tensorboard_dir=None,
        rules=None,
    ):
        check_backend("gradflow.GradientLog")
        check_not_legacy("model", model)
        if not isinstance(model, keras.layers.Layer):
            raise ValueError(
                "`model` must be a Keras 3 model or layer (the one the gradients are for), "
                f"got {type(model).__module__}.{type(model).__name__}."
            )
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`optimizer` must be a Keras optimizer or None, got "
                f"{type(optimizer).__name__} {optimizer!r}."
            )
        self.model = model
        self.variables = None if variables is None else _checked_variables(variables, model)
        self._variables_given = variables is not None
        self.optimizer = optimizer
        self.every = positive_int("every", every)
        self.histograms = flag("histograms", histograms)
        self.update_ratio = flag("update_ratio", update_ratio)
        self.stop_on_nonfinite = flag("stop_on_nonfinite", stop_on_nonfinite)
        self.total_steps = whole_number("total_steps", total_steps, least=1, allow_none=True)
        check_outputs(store, run_name, tensorboard_dir, rules)
        self.run_name = run_name
        self.tensorboard_dir = tensorboard_dir
        self.rules = rules
        self.run_id = None
        self._store = store
        self._writer = None
        self._summaries = None
        self._told_store = False
        self._step = 0  # the last step `record` was called for
        # (steps [1], stats [1, rows, columns], metrics [1, 3], histograms, layout, metric names kept)
        self._blocks = []
        self._metric_rows = []  # (step, name, value) given to `record` as keywords
        self._events = []
        self._layouts = {}  # which gradients were present -> RowLayout
        self._names = None
        self._called = None  # leaf-layer paths in the order a forward pass calls them
        self._before = None  # (step, weights read then), for the update ratio
        self._statistics = _Statistics(self.histograms)
        self._nonfinite_step = None
        self._status = None  # set when closed
        # The optimizer as the last `record` (or this constructor) read it: the
        # step after it is numbered, scaled and rated from it (`_used`).
        self._optimizer_seen = self._read_optimizer()
        self._told_unseen_updates = False
        self._overflow_told = False  # a skip told from the gradients, before the update
        self._skipped = 0  # steps a LossScaleOptimizer skipped for overflow
        variables = self.variables or list(model.trainable_variables)
        if self.update_ratio and self.every == 1 and variables:
            # The weights before step 1, if the loop has not begun: its first
            # recorded step has an update ratio too.
            self._before = (0, [tf.convert_to_tensor(v) for v in variables])
        self._message = None
        self._frames = None
        self._requests = None  # the dashboard's Pause/Stop, once the run is in a store
        self.stop_training = False
        self._stopped_at = None  # the step after which the dashboard's Stop came
        self._told_stop = False

    # -- recording ---------------------------------------------------------

    def record(self, gradients, loss=None, step=None, **metrics):
        """Record one step's gradients (after the optimizer applied them).

        Args:
            gradients: The gradients, in the order of `variables` (a list, as
                `tape.gradient` returns it; None where no gradient reached
                a variable). Tensors, `tf.IndexedSlices` or NumPy arrays. Or
                what `summarize` made of them inside the step (cheaper).
            loss: The step's loss (the batch mean), if any.
            step: The step's number; defaults to one more than the last.
                Numbers must increase (`optimizer.iterations` may be given:
                a step a `LossScaleOptimizer` skips repeats it, and is not
                recorded). Call `record` after every update, also those
                `every` does not record: the optimizer is read at each call.
            **metrics: Other numbers of the step to keep with it
                (`accuracy=...`, `d_loss=...`).

        With a `store`, a Pause pressed on the dashboard's Live page holds
        this call until Resume, Step once or Stop (which sets
        `stop_training`).

        Returns:
            True when this step was recorded, False when `every` skipped it.

        Raises:
            FloatingPointError: with `stop_on_nonfinite`, at the first step
                whose gradients or loss hold NaN/Inf.
        """
        recorded = self._record_step(gradients, loss, step, metrics)
        if self._requests is None:
            return recorded
        if self._stopped_at is not None and not self._told_stop:
            # A loop that reads the flag only now and then (at an epoch's
            # end) trains on a while: the page says why the run still runs.
            self._told_stop = True
            self._add_event(
                self._step,
                None,
                "info",
                "Stop was pressed on the dashboard: the loop trains on until it reads "
                "`log.stop_training`.",
            )
        elif self._stopped_at is None and self._requests.check() == "stop":
            # Pause (held in `check`, between two steps), Step once and Stop
            # from the dashboard's Live page.
            self.stop_training = True
            self._stopped_at = self._step
        return recorded

    def _record_step(self, gradients, loss, step, metrics):
        if tf.inside_function():
            raise RuntimeError(_INSIDE_A_FUNCTION)
        if self._status is not None:
            raise RuntimeError(
                f"This GradientLog was closed ({self._status}); make a new one to record more."
            )
        now = self._read_optimizer()
        last = self._optimizer_seen
        lowered = (
            now.scale is not None and now.iterations == last.iterations and now.scale < last.scale
        )
        if lowered and self._overflow_told:
            # The overflow `record` saw before the update (its gradients): told then.
            lowered = self._overflow_told = False
        if lowered:
            # A LossScaleOptimizer lowers its scale only when the gradients
            # overflowed, and then skips the update (its step count stays):
            # the loop trained nothing. Before `step` is checked: a loop that
            # numbers by `optimizer.iterations` gives the same number again.
            self._optimizer_seen = now
            if step is None:
                self._step += 1
                if self._before is not None and self._before[0] == self._step - 1:
                    # The skipped update left the weights as they were: still the
                    # "before" of the next step (its update ratio read NaN).
                    self._before = (self._step, self._before[1])
            # `optimizer.iterations` as given: its value now, not the variable
            # (the rules failed at `close()` on it, and the event read its repr).
            self._note_skipped(self._step if step is None else _whole_step(step), last.scale)
            return False
        step = self._step_of(step)
        summary = gradients if _is_summary(gradients) else None
        if summary is not None:
            if self.variables is None:
                raise ValueError("`gradients` is a summary of another GradientLog's `summarize`.")
            variables = self.variables
        else:
            variables = self._variables_for(gradients)
        recorded = step % self.every == 0
        # Everything checked before anything changes: a call that raises records nothing.
        extra = {name: _number(name, value) for name, value in metrics.items()}
        taken = sorted(set(extra) & set(STEP_METRICS))
        if taken:
            raise ValueError(
                f"`{taken[0]}` is a metric GradientLog records itself, got it as a keyword of "
                f"`record`: name yours otherwise (e.g. `my_{taken[0]}=...`)."
            )
        if recorded and summary is not None:
            present = tuple(int(i) for i in summary[_PRESENT].numpy())
            tensors = summary
            loss_value = _number("loss", loss)
        elif recorded:
            present = _present(gradients, variables)
            if not present:
                raise ValueError(
                    f"`gradients` holds no gradient at step {step}: every one is None, so the "
                    "loss depends on none of `variables`. Check that the tape watched the "
                    "model's call and that `variables` are the ones differentiated."
                )
            tensors = [_gradient_tensor(gradients[i], variables[i], i) for i in present]
            loss_value = _number("loss", loss)
        if self._store is not None and self._writer is None:
            self._open_store()  # before anything changes: a store it cannot open records nothing
        self._optimizer_seen = now
        previous, self._step = self._step, step
        before = None
        if recorded and self.update_ratio and self._before is not None:
            taken_at, weights = self._before
            # The weights after the step before this one: the update is this step's alone.
            if taken_at == step - 1 == previous and len(weights) == len(variables):
                before = [weights[i] for i in present]
        self._before = None
        if self.update_ratio and summary is None and (step + 1) % self.every == 0:
            self._before = (step, [tf.convert_to_tensor(v) for v in variables])
        if extra:
            self._add_metrics(step, extra)
        if not recorded:
            return False
        used = self._used(last, now, step)  # the rate only for steps recorded
        self._record(step, present, tensors, variables, loss_value, loss is not None, before, used)
        return True

    def _read_optimizer(self):
        """What the optimizer holds now: its loss scale and step count (at every call)."""
        optimizer = self.optimizer
        if optimizer is None:
            return _Seen(None, 0)
        scale = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            scale = optimizer.initial_scale
            if optimizer.built:
                scale = optimizer.dynamic_scale.numpy()
        elif getattr(optimizer, "loss_scale_factor", None):
            scale = optimizer.loss_scale_factor
        iterations = int(_value(optimizer.iterations))
        return _Seen(None if scale is None else float(scale), iterations)

    def _used(self, last, now, step):
        """The learning rate and loss scale of this step's update, from the optimizer
        as the last `record` and this one read it.

        `record` follows the update: the step count went up by one since the
        last `record`, the scale this step's gradients were multiplied by is
        the one read then (the update may have doubled it since), and a
        schedule's rate is its value at the count before the update. When
        the count did not move (`record` called before the update), both
        are those read now. When it moved by more (updates `record` did not
        see), the scale read now is the best guess, and the user is told once.
        """
        moved = now.iterations - last.iterations
        schedule = self._schedule()
        if schedule is not None:
            at = now.iterations - 1 if moved > 0 else now.iterations
            rate = float(keras.ops.convert_to_numpy(schedule(max(at, 0))))
        elif self.optimizer is None:
            rate = _NAN
        else:
            # A plain rate (set by hand, perhaps, before this step): as it is now.
            try:
                rate = float(_value(self.optimizer.learning_rate))
            except (TypeError, ValueError):
                rate = _NAN
        scale = now.scale
        if scale is not None and moved == 1:
            scale = last.scale
        elif scale is not None and moved > 1 and not self._told_unseen_updates:
            self._told_unseen_updates = True
            warn_user(
                f"GradientLog: the optimizer made {moved} updates between two `record` calls "
                f"(at step {step}): the gradients are unscaled by its loss scale as it is now, "
                "which may be twice or half the one they were made with. Call `record` after "
                "every update (with `every=` to record only some of them)."
            )
        return _Uses(rate, scale)

    def _schedule(self):
        optimizer = self.optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        rate = getattr(optimizer, "_learning_rate", None)
        return rate if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) else None

    def _note_skipped(self, step, scale):
        self._skipped += 1
        if self._skipped == 1:
            self._add_event(
                step,
                None,
                "info",
                f"Step {step} was skipped by the LossScaleOptimizer: its gradients overflowed at "
                f"loss scale {scale:g}, so it lowered the scale and left the weights as they "
                "were. Such steps are not recorded (a few at the start of mixed-precision "
                "training are normal); `close()` counts them.",
            )

    def summarize(self, gradients):
        """The step's statistics as a few small tensors, made inside your `tf.function`.

        `record` computes the statistics outside the step, one small op after
        another (a millisecond or more a step on a CPU); made inside the
        step, they cost about what `GradientMonitor`'s do. Return the result
        from the step and give it to `record` in place of the gradients:

        ```python
        @tf.function
        def train_step(x, y):
            ...
            optimizer.apply(gradients, model.trainable_variables)
            return loss, log.summarize(gradients)

        loss, summary = train_step(x, y)
        log.record(summary, loss=loss)
        ```

        The weight norms are read where `summarize` is called: after the
        update, as `record` reads them. The update ratio needs the weights
        before the update, which a summary does not hold: it reads NaN.
        The statistics are made at every step, also those `every` skips.
        With a `LossScaleOptimizer`, `record` divides the sizes by the loss
        scale; the histograms stay those of the scaled gradients.

        Args:
            gradients: As for `record`.

        Returns:
            A dict of tensors, to be given to `record` as they are.
        """
        variables = self._variables_for(gradients)
        present = _present(gradients, variables)
        if not present:
            raise ValueError(
                "`gradients` holds no gradient: every one is None, so the loss depends on none "
                "of `variables`."
            )
        tensors = [_gradient_tensor(gradients[i], variables[i], i) for i in present]
        weights = [variables[i] for i in present]
        rows, counts = _step_statistics(tensors, weights, None, self.histograms)
        summary = {_ROWS: rows, _PRESENT: tf.constant(present, tf.int32)}
        if counts is not None:
            summary[_COUNTS] = counts
        return summary

    def _record(self, step, present, tensors, variables, loss, loss_given, before, used):
        scale = used.scale or 1.0
        if _is_summary(tensors):
            rows = tensors[_ROWS].numpy()
            counts = tensors.get(_COUNTS)
            histograms = None if counts is None else counts.numpy()
            rows, global_norm = rows[:-1], float(rows[-1, 0]) / scale
            # The gradients of a scaled loss: their sizes scale with it (a
            # power of two, exact); the histograms stay those of the scaled ones.
            rows[:, :_SIZE_COLUMNS] /= scale
        else:
            rows, histograms, global_norm = self._statistics(
                present, tensors, variables, before, scale
            )
        if (
            isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
            and scale > 1
            and rows[:, _NONFINITE].any()
        ):
            # Recorded before the update: the LossScaleOptimizer will skip it.
            self._note_skipped(step, scale)
            self._overflow_told = True
            return
        layout = self._layout(present, variables, step)
        stats = np.full([1, len(layout), len(ROW_COLUMNS)], _NAN, np.float32)
        stats[0, :, : rows.shape[1]] = rows
        values = np.array([[loss, used.learning_rate, global_norm]], np.float32)
        histograms = None if histograms is None else histograms[np.newaxis]
        kept = {"global_norm"}
        if loss_given:
            kept.add("loss")
        if self.optimizer is not None:
            kept.add("learning_rate")
        block = (np.array([step], np.int64), stats, values, histograms, layout, kept)
        self._blocks.append(block)
        self._frames = None
        self._publish(block)
        self._check_nonfinite(step, stats[0], loss if loss_given else None, layout)

    def _step_of(self, step):
        if step is None:
            return self._step + 1
        step = _whole_step(step)
        if step <= self._step:
            raise ValueError(
                f"`step` must be greater than the last step recorded or skipped ({self._step}), "
                f"got {int(step)}: steps are numbered in the order they trained."
            )
        return int(step)

    def _variables_for(self, gradients):
        if isinstance(gradients, (tf.Tensor, np.ndarray)) or not isinstance(
            gradients, (list, tuple)
        ):
            raise ValueError(
                "`gradients` must be a list of gradients, one per variable (as "
                f"`tape.gradient(loss, variables)` returns it), got {type(gradients).__name__}."
            )
        if self.variables is None:
            self.variables = list(self.model.trainable_variables)
            if not self.variables:
                raise ValueError(
                    f"Model {self.model.name!r} has no trainable variables yet: build it (call "
                    "it on a batch) before the first `record`, or pass `variables=`."
                )
        if not self._variables_given:
            now = self.model.trainable_variables
            if len(now) != len(self.variables) or any(
                a is not b for a, b in zip(now, self.variables, strict=True)
            ):
                # A layer frozen or unfrozen between two steps: the log follows
                # `model.trainable_variables` as the loop's tape does (by
                # identity: one frozen and one of the same shapes unfrozen
                # kept the count and put the gradients under the wrong layers).
                self.variables, self._names, self._layouts, self._before = (
                    list(now),
                    None,
                    {},
                    None,
                )
        if len(gradients) != len(self.variables):
            given = "`variables`" if self._variables_given else "trainable variables"
            raise ValueError(
                f"`gradients` holds {len(gradients)} gradients, but there are "
                f"{len(self.variables)} {given} (of model {self.model.name!r}). Pass one "
                "gradient for each, in order (`tape.gradient(loss, variables)`), or give the "
                "variables they are for as `GradientLog(variables=...)`."
            )
        return self.variables

    def _layout(self, present, variables, step):
        layout = self._layouts.get(present)
        if layout is not None:
            return layout
        if self._names is None:
            if self._called is None:
                self._called = _call_order(self.model)
            self._names = variable_names(self.model, variables, called=self._called)
        names = [self._names[i] for i in present]
        layout = RowLayout.build(names, [], layer_order(self.model, called=self._called))
        self._layouts[present] = layout
        missing = {}
        for i, name in enumerate(self._names):
            if i not in present and not is_overwritten(variables[i]):
                missing.setdefault(name.layer, []).append(name.tensor)
        told = {layer for _, layer, kind, _ in self._events if kind == "no_gradient"}
        for layer, tensors in missing.items():
            if layer not in told:
                self._add_event(step, layer, "no_gradient", no_gradient_message(layer, tensors))
        return layout

    def _check_nonfinite(self, step, stats, loss, layout):
        if self._nonfinite_step is not None:
            return
        row = nonfinite_origin(stats, layout)
        if row is None and (loss is None or math.isfinite(loss)):
            return
        self._nonfinite_step = step
        if row is None:
            layer, message = None, loss_alone_message(step, loss)
        else:
            layer = layout.layers[row]
            count = int(stats[row, _NONFINITE])
            # An unknown loss: told as the gradient's, where it was found.
            loss = 0.0 if loss is None else loss
            message = nonfinite_message(step, layer, layout.tensors[row], count, loss)
        self._add_event(step, layer, "nonfinite", message)
        if self.stop_on_nonfinite:
            self.close("diverged", message)
            raise FloatingPointError(f"GradientLog (stop_on_nonfinite=True): {message}")

    # -- outputs -----------------------------------------------------------

    def _publish(self, block):
        steps, stats, values, histograms, layout, kept = block
        histogram_rows = []
        if histograms is not None:
            histogram_rows = [
                (
                    layout.layers[i],
                    layout.layer_indices[i],
                    layout.tensors[i],
                    histograms[0, i].astype(np.int64),
                )
                for i in range(len(layout))
            ]
        step = int(steps[0])
        if self._writer is not None:
            with self._store_trouble():
                with self._writer.batch():
                    self._writer.add_layer_stats_array(steps, stats, layout.series)
                    self._writer.add_metrics(step, _kept_values(values[0], kept))
                    if histogram_rows:
                        self._writer.add_histograms(step, histogram_rows)
                    self._writer.progress(step)
        if self.tensorboard_dir is not None:
            if self._summaries is None:
                self._summaries = SummaryWriter(self.tensorboard_dir)
            self._summaries.write(
                layer_stats_frame(steps, stats, layout),
                metrics_frame(steps, values, _STEP_METRICS, kept),
                [(step, layer, tensor, counts) for layer, _, tensor, counts in histogram_rows],
            )

    def _open_store(self):
        try:
            self._create_run()
        except (sqlite3.Error, OSError) as error:
            # SQLite's or the file system's words name neither the argument nor the file.
            raise RuntimeError(
                f"GradientLog could not write to its `store`: "
                f"{trouble.explain(error, self._store_path())} (or leave `store` out to "
                "keep the statistics in `.history` only)."
            ) from error

    def _create_run(self):
        store = self._store
        if isinstance(store, (str, os.PathLike)):
            from gradflow.store import RunStore

            store = RunStore(store)
            self._store = store
        config = run_config(
            self.model,
            self.optimizer,
            self.every,
            self.histograms,
            self.rules,
            recorded_by="GradientLog",
        )
        self.run_id = store.create_run(
            config, name=self.run_name, source="monitor", total_steps=self.total_steps
        )
        self._writer = store.writer(self.run_id)
        self._requests = DashboardRequests(store, self.run_id, on_pause=self._show_pause)
        _OPEN.add(self)

    def _show_pause(self):
        """Before a pause: the step it waits after (`every` may have skipped it), all written."""
        with self._store_trouble():
            self._writer.progress(self._step)
            self._writer.flush()

    @contextlib.contextmanager
    def _store_trouble(self):
        """Warn once when the store takes no rows, and train on: they stay in `history`."""
        try:
            yield
        except Exception as error:
            if not trouble.cause(error):
                raise
            self._tell_store(error)
        error = getattr(self._writer, "write_error", None)
        if error is not None:
            self._tell_store(error)

    def _tell_store(self, error):
        if not self._told_store:
            self._told_store = True
            warn_user(
                f"GradientLog: the run store could not take this run's rows "
                f"({trouble.explain(error, self._store_path())}). Recording goes on in memory "
                "(`history`); `close()` writes what is waiting once the store is mended."
            )

    def _store_path(self):
        return getattr(self._store, "path", self._store)

    def _add_metrics(self, step, values):
        self._metric_rows.extend((step, name, value) for name, value in values.items())
        self._frames = None
        if self._writer is not None:
            with self._store_trouble():
                self._writer.add_metrics(step, values)
        if self.tensorboard_dir is not None:
            if self._summaries is None:
                self._summaries = SummaryWriter(self.tensorboard_dir)
            self._summaries.write_metrics(step, values)

    def _add_event(self, step, layer, kind, message):
        self._events.append((step, layer, kind, message))
        if self._writer is not None:
            with self._store_trouble():
                self._writer.add_event(step, layer, kind, message)

    # -- the end -----------------------------------------------------------

    def close(self, status=None, message=None):
        """End the run: run the rules on its history, write the rest, close the store's run.

        Called by `with log:` at the block's end. Calling it again does
        nothing, unless the store could not take the end: then it tries again.

        Args:
            status: The run's status: `"completed"` (the default),
                `"stopped"`, `"interrupted"`, `"failed"` or `"diverged"`
                (the default after a non-finite step).
            message: Words for the dashboard beside the status.

        Raises:
            RuntimeError: when the run store could not take the run's end
                (a full disk, a lock held by another program); the
                statistics stay in `history`, and `close()` may be called
                again once the store is mended.
        """
        if self._status is None:
            if status is None and self._nonfinite_step is not None:
                status = "diverged"
            elif status is None and self._stopped_at is not None:
                status = "stopped"
            elif status is None:
                status = "completed"
            if status == "stopped" and message is None and self._stopped_at is not None:
                message = stopped_message(self._stopped_at, self._step)
            if status not in _STATUSES:
                raise ValueError(f"`status` must be one of {_STATUSES}, got {status!r}.")
            self._status = status
            self._message = message
            if self._skipped > 1:
                self._add_event(
                    self._step,
                    None,
                    "info",
                    f"{self._skipped} steps were skipped by the LossScaleOptimizer (their "
                    "gradients overflowed at its loss scale); they are not recorded.",
                )
            try:
                self._diagnose()
            except Exception as error:
                warn_user(
                    f"GradientLog: the diagnosis rules failed ({type(error).__name__}: {error}); "
                    "the recorded statistics are complete."
                )
            if self._summaries is not None:
                self._summaries.close()
                self._summaries = None
        _OPEN.discard(self)
        if self._writer is None:
            return
        try:
            self._writer.close(self._status, self._message)
        except Exception as error:
            if not trouble.cause(error):
                raise
            _OPEN.add(self)  # tried again at exit
            raise RuntimeError(
                f"GradientLog: the run store could not take the end of run {self.run_id} "
                f"({trouble.explain(error, self._store_path())}). The statistics are in "
                "`history`; call `close()` again once the store is mended."
            ) from error
        self._writer = None

    def _diagnose(self):
        history = self.history
        if history.empty:
            return
        found = diagnose(history, self.rules)
        known = {(step, layer, kind) for step, layer, kind, _ in self._events}
        told_nonfinite = self._nonfinite_step is not None
        for step, layer, kind, message in found[list(schema.EVENTS_COLUMNS)].itertuples(
            index=False
        ):
            if kind == "nonfinite" and told_nonfinite:
                continue  # told when it happened
            if (int(step), layer, kind) not in known:
                self._add_event(int(step), layer, kind, message)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if self._status is not None and self._writer is None:
            return False
        if error is None:
            self.close()
        elif isinstance(error, KeyboardInterrupt):
            self.close("interrupted", "Stopped with Ctrl-C (KeyboardInterrupt).")
        elif isinstance(error, FloatingPointError) and self._nonfinite_step is not None:
            self.close()
        else:
            self.close("failed", f"{type(error).__name__}: {error}"[:2000])
        return False

    # -- tables --------------------------------------------------------------

    @property
    def history(self):
        """Tidy per-layer statistics of every recorded step (a DataFrame), as `GradientMonitor.history`."""
        if self._frames is None:
            self._frames = self._tables()
        return self._frames[0]

    @property
    def metrics(self):
        """Per-step metrics in long form: `step, name, value` (a DataFrame)."""
        if self._frames is None:
            self._frames = self._tables()
        return self._frames[1]

    @property
    def events(self):
        """Events (a non-finite origin, the rules' findings at `close()`): `step, layer, kind, message`."""
        events = pd.DataFrame(self._events, columns=list(schema.EVENTS_COLUMNS))
        return events.sort_values("step", kind="stable", ignore_index=True).astype(
            {"step": "int64"}
        )

    @property
    def histogram_rows(self):
        """Recorded histograms: `step, layer, layer_index, tensor, counts` (a DataFrame)."""
        rows = [
            (
                int(steps[0]),
                layout.layers[i],
                layout.layer_indices[i],
                layout.tensors[i],
                h[0, i].astype(np.int64),
            )
            for steps, _, _, h, layout, _ in self._blocks
            if h is not None
            for i in range(len(layout))
        ]
        return pd.DataFrame(rows, columns=["step", "layer", "layer_index", "tensor", "counts"])

    def _tables(self):
        # Steps of one layout joined first, then one frame: a frame per step
        # took 72 s for the `history` of 20,000 steps (the audit's loop).
        history = layer_history(self._blocks)
        rows = [
            (int(steps[0]), name, value)
            for steps, _, values, _, _, kept in self._blocks
            for name, value in _kept_values(values[0], kept).items()
        ]
        rows += self._metric_rows
        metrics = pd.DataFrame(rows, columns=list(schema.METRICS_COLUMNS))
        metrics = metrics.sort_values("step", kind="stable", ignore_index=True)
        return history, metrics.astype({"step": "int64"})


_STATUSES = ("completed", "stopped", "interrupted", "failed", "diverged")
# Logs whose run is open in a store: closed at exit, so it does not read "running".
_OPEN = set()


@atexit.register
def _close_logs_left_open():
    error = getattr(sys, "last_value", None)
    for log in list(_OPEN):
        with contextlib.suppress(Exception):  # exiting must not fail here
            if error is None:
                log.close()
            elif isinstance(error, KeyboardInterrupt):
                log.close("interrupted", "Stopped with Ctrl-C (KeyboardInterrupt).")
            else:
                log.close("failed", f"The script ended with {type(error).__name__}: {error}"[:2000])


class _Statistics:
    """The compiled statistics of one step's gradients, traced once per set of them.

    A `ConcreteFunction` per key (which gradients are present, their dtypes,
    whether the weights before are given), called directly: through
    `tf.function`'s own dispatch each call matched its arguments against the
    traces first, which took longer than the statistics on a 20-layer MLP.
    The weights are read inside the function, not passed in: 40 eager reads
    a step cost about a millisecond there (`bench/bench_gradient_log.py`).
    IndexedSlices are made dense before (their row count changes).
    """

    def __init__(self, histograms):
        self.histograms = histograms
        self._functions = {}

    def __call__(self, present, gradients, variables, before, scale=1.0):
        """`[rows, 9]` float32: statistics, weight_norm, NaN, update_ratio; histograms or None; global norm.

        The global norm comes back as the last row's first entry of one
        array, so a step converts one tensor to NumPy, not three.
        """
        gradients = [tf.convert_to_tensor(g) for g in gradients]
        key = (present, tuple(g.dtype for g in gradients), before is not None)
        function = self._functions.get(key)
        if function is None:
            weights = [variables[i] for i in present]
            histograms = self.histograms

            def compute(gradients, before, scale):
                # Unscaled first (a loss scale is a power of two: exact), so
                # that the histograms are of the gradients applied too.
                gradients = [tf.cast(g, tf.float32) / scale for g in gradients]
                return _step_statistics(gradients, weights, before, histograms)

            specs = [tf.TensorSpec(g.shape, g.dtype) for g in gradients]
            before_specs = (
                None if before is None else [tf.TensorSpec(b.shape, b.dtype) for b in before]
            )
            function = tf.function(compute).get_concrete_function(
                specs, before_specs, tf.TensorSpec([], tf.float32)
            )
            self._functions[key] = function
        rows, counts = function(gradients, before, tf.constant(scale, tf.float32))
        rows = rows.numpy()
        return rows[:-1], None if counts is None else counts.numpy(), float(rows[-1, 0])


def _step_statistics(gradients, weights, before, histograms):
    stats, counts = summarize(gradients, histograms)
    after = [tf.cast(w, tf.float32) for w in weights]
    segments = WeightSegments(after)
    columns = [segments.flat(after)]
    if before is not None:
        columns += [
            segments.difference(columns[0], segments.flat(before)),
            segments.flat(before),
        ]
    norms = segments.norms(columns)
    missing = tf.fill([len(gradients)], _NAN)
    ratio = missing
    if before is not None:
        change, before_norm = norms[:, 1], norms[:, 2]
        ratio = tf.where(before_norm > 0, change / tf.maximum(before_norm, 1e-30), _NAN)
    rows = tf.concat([stats, tf.stack([norms[:, 0], missing, ratio], axis=1)], axis=1)
    global_norm = tf.pad(tf.reshape(norm_of_norms(stats[:, 1]), [1, 1]), [[0, 0], [0, 8]])
    return tf.concat([rows, global_norm], axis=0), counts


def _call_order(model):
    """Leaf-layer paths in the order `model`'s forward pass calls them, or `()` if unknown.

    A subclassed model tracks its layers in the order `__init__` made them,
    which may be head first: numbered so, the non-finite origin (the layer
    nearest the loss) named the input layer, and heatmaps drew the head at
    the bottom. A `GradientLog` sees no batch, so the pass is traced (not
    run) on the input shape the model was built with, once every layer is
    built (so that the trace makes no variable). Functional and
    Sequential models already track their layers in call order; a model
    built on several inputs, or whose trace fails, keeps its tracking order.
    """
    from keras.src.models.functional import Functional

    from gradflow.probe.capture import leaf_layers, record_layer_outputs

    shapes = getattr(model, "_build_shapes_dict", None)
    if isinstance(model, (Functional, keras.Sequential)) or not shapes or len(shapes) != 1:
        return ()
    shape = next(iter(shapes.values()))
    if not isinstance(shape, (tuple, list)) or not all(
        layer.built for _, layer in leaf_layers(model)
    ):
        # A dict of inputs; or a layer the trace would build, making its variables there.
        return ()
    try:
        # The build shape as it is: a stateful RNN needs its batch size.
        spec = tf.TensorSpec(shape, tf.float32)

        def forward(x):
            return model(x, training=False)

        with record_layer_outputs(model) as outputs:
            tf.function(forward, autograph=False).get_concrete_function(spec)
    except Exception:  # a trace is only a way to number the layers
        return ()
    return tuple(outputs.paths)


# The keys of `GradientLog.summarize`'s dict.
_ROWS, _PRESENT, _COUNTS = "gradflow.rows", "gradflow.present", "gradflow.histograms"


def _present(gradients, variables):
    """The indices of the gradients to record: given, and not a float8 scale's new value."""
    return tuple(
        i for i, g in enumerate(gradients) if g is not None and not is_overwritten(variables[i])
    )


def _is_summary(value):
    return isinstance(value, dict) and _ROWS in value and _PRESENT in value


def _checked_variables(variables, model):
    if isinstance(variables, (str, bytes)) or not hasattr(variables, "__iter__"):
        raise ValueError(
            f"`variables` must be a list of Keras variables, got {type(variables).__name__}."
        )
    variables = list(variables)
    for i, variable in enumerate(variables):
        if not isinstance(variable, keras.Variable):
            raise ValueError(
                f"`variables[{i}]` must be a Keras 3 variable (such as an item of "
                f"`model.trainable_variables`), got {type(variable).__name__}."
            )
    if not variables:
        raise ValueError("`variables` must hold at least one variable, got an empty list.")
    # Named by the model's layers: another model's would all read as this one's own.
    own = {id(v) for v in model.weights}
    for i, variable in enumerate(variables):
        if id(variable) not in own:
            raise ValueError(
                f"`variables[{i}]` ({variable.path!r}) is not a variable of model "
                f"{model.name!r}: give GradientLog the model that holds them (for several "
                "models, one that holds them all, or one log each)."
            )
    return variables


def _gradient_tensor(gradient, variable, index):
    if isinstance(gradient, tf.distribute.DistributedValues):
        raise ValueError(
            f"`gradients[{index}]` holds one value per replica (from `strategy.run`): reduce "
            "them first, e.g. `strategy.reduce('SUM', g, axis=None)` for each, and record "
            "the gradients applied."
        )
    if not isinstance(gradient, tf.IndexedSlices):
        try:
            gradient = tf.convert_to_tensor(gradient)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"`gradients[{index}]` (for {variable.path!r}) must be a tensor or an array, "
                f"got {type(gradient).__name__}: {error}"
            ) from None
        if not gradient.dtype.is_floating:
            raise ValueError(
                f"`gradients[{index}]` (for {variable.path!r}) must hold floats, got "
                f"{gradient.dtype.name}."
            )
    shape = tuple(gradient.shape) if not isinstance(gradient, tf.IndexedSlices) else None
    if shape is not None and shape != tuple(variable.shape):
        raise ValueError(
            f"`gradients[{index}]` has shape {shape}, but its variable {variable.path!r} has "
            f"shape {tuple(variable.shape)}: the gradients must be in the order of the variables."
        )
    return gradient


def _number(name, value):
    """A float from a Python number, a NumPy or tensor scalar; NaN for None."""
    if value is None:
        return _NAN
    try:
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    except Exception:
        array = None
    if array is None or array.dtype.kind not in "biuf" or array.size != 1:
        shape = "" if array is None or array.dtype.kind == "O" else f" of shape {array.shape}"
        hint = " (the batch mean)" if name == "loss" else ""
        if isinstance(value, tf.distribute.DistributedValues):
            hint += ": one value per replica; reduce it first (`strategy.reduce`)"
        raise ValueError(f"`{name}` must be one number{hint}, got {type(value).__name__}{shape}.")
    return float(array.reshape(()))


def _kept_values(values, kept):
    """`{name: value}` of one step's metrics that it has (a loss only if given)."""
    return {
        name: float(value)
        for name, value in zip(_STEP_METRICS, values, strict=True)
        if name in kept
    }


def _whole_step(step):
    """`record`'s `step` as an int: a number, or `optimizer.iterations` (a variable)."""
    if hasattr(step, "numpy") and not isinstance(step, bool):
        step = step.numpy()  # `optimizer.iterations`, a tensor
    if isinstance(step, np.ndarray) and step.shape == () and step.dtype.kind in "iu":
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ValueError(
            f"`step` must be a whole number or None, got {type(step).__name__} {step!r}."
        )
    return int(step)
