"""`GradientMonitor`: per-layer gradient statistics of `model.fit`, every step."""

import atexit
import contextlib
import math
import os
import sqlite3
import sys
import threading
import time
import uuid
import weakref

import keras
import numpy as np
import pandas as pd
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

from gradflow import schema
from gradflow.checks import (
    check_backend,
    error_text,
    flag,
    legacy_keras_words,
    positive_int,
    warn_user,
    whole_number,
)
from gradflow.diagnosis import context_start, diagnose, look_back, no_gradient_message
from gradflow.monitor import through_time, trace_gradients
from gradflow.monitor.buffer import STEP_METRICS
from gradflow.monitor.outputs import check_outputs, run_config
from gradflow.monitor.records import (
    RowLayout,
    layer_history,
    layer_stats_frame,
    layout_runs,
    loss_alone_message,
    metrics_frame,
    nonfinite_message,
    nonfinite_origin,
    unrecorded_time_steps,
)
from gradflow.monitor.remote import DashboardRequests, drop_left_over, stopped_message
from gradflow.monitor.step import (
    StepPlan,
    clipping_optimizer,
    instrumented_train_step,
    probed_train_step,
    step_counter,
)
from gradflow.monitor.tensorboard import SummaryWriter
from gradflow.probe.naming import split_overwritten
from gradflow.probe.snapshot import resolve_loss
from gradflow.store import tables, trouble
from gradflow.store.store import UnknownRunError

# The ring holds this many executions of the train function, so the callback
# can read it every few batches instead of after each one. A read is a few
# variable reads, 0.6 ms inside a running fit: once every 16 steps that was 2%
# of the lab's 3 ms step. Under tf.distribute every step rewrites the
# replica's whole ring (no scatter there), so that ring stays small.
_EXECUTIONS_PER_READ = 64
_EXECUTIONS_PER_READ_DISTRIBUTED = 16
# ...but never waits longer than this, so a live dashboard stays live.
_READ_INTERVAL_S = 0.2


class GradientMonitor(keras.callbacks.Callback):
    """Record per-layer gradient statistics while `model.fit` trains.

    The monitor swaps in an instrumented copy of Keras's train step for the
    duration of `fit`. It records the very gradients the step hands to the
    optimizer: no second forward or backward pass. On a small model (up to
    32,768 parameters, every step recorded, no clipping or constraint) the
    step only copies the gradients and weights into a ring (and, with
    `activations=True`, the statistics of the activation gradients) and the
    statistics are computed when the monitor reads it, every few hundred
    steps or 0.2 s, which costs the step less; otherwise they are computed
    inside the compiled step. Per trainable variable and
    recorded step it keeps the statistics of `gradflow.schema.STATISTICS` plus the weight norm, the
    update ratio ||dw|| / ||w||, the gradient after optimizer clipping
    (`clipnorm`, `clipvalue`, `global_clipnorm`) and the weight norm before a
    constraint such as `keras.constraints.MaxNorm`. Per step it keeps the
    loss, the learning rate and the global gradient norm.

    Calling `fit` again (an epoch at a time, a notebook cell run again) with
    this or a new monitor of the same options reuses the step the model's
    last monitored `fit` traced, unless something that step read when it was
    traced has changed since: the optimizer or its settings, the loss and
    metrics, steps per execution, XLA, a layer's `trainable` flag, the
    trainable variables or their constraints.

    Steps are numbered as the optimizer counts them (`optimizer.iterations`
    after the step's update). A new optimizer counts from 0 again (Keras's
    fine-tuning recipe: unfreeze, `compile()` again, `fit` again): a `fit`
    of this monitor that starts below the steps it has recorded numbers its
    steps on after them, and an `info` event says by how much, so that no
    recorded step is replaced.

    It works with compiled metrics, sample weights, validation data,
    `steps_per_execution > 1` (every step is recorded) and `tf.distribute`
    strategies (the per-replica gradients are all-reduced first, so the
    numbers are those of the applied, summed gradient; the run store and
    TensorBoard are written by the chief only).

    Memory: every recorded step stays in memory for `history`, about 44
    bytes per weight tensor (twice that with `activations=True`, about 180
    more with `histograms=True`), also when a `store` has them on disk: a
    160-tensor model recorded for 100,000 steps keeps about 0.7 GB, and
    reading `history` builds a DataFrame of about 260 bytes a row more.
    For long runs, `every=10` keeps a tenth (measured: docs/reliability.md),
    and `keep_steps` keeps only the last steps in memory, e.g. with a `store`
    that has them all: `GradientMonitor(store="runs.db", keep_steps=1000)`.

    A monitor records one model: another model's `fit` with it raises,
    unless the monitor has a `store` and made its run, which has ended: the
    new model then goes into a new run, with a warning (SciKeras refits so).
    A copy (`copy.deepcopy`, KerasTuner's per trial, `sklearn.clone`) records
    its first `fit` afresh, into a run of its own. A
    layer's `trainable` changed without `compile()` again: Keras warns, and a
    plain `fit` with the step it traced before keeps training that layer;
    the monitor traces its step anew, so the layer is frozen as its flag
    says. Call `compile()` after changing `trainable`, as Keras asks, and
    both train the same.

    Example:

    ```python
    monitor = gradflow.GradientMonitor(activations=True)
    model.fit(x, y, epochs=3, callbacks=[monitor])
    monitor.history.groupby("layer")["l2_norm"].mean()
    ```

    A model that overrides `train_step` cannot be instrumented. The monitor
    then warns and falls back to a probe: every `probe_every` steps (default
    `every`) it runs one more forward and backward pass on the same batch, in
    inference mode and before the model's own update, and records those
    gradients (no clipping, update ratio or constraint columns; its
    `weight_norm` is that of the weights it saw, before the update). The probe
    differentiates the compiled loss; a model compiled without one (its loss
    computed inside its `train_step`, as in a GAN) needs `probe_loss`.

    Args:
        every: Record every `every` optimizer steps. Defaults to 1. With
            `every > 1`, a step whose gradient first goes NaN or Inf is
            recorded off that grid only with `stop_on_nonfinite=True`, which
            checks every step; otherwise the NaN is found at the next
            recorded step, where it may already have spread to every layer.
        activations: Also record dLoss/d(output of each layer), from the same
            backward pass. Defaults to `False`.
        histograms: Also count log10|g| histograms (fixed bins of
            `gradflow.schema`). Defaults to `False`.
        through_time: Also record the gradient through time, for a model
            that reads a sequence (an RNN): rows with `tensor == "time_step"`
            and `layer` `"t=01"`, `"t=02"`, ..., holding the statistics of the
            gradient of the model's outputs (summed with alternating signs,
            so a softmax's do not cancel) w.r.t. the sequence at that time
            step, from the same forward pass. Where it fades towards `t=1`,
            the early steps no longer reach the output: the gradient
            vanishes through time (a rule says so:
            `Thresholds.vanishing_through_time`). The sequence is the input when it is one
            float tensor `(batch, time, features)`, else the first layer
            output shaped so (an `Embedding`'s); more than 100 time steps
            share rows (`"t=001–003"`). It costs one more backward pass per
            recorded step (`every`). Defaults to `False`.
        store: A `gradflow.RunStore`, or a path to one, to write every
            recorded step to (live, for the dashboard). The Live page's
            Pause, Step once and Stop, after its **Take control**, then act
            on this `fit` (a run the monitor made; `run_id` runs are their
            owner's). Defaults to `None`.
        keep_steps: How many of the last recorded steps `history`,
            `metrics` and `histogram_rows` keep in memory: for a long run
            written to a `store` (or TensorBoard), which has every step. `0`
            keeps none; `events` are always kept, and the diagnosis rules
            still read every step (during the `fit`, in pieces of about
            100,000 rows, before older steps go). What the monitor holds
            then stays bounded: up to a piece of rows the rules have not
            read, and the steps they look back at (`repeat_after` + 1
            recorded steps and `growth_window` steps before them; through
            time, 10 times as many). Defaults to `None`: every recorded step
            stays in memory.
        run_id: Write into this existing run of `store` instead of creating
            one. Defaults to `None`.
        run_name: Name of the run the monitor creates. Defaults to `None`.
        close_run: Whether to set the run's final status at the end of `fit`
            (`"completed"`, `"diverged"`, or `"stopped"` after the
            dashboard's Stop). The lab runner passes `False`
            and sets it itself. Defaults to `True`.
        stop_on_nonfinite: Stop training at the first step whose gradient
            holds a NaN or Inf. That step's update is skipped, like
            `keras.optimizers.LossScaleOptimizer` does, so the weights stay
            finite, and so are the updates of the few batches `fit` still
            runs before the callback reads the step (at most 0.2 s or one ring:
            64 executions, up to 256 for the ring of a small model; none when
            the loss is non-finite too): the weights stay those of the last
            finite step, and `optimizer.iterations` ends at the non-finite
            one (it counts as a step, as a skipped update does in
            `LossScaleOptimizer`; the steps after it do not count). Under
            `tf.distribute` the update is applied: a cond around the
            optimizer's cross-replica update is not allowed there. A loss
            that turns NaN/Inf while every gradient is finite (a squared
            error overflowing) stops training at the end of its execution,
            with that step's update applied: with `steps_per_execution > 1`
            the steps after it in the execution are applied too. Defaults
            to `False`.
        tensorboard_dir: Also write the statistics as TensorBoard scalars and
            histograms into this folder. Defaults to `None`.
        probe_every: Probe interval of the fallback for models with their own
            `train_step`. Defaults to `every`.
        probe_loss: The loss the fallback's probe differentiates: a Keras
            loss object, its name (`"mse"`), or a callable
            `(y_true, y_pred) -> loss`, taken as its batch mean (plus the
            model's `add_loss` losses). Defaults to `None`: the compiled
            loss, which a model that computes its loss inside its own
            `train_step` may not have; without either, the probe has nothing
            to differentiate and the monitor warns and records nothing.
        rules: A `gradflow.diagnosis.Thresholds` for the diagnosis rules
            (vanishing, exploding, dead ReLU, saturation, vanishing through
            time) that run on the history at the end of training (with
            `keep_steps`, during it, in pieces); their findings join
            `.events`. Defaults to `None` (the default thresholds).

    Attributes:
        history: Tidy layer statistics (`schema.LAYER_STATS_COLUMNS`).
        metrics: Long per-step metrics (`step, name, value`).
        events: Events (`step, layer, kind, message`), e.g. the non-finite
            origin, or a layer no gradient reaches (`no_gradient`: it is
            left out of `history`, where zeros would read as vanishing).
        run_id: The run written in `store`, or `None`.

    If training raises (a KeyboardInterrupt, a bad batch), the steps
    recorded before are kept, the model gets Keras's own train step back, and
    a run the monitor created in `store` ends `interrupted` or `failed`.
    When another callback raises, Keras calls none of the monitor's hooks:
    the run is closed with that error when the notebook cell or the script
    ends of it; if the script catches it, only the next `fit` or
    `train_on_batch` closes the run, as `failed` with a general message
    (the error itself is gone by then).

    Raises:
        ValueError: if `every` or `probe_every` is not a positive integer,
            `keep_steps` is neither None nor an integer >= 0,
            `probe_loss` is an unknown loss name or several losses, a
            switch is not True or False, `store`, `run_name` or `rules` is of
            the wrong kind, or `run_id` comes without `store`; at the start
            of `fit`, if the model is not compiled or a second
            `GradientMonitor` is given to the same `fit`.
            Also at the start of `fit`: another model's, without a `store`
            (or with a `run_id` given, or `close_run=False`); and a copy's
            of a monitor given `run_id` (every copy would write into that run).
        TypeError: if `probe_loss` is neither a loss name nor callable.
    """

    def __init__(
        self,
        every=1,
        activations=False,
        histograms=False,
        store=None,
        run_id=None,
        run_name=None,
        close_run=True,
        stop_on_nonfinite=False,
        tensorboard_dir=None,
        probe_every=None,
        rules=None,
        probe_loss=None,
        through_time=False,
        keep_steps=None,
    ):
        check_backend("gradflow.GradientMonitor")
        super().__init__()
        self.every = positive_int("every", every)
        self.probe_every = (
            self.every if probe_every is None else positive_int("probe_every", probe_every)
        )
        self.probe_loss = (
            None if probe_loss is None else resolve_loss(None, probe_loss, argument="probe_loss")
        )
        if store is None and run_id is not None:
            raise ValueError(
                f"`run_id` needs a `store` to write to, got run_id={run_id!r} and store=None."
            )
        check_outputs(store, run_name, tensorboard_dir, rules)
        self.activations = flag("activations", activations)
        self.histograms = flag("histograms", histograms)
        self.through_time = flag("through_time", through_time)
        self.stop_on_nonfinite = flag("stop_on_nonfinite", stop_on_nonfinite)
        self.keep_steps = whole_number("keep_steps", keep_steps, least=0, allow_none=True)
        self.tensorboard_dir = tensorboard_dir
        self.run_name = run_name
        self.run_id = run_id
        self._created_run = False  # whether `run_id` is a run this monitor made
        self.close_run = flag("close_run", close_run)
        self.rules = rules
        self._store = store
        self._writer = None
        # The dashboard's Pause/Stop for a run this monitor made (`_open_store`).
        self._requests = None
        # The `steps_per_execution` the page was told Step once trains.
        self._told_execution_steps = None
        # (writer, status, message) of a run whose end the store could not
        # take (a full disk): `flush()` tries again.
        self._unwritten = []
        # The store trouble this fit's user was told of (`_check_store`).
        self._told_store = set()
        self._summaries = None
        self._blocks = []
        self._metric_rows = []
        self._events = []
        self._frames = None
        # How many of `_blocks` the diagnosis rules have read (`_diagnose`).
        self._diagnosed_blocks = 0
        # Tidy rows in `_blocks` the rules have not read (with `keep_steps`,
        # they read them during the `fit`, before older rows are dropped).
        self._undiagnosed_rows = 0
        # The last step `keep_steps` dropped from memory, or None.
        self._forgotten_through = None
        self._nonfinite_step = None
        self._halt_step = None
        self._plan = None
        # Whether the last `fit` clipped (set at its start; `history` before any fit reads it).
        self._clipping = False
        # Whether this monitor is a copy (`copy`, `pickle`, `sklearn.clone`,
        # KerasTuner's per trial): it records its first `fit` afresh.
        self._copied = False
        # The methods (`evaluate`, `predict`) said to record nothing: once each.
        self._told_only_fit = set()
        # The row layout of the last `fit` that recorded a step: a later
        # `fit` that trains other layers says so (`_note_trained_layers`).
        self._last_layout = None
        self._held_log = None
        # Added to the optimizer's step count to number the steps of this
        # `fit`: non-zero once the count went back below what this monitor
        # had recorded (a new optimizer, `compile()` again), see `_begin_fit`.
        self._step_offset = 0
        # The optimizer of the last `fit`: a count that went back with the
        # same optimizer is a restored state, not a new optimizer.
        self._last_optimizer = None

    def __getstate__(self):
        # A weak reference cannot be pickled, and a copy's model (copied
        # with it) has its own optimizer.
        state = dict(self.__dict__)
        state["_last_optimizer"] = None
        state["_unwritten"] = []  # a writer's connection and thread stay with this monitor
        state["_requests"] = None
        # `copy.copy` shares what the state holds: two copies on two models
        # each recorded into the same lists, and read both models' rows.
        for name in ("_blocks", "_metric_rows", "_events"):
            state[name] = list(state[name])
        state["_told_store"] = set(state["_told_store"])
        state["_told_only_fit"] = set(state["_told_only_fit"])
        state["_frames"] = None
        # Not the model it recorded: a copy would copy it too, through Keras's
        # serialization, which fails for a custom layer that is not registered.
        # A copy records a model of its own (`_start_afresh`): also a copy of a
        # monitor that never ran, KerasTuner's per trial, whose copies all wrote
        # into one TensorBoard folder (and one `run_id`, each over the last).
        state["_copied"] = True
        for name in ("_plan", "_model", "_saved_train_step", "_held_log"):
            state[name] = None
        return state

    def _start_afresh(self, model_name):
        """Forget the model a copied monitor recorded: it records its new one from scratch.

        KerasTuner copies the callbacks for each trial, scikit-learn's `clone`
        (SciKeras, `cross_val_score`, `GridSearchCV`) for each fit, each
        with a new model; a copy of a monitor that had recorded a `fit`
        refused them all. The original keeps what it recorded.
        """
        root = self.__dict__.get("_tensorboard_root") or self.tensorboard_dir
        # Not `type(self)(...)`: a subclass's `__init__` may take other arguments.
        fresh = object.__new__(type(self))
        GradientMonitor.__init__(
            fresh,
            every=self.every,
            activations=self.activations,
            histograms=self.histograms,
            store=self._store,
            run_id=None if self._created_run else self.run_id,
            run_name=self.run_name,
            close_run=self.close_run,
            stop_on_nonfinite=self.stop_on_nonfinite,
            # A folder of its own in the one the user gave (not in the last fresh
            # start's, which nested deeper at every model): TensorBoard drew two
            # models' steps as one run.
            tensorboard_dir=None
            if self.tensorboard_dir is None
            else os.path.join(root, f"{model_name}-{uuid.uuid4().hex[:8]}"),
            probe_every=self.probe_every,
            rules=self.rules,
            probe_loss=self.probe_loss,
            through_time=self.through_time,
            keep_steps=self.keep_steps,
        )
        # What `fit` gave this copy (its model, `params`) stays.
        kept = {name: self.__dict__[name] for name in ("_model", "params") if name in self.__dict__}
        self.__dict__.update(fresh.__dict__)
        self.__dict__.update(kept)
        self._tensorboard_root = root

    # Results -----------------------------------------------------------------

    @property
    def history(self):
        """Tidy per-layer statistics of every recorded step (a DataFrame).

        With `keep_steps`, of the last `keep_steps` recorded steps only.
        """
        self._catch_up()
        return self._tables()[0]

    @property
    def metrics(self):
        """Per-step metrics in long form: `step, name, value` (a DataFrame).

        With `keep_steps`, from the first of the last `keep_steps` recorded
        steps on (with `every > 1`, the logged metrics of the batches after it too).
        """
        self._catch_up()
        return self._tables()[1]

    @property
    def events(self):
        """Events such as the non-finite origin: `step, layer, kind, message`, in step order."""
        self._catch_up()
        events = pd.DataFrame(self._events, columns=list(schema.EVENTS_COLUMNS))
        # In the order found, a NaN (told when read) came before the rules'
        # findings of the steps before it, or after them with `keep_steps`.
        events = events.sort_values("step", kind="stable", na_position="last", ignore_index=True)
        # As `diagnose` returns them, empty too (an empty frame's steps were objects).
        return events.astype({"step": "int64"}) if events["step"].notna().all() else events

    def _catch_up(self):
        """Read the steps a `fit` recorded that has not ended through `on_train_end`.

        Keras calls no callback when another callback raises (a validation
        set that does not fit, a Ctrl-C landing in one): the monitor's last
        steps stayed in its ring, and `history` read empty just when the
        user looked for what went wrong. Only in the thread that runs the
        `fit`, between two of its steps (or after it), as the monitor's own
        reads are.
        """
        model = getattr(self, "model", None)
        if (
            model is not None
            and model.__dict__.get(_OWNER, (None,))[0] is self
            and getattr(self, "_fit_thread", None) == threading.get_ident()
        ):
            self._collect()

    @property
    def histogram_rows(self):
        """Recorded histograms as a DataFrame: `step, layer, layer_index, tensor, counts`.

        With `keep_steps`, of the last `keep_steps` recorded steps only.
        """
        rows = [
            (step, layer, index, tensor, counts)
            for step, layer, index, tensor, counts in self._histogram_rows()
        ]
        return pd.DataFrame(rows, columns=["step", "layer", "layer_index", "tensor", "counts"])

    def flush(self):
        """Read every step recorded so far and write it to the store now.

        The monitor reads the compiled step's records every few batches (at
        most 0.2 s apart); call this when the run must show its latest step
        at once, e.g. before it pauses. Outside `fit` it writes what an
        earlier `fit` could not (a full disk, a lock held for minutes: that
        `fit` warned), and is otherwise a no-op.

        Raises:
            RuntimeError: outside `fit`, when the store still cannot take
                those rows (inside `fit` it warns: training goes on).
        """
        self._write_unwritten(during_fit=self._writer is not None)
        if getattr(self, "_plan", None) is None:
            return
        self._collect()
        if self._writer is not None:
            self._writer.flush()

    def _write_unwritten(self, during_fit):
        """Write the ends of earlier fits the store could not take (`_close_outputs`), oldest first."""
        while self._unwritten:
            writer, status, message = self._unwritten[0]
            try:
                writer.close(status, message)
            except sqlite3.Error as error:
                said = (
                    f"GradientMonitor still cannot write run {self.run_id} to its store: "
                    f"{trouble.explain(error, self._store_path())}.{self._kept_in_history()}"
                )
                if not during_fit:
                    raise RuntimeError(said) from error
                warn_user(said)
                return
            self._unwritten.pop(0)

    # Callback hooks ----------------------------------------------------------

    def set_model(self, model):
        # A tf_keras (Keras 2) `fit` calls this first, then Keras 2 methods a
        # Keras 3 callback lacks (an AttributeError from inside tf_keras).
        words = legacy_keras_words(model)
        if words is not None:
            raise TypeError(f"GradientMonitor needs a Keras 3 model: {words}.")
        super().set_model(model)

    def on_train_begin(self, logs=None):
        model = self.model
        if model.optimizer is None:
            raise ValueError(
                "GradientMonitor needs a compiled model; call `model.compile()` first."
            )
        # Before the model is taken: raised later, it left the model this
        # monitor's, and the next `fit` failed in `_restore_model`.
        steps_per_execution = _steps_per_execution(model)
        # The plan of this monitor's last `fit` holds the model it recorded.
        first = self._plan.model if self._plan is not None else None
        if (
            first is not None
            and first is not model
            # Its `fit` on this thread: one running in another thread is alive,
            # and `_models_in_a_fit_now` sees this thread's stack only.
            and _IN_A_FIT.get(self) == threading.get_ident()
            and id(first) not in _models_in_a_fit_now()
        ):
            # The last model's `fit` ended in an error the script caught (another
            # callback's): its run read `running` and this `fit` was refused.
            # Closed now, with that model, as the next `fit` of it would.
            self._abandon_fit_of(first)
        if self._copied:
            if self.run_id is not None and not self._created_run:
                # A run the user named by id is theirs: a copy's new model would
                # join its curves, as a second model would (below).
                raise ValueError(
                    f"This GradientMonitor is a copy of one given `run_id={self.run_id!r}`: "
                    "KerasTuner and scikit-learn copy the callbacks for each trial or fold, "
                    "and every copy would write its model into that one run, each over the "
                    "last. Leave `run_id` out: each copy then records into a run of its own."
                )
            self._start_afresh(model.name)
            first = None
        elif (
            first is not None
            and first is not model
            and self._created_run
            and self.close_run
            and self._writer is None
            and not self._unwritten
        ):
            # The last model's steps are safe in its closed run: SciKeras gives
            # the same monitor to each `fit` of an estimator, with a new model
            # each time, and the second `fit` failed.
            ended = self.run_id
            self._start_afresh(model.name)
            warn_user(
                f"GradientMonitor recorded model {first.name!r} into run {ended} of its store; "
                f"this fit's model ({model.name!r}, another model object) goes into a new run, "
                "and `history` now holds the new model's steps only."
            )
            first = None
        if first is not None and first is not model:
            # Its steps would go on from the first model's and layers of one
            # name would join its curves, in one history and one stored run.
            other = (
                f"another model object named {model.name!r} (a model built again, "
                "e.g. after `keras.backend.clear_session()`)"
                if first.name == model.name
                else f"model {model.name!r}"
            )
            raise ValueError(
                f"This GradientMonitor recorded model {first.name!r}; {other} needs a "
                "GradientMonitor of its own (make one for each model, e.g. inside the loop "
                "over models"
                + (
                    "; a copy, `copy.deepcopy(monitor)`, records a new model afresh)."
                    if self.run_id is None or self._created_run
                    else ")."
                )
            )
        # Every callback of one `fit` gets the same `params` dict. Each
        # monitor rebuilds the train step, so a second one would silently
        # leave the first with nothing.
        owner = model.__dict__.get(_OWNER)
        if owner is not None and owner[0] is not self and owner[1] is self.params:
            error = ValueError(
                "Two GradientMonitors were given to one `fit`, and only one can record it "
                "(each rebuilds the train step). Use one monitor with the options of both."
            )
            owner[0]._abandon(error)  # `fit` ends here: leave the model as it was
            raise error
        if owner is not None and owner[1] is not self.params:
            # An earlier `fit` failed in its monitor's `on_train_begin`, after
            # the model was taken and before `_watch_for_the_next_fit` (which
            # closes every later failure). Close that run and give the model
            # its own step back before this `fit` saves it.
            owner[0]._abandon(RuntimeError(_ENDED_OUTSIDE_THE_STEP))
        object.__setattr__(model, _OWNER, (self, self.params))
        self._fit_thread = threading.get_ident()
        strategy = model.distribute_strategy
        self._is_chief = bool(getattr(strategy.extended, "should_checkpoint", True))
        executions_per_read = (
            _EXECUTIONS_PER_READ
            if strategy.num_replicas_in_sync == 1
            else _EXECUTIONS_PER_READ_DISTRIBUTED
        )
        self._steps_per_execution = steps_per_execution
        self._saved_train_step = model.__dict__.get("train_step")
        # Made once: the optimizer's config and every layer are read for it.
        reuse_key = _ReuseKey(self, model)
        if self._reuse_last_step(model, reuse_key):
            self._begin_fit()
            return
        self._plan = StepPlan(
            model,
            self._steps_per_execution * executions_per_read,
            self.activations,
            self.every,
            self.histograms,
            self.stop_on_nonfinite,
            self.through_time,
        )
        instrumented = type(model).train_step is TensorFlowTrainer.train_step
        if instrumented:
            step = instrumented_train_step(self._plan)
        else:
            warn_user(
                f"Model {model.name!r} overrides `train_step`, so GradientMonitor cannot "
                "read the gradients it applies. Falling back to a probe: one extra forward "
                f"and backward pass (inference mode) on the training batch every "
                f"{self.probe_every} steps (`probe_every`)."
            )
            step = probed_train_step(
                self._plan, model.train_step, self.probe_every, self.probe_loss
            )
        rows_known = not self.through_time or through_time.rows_before_fit(self._plan)
        if self.through_time and not rows_known and self._plan.replicas > 1:
            # The ring cannot be made inside a replica's step.
            warn_user(
                f"GradientMonitor(through_time=True) records nothing through time for model "
                f"{model.name!r} under tf.distribute: it needs a model whose input is declared "
                "as (batch, time, features), a Functional or Sequential model."
            )
            self._plan.through_time = False
            rows_known = True
        if all(layer.built for layer in model._flatten_layers()) and rows_known:
            # Otherwise the first trace builds the model and then the ring
            # (and the ring's rows through time, which the sequence it traces
            # with decides).
            self._plan.prepare(*split_overwritten(model.trainable_weights))
        # Keras builds its train function from `model.train_step`; an instance
        # attribute shadows the class's method until `on_train_end`.
        object.__setattr__(model, "train_step", step)
        model.make_train_function(force=True)
        compiled = model.train_function
        model.train_function = self._guarded(compiled)
        if instrumented:
            object.__setattr__(model, _LAST_STEP, (reuse_key, self._plan, step, compiled))
        self._begin_fit()

    def _reuse_last_step(self, model, key):
        """Take the train step the model's last monitored `fit` traced, if nothing it depends on changed.

        Tracing the instrumented step took most of a short `fit`'s time (a
        20-step `fit` of the 5-layer MLP 0.48-0.50 s with a monitor, 0.12 s
        reusing it, 0.075 s plain: `python3 bench/bench_refit.py`), and users call `fit`
        in loops, one epoch at a time, or again from a notebook cell. So a
        `fit` for which nothing in `_ReuseKey` changed since the model's
        last monitored `fit` runs the compiled function that `fit` built;
        anything else traces anew.
        """
        last = model.__dict__.get(_LAST_STEP)
        # No ring yet: the last `fit` ended before its first trace.
        if last is None or last[1].buffer is None or last[0] != key:
            return False
        _, self._plan, step, compiled = last
        # A fresh start: nothing halted, no step of the last `fit` left to read.
        self._plan.buffer.halted.assign(0)
        self._plan.buffer.steps.assign(tf.zeros_like(self._plan.buffer.steps))
        object.__setattr__(model, "train_step", step)
        model.train_function = self._guarded(compiled)
        return True

    def _begin_fit(self):
        model = self.model
        self._watch_for_the_next_fit()
        _close_fits_that_ended_in_an_error(self)
        _IN_A_FIT[self] = threading.get_ident()
        _close_at_each_notebook_cells_end()
        self._clipping = not self._plan.probing and clipping_optimizer(model.optimizer) is not None
        # `_last_step` and `_final_step` count as the optimizer does (the
        # ring's steps); every step this monitor reports adds `_step_offset`.
        self._last_step = self._counted_steps()
        restored = self._last_optimizer is not None and self._last_optimizer() is model.optimizer
        numbering = self._number_on_from(self._last_step, "restored" if restored else "new")
        self._last_optimizer = weakref.ref(model.optimizer)
        planned = _planned_steps(self.params)
        # Lets a short run skip compiling the deferred ring's read.
        self._final_step = None if planned is None else self._last_step + planned
        self._first_epoch = None
        self._last_read = time.monotonic()
        self._batches_since_read = 0
        self._pending_logs = []
        # The last execution's metrics in an epoch of unknown length (`on_train_batch_end`).
        self._held_log = None
        self._told_store = set()
        self._epoch_start_step = self._current_step()
        # A short last execution is reported as whole (see on_train_batch_end).
        self._steps_per_epoch = int(self.params.get("steps") or 0) or math.inf
        self._layout = None
        # Each `fit` halts at its own first non-finite step (a monitor given
        # to several fits); the events of earlier fits stay.
        self._nonfinite_step = None
        # The first non-finite gradient, where the step halts with `stop_on_nonfinite`.
        self._halt_step = None
        self._loss_scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        self._overflows_seen, self._overflow_step = self._overflows(), self._current_step()
        if self._is_chief:
            try:
                self._open_store()
            except sqlite3.Error as error:
                # SQLite's words ("attempt to write a readonly database") name
                # neither the argument nor the file; `fit` ends here.
                self._abandon(error)
                raise RuntimeError(
                    f"GradientMonitor could not write to its `store`: "
                    f"{trouble.explain(error, self._store_path())} (or leave `store` out to "
                    "keep the statistics in `.history` only)."
                ) from error
            if self.tensorboard_dir is not None:
                self._summaries = SummaryWriter(self.tensorboard_dir)
        if numbering is not None:
            # Told once the store is open: the run's page says it too.
            self._add_event(*numbering)

    def _number_on_from(self, count, why):
        """Number this `fit`'s steps after every step this monitor has reported.

        Steps are the optimizer's count, which starts again at 0 with a new
        optimizer: Keras's fine-tuning recipe (train the head, unfreeze,
        `compile()` again, `fit` again) or one monitor given to another
        model. It also goes back when a saved state is loaded
        (`BackupAndRestore` resuming after a crash, `load_weights`).
        Numbered as they come, the second `fit`'s steps 1, 2, ...
        would repeat the first's: two rows per step in `history`, and in the
        store the later rows would replace the earlier ones.

        Args:
            count: the optimizer's step count now.
            why: what the event gives as the cause: `"new"` (another
                optimizer), `"restored"` (the same optimizer, its state
                loaded) or `"callback"` (a callback's `on_train_begin` loaded it).

        Returns:
            The `info` event that says so `(step, layer, kind, message)`, or
            None when the numbering did not change.
        """
        reported = [int(block[0][-1]) for block in self._blocks if len(block[0])]
        reported += [] if self._forgotten_through is None else [self._forgotten_through]
        reported += [row[0] for row in self._metric_rows + self._events if row[0] is not None]
        through = max(reported, default=None)
        offset = 0 if through is None else max(0, through - count)
        note = None
        if offset and offset != self._step_offset:
            note = (
                through,
                None,
                "info",
                f"The optimizer's step count is {count} at the start of this fit, below the "
                f"step {through} this monitor has already recorded ({_WHY_THE_COUNT_WENT_BACK[why]}). "
                f"So that nothing recorded is replaced, this fit's steps are "
                f"numbered on from step {through + 1}: its step n is the optimizer's "
                f"iteration n - {offset}.",
            )
        self._step_offset = offset
        return note

    def on_train_batch_end(self, batch, logs=None):
        self._batches_since_read += 1
        logs = logs or {}
        # Compiled metrics (accuracy, ...) come only through `logs`, as
        # Keras's running means over the epoch so far; keep them per batch.
        # Converting a tensor to a float waits for the step to finish, so
        # they are kept as they are and converted when the ring is read.
        compiled = {k: v for k, v in logs.items() if k != "loss"}
        if compiled:
            # `batch` is the last step of this execution within the epoch;
            # reading `optimizer.iterations` here would wait for the step.
            # Keras reports a short last execution of an epoch (6 batches at
            # 4 steps per execution) as if it were whole: it ends the epoch.
            done = min(batch + 1, self._steps_per_epoch)
            entry = (self._epoch_start_step + done, compiled)
            if self._steps_per_epoch == math.inf and self._steps_per_execution > 1:
                # An epoch of unknown length (a generator) says its short
                # last execution is whole only by ending: batch 7 of an epoch
                # of 6 put the epoch's metrics on a step of the next one, and
                # the last epoch's past the run's end. So each execution's
                # metrics wait for the next one of the epoch, or for its end.
                if self._held_log is not None:
                    self._pending_logs.append(self._held_log)
                self._held_log = entry
            else:
                self._pending_logs.append(entry)
        # With `stop_on_nonfinite`, the step that meets a non-finite gradient
        # records itself and halts: it and every step after it leave the
        # weights and `optimizer.iterations` alone. Reading the ring finds
        # that step and stops `fit`. Asking the step's halt flag after every
        # batch instead cost 60-100 us a step (a variable read), 2-3% of a
        # lab step; a non-finite loss, the usual sign, is read at once.
        if (
            # The plan's capacity may grow when it prepares (a deferred ring).
            self._batches_since_read * self._steps_per_execution >= self._plan.capacity
            or time.monotonic() - self._last_read >= _READ_INTERVAL_S
            or (self.stop_on_nonfinite and not _is_finite(logs.get("loss", 0.0)))
        ):
            self._collect()
        if self._requests is not None:
            self._take_requests()

    def _take_requests(self):
        """The Live page's Pause, Step once and Stop, for a run this monitor made."""
        try:
            stop = self._requests.check() == "stop"
        except BaseException as error:
            # A Ctrl-C lands here while paused, outside the guarded train
            # function: the run read "paused" until the script ended, then
            # "failed" (an error outside the train step).
            self._abandon(error)
            raise
        if stop:
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        if self._first_epoch is None:
            self._first_epoch = epoch
            self._count_again(epoch)
        self._epoch_start_step = self._current_step()

    def _count_again(self, epoch):
        """Take the optimizer's step count again, now that every callback's `on_train_begin` ran.

        `BackupAndRestore` loads the weights, `optimizer.iterations` and the
        epoch to resume from in its own `on_train_begin`, after this
        monitor's when the monitor comes first in `callbacks`. Counted from
        before the restore, the resumed steps the ring held at or below the
        old count were dropped as already read, and the planned total was
        off by the restored steps ("step 18 of 12").
        """
        count = self._counted_steps()
        if count != self._last_step:
            self._last_step = count
            numbering = self._number_on_from(count, "callback")
            if numbering is not None:
                self._add_event(*numbering)
            self._overflows_seen, self._overflow_step = self._overflows(), self._current_step()
        planned = _planned_steps(self.params)
        if planned is None:
            return
        # `fit(initial_epoch=...)`, or the epoch a backup resumes from, runs
        # epochs - initial_epoch epochs, and `params` does not say so.
        final = count + planned - epoch * int(self.params["steps"])
        if final != self._final_step:
            self._final_step = final
            if self._created_run and self._store is not None:
                self._store_call("set_total_steps", self._final_numbered_step())

    def on_test_begin(self, logs=None):
        # `fit` runs its validation through `evaluate` with the same callbacks.
        if _IN_A_FIT.get(self) != threading.get_ident():
            self._records_only_fit("evaluate")

    def on_predict_begin(self, logs=None):
        self._records_only_fit("predict")

    def _records_only_fit(self, method):
        if method in self._told_only_fit or self._plan is not None:
            # Once; and not at all to a monitor that recorded a `fit`: SciKeras
            # gives `predict` and `score` the `fit`'s callbacks, and every call warned.
            return
        self._told_only_fit.add(method)
        warn_user(
            f"GradientMonitor records training steps only: `{method}` computes no gradients, "
            f"so it records nothing. Give it to `fit` (or use `gradflow.snapshot` for the "
            "gradients of one batch)."
        )

    def on_epoch_end(self, epoch, logs=None):
        self._release_held_log()
        self._collect()
        # Validation results belong to the last step of the epoch.
        values = {k: float(v) for k, v in (logs or {}).items() if k.startswith("val_")}
        if values:
            self._add_metrics(self._current_step(), values)

    def on_train_end(self, logs=None):
        try:
            self._release_held_log()
            self._collect()
        finally:
            self._restore_model()
        dropped = self._plan.dropped_activations
        if dropped:
            named = ", ".join(dropped[:8]) + (", ..." if len(dropped) > 8 else "")
            warn_user(
                f"GradientMonitor recorded the outputs of {self._plan.activation_slots} layer "
                f"calls (every layer's first) and left out {len(dropped)} more: {named}. "
                "`gradflow.snapshot(model, x, y)` records every call, on one batch."
            )
        self._diagnose_safely()
        status, message = "completed", None
        if self._nonfinite_step is not None:
            status = "diverged"
            # Not the first event: a layer no gradient reaches is told at the first step.
            # Nor an earlier fit's: this monitor may have recorded several.
            message = next(
                (
                    e[3]
                    for e in self._events
                    if e[2] == "nonfinite" and e[0] == self._nonfinite_step
                ),
                None,
            )
        elif self._requests is not None and self._requests.stopped:
            status, message = "stopped", stopped_message(self._current_step())
        else:
            message = self._ended_early()
        self._requests = None
        if self._writer is not None:
            # With `every=50` a 60-step run's last recorded step is 50: it read
            # "Completed · step 50 / 60", as if 10 steps had been lost.
            self._writer.progress(self._current_step())
        self._close_outputs(status, message)

    def _ended_early(self):
        """A stored run another callback ended early (EarlyStopping) ends where it stopped.

        It said "step 40 / 100" for ever, as if 60 steps had been lost.
        Returns the run's message then, else None.
        """
        planned = self._final_numbered_step()
        if not (self._created_run and self._store is not None and planned is not None):
            return None
        done = self._current_step()
        if self._first_epoch is None and done < planned:
            # No epoch ran (`fit(initial_epoch=3, epochs=3)`): nothing was planned.
            self._store_call("set_total_steps", done)
            return None
        if not self.model.stop_training or done >= planned:
            return None
        self._store_call("set_total_steps", done)
        return (
            f"Training ended at step {done} of the {planned} planned: a callback "
            "stopped it (such as EarlyStopping)."
        )

    # Internals ---------------------------------------------------------------

    def _guarded(self, compiled):
        """`compiled` (Keras's train function) that, when it raises, keeps what was recorded.

        Keras calls no callback when `fit` raises (a KeyboardInterrupt, a bad
        batch, out of memory): without this the model would keep the
        instrumented step and a stored run would say "running" for ever.
        """

        def train_function(iterator):
            try:
                return compiled(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                raise  # The end of the data: Keras ends the epoch.
            except BaseException as error:
                self._abandon(error)
                raise

        train_function.__wrapped__ = compiled
        return train_function

    def _watch_for_the_next_fit(self):
        """Give the model its own step back if it trains again before this `fit` ends.

        Keras calls no callback when another callback raises (or a Ctrl-C
        lands in one), so `fit` can end with the model still holding the
        instrumented step, and a plain `fit` after it would run that step: it
        would halt on a NaN and fill a ring no one reads. Keras's `fit` and
        `train_on_batch` call `make_train_function()` before anything else, so
        an instance attribute shadowing it sees the next one begin, closes
        this run as failed and lets Keras build its own step. A call with
        `force=True` is a retrace inside this `fit` (the lab's `RunControl`
        stepping one step at a time), which must build the instrumented step.
        """
        model = self.model

        def make_train_function(force=False):
            if force:
                return type(model).make_train_function(model, force=True)
            model.__dict__.pop("make_train_function", None)
            self._abandon(_how_fit_ended(model))
            return model.make_train_function(force=force)

        object.__setattr__(model, "make_train_function", make_train_function)

    def _abandon_fit_of(self, model):
        """Close the run of `model`'s `fit` that ended in an error, though `fit` now has another."""
        current = self._model
        self._model = model  # `_abandon` reads the ring and restores the model it recorded
        try:
            with contextlib.suppress(Exception):  # the new fit must not fail for it
                self._abandon(_how_fit_ended(model))
        finally:
            self._model = current

    def _abandon(self, error):
        """Keep the steps recorded before `error`, put the model back, close the run."""
        try:
            self._collect()
        except Exception:  # The error being raised matters more.
            pass
        self._restore_model()
        if isinstance(error, KeyboardInterrupt):
            status, message = "interrupted", "Training was interrupted (KeyboardInterrupt)."
        else:
            status = "failed"
            message = f"Training failed: {error_text(error)}"[:500]
        self._close_outputs(status, message)

    def _restore_model(self):
        model = self.model
        if model.__dict__.get(_OWNER, (None,))[0] is not self:
            return  # Done already.
        model.__dict__.pop(_OWNER, None)
        model.__dict__.pop("train_step", None)
        model.__dict__.pop("make_train_function", None)
        if self._saved_train_step is not None:
            object.__setattr__(model, "train_step", self._saved_train_step)
        # Make the next fit (or train_on_batch) build Keras's own step again.
        model.train_function = None
        # Nothing uses our step now: let it, and the ring it captured, be freed.
        trace_gradients.forget(self._plan.custom_gradients)

    def _close_outputs(self, status, message):
        """Close the TensorBoard files and the store writer; `status` only if this run is ours."""
        _IN_A_FIT.pop(self, None)
        summaries, self._summaries = self._summaries, None
        writer, self._writer = self._writer, None
        try:
            if summaries is not None:
                summaries.close()
        finally:
            if writer is not None:
                status = status if self.close_run else None
                try:
                    writer.close(status, message)
                    # A short fit's last flush may be the first to find its run deleted.
                    self._check_store(writer)
                except sqlite3.Error as error:
                    # Training is done and every step is in `.history`: a
                    # store that cannot take the last ones (a full disk, a
                    # lock held for minutes) must not end `fit` in SQLite's
                    # words, before the user's next line (`model.save`) runs.
                    self._unwritten.append((writer, status, message))
                    warn_user(
                        f"GradientMonitor could not write the end of run {self.run_id} to its "
                        f"store: {trouble.explain(error, self._store_path())}. Training "
                        f"finished.{self._kept_in_history()} Call `monitor.flush()` to write "
                        "the rest to the store once that is mended."
                    )

    def _collect(self):
        """Read the ring, keep the new records, and pass them on."""
        self._last_read = time.monotonic()
        self._batches_since_read = 0
        if self._plan.buffer is not None:  # None until the step is traced
            self._read_ring()
            self._note_overflows()
        if self._writer is not None:
            self._check_store(self._writer)
        halted_at = self._halted_step()
        for step, compiled in self._pending_logs:
            # The batches `fit` ran after a halt changed nothing: their
            # running metrics belong to no step.
            if halted_at is None or step <= halted_at:
                self._add_metrics(step, {name: float(value) for name, value in compiled.items()})
        self._pending_logs = []

    def _check_store(self, writer):
        """Tell the user once when the store stops taking this run's rows.

        The writer keeps them in memory and tries again every half second:
        a disk that fills and is freed loses nothing. Before, nothing was
        said until `fit` ended in SQLite's "database or disk is full".
        """
        if writer.run_deleted and "deleted" not in self._told_store:
            self._told_store.add("deleted")
            warn_user(
                f"Run {self.run_id} was deleted from the run store while it trained: "
                "GradientMonitor keeps its steps in `.history` only."
            )
        error = writer.write_error
        if error is not None and "unwritable" not in self._told_store:
            self._told_store.add("unwritable")
            warn_user(
                f"GradientMonitor cannot write run {self.run_id} to its store now: "
                f"{trouble.explain(error, self._store_path())}. Training goes on; the steps "
                "wait in memory and are written once the store takes them again."
                f"{self._kept_in_history()}"
            )

    def _kept_in_history(self):
        # With `keep_steps`, `.history` holds only the last steps.
        return " Every step is in `.history`." if self.keep_steps is None else ""

    def _store_path(self):
        return str(getattr(self._store, "path", self._store))

    def _store_call(self, method, *args):
        """A write of the run's total or settings during `fit`: a store in trouble only warns.

        A run deleted from the dashboard while its script trained ended the
        script's `fit` in `UnknownRunError` (with EarlyStopping, at its end).
        """
        try:
            getattr(self._store, method)(self.run_id, *args)
        except UnknownRunError:
            pass  # `_check_store` says so
        except sqlite3.Error:
            pass  # the writer's rows meet the same trouble, and `_check_store` says so

    def _halted_step(self):
        """The step where `stop_on_nonfinite` halted training, or None."""
        halts = self.stop_on_nonfinite and not self._plan.probing and self._plan.replicas == 1
        # A non-finite loss with finite gradients halts nothing in the step:
        # its update was applied, and so were those after it until `fit` stopped.
        return self._halt_step if halts else None

    def _read_ring(self):
        steps, stats, metrics, histograms = self._plan.buffer.read(
            self._last_step, self._final_step
        )
        if len(steps) == 0:
            return
        self._last_step = int(steps[-1])
        steps = steps + self._step_offset
        if self._layout is None:
            self._layout = RowLayout.build(
                self._plan.names,
                self._plan.activation_paths,
                self._plan.layer_order,
                self._plan.unreached,
                self._plan.time_labels,
                self._plan.time_source,
            )
            self._note_unreached(int(steps[0]))
            self._note_trained_layers(int(steps[0]))
            self._store_layer_inputs()
        stats, histograms = self._layout.take(stats), self._layout.take(histograms)
        # With its layout: a later `fit` of this monitor may have other rows (a frozen layer).
        self._blocks.append((steps, stats, metrics, histograms, self._layout))
        self._undiagnosed_rows += int(np.prod(stats.shape[:2]))  # steps x tensors
        self._frames = None
        self._check_nonfinite(steps, stats, metrics)
        if self._writer is not None or self._summaries is not None:
            self._publish(steps, stats, metrics, histograms)
        if self.keep_steps is not None and self._undiagnosed_rows >= _DIAGNOSED_ROWS:
            # The rules read the steps now, so that the old ones can go.
            self._diagnose_safely()

    def _note_trained_layers(self, step):
        """An `info` event when this `fit` trains other layers than the last one did.

        Keras's fine-tuning recipe trains a head on a frozen base, then
        unfreezes part of it and trains again: the heatmap went from 2 layers
        to 16 at that step with nothing saying why.
        """
        before, self._last_layout = self._last_layout, self._layout
        if before is None:
            return
        old, new = _weight_layers(before), _weight_layers(self._layout)
        added = [layer for layer in new if layer not in old]
        gone = [layer for layer in old if layer not in new]
        # The same layer training other weights: `enable_lora` between two
        # fits freezes `kernel` and adds `lora_kernel_a`/`_b`, and the layer's
        # norm changed at that step with nothing saying why.
        changed = [layer for layer in new if layer in old and set(new[layer]) != set(old[layer])]
        if not added and not gone and not changed:
            return
        told = [f"This fit trains {_count(new, 'layer')} with weights, the last fit {len(old)}."]
        if added:
            told.append(f"Training now and not in the last fit (unfrozen, or new): {_some(added)}.")
        if gone:
            told.append(
                "Trained in the last fit and not now, so without rows from this step on "
                f"(frozen with `trainable = False`, or gone): {_some(gone)}."
            )
        if changed:
            told.append(
                "Training other weights than in the last fit (`enable_lora`, or a weight "
                "frozen on its own), so their norms change here: "
                + _some(
                    [
                        f"{layer} ({', '.join(new[layer])}; was {', '.join(old[layer])})"
                        for layer in changed
                    ],
                    most=4,
                )
                + "."
            )
        self._add_event(step, None, "info", " ".join(told))

    def _store_layer_inputs(self):
        """Keep which recorded layer reads which in the run's config, for the
        dashboard's and the exports' alerts (`diagnosis.run_layer_inputs`),
        and the model's size: a model without an `Input` (KerasTuner's
        tutorials) is built by its first step, after the run was made."""
        if self._store is None or not self._created_run:
            return
        entries = {"parameters": self._plan.model.count_params()}
        if self._plan.activation_inputs:
            entries["layer_inputs"] = dict(self._plan.activation_inputs)
        self._store_call("update_config", entries)

    def _note_unreached(self, step):
        """A `no_gradient` event per layer with weights or an output no gradient reaches.

        The tape returns no gradient there, and Keras's optimizer skips those
        weights; recorded as zeros, they would read as vanishing gradients
        and dead ReLUs. Often it is a bug (a layer left out of `call`, an
        output with no loss), so the event says what was seen and what to check.
        """
        plan = self._plan
        rows = len(plan.names)
        unreached, untaped = {}, []
        for row in plan.unreached:
            if row < rows:
                name = plan.names[row]
                unreached.setdefault(name.layer, []).append(name.tensor)
            elif row - rows < len(plan.activation_paths):
                path = plan.activation_paths[row - rows]
                if path in plan.untaped:
                    untaped.append(path)
                else:
                    unreached.setdefault(path, []).append("output")
        told = {layer for _, layer, kind, _ in self._events if kind == "no_gradient"}
        for layer, tensors in unreached.items():
            if layer in told:
                continue  # by an earlier `fit` of this monitor
            self._add_event(step, layer, "no_gradient", no_gradient_message(layer, tensors))
        told = {layer for _, layer, kind, _ in self._events if kind == "info"}
        for layer in untaped:
            if layer not in told:
                self._add_event(
                    step,
                    layer,
                    "info",
                    f"Layer {layer!r} runs inside `keras.remat` (or another block the tape "
                    "does not record, such as `tf.recompute_grad`), so the gradient with "
                    "respect to its output cannot be read there: it has no output row. Its "
                    "weights' gradients are recorded as usual.",
                )

    def _check_nonfinite(self, steps, stats, metrics):
        if self._halt_step is not None:
            return
        for step, block, values in zip(steps, stats, metrics, strict=False):
            row = nonfinite_origin(block, self._layout)
            loss = float(values[STEP_METRICS.index("loss")])
            if row is None:
                if not math.isfinite(loss) and self._nonfinite_step is None:
                    # A squared error overflows float32 before its gradient
                    # (twice the error) does. `TerminateOnNaN` stopped such a
                    # run and it was stored "completed: a callback stopped it
                    # (such as EarlyStopping)".
                    self._nonfinite_step = int(step)
                    self._add_event(int(step), None, "nonfinite", loss_alone_message(step, loss))
                    if self.stop_on_nonfinite:
                        self.model.stop_training = True
                continue
            self._halt_step = int(step)
            if self._nonfinite_step is None:
                self._nonfinite_step = int(step)
            layer, tensor = self._layout.layers[row], self._layout.tensors[row]
            count = int(block[row, schema.STATISTICS.index("nonfinite")])
            message = nonfinite_message(step, layer, tensor, count, loss)
            self._add_event(int(step), layer, "nonfinite", message)
            if self.stop_on_nonfinite:
                self.model.stop_training = True
            return

    def _overflows(self):
        """How many batches the model's `LossScaleOptimizer` has skipped in monitored steps."""
        overflows = getattr(self._plan.buffer, "overflows", None)
        if not self._loss_scaled or overflows is None:
            return 0
        return int(overflows.numpy())

    def _note_overflows(self):
        """An `info` event for the batches skipped for loss-scale overflow since the last read.

        Their gradients are not in the history (nothing was applied), so the
        event says where the missing batches went.
        """
        if not self._loss_scaled:
            return
        count, step = self._overflows(), self._current_step()
        skipped, self._overflows_seen = count - self._overflows_seen, count
        since, self._overflow_step = self._overflow_step, step
        if skipped <= 0:
            return
        scale = float(self.model.optimizer.dynamic_scale.numpy())
        batches = "1 batch" if skipped == 1 else f"{skipped} batches"
        self._add_event(
            step,
            None,
            "info",
            f"Loss-scale overflow: {batches} between step {since} and step {step + 1} had "
            "gradients beyond float16's range at the loss scale, so LossScaleOptimizer skipped "
            f"{'its' if skipped == 1 else 'their'} update and halved the scale (now "
            f"{scale:g}). This is normal while mixed-precision training finds its scale; "
            "skipped batches are not in the history.",
        )

    def _release_held_log(self):
        """The held metrics of an epoch of unknown length, at most at the step it ended."""
        if self._held_log is not None:
            step, compiled = self._held_log
            self._held_log = None
            self._pending_logs.append((min(step, self._current_step()), compiled))

    def _current_step(self):
        """The step the optimizer is at, as this monitor numbers it."""
        return self._counted_steps() + self._step_offset

    def _counted_steps(self):
        """The count the ring's steps follow: the optimizer's, or a probe's batches."""
        if self._plan.batches is not None:
            return int(self._plan.batches.numpy())
        return int(step_counter(self.model.optimizer).numpy())

    def _final_numbered_step(self):
        return None if self._final_step is None else self._final_step + self._step_offset

    def _add_metrics(self, step, values):
        self._metric_rows.extend((step, name, value) for name, value in values.items())
        self._frames = None
        if self._writer is not None:
            self._writer.add_metrics(step, values)
        if self._summaries is not None:
            self._summaries.write_metrics(step, values)

    def _add_event(self, step, layer, kind, message):
        self._events.append((step, layer, kind, message))
        if self._writer is not None:
            self._writer.add_event(step, layer, kind, message)

    def _publish(self, steps, stats, metrics, histograms):
        histogram_rows = self._histogram_rows([(steps, stats, metrics, histograms, self._layout)])
        if self._writer is not None:
            self._write(steps, stats, metrics, histogram_rows)
        if self._summaries is not None:
            self._summaries.write(
                layer_stats_frame(steps, stats, self._layout),
                metrics_frame(steps, metrics, STEP_METRICS, self._metric_names()),
                [(s, layer, tensor, counts) for s, layer, _, tensor, counts in histogram_rows],
            )

    def _write(self, steps, stats, metrics, histogram_rows):
        # Arrays straight to the writer: a DataFrame per read cost more than
        # the statistics themselves on a small model. One batch, so a live
        # page never reads a step's statistics without its loss.
        writer = self._writer
        with writer.batch():
            rows = len(self._layout)
            unrecorded = unrecorded_time_steps(stats, self._layout)
            if unrecorded.any():
                # No rows through time where the step recorded none.
                in_time = self._layout.time_rows
                others = sorted(set(range(rows)) - set(in_time))
                series = self._layout.series
                writer.add_layer_stats_array(steps, stats[:, others], [series[i] for i in others])
                writer.add_layer_stats_array(
                    steps[~unrecorded],
                    stats[~unrecorded][:, in_time],
                    [series[i] for i in in_time],
                )
            else:
                writer.add_layer_stats_array(steps, stats[:, :rows], self._layout.series)
            names = self._metric_names()
            kept = [(i, name) for i, name in enumerate(STEP_METRICS) if name in names]
            for step, values in zip(steps, metrics, strict=True):
                writer.add_metrics(int(step), {name: values[i] for i, name in kept})
            # Grouped once: filtering every row for each step of a read cost
            # 0.66 ms a step with 162 tensors (an overnight run's audit).
            by_step = {}
            for row in histogram_rows:
                by_step.setdefault(row[0], []).append(row[1:])
            for step, rows in by_step.items():
                writer.add_histograms(int(step), rows)
            writer.progress(int(steps[-1]))

    def _metric_names(self):
        names = {"loss", "learning_rate", "global_norm"}
        if self._clipping:
            names |= {"global_norm_clipped", "clipped"}
        return names

    def _histogram_rows(self, blocks=None):
        rows = []
        for steps, _, _, histograms, layout in self._kept_blocks() if blocks is None else blocks:
            if histograms is None:
                continue
            for step, block in zip(steps, histograms, strict=False):
                for i in range(len(layout)):
                    rows.append(
                        (
                            int(step),
                            layout.layers[i],
                            layout.layer_indices[i],
                            layout.tensors[i],
                            block[i].astype(np.int64),
                        )
                    )
        return rows

    def _kept_blocks(self, first=None):
        """The blocks `history` shows: with `keep_steps`, its steps from `first` on.

        `_blocks` may hold older steps too, which the rules still look back at.

        Args:
            first: `_first_kept_step()`, if the caller has it already.
        """
        if self.keep_steps is None:
            return self._blocks
        first = self._first_kept_step() if first is None else first
        if first is None:  # `keep_steps=0`, or nothing recorded
            return []
        kept = [_steps_of(block, block[0] >= first) for block in self._blocks]
        return [block for block in kept if len(block[0])]

    def _tables(self):
        if self._frames is None:
            first = None if self.keep_steps is None else self._first_kept_step()
            blocks = self._kept_blocks(first)
            history = layer_history(blocks)
            if self._plan is not None and self._plan.activation_inputs:
                # `gradflow.diagnose(monitor.history)` then compares the layers the monitor does.
                history.attrs["layer_inputs"] = dict(self._plan.activation_inputs)
            metric_frames = [
                metrics_frame(
                    np.concatenate([b[0] for b in run]),
                    np.concatenate([b[2] for b in run]),
                    STEP_METRICS,
                    self._metric_names(),
                )
                for run in layout_runs(blocks)
            ]
            if metric_frames:
                step_metrics = pd.concat(metric_frames, ignore_index=True)
            else:
                step_metrics = pd.DataFrame(columns=list(schema.METRICS_COLUMNS))
            extra = pd.DataFrame(
                [row for row in self._metric_rows if self._shown(row[0], first)],
                columns=list(schema.METRICS_COLUMNS),
            )
            if len(extra):
                # Not concatenated with an empty frame, which pandas warns of (a
                # probe that recorded nothing, and its model's logs).
                if len(step_metrics):
                    extra = pd.concat([step_metrics, extra], ignore_index=True)
                step_metrics = extra.sort_values("step", kind="stable", ignore_index=True)
            self._frames = (history, step_metrics)
        return self._frames

    def _open_store(self):
        if self._store is None:
            return
        if self._unwritten:
            # This fit sets the run's status at its end: an earlier fit's,
            # written later by `flush()`, would replace it. Its rows still go.
            self._unwritten = [(writer, None, None) for writer, _, _ in self._unwritten]
            self._write_unwritten(during_fit=True)
        store = self._store
        if isinstance(store, (str, os.PathLike)):
            from gradflow.store import RunStore

            store = RunStore(store)
            self._store = store
        ended_as = None
        if self._created_run and self.run_id is not None:
            try:
                ended_as = store.status(self.run_id)
            except UnknownRunError:
                # Deleted on the Runs page between two fits: the second `fit`
                # ended in the store's error before its first step.
                warn_user(
                    f"GradientMonitor's run {self.run_id} was deleted from its store: this fit "
                    "records into a new run."
                )
                self.run_id, self._created_run = None, False
        if self.run_id is None:
            # The dashboard and the exports run the rules again on the stored
            # statistics: with the thresholds this monitor used (`alert_rules`).
            config = run_config(
                self.model,
                self.model.optimizer,
                self.every,
                self.histograms,
                self.rules,
                activations=self.activations,
                through_time=self.through_time,
            )
            # The step the run ends at: a model trained before starts past 0.
            self.run_id = store.create_run(
                config,
                name=self.run_name,
                source="monitor",
                total_steps=self._final_numbered_step(),
            )
            self._created_run = True
        elif self._created_run:
            # The same monitor given to another `fit`: its run trains on, further.
            # (A run given by `run_id` is its owner's to keep: the lab's worker.)
            if ended_as in tables.FINAL_STATUSES:
                # Before it reads "running" again: the page sent none since it
                # ended. (With `close_run=False` it still reads "running", and a
                # Pause pressed between the fits is for this one.)
                drop_left_over(store, self.run_id)
            store.set_status(self.run_id, "running", pid=os.getpid())
            store.set_total_steps(self.run_id, self._final_numbered_step())
        self._writer = store.writer(self.run_id)
        # The Live page's Pause, Step once and Stop reach a run this monitor
        # made: it trains here, in the user's process. (A run given by
        # `run_id` has an owner that takes them: the lab's `RunControl`.)
        self._requests = (
            DashboardRequests(store, self.run_id, on_pause=self._show_pause)
            if self._created_run
            else None
        )
        if ended_as in _ENDED_AS:
            # Else the run read "completed" at the end, as if nothing had happened.
            step = self._current_step()
            self._add_event(
                step,
                None,
                "info",
                f"Training went on after step {step}, where the run {_ENDED_AS[ended_as]}.",
            )

    def _show_pause(self):
        """Before a pause: every step so far on the page, and the step it waits after."""
        step = self._current_step()
        if self._writer is not None:
            # With `every=5`, paused after step 17 read "step 15". First: a
            # flush that fails keeps it, for the writer's next try.
            self._writer.progress(step)
        try:
            self.flush()
        except sqlite3.Error as error:
            # A busy store must not end `fit`: the rows wait in the writer.
            warn_user(
                f"GradientMonitor could not write run {self.run_id}'s last steps before pausing: "
                f"{trouble.explain(error, self._store_path())}. The page may show an older "
                "step while paused."
            )
        if (
            self._steps_per_execution > 1
            and self._told_execution_steps != self._steps_per_execution
        ):
            self._told_execution_steps = self._steps_per_execution
            self._add_event(
                step,
                None,
                "info",
                f"This fit runs {self._steps_per_execution} steps per call "
                "(`steps_per_execution`): it pauses between calls, and Step once trains one "
                f"call, {self._steps_per_execution} steps.",
            )

    def _diagnose_safely(self):
        """`_diagnose`, where a rule's fault only warns: it must not stop training or a run."""
        try:
            self._diagnose()
        except Exception as error:
            warn_user(
                f"GradientMonitor: the diagnosis rules failed ({type(error).__name__}: "
                f"{error}); the recorded statistics are complete.",
            )
            # Not read again at every step (`keep_steps`), nor kept for it.
            self._diagnosed_blocks = len(self._blocks)
            self._undiagnosed_rows = 0
            if self.keep_steps is not None:
                self._forget()

    def _diagnose(self):
        """Run the rules on what this `fit` recorded, with the steps before it they look back at.

        A monitor given to many `fit` calls (a loop of one-epoch fits, a
        notebook cell run again) would otherwise read its whole history at
        every `fit`'s end: the thirtieth session found that taking a third of
        the time of the 30th one-epoch `fit` of a 20-layer MLP.
        """
        while self._diagnosed_blocks < len(self._blocks):
            first = end = self._diagnosed_blocks
            rows = 0
            while end < len(self._blocks) and (end == first or rows < _DIAGNOSED_ROWS):
                rows += int(np.prod(self._blocks[end][1].shape[:2]))  # steps x tensors
                end += 1
            self._diagnose_blocks(first, end)
        self._undiagnosed_rows = 0
        if self.keep_steps is not None:
            self._forget()

    def _forget(self):
        """Drop the steps that `keep_steps` lets go of, once the rules have read them.

        Kept: the last `keep_steps` recorded steps, the steps the rules have
        not read, and the steps before those that the rules look back at
        (`look_back`), so that their findings are those of the whole run.
        The store and TensorBoard have every step already: they are written
        as each step is read.
        """
        diagnosed = self._blocks[: self._diagnosed_blocks]
        if not diagnosed:
            return
        window, quiet = look_back(self.rules, self.through_time)
        cut = context_start(np.concatenate([block[0] for block in diagnosed]), window, quiet)
        shown = self._first_kept_step()
        if shown is not None:
            cut = min(cut, shown)
        kept, read = [], self._diagnosed_blocks
        for index, block in enumerate(self._blocks):
            steps = block[0]
            if index >= read or not len(steps) or steps[0] >= cut:
                kept.append(block)
                continue
            keep = steps >= cut
            dropped = int(steps[~keep].max())
            self._forgotten_through = max(dropped, self._forgotten_through or dropped)
            if keep.any():
                kept.append(_steps_of(block, keep))
            else:
                self._diagnosed_blocks -= 1
        self._blocks = kept
        # The metrics of `fit`'s logs (compiled metrics, validation) go with their steps.
        gone = [row for row in self._metric_rows if not self._shown(row[0], shown)]
        if gone:
            self._metric_rows = [row for row in self._metric_rows if self._shown(row[0], shown)]
            last = max(row[0] for row in gone)
            self._forgotten_through = max(last, self._forgotten_through or last)
        self._frames = None

    def _shown(self, step, first):
        """Whether `history` and `metrics` show `step`, when they start at step `first`.

        `first` is None before any step is recorded: the metrics of `fit`'s
        logs are then all shown (a `fit` shorter than `every`).
        """
        if self.keep_steps is None:
            return True
        return self.keep_steps > 0 and (first is None or step >= first)

    def _first_kept_step(self):
        """The first of the last `keep_steps` recorded steps (with `keep_steps`): `history`'s first.

        None when `keep_steps` is 0 (nothing is kept) or no step is recorded.
        """
        if self.keep_steps == 0:
            return None
        steps = [block[0] for block in self._blocks if len(block[0])]
        if not steps:
            return None
        steps = np.unique(np.concatenate(steps))
        return int(steps[max(0, len(steps) - self.keep_steps)])

    def _diagnose_blocks(self, first, end):
        """The rules on blocks `first` to `end`, with the blocks before them they look back at.

        A long first `fit` is read in pieces of about `_DIAGNOSED_ROWS` rows:
        read whole, the table of a 162-tensor model's 5,000 steps added 450
        MiB at the `fit`'s very end (an overnight run's audit: about 9 GB for
        a ResNet-50's 100,000 steps), where running out of memory would lose
        the run.
        """
        old, new = self._blocks[:first], self._blocks[first:end]
        self._diagnosed_blocks = end
        if not new:
            return
        new_steps = np.concatenate([block[0] for block in new])
        window, quiet = look_back(self.rules, self.through_time)
        # The newest old blocks, back to one that reaches the context's start.
        recent, old_steps = [], np.zeros([0], np.int64)
        for block in reversed(old):
            recent.insert(0, block)
            old_steps = np.unique(np.concatenate([block[0], old_steps]))
            if len(old_steps) > quiet and old_steps[0] <= old_steps[-1 - quiet] - window:
                break
        context = []
        if len(old_steps) and old_steps[-1] < new_steps[0]:
            start = context_start(old_steps, window, quiet)
            for steps, stats, _, _, layout in recent:
                keep = steps >= start
                if keep.any():
                    context.append((steps[keep], stats[keep], None, None, layout))
        # else: no step before this fit's: its steps are read on their own.
        history = layer_history(context + new)
        if history.empty:
            return
        found = diagnose(history, self.rules, self._plan.activation_inputs or None)
        found = found[found["step"].isin(new_steps)]
        # What an earlier fit's end reported may be found again.
        known = {(step, layer, kind) for step, layer, kind, _ in self._events}
        reported_nonfinite = any(kind == "nonfinite" for _, _, kind, _ in self._events)
        for step, layer, kind, message in found[list(schema.EVENTS_COLUMNS)].itertuples(
            index=False
        ):
            if kind == "nonfinite" and reported_nonfinite:
                continue  # the monitor reported it already, when it happened
            if (int(step), layer, kind) not in known:
                self._add_event(int(step), layer, kind, message)


def _steps_of(block, keep):
    """A `(steps, stats, metrics, histograms, layout)` block with only the steps `keep` marks."""
    return tuple(part if part is None else part[keep] for part in block[:4]) + block[4:]


def _weight_layers(layout):
    """`{layer: [tensor, ...]}` of the weight rows in `layout`, in row order."""
    found = {}
    for layer, tensor in zip(layout.layers, layout.tensors, strict=True):
        if tensor not in (schema.ACTIVATION, schema.TIME_STEP):
            found.setdefault(layer, []).append(tensor)
    return found


def _count(items, noun):
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _some(names, most=8):
    """`names` joined, at most `most` of them and how many more."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


# Tidy rows the diagnosis rules read at once at a `fit`'s end (about 60 MB of table).
_DIAGNOSED_ROWS = 100_000
_ENDED_AS = {
    "interrupted": "was interrupted",
    "failed": "had failed",
    "stopped": "was stopped",
    "diverged": "had diverged",
}
_ENDED_OUTSIDE_THE_STEP = "`fit` ended with an error outside the train step (in a callback?)"

# Monitors whose `fit` has begun and not ended, with the thread of that `fit`.
# When another callback raises, Keras calls none of the monitor's hooks; if the
# script then dies of that error, nothing else would store the steps still in
# the ring or close the run, which would read "running" with none of its
# steps. Held strongly: a sweep that catches the error and drops the model and
# its monitor lost the run's steps to the garbage collector.
_IN_A_FIT = {}


def _models_in_a_fit_now():
    """The ids of the models whose `fit` is on this thread's stack now."""
    models = set()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and "self" in frame.f_code.co_varnames:
            models.add(id(frame.f_locals.get("self")))
        frame = frame.f_back
    return models


def _close_fits_that_ended_in_an_error(starting=None, error=None):
    """Close the runs of this thread's monitors whose `fit` is no longer running.

    A new `fit` (of `starting`) begins on this thread, or a notebook cell
    ends, while another monitor's `fit` never reached its end: that `fit`
    ended with an error which the script caught (a sweep that goes on to its
    next model) or which ended the cell. Its run is closed now with its
    steps (`_how_fit_ended`, from `error` if given), not at the program's
    exit. A `fit` called from inside another's callback leaves that one
    running: its `fit` is on the stack.
    """
    thread = threading.get_ident()
    others = [m for m, t in list(_IN_A_FIT.items()) if m is not starting and t == thread]
    if not others:
        return
    running = _models_in_a_fit_now()
    for monitor in others:
        if id(monitor.model) not in running:
            with contextlib.suppress(Exception):  # the new fit or cell must not fail for it
                monitor._abandon(_how_fit_ended(monitor.model, error))


def _how_fit_ended(model, error=None):
    """The error that ended `model`'s last `fit`, as far as can be told.

    `error` (or else the last error the interpreter, or IPython, reported:
    `sys.last_value`) if its traceback passes through that model's `fit`:
    a Ctrl-C that landed between two steps is told as an interruption, not
    as a failure. Otherwise a generic error outside the train step.
    """
    if error is None:
        error = getattr(sys, "last_value", None)
    frames = getattr(error, "__traceback__", None)
    while frames is not None:
        code, scope = frames.tb_frame.f_code, frames.tb_frame.f_locals
        if code.co_name == "fit" and scope.get("self") is model:
            return error
        frames = frames.tb_next
    return RuntimeError(_ENDED_OUTSIDE_THE_STEP)


_CELL_HOOK = []  # the IPython shell whose cells are watched, once registered


def _close_at_each_notebook_cells_end():
    """In a notebook (IPython), close the runs of fits that a cell's error ended, as the cell ends.

    A Ctrl-C (the notebook's Interrupt button) most often lands between
    two steps, in Keras's own code, where no callback sees it: the run read
    "running" in the dashboard, whose Stop then did nothing, until the next
    `fit` or the kernel's exit. IPython says when a cell ends and with what
    error (`post_run_cell`); a monitor whose `fit` is no longer running is
    closed then, "interrupted" for a KeyboardInterrupt.
    """
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or shell in _CELL_HOOK:
        return

    def after_cell(result):
        _close_fits_that_ended_in_an_error(error=getattr(result, "error_in_exec", None))

    shell.events.register("post_run_cell", after_cell)
    _CELL_HOOK.append(shell)


@atexit.register
def _close_runs_left_open():
    for monitor in list(_IN_A_FIT):
        # The error that ends the program, if one does (set before exit hooks run).
        error = getattr(sys, "last_value", None) or RuntimeError(_ENDED_OUTSIDE_THE_STEP)
        with contextlib.suppress(Exception):  # Exiting must not fail here.
            monitor._abandon(error)


# The `(monitor, params)` of the monitor recording a model's current `fit`.
_OWNER = "_gradflow_monitor"
# `(key, plan, train_step, compiled train function)` of the model's last
# monitored `fit`, which a later one may reuse (`_reuse_last_step`).
_LAST_STEP = "_gradflow_last_step"


class _ReuseKey:
    """What a traced instrumented step depends on; equal when a later `fit` may reuse it.

    Settings compare by value, Keras objects by identity. The step reads, when
    it is traced: the optimizer and its settings (clipping, weight decay,
    loss scaling, ...; not its learning rate, a variable the step reads at
    every call, unless a schedule replaced it); the compiled loss, metrics
    and loss tracker (`compile()` makes new ones, even when given the same
    optimizer); every layer's `trainable` flag (a frozen BatchNormalization
    has no trainable weights to show it); the trainable variables and their
    constraints.
    """

    def __init__(self, monitor, model):
        optimizer = model.optimizer
        variables = model.trainable_weights
        self.settings = (
            monitor.activations,
            monitor.every,
            monitor.histograms,
            monitor.stop_on_nonfinite,
            monitor.through_time,
            int(model.steps_per_execution),
            model.jit_compile,
            model.run_eagerly,
            _optimizer_settings(optimizer),
            tuple(layer.trainable for layer in model._flatten_layers()),
        )
        self.objects = (
            optimizer,
            getattr(optimizer, "_learning_rate", None),
            getattr(model, "_compile_loss", None),
            getattr(model, "_compile_metrics", None),
            getattr(model, "_loss_tracker", None),
            model.distribute_strategy,
            *variables,
            *(variable.constraint for variable in variables),
        )

    def __eq__(self, other):
        return (
            isinstance(other, _ReuseKey)
            and self.settings == other.settings
            and len(self.objects) == len(other.objects)
            and all(a is b for a, b in zip(self.objects, other.objects, strict=True))
        )

    __hash__ = None


def _optimizer_settings(optimizer):
    """The optimizer's config without its learning rate; a fresh object (never equal) if it has none."""
    try:
        config = dict(optimizer.get_config())
    except Exception:  # a custom optimizer without a config: never reuse
        return object()
    config.pop("learning_rate", None)
    return config


def _is_finite(value):
    try:
        return math.isfinite(value)
    except TypeError:  # not a number: Keras could not make it a float
        return True


_WHY_THE_COUNT_WENT_BACK = {
    "new": "a new optimizer, e.g. after `compile()`",
    "restored": "the optimizer's state was loaded, e.g. by `load_weights` or by "
    "`BackupAndRestore` resuming after an interruption",
    "callback": "a callback loaded an earlier state as this fit began, e.g. `BackupAndRestore` "
    "resuming after an interruption",
}


def _steps_per_execution(model):
    """The model's `steps_per_execution`, checked: Python's own words named no argument."""
    value = model.steps_per_execution
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"`steps_per_execution` (given to `model.compile`) must be a whole number of at "
            f"least 1, got {value!r}. Keras 3 does not tune it (`'auto'` was tf.keras 2's)."
        )
    return int(value)


def _planned_steps(params):
    params = params or {}
    if params.get("steps") and params.get("epochs"):
        return int(params["steps"]) * int(params["epochs"])
    return None
