"""The instrumented train step: Keras's own recipe plus one recording block.

`instrumented_train_step` returns a step that reads like
`keras/src/backend/tensorflow/trainer.py` `TensorFlowTrainer.train_step`
and records the statistics of the very gradients it hands to the optimizer:
no second forward or backward pass. Activation gradients (dLoss/d(output of
each layer)) come from the same `tape.gradient` call as the weight gradients.

`probed_train_step` is the fallback for models that override `train_step`
themselves: their step cannot be opened, so every `probe_every` steps the
wrapper runs one extra forward and backward pass on the same batch (in
inference mode, before the model's own step updates the weights) and records
those gradients instead.
"""

import contextlib
import functools
import os
import typing

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from gradflow import schema
from gradflow.checks import warn_user
from gradflow.monitor import deferred, through_time, trace_gradients
from gradflow.monitor.buffer import STEP_METRICS, RingBuffer, pad_rows, replica_counter
from gradflow.probe.capture import output_values, reached_outputs, record_layer_outputs
from gradflow.probe.naming import layer_order, split_overwritten, variable_names
from gradflow.probe.sensitivity import carried_state
from gradflow.statistics import (
    ShapeGroups,
    Stacked,
    exact_l2_norms,
    norm_of_norms,
    stack_rows,
    sum_of_squares,
    summarize,
    zeros_where_missing,
)

_NAN = float("nan")


class StepPlan:
    """What the compiled step records and where it leaves it.

    Args:
        model: The compiled Keras model.
        capacity: Steps the ring buffer holds between two reads.
        activations: Whether to record activation gradients too.
        every: Record when `optimizer.iterations % every == 0`.
        histograms: Whether to count log10|g| histograms.
        stop_on_nonfinite: Whether to skip the update of a step with a
            non-finite gradient and halt the steps after it.
        through_time: Whether to record the gradient through time
            (`gradflow.monitor.through_time`), in rows after the layer outputs'.
    """

    def __init__(
        self,
        model,
        capacity,
        activations,
        every,
        histograms,
        stop_on_nonfinite,
        through_time=False,
    ):
        self.model = model
        self.through_time = through_time
        # Set by the first trace (`through_time.plan_rows`): the label of each
        # row through time ("t=01", ...) and the tensor differentiated.
        self.time_labels = None
        self.time_source = None
        self.time_warnings = set()
        self.capacity = capacity
        self.every = every
        self.histograms = histograms
        self.stop_on_nonfinite = stop_on_nonfinite
        # Leaf-layer paths, index = `layer_index`: in call order once the
        # step is traced (`_take_activations`), tracking order until then.
        self.layer_order = layer_order(model)
        # Rows for layer outputs; a shared layer is recorded once per call,
        # so leave room for a few repeated calls.
        self.activation_slots = 2 * len(self.layer_order) + 4 if activations else 0
        self.variables = None
        self.called = None
        self._names = None
        self.buffer = None
        # Whether the step only copies its gradients and weights and the read
        # summarizes them (`gradflow.monitor.deferred`); decided by `prepare`.
        self.deferred = False
        # Set by `probed_train_step`: a probe records through the in-step path,
        # and numbers its steps by `batches`, the batches the model's own
        # `train_step` ran (a variable).
        self.probing = False
        self.batches = None
        # Filled while the step is traced: the path of each recorded layer
        # output, in call order (`path#2` for a second call of a shared layer).
        self.activation_paths = []
        # Recorded layer -> the recorded layer whose output it reads, or None
        # (`LayerOutputs.fed_by`; None too for a pooling layer, whose pair
        # is not compared: `LayerOutputs.spreads`): the saturation rule's pairs.
        self.activation_inputs = {}
        # Paths of the layer calls left out for want of rows (repeated calls).
        self.dropped_activations = []
        # Recorded layer calls the tape did not record (inside `keras.remat`:
        # `LayerOutputs.untaped`): unreached, but not for want of a gradient.
        self.untaped = set()
        # Filled while the step is traced: the rows (weights, then layer
        # outputs) whose gradient the tape returned as None, because the loss
        # does not depend on them. Their rows are recorded as zeros, which
        # would read as vanishing gradients; the callback leaves them out.
        self.unreached = []
        # Custom gradients TensorFlow registered while the step was traced,
        # for the callback to drop after `fit` (`trace_gradients`).
        self.custom_gradients = set()

    @property
    def names(self):
        """`VariableName`s of the trainable variables, in row order (after `prepare`)."""
        if self._names is None and self.variables is not None:
            self._names = variable_names(self.model, self.variables, called=self.called)
        return self._names

    def note_call_order(self, called):
        """Number the layers as the traced forward pass called them (`naming.layer_order`)."""
        if called and called != self.called:
            self.called = called
            self.layer_order = layer_order(self.model, called)
            self._names = None

    @property
    def row_slots(self):
        """Rows of the ring after the weights': layer outputs, then time steps."""
        return self.activation_slots + len(self.time_labels or ())

    @property
    def replicas(self):
        return self.model.distribute_strategy.num_replicas_in_sync

    @property
    def optimizer(self):
        return self.model.optimizer

    def prepare(self, variables, overwritten=()):
        """Name the variables and create the ring buffer, once.

        Keras builds a subclassed model only while it traces the first train
        step, so this may run inside that trace; `tf.init_scope` lifts the
        new variables out of the graph, as Keras does for the model's own.

        Args:
            variables: The trainable variables that get rows, in gradient order.
            overwritten: The trainable variables the optimizer sets to their
                "gradient" (`naming.split_overwritten`): no rows, but the
                optimizer is built for them too.
        """
        if self.buffer is not None:
            return
        with tf.init_scope():
            self._build_optimizer(list(variables) + list(overwritten))
            self.variables = list(variables)
            self.deferred = self._can_defer(variables)
            if self.deferred:
                self.capacity = deferred.ring_capacity(
                    variables, self.capacity, self.row_slots, self.histograms
                )
                self.buffer = deferred.DeferredRing(
                    variables, self.capacity, self.histograms, self.row_slots
                )
            else:
                self.buffer = RingBuffer(
                    self.model.distribute_strategy,
                    self.capacity,
                    len(variables) + self.row_slots,
                    self.histograms,
                )

    def _build_optimizer(self, variables):
        """Create the optimizer's variables now, not in the first traced update.

        Without a distribution strategy Keras leaves that to the first
        `apply_gradients`, inside the traced step. Ours applies after control
        dependencies (the copy or the statistics it waits for), so TensorFlow
        could not lift those variables' initializers out of the graph and
        fell back to checking, at every step, that each one is initialized:
        a `VarIsInitializedOp` per optimizer variable and a cond around the
        whole step, in every model's first `fit` (measured in
        `docs/architecture.md`). Keras's own `_symbolic_build` builds the
        optimizer this way under a distribution strategy, where it has
        already happened by now.
        """
        optimizer = self.optimizer
        if not optimizer.built and not tf.distribute.has_strategy():
            optimizer.build(variables)

    def _can_defer(self, variables):
        """Whether every recorded column can be computed from the gradients and weights later.

        See `gradflow.monitor.deferred` for why each case keeps the in-step path.
        """
        optimizer = self.optimizer
        return (
            self.every == 1
            and not self.probing
            and self.replicas == 1
            and clipping_optimizer(optimizer) is None
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and optimizer.loss_scale_factor is None
            and not _constrained_indices(variables)
            and deferred.fits(variables, self.capacity, self.row_slots, self.histograms)
        )


def instrumented_train_step(plan):
    """Build Keras's train step with a `# Record gradient statistics` block.

    Args:
        plan: A `StepPlan`.

    Returns:
        A function `train_step(data) -> logs` to set as `model.train_step`.
    """
    model = plan.model
    optimizer = plan.optimizer

    def train_step(data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)

        # Forward pass
        with (
            tf.GradientTape(persistent=plan.through_time) as tape,
            _layer_outputs(plan, tape) as outputs,
        ):
            watched = through_time.watch_input(tape, x) if plan.through_time else None
            if model._call_has_training_arg:
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            probe = through_time.output_probe(y_pred) if plan.through_time else None
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
            )
            scaled_loss = optimizer.scale_loss(loss)

        # Compute gradients
        if not model.trainable_weights:
            warn_user("The model does not have any trainable weights.")
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        # float8 scales and amax histories: no rows, but Keras's update sets them.
        variables, overwritten = split_overwritten(model.trainable_weights)
        sequence = _sequence_rows(plan, x, watched, outputs)
        plan.prepare(variables, overwritten)
        activations, gradients = _gradients(
            plan, tape, scaled_loss, variables, outputs, overwritten
        )
        new_values = gradients[len(variables) : len(variables) + len(overwritten)]
        del gradients[len(variables) : len(variables) + len(overwritten)]
        _fill_output_gradients(
            gradients, len(variables), activations, (x, y, y_pred, sample_weight), plan
        )
        _note_unreached(plan, gradients)
        # Made where they are recorded: with `every > 1`, inside the cond of
        # the steps that record, not at every step.
        time_gradients = functools.partial(_time_gradients, tape, probe, sequence)
        weight_gradients = gradients[: len(variables)]
        scale = _loss_scale(optimizer)
        learning_rate = _scalar(optimizer.learning_rate)
        constrained = _constrained_indices(variables)
        constraints = [variables[i].constraint for i in constrained]
        if plan.deferred:
            return _deferred_tail(
                plan,
                (x, y, y_pred, sample_weight),
                loss,
                learning_rate,
                weight_gradients,
                variables,
                zeros_where_missing(gradients[len(variables) :], activations) + time_gradients(),
                (new_values, overwritten),
            )
        weight_groups = ShapeGroups([v.shape for v in variables])
        updates = _UpdateCapture.for_step(
            optimizer, variables, weight_groups, constrained, plan.replicas
        )
        if updates is None:
            # Stacking by shape copies the weights (the values before the
            # update); the update ratio then comes from their difference.
            weights_before = weight_groups.stack([v.value for v in variables])
        else:
            weights_before = None
            before_norms = updates.norms_before()
        update_norms = None

        # Update weights
        before_update = [] if updates is None else list(updates.waits)
        clipping = clipping_optimizer(optimizer)
        clipped_gradients = None
        if clipping is not None and clipping.gradient_accumulation_steps:
            # What the update clips is the mean of the accumulated gradients,
            # which the update then resets: read them first.
            clipped_gradients = _clipped(clipping, weight_gradients, variables, scale)
            before_update += [*clipped_gradients.values, clipped_gradients.applied]

        def update():
            capture = contextlib.nullcontext() if updates is None else updates.recording()
            with _constraints_deferred(variables, constrained), capture:
                with tf.control_dependencies(before_update):
                    optimizer.apply_gradients(
                        zip(weight_gradients + new_values, variables + overwritten, strict=False)
                    )
                # Keras applies constraints inside `apply`; doing it here lets
                # the step measure the weights between update and constraint.
                unconstrained = []
                for index, constraint in zip(constrained, constraints, strict=False):
                    variable = variables[index]
                    unconstrained.append(tf.identity(variable.value))
                    variable.assign(constraint(variable))
            changes = [] if updates is None else list(updates.change_and_after_norms())
            return unconstrained, changes

        recorded_gradients = _unscaled(zeros_where_missing(weight_gradients, variables), scale)
        # The rows through time differentiate the outputs, not the scaled loss.
        activation_gradients = _unscaled(
            zeros_where_missing(gradients[len(variables) :], activations), scale
        )
        finite = halted = summary = None
        loss_scaled = (
            isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and plan.replicas == 1
        )
        if loss_scaled:
            # An attempt that does not update does not advance `iterations`:
            # numbered after the update, it would take the step before's number.
            attempted_step = tf.cast(step_counter(optimizer), tf.int64) + 1
        if (
            plan.every == 1
            and plan.replicas == 1
            and (plan.stop_on_nonfinite or _one_op_at_a_time())
        ):
            # Every step is summarized anyway: do it before the update. With
            # `stop_on_nonfinite`, finiteness is read off the statistics' count
            # of NaN/Inf entries (no pass of its own; not off the L2 norm,
            # which overflows float32 for finite entries above about 1e38 and
            # would halt a step that is not broken). With one inter-op thread
            # nothing runs beside the update anyway, and once the statistics
            # have read the gradients the optimizer's ops may reuse their
            # buffers (faster in side-by-side runs of both orders on the
            # lab's 4x32 MLP).
            activation_gradients = activation_gradients + time_gradients()
            time_gradients = list  # in the summary already
            summary = summarize(recorded_gradients + activation_gradients, plan.histograms)
            before_update.append(summary[0])
            if plan.stop_on_nonfinite or loss_scaled:
                counts = summary[0][: len(variables), schema.STATISTICS.index("nonfinite")]
                finite = tf.reduce_all(tf.equal(counts, 0.0))
        elif plan.stop_on_nonfinite or loss_scaled:
            finite = _all_finite(weight_gradients)
        overflowed = None
        if loss_scaled:
            finite, overflowed = _overflow_or_nonfinite(finite, loss, scale)
            plan.buffer.overflows.assign_add(tf.cast(overflowed, tf.int64))
            if not plan.stop_on_nonfinite:
                finite = None
        if plan.stop_on_nonfinite and plan.replicas == 1:
            # A skipped update changes nothing: no change, the weights as before.
            unchanged = [] if updates is None else [tf.zeros_like(before_norms), before_norms]
            (unconstrained, changes), halted = _update_unless_nonfinite(
                plan, update, finite, [variables[i] for i in constrained], unchanged
            )
        else:
            unconstrained, changes = update()
        weight_norms = None
        if updates is not None:
            update_norms = (changes[0], before_norms)
            weight_norms = changes[1]

        # Record gradient statistics
        step = attempted_step if loss_scaled else tf.cast(step_counter(optimizer), tf.int64)
        when = None  # every step
        if plan.every > 1:
            when = tf.equal(tf.math.floormod(step, plan.every), 0)
            if finite is not None:  # the non-finite step, also off the grid
                when = tf.logical_or(when, tf.logical_not(finite))
        for skip in (halted, overflowed):  # nothing after a halt; no overflowed attempt
            if skip is not None:
                when = (
                    tf.logical_not(skip)
                    if when is None
                    else tf.logical_and(when, tf.logical_not(skip))
                )
        if clipping is not None and clipped_gradients is None:
            clipped_gradients = _clipped(clipping, weight_gradients, variables, scale)
        _record(
            plan,
            when=when,
            step=step,
            loss=loss,
            learning_rate=learning_rate,
            weight_gradients=recorded_gradients,
            activation_gradients=activation_gradients,
            time_gradients=time_gradients,
            summary=summary,
            weights=(
                weight_norms
                if weight_norms is not None
                else weight_groups.stack([v.value for v in variables])
            ),
            weights_before=weights_before,
            update_norms=update_norms,
            unconstrained=dict(zip(constrained, unconstrained, strict=False)),
            clipped_gradients=clipped_gradients,
        )
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return _noting_custom_gradients(plan, train_step)


def _noting_custom_gradients(plan, train_step):
    """`train_step`, noting in the plan the custom gradients its traces register."""

    @functools.wraps(train_step)
    def step(data):
        with trace_gradients.noted_while_tracing(plan.custom_gradients):
            return train_step(data)

    return step


def _deferred_tail(
    plan, batch, loss, learning_rate, gradients, variables, activation_gradients, overwrites
):
    """Update and record the step for `gradflow.monitor.deferred`: one copy, and
    the statistics of the activation gradients only.

    The gradients are never scaled here (no loss scaling on this path).
    `overwrites` is `(values, variables)` of the variables the optimizer sets
    to their "gradient" (`naming.split_overwritten`), applied and not recorded.
    """
    model, optimizer = plan.model, plan.optimizer
    x, y, y_pred, sample_weight = batch
    packed = plan.buffer.pack(
        zeros_where_missing(gradients, variables), loss, learning_rate, activation_gradients
    )

    def update():
        # The copy reads the weights before the update; waiting for it lets
        # the optimizer write them in place instead of copying them first.
        new_values, overwritten = overwrites
        with tf.control_dependencies([packed]):
            optimizer.apply_gradients(
                zip(list(gradients) + new_values, variables + overwritten, strict=False)
            )
        return [], []

    halted = None
    if plan.stop_on_nonfinite:
        _, halted = _update_unless_nonfinite(plan, update, plan.buffer.all_finite(packed), [], [])
    else:
        update()
    plan.buffer.write(tf.cast(step_counter(optimizer), tf.int64), packed, halted)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _update_unless_nonfinite(plan, update, finite, constrained_variables, unchanged):
    """Run `update` only while every gradient is finite and no step halted.

    Like `LossScaleOptimizer`, a non-finite step leaves the weights alone, so
    the model stays usable; it still counts as a step, and the steps after it
    in the same execution do nothing. (tf.distribute forbids a cond around
    the optimizer's cross-replica update, so this is for one replica only.)

    Returns:
        `(unconstrained, halted)`: the values `update` returns (or the
        current ones when skipped) and whether an earlier step had halted.
    """
    optimizer = plan.optimizer
    halted = plan.buffer.halted.read_value() > 0

    def skip():
        def halt():
            step_counter(optimizer).assign_add(1)
            plan.buffer.halted.assign(1)

        tf.cond(halted, lambda: None, halt)
        return [tf.identity(v.value) for v in constrained_variables], list(unchanged)

    go = tf.logical_and(finite, tf.logical_not(halted))
    return tf.cond(go, update, skip), halted


def probed_train_step(plan, original_train_step, probe_every, probe_loss=None):
    """Wrap a model's own `train_step` with a probe pass every `probe_every` steps.

    Args:
        plan: A `StepPlan`.
        original_train_step: The model's bound `train_step`.
        probe_every: Probe when the step about to run is a multiple of it.
        probe_loss: A loss function `(y_true, y_pred)` to differentiate, or
            None for the compiled loss. With neither (and no `add_loss`
            loss), the probe records nothing and warns once, when traced.

    Returns:
        A function `train_step(data) -> logs`; one that only counts batches
        when the model has no forward pass to probe (a GAN without `call`).
    """
    model = plan.model
    optimizer = plan.optimizer
    plan.probing = True
    # The probe numbers its steps by the batches it sees: a model with its own
    # optimizers (a GAN's `d_optimizer` and `g_optimizer`) never steps
    # `model.optimizer`, and every probe landed on step 1. With a `train_step`
    # that steps `model.optimizer` once a batch the two counts agree.
    plan.batches = replica_counter(model.distribute_strategy, int(step_counter(optimizer).numpy()))
    if type(model).call is keras.Model.call:
        # Keras's GAN recipe: `train_step` calls the generator and the
        # discriminator; the model itself has no `call`, and a probe's
        # `model(x)` ended the user's `fit` with NotImplementedError.
        warn_user(
            f"GradientMonitor records nothing for model {model.name!r}: it has its own "
            "`train_step` and no `call()`, so there is no forward pass to probe. Give the "
            "part you want to see a `call()`, or take `gradflow.snapshot(part, x, y, "
            "loss=...)` of it (the generator or the discriminator) on a batch."
        )

        def counted_train_step(data):
            logs = original_train_step(data)
            plan.batches.assign_add(1)  # Its compiled metrics are numbered by batch.
            return logs

        return counted_train_step

    def probe(x, y, sample_weight, upcoming, when):
        # What the probe's forward pass may move (a stateful RNN's carried
        # state, a custom layer's counters) is put back before the model's own
        # step; listed while tracing, when Keras has built the model. Not under
        # tf.distribute, where assigning mirrored variables inside a replica's
        # step is not allowed.
        kept = carried_state(model) if plan.replicas == 1 else []
        saved = [tf.identity(v.value) for v in kept]
        with (
            tf.GradientTape(persistent=plan.through_time) as tape,
            _layer_outputs(plan, tape) as outputs,
        ):
            watched = through_time.watch_input(tape, x) if plan.through_time else None
            # Inference mode: a second training-mode call would update batch
            # norm statistics and advance dropout seeds behind the model's back.
            y_pred = model(x, training=False) if model._call_has_training_arg else model(x)
            if probe_loss is not None:
                loss = tf.reduce_mean(tf.cast(probe_loss(y, y_pred), tf.float32))
                if model.losses:
                    # Each added loss summed, as Keras's own step adds them
                    # (`add_loss` of a per-sample tensor).
                    loss += tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in model.losses])
            elif model._compile_loss is None and not model.losses:
                loss = None
            else:
                loss = model.compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
                )
            probe_target = through_time.output_probe(y_pred) if plan.through_time else None
        for variable, value in zip(kept, saved, strict=True):
            variable.assign(value)
        if loss is None:
            # Keras's `compute_loss` would raise and end the user's `fit`.
            warn_user(
                f"GradientMonitor records nothing for model {model.name!r}: it has its own "
                "`train_step` and was compiled without a loss, so the probe has no loss to "
                "differentiate. Pass the loss your `train_step` computes as "
                "`GradientMonitor(probe_loss=...)` (e.g. 'mse' or a function (y_true, y_pred)).",
            )
            return
        variables, overwritten = split_overwritten(model.trainable_weights)
        sequence = _sequence_rows(plan, x, watched, outputs)
        plan.prepare(variables, overwritten)
        activations, gradients = _gradients(plan, tape, loss, variables, outputs)
        _note_unreached(plan, gradients)
        time_gradients = _time_gradients(tape, probe_target, sequence)
        _record(
            plan,
            when=when,
            step=upcoming,
            loss=loss,
            learning_rate=_scalar(optimizer.learning_rate),
            weight_gradients=zeros_where_missing(gradients[: len(variables)], variables),
            activation_gradients=(
                zeros_where_missing(gradients[len(variables) :], activations) + time_gradients
            ),
            weights=[tf.identity(v.value) for v in variables],
        )

    def train_step(data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        upcoming = plan.batches.read_value() + 1
        when = tf.equal(tf.math.floormod(upcoming, probe_every), 0)
        if plan.replicas > 1:
            # The all-reduce cannot sit inside a cond under tf.distribute.
            probe(x, y, sample_weight, upcoming, when)
        else:
            tf.cond(when, lambda: probe(x, y, sample_weight, upcoming, None), lambda: None)
        logs = original_train_step(data)
        plan.batches.assign_add(1)
        return logs

    return _noting_custom_gradients(plan, train_step)


def _record(
    plan,
    when,
    step,
    loss,
    learning_rate,
    weight_gradients,
    activation_gradients,
    weights,
    weights_before=None,
    update_norms=None,
    unconstrained=None,
    clipped_gradients=None,
    summary=None,
    time_gradients=list,
):
    """Summarize one step and write it to the ring: when `when` holds, or always if it is None.

    `summary` is `summarize`'s result for these gradients when the step has
    it already (one replica only: it is not all-reduced here).
    `time_gradients` makes the rows through time's gradients, which follow
    the activation rows: called inside the cond of `when`, so that the steps
    that record nothing do not make them.
    """
    if plan.replicas > 1 or when is None:
        # Under tf.distribute they are gathered outside the cond, as the
        # layer outputs' are.
        activation_gradients = activation_gradients + time_gradients()
        time_gradients = list
    if plan.replicas > 1:
        # Each replica holds the gradient of its share of the batch; Keras
        # sums them inside `optimizer.apply`. Sum them here too (and put the
        # batch back together for layer outputs) so the statistics are those
        # of the applied gradient, equal to a single-device run.
        context = tf.distribute.get_replica_context()
        clipped_values = [] if clipped_gradients is None else clipped_gradients.values
        reduced = context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            [loss] + weight_gradients + clipped_values,
        )
        loss = reduced[0]
        weight_gradients = reduced[1 : 1 + len(weight_gradients)]
        if clipped_gradients is not None:
            clipped_gradients = clipped_gradients._replace(
                values=reduced[1 + len(weight_gradients) :]
            )
        activation_gradients = [context.all_gather(g, axis=0) for g in activation_gradients]

    def write():
        stats, metrics, histograms = _summarize_step(
            plan,
            loss,
            learning_rate,
            weight_gradients,
            activation_gradients + time_gradients(),
            weights,
            weights_before,
            update_norms,
            unconstrained or {},
            clipped_gradients,
            summary,
        )
        plan.buffer.write(step, stats, metrics, histograms)

    if when is None:
        write()
    else:
        tf.cond(when, write, lambda: None)


def _summarize_step(
    plan,
    loss,
    learning_rate,
    weight_gradients,
    activation_gradients,
    weights,
    weights_before,
    update_norms,
    unconstrained,
    clipped_gradients,
    summary,
):
    count = len(weight_gradients)
    if summary is None:
        summary = summarize(weight_gradients + activation_gradients, plan.histograms)
    stats, histograms = summary
    missing = tf.fill([count], _NAN)

    # Weights, their change and the clipped gradients share the shapes of the
    # weights, so they share one grouping by shape.
    segments = WeightSegments(weights if isinstance(weights, Stacked) else weight_gradients)
    # `weights` is either the weights after the update (stacked) or, when the
    # step took them from the optimizer's increments, their norms already.
    columns = [] if isinstance(weights, tf.Tensor) else [segments.flat(weights)]
    if weights_before is not None:
        before = segments.flat(weights_before)
        columns += [segments.difference(columns[0], before), before]
    if clipped_gradients is not None:
        clipped_values = segments.flat(clipped_gradients.values)
        columns.append(clipped_values)
    norms = tf.unstack(segments.norms(columns), num=len(columns), axis=1) if columns else []
    weight_norm = weights if isinstance(weights, tf.Tensor) else norms[0]
    update_ratio = missing
    if weights_before is not None:
        update_norms = (norms[1], norms[2])
    if update_norms is not None:
        change, before_norm = update_norms
        update_ratio = tf.where(before_norm > 0, change / tf.maximum(before_norm, 1e-30), _NAN)
    weight_norm_unconstrained = missing
    if unconstrained:
        indices = sorted(unconstrained)
        unconstrained_norms = exact_l2_norms(
            lambda tensors: tf.stack([tf.reduce_sum(tf.square(t)) for t in tensors]),
            [tf.cast(unconstrained[i], tf.float32) for i in indices],
            np.array([unconstrained[i].shape.num_elements() for i in indices], np.float64),
        )
        weight_norm_unconstrained = tf.tensor_scatter_nd_update(
            missing, [[i] for i in indices], unconstrained_norms
        )

    gradient_norm = stats[:count, 1]
    global_norm = norm_of_norms(gradient_norm)
    l2_norm_clipped = max_abs_clipped = missing
    global_norm_clipped = clipped = tf.constant(_NAN)
    if clipped_gradients is not None:
        l2_norm_clipped = norms[-1]
        max_abs_clipped = segments.max_abs(clipped_values)
        global_norm_clipped = norm_of_norms(l2_norm_clipped)
        unclipped = clipped_gradients.unclipped_norms
        unclipped = gradient_norm if unclipped is None else unclipped
        # Clipping scales by clip/norm, which is 1.0 up to rounding when the
        # norm is under the limit: count only a real reduction.
        clipped = tf.cast(tf.reduce_any(l2_norm_clipped < unclipped * (1.0 - 1e-6)), tf.float32)
        if clipped_gradients.applied is not None:
            # A step that only accumulates applies no clipped gradient.
            applied = clipped_gradients.applied
            l2_norm_clipped = tf.where(applied, l2_norm_clipped, missing)
            max_abs_clipped = tf.where(applied, max_abs_clipped, missing)
            global_norm_clipped = tf.where(applied, global_norm_clipped, _NAN)
            clipped = tf.where(applied, clipped, _NAN)

    extras = tf.stack(
        [weight_norm, weight_norm_unconstrained, update_ratio, l2_norm_clipped, max_abs_clipped],
        axis=1,
    )
    activation_extras = tf.fill([len(activation_gradients), extras.shape[1]], _NAN)
    rows = tf.concat([stats, tf.concat([extras, activation_extras], axis=0)], axis=1)
    rows, histograms = pad_rows(rows, histograms, count + plan.row_slots)
    metrics = tf.stack(
        [tf.cast(loss, tf.float32), learning_rate, global_norm, global_norm_clipped, clipped]
    )
    assert metrics.shape[0] == len(STEP_METRICS)
    return rows, metrics, histograms


class _UpdateCapture:
    """The size of each weight update, taken from the optimizer's own increment.

    Keras's built-in optimizers change a model variable with one
    `optimizer.assign_add(variable, increment)` or `assign_sub` per step
    (`keras/src/optimizers/adam.py` `update_step`). While the update is
    traced, those two methods are wrapped to take `||increment||` on the
    way. That replaces a copy of every weight before the update and a
    subtraction after it: for a large model, several passes over memory.

    Only for optimizers known to update each variable exactly so; anything
    else (weight decay, EMA, gradient accumulation, loss scaling, several
    replicas, constraints, other optimizers) measures the difference of
    the weights instead (`for_step` returns None).
    """

    # Exact classes, not subclasses: a subclass may update differently.
    KNOWN = (
        keras.optimizers.SGD,
        keras.optimizers.Adam,
        keras.optimizers.RMSprop,
        keras.optimizers.Adagrad,
        keras.optimizers.Nadam,
        keras.optimizers.Adamax,
    )

    def __init__(self, optimizer, variables, groups):
        self.optimizer = optimizer
        self.variables = variables
        self.groups = groups
        self._index = {optimizer._var_key(v): i for i, v in enumerate(variables)}
        self._increments = {}

    @classmethod
    def for_step(cls, optimizer, variables, groups, constrained, replicas):
        eligible = (
            type(optimizer) in cls.KNOWN
            and replicas == 1
            and not constrained
            and not optimizer.weight_decay
            and not optimizer.use_ema
            and not getattr(optimizer, "gradient_accumulation_steps", None)
            and all(isinstance(v, keras.Variable) for v in variables)
            # The increments are in the variables' type, the norms float32.
            and all(v.dtype == "float32" for v in variables)
        )
        return cls(optimizer, variables, groups) if eligible else None

    def norms_before(self):
        """`||w||` of every variable, read before the update.

        Small tensors are stacked by shape (a copy, kept for the norms after
        the update), so the update need not wait for their norms. A large
        tensor is reduced where it lies, and the update waits for the norms
        (`exact_l2_norms`' branch may read it again): holding its buffer
        across the update would make the update copy it.
        """
        groups = self.groups
        self._before = groups.stack([v.value for v in self.variables])
        norms = groups.l2_norms(self._before)
        self.waits = [norms] if any(groups.is_large(group) for group in groups.groups) else []
        return norms

    @contextlib.contextmanager
    def recording(self):
        """Wrap `assign_add`/`assign_sub` of the optimizer while `apply` is traced."""
        optimizer = self.optimizer
        originals = {name: getattr(optimizer, name) for name in ("assign_add", "assign_sub")}
        self._increments = {}

        def wrap(name, sign):
            def assign(variable, value):
                index = self._index.get(optimizer._var_key(variable))
                if index is not None:
                    increment = tf.cast(tf.convert_to_tensor(value), tf.float32)
                    self._increments.setdefault(index, []).append((sign, increment))
                return originals[name](variable, value)

            return assign

        for name, sign in (("assign_add", 1.0), ("assign_sub", -1.0)):
            object.__setattr__(optimizer, name, wrap(name, sign))
        try:
            yield
        finally:
            for name in originals:
                optimizer.__dict__.pop(name, None)

    def change_and_after_norms(self):
        """`||dw||` and `||w + dw||` of every variable, once the update is traced.

        For small tensors both come from the stacked copy before the update
        and the increments, two reductions per shape group: nothing waits
        for the update to finish, so these ops run beside the optimizer's.
        A large tensor is read again after the update instead; a variable not
        updated exactly once gets a NaN change and is read again too.
        """
        groups = self.groups
        increments_and_after = []
        for group, before in zip(groups.groups, self._before, strict=True):
            taken = [self._increments.get(i, []) for i in group]
            exact = all(len(t) == 1 for t in taken)
            increments = stack_rows(
                [
                    t[0][1] if len(t) == 1 else tf.fill(self.variables[i].shape, _NAN)
                    for i, t in zip(group, taken, strict=True)
                ]
            )
            if exact and not groups.is_large(group):
                signs = {t[0][0] for t in taken}
                if signs == {-1.0}:  # one sign for all: no broadcast multiply
                    after = before - increments
                elif signs == {1.0}:
                    after = before + increments
                else:
                    after = (
                        before + tf.constant([[t[0][0]] for t in taken], tf.float32) * increments
                    )
            else:
                after = stack_rows([self.variables[i].value for i in group])
            increments_and_after.append((increments, after))

        def squares(pairs):
            # Two reductions, not one over a stack of both: stacking copies them.
            per_group = [tf.stack([sum_of_squares(i), sum_of_squares(a)]) for i, a in pairs]
            return groups.rows(per_group, axis=1)

        change, after = tf.unstack(
            exact_l2_norms(squares, increments_and_after, groups.entries), num=2
        )
        return change, after


class WeightSegments:
    """Per-variable reductions over tensors shaped like the model's weights.

    Same-shaped tensors are stacked and reduced together
    (`gradflow.statistics.ShapeGroups`), so the op count follows the number
    of distinct shapes, not of variables.
    """

    def __init__(self, weights):
        self.groups = (
            weights.groups
            if isinstance(weights, Stacked)
            else ShapeGroups([t.shape for t in weights])
        )

    def flat(self, tensors):
        if isinstance(tensors, Stacked):
            return tensors
        return self.groups.stack([tf.cast(t, tf.float32) for t in tensors])

    def difference(self, after, before):
        return Stacked([a - b for a, b in zip(after, before, strict=True)], after.groups)

    def norms(self, columns):
        """`[count, len(columns)]` L2 norms, one column per stacked list of tensors."""

        def squares(columns):
            return tf.stack([self.groups.sums_of_squares(column) for column in columns], axis=1)

        return exact_l2_norms(
            squares, [list(column) for column in columns], self.groups.entries[:, np.newaxis]
        )

    def max_abs(self, values):
        return self.groups.max_abs(values)


def _layer_outputs(plan, tape):
    # Always, also without activation rows: the order of the calls numbers
    # the layers. It costs the trace only; unused outputs add no work. The
    # tape watches each output, so that a layer that depends on no variable
    # (a Rescaling first) has its gradient too.
    return record_layer_outputs(plan.model, watch=tape.watch)


def _sequence_rows(plan, x, watched_input, outputs):
    """`(source, sizes)` of the rows through time (`through_time.plan_rows`), or None."""
    if not plan.through_time:
        return None
    source, sizes = through_time.plan_rows(plan, x, watched_input, outputs)
    return None if source is None else (source, sizes)


def _time_gradients(tape, probe, sequence):
    """The rows through time's gradients, after the loss's (the tape is persistent then)."""
    if sequence is None:
        return []
    return through_time.gradients_through_time(tape, probe, *sequence)


def _gradients(plan, tape, loss, variables, outputs, overwritten=()):
    """`(activations, gradients)`: the layer outputs the rows read, and the
    gradients of `variables`, then of `overwritten` (their new values, see
    `naming.split_overwritten`), then of those outputs (None where unreached)."""
    activations, others = _take_activations(plan, outputs)
    start = len(variables) + len(overwritten)
    gradients = tape.gradient(
        loss, variables + list(overwritten) + activations + [t for row in others for t in row]
    )
    activations, gradients[start:] = reached_outputs(activations, others, gradients[start:])
    return activations, gradients


def _take_activations(plan, outputs):
    """Layer outputs to differentiate, and each call's other outputs (`reached_outputs`).

    Also names their rows (at trace time).

    With more calls than rows (a layer applied in a loop), every layer's
    first call keeps its row, and the repeated calls fill the rest in call
    order: the first calls took them all once, and the layers nearest the
    loss, called last, lost theirs.
    """
    plan.note_call_order(list(outputs.paths))
    if not plan.activation_slots:
        return [], []
    seen, firsts, repeats = set(), [], []
    for index, path in enumerate(outputs.paths):
        layer = path.split("#")[0]
        (repeats if layer in seen else firsts).append(index)
        seen.add(layer)
    room = max(0, plan.activation_slots - len(firsts))
    keep = sorted(firsts[: plan.activation_slots] + repeats[:room])
    plan.activation_paths = [outputs.paths[i] for i in keep]
    inputs = outputs.compared_inputs()
    plan.activation_inputs = {outputs.paths[i]: inputs[i] for i in keep}
    kept = set(keep)
    plan.dropped_activations = [p for i, p in enumerate(outputs.paths) if i not in kept]
    plan.untaped = {outputs.paths[i] for i in keep if outputs.untaped[i]}
    return (
        [tf.convert_to_tensor(outputs.tensors[i]) for i in keep],
        [[tf.convert_to_tensor(t) for t in outputs.others[i]] for i in keep],
    )


def _loss_scale(optimizer):
    """The factor the loss was multiplied by, read before the update changes it."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # The same choice as `LossScaleOptimizer.scale_loss` made above.
        if not optimizer.built:
            return optimizer.initial_scale
        return tf.identity(optimizer.dynamic_scale.value)
    return optimizer.loss_scale_factor


class Clipped(typing.NamedTuple):
    """The gradients as the optimizer clipped them, and what to compare them with.

    Attributes:
        values: Dense clipped gradients, one per variable.
        unclipped_norms: L2 norms of the gradients the optimizer clipped, or
            None when those are the step's own gradients.
        applied: Whether this step applied them (a bool tensor), or None
            when every step does.
    """

    values: list
    unclipped_norms: object = None
    applied: object = None


def _clipped(clipping, gradients, variables, scale):
    """The gradients as the optimizer clips them, made dense (a `Clipped`).

    Clipped as they come from the tape, as Keras clips them: an Embedding's
    gradient is a `tf.IndexedSlices` with one slice per lookup, and
    `clipvalue` clips each slice and `clipnorm` measures all of them before
    repeated rows are summed. Clipping the summed, dense gradient recorded
    other numbers than the ones applied.

    With `gradient_accumulation_steps`, Keras clips the mean of the
    accumulated gradients, and only at a step that closes an accumulation
    (`BaseOptimizer._backend_apply_gradients`); so does this, to be called
    before the update resets the accumulators. The other steps apply
    nothing: `applied` says which.
    """
    raw = [tf.zeros_like(v) if g is None else g for g, v in zip(gradients, variables, strict=True)]
    raw = _unscaled(raw, scale)
    steps = clipping.gradient_accumulation_steps
    if not steps:
        return Clipped(zeros_where_missing(clipping._clip_gradients(raw), variables))
    accumulated = [
        clipping._accumulated_gradients[clipping._get_variable_index(v)] for v in variables
    ]
    mean = [
        (tf.convert_to_tensor(g) + tf.cast(a.value, g.dtype)) / steps
        for g, a in zip(raw, accumulated, strict=True)
    ]
    # Keras's test; `iterations` counts whole accumulations, `_iterations` batches.
    applied = tf.equal(tf.math.floormod(clipping._iterations + 1, steps), 0)
    return Clipped(
        zeros_where_missing(clipping._clip_gradients(mean), variables),
        tf.stack([tf.norm(tf.cast(g, tf.float32)) for g in mean]),
        applied,
    )


def _overflow_or_nonfinite(finite, loss, scale):
    """Tell a loss-scale overflow from a non-finite gradient the model made.

    With mixed precision, `LossScaleOptimizer` multiplies the loss by a
    scale that it halves whenever the scaled gradients overflow float16,
    skipping that batch's update; such an attempt says nothing about the
    model, and is neither recorded (its gradients are not applied) nor a
    reason to halt. Gradients that are still non-finite with a finite loss
    at a scale of 1 or less, or with a non-finite loss, are the model's.

    Returns:
        `(finite, overflowed)`: bool scalars; `finite` is False only for
        the model's own non-finite gradients.
    """
    nonfinite = tf.logical_not(finite)
    models_own = tf.logical_or(
        tf.logical_not(tf.math.is_finite(tf.cast(loss, tf.float32))),
        tf.cast(scale, tf.float32) <= 1.0,
    )
    overflowed = tf.logical_and(nonfinite, tf.logical_not(models_own))
    return tf.logical_not(tf.logical_and(nonfinite, models_own)), overflowed


def _unscaled(gradients, scale):
    if scale is None:
        return list(gradients)

    # In float32: a float16 layer output's gradient divided by a scale of
    # 65536 cast to float16 (Inf) read 0 everywhere, and "dead ReLUs" once the
    # scale had doubled past 32768 (after about 2,000 finite steps).
    scale = tf.cast(scale, tf.float32)

    def unscaled(g):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(tf.cast(g.values, tf.float32) / scale, g.indices, g.dense_shape)
        return None if g is None else tf.cast(g, tf.float32) / scale

    return [unscaled(g) for g in gradients]


def step_counter(optimizer):
    """The variable that counts train steps (batches), which names the monitor's steps.

    That is `optimizer.iterations`, except with `gradient_accumulation_steps`:
    there `iterations` counts updates (batches // N), and every batch still
    computes gradients worth recording, so the monitor counts batches, with
    the raw counter behind `iterations`.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(inner, "gradient_accumulation_steps", None):
        return inner._iterations
    return optimizer.iterations


def clipping_optimizer(optimizer):
    """The optimizer whose `_clip_gradients` runs, or None without clipping."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if any(value for value in (inner.clipnorm, inner.clipvalue, inner.global_clipnorm)):
        return inner
    return None


def _fill_output_gradients(gradients, start, activations, batch, plan):
    """Put dLoss/d(output) in place for outputs the loss reached through their logits.

    Keras's cross-entropies read a softmax or sigmoid output's logits directly
    (for stability), which leaves the output tensor itself off the gradient
    path: its gradient comes back None, and would be recorded as all zeros
    (and called dead units). As `gradflow.snapshot` does, the same loss on a
    copy of the output values gives dLoss/d(output) as a student would define
    it. Only such outputs pay for it, and only with activation gradients on.
    The update is untouched: it uses the weight gradients alone.
    """
    missing = [
        i
        for i, t in enumerate(activations)
        if gradients[start + i] is None and hasattr(t, "_keras_logits")
    ]
    if not missing:
        return
    model, optimizer = plan.model, plan.optimizer
    x, y, y_pred, sample_weight = batch
    flat = tree.flatten(y_pred)
    with tf.GradientTape() as tape:
        # With their Keras masks: a loss weighs a sequence's steps by it.
        copies = [output_values(t) for t in flat]
        tape.watch(copies)
        loss = model._compute_loss(
            x=x,
            y=y,
            y_pred=tree.pack_sequence_as(y_pred, copies),
            sample_weight=sample_weight,
            training=True,
        )
        # The same scale as the other gradients, which are unscaled later.
        loss = optimizer.scale_loss(loss)
    found = tape.gradient(loss, copies)
    for i in missing:
        for output, gradient in zip(flat, found, strict=True):
            if output is activations[i]:
                gradients[start + i] = gradient


def _note_unreached(plan, gradients):
    """Note, at trace time, the rows whose gradient is None (see `StepPlan.unreached`)."""
    plan.unreached = [i for i, g in enumerate(gradients) if g is None]


def _one_op_at_a_time():
    """Whether TensorFlow runs this process's graph ops one after another."""
    return tf.config.threading.get_inter_op_parallelism_threads() == 1 or os.cpu_count() == 1


def _all_finite(gradients):
    checks = [tf.reduce_all(tf.math.is_finite(g)) for g in gradients if g is not None]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def _scalar(value):
    return tf.cast(keras.ops.convert_to_tensor(value), tf.float32)


def _constrained_indices(variables):
    return [i for i, v in enumerate(variables) if v.constraint is not None]


@contextlib.contextmanager
def _constraints_deferred(variables, indices):
    """Hide the constraints from `optimizer.apply` while the step is traced.

    The caller applies them itself after the update; they are back on the
    variables when the block ends.
    """
    saved = [(variables[i], variables[i].constraint) for i in indices]
    for variable, _ in saved:
        variable.constraint = None
    try:
        yield
    finally:
        for variable, constraint in saved:
            variable.constraint = constraint
