"""The deferred path: the step copies its gradients and weights, the read summarizes them.

On a small model the cost of recording is not arithmetic but the dispatch of
about two hundred small ops in every step. So for small models the step does
only this: one concat of the gradients it applies and the weights before the
update, with the loss and the learning rate, written into one slot of a
`[capacity, 2 x parameters + 2]` ring (an in-place scatter). When the
callback reads the ring (when it is full or 0.2 s after the last read), the
statistics of every new slot are computed at once, so their ops are paid once
per read, not once per step: in NumPy
(`gradflow.statistics.summarize_rows_numpy`) while the reads still to come
would not repay compiling, then in one compiled call of the in-step path's
kernel (`gradflow.statistics.summarize_rows`). With histograms, whose bins NumPy's
logarithm could round differently, the uncompiled read runs that kernel op by
op.

The weights after step t are the weights before step t + 1, the next slot;
for the newest step they are the model's weights as they are at the read,
since the callback reads between executions. That holds only when every step
is recorded (`every=1`) and nothing else changes the weights: constraints,
clipping (whose columns need the clipped gradient), loss scaling and several
replicas keep the in-step path, as do models too large for the ring (`fits`).

Activation gradients are the one thing summarized in the step: their shape
follows the batch (the last batch of an epoch is often smaller), so they
cannot sit in fixed slots. Their statistics (and histograms) are a fixed
`[activation_rows, ...]` block, and that block is what the slot keeps. The
weights still take the cheap copy.
"""

import time

import numpy as np
import tensorflow as tf

from gradflow import schema
from gradflow.monitor.buffer import (
    ROW_COLUMNS,
    STEP_METRICS,
    _local_variable,
    _write_slot,
    pad_rows,
)
from gradflow.statistics import (
    ShapeGroups,
    exact_l2_norms,
    exact_sums_of_squares_numpy,
    norm_of_norms,
    norm_of_norms_numpy,
    sum_of_squares_numpy,
    summarize,
    summarize_rows,
    summarize_rows_numpy,
)

_NAN = float("nan")

# Above this many trainable parameters the copy into the ring and the read
# cost about what the in-step statistics do (`bench/bench_monitor_step.py`,
# `weights deferred` against `weights in-step`: the lab's 5.6k-parameter MLP
# and a 20k-parameter CNN gained, a 78k-parameter MLP did not).
MAX_PARAMETERS = 32_768


# The ring may hold up to four times the steps of the in-step ring (so a read,
# whose cost is mostly its op count, comes four times less often) while it
# stays under this size.
RING_BYTES = 16 * 2**20
_MAX_GROWTH = 4


# A ring the callback's own capacity would make larger than this (many steps
# per execution) keeps the in-step path.
MAX_RING_BYTES = 64 * 2**20


# A read that is not compiled runs in NumPy (`_summarize_in_numpy`; with
# histograms, op by op in TensorFlow), and compiling it pays off only over many
# reads. 45 steps a read on one TensorFlow thread (`python3
# bench/bench_ring_read.py --first-reads`): the lab's MLP 3.4 ms in NumPy, 18 ms
# op by op, 2.5 ms compiled after 0.41 s of tracing and first running the
# compiled call; the 5-layer MLP 6.3 / 22 / 4.8 ms after 0.41 s; the CNN 8.0 /
# 32 / 6.5 ms after 0.64 s. Compiling breaks even when the NumPy reads still to
# come would take 1.5-3.3 s (about 450, 275 and 400 reads), op by op 0.5-0.8 s.
# The lab's default 300-step run reads about 8 times. So the read compiles when
# the reads to come, at what the uncompiled ones took per step so far, would
# take more than this many seconds.
COMPILE_WHEN_SECONDS_LEFT = 2.0
# When the steps to come are unknown (a dataset of unknown length), the read
# compiles once the uncompiled reads have taken about what compiling costs:
# never more than twice the better choice's time.
COMPILE_AFTER_SECONDS = 0.5


def ring_capacity(variables, capacity, activation_rows=0, histograms=False):
    """Steps a deferred ring holds: `capacity`, or more while the ring stays under `RING_BYTES`."""
    slot = _slot_bytes(variables, activation_rows, histograms)
    return max(capacity, min(_MAX_GROWTH * capacity, RING_BYTES // slot))


def _parameters(variables):
    return sum(tf.TensorShape(v.shape).num_elements() for v in variables)


def _activation_width(activation_rows, histograms):
    """Floats a slot keeps for the activation gradients' statistics (and histograms)."""
    per_row = len(schema.STATISTICS) + (schema.HISTOGRAM_BINS if histograms else 0)
    return activation_rows * per_row


def _slot_bytes(variables, activation_rows=0, histograms=False):
    return 4 * (2 * _parameters(variables) + 2 + _activation_width(activation_rows, histograms))


def fits(variables, capacity, activation_rows=0, histograms=False):
    """Whether a model with these trainable variables is small enough for the deferred path.

    Args:
        variables: The model's trainable variables.
        capacity: The steps the callback reads at most at once.
        activation_rows: Rows kept for activation gradients (0 without them).
        histograms: Whether histograms are recorded.
    """
    shapes = [tf.TensorShape(v.shape) for v in variables]
    if not all(s.is_fully_defined() for s in shapes):
        return False
    return (
        _parameters(variables) <= MAX_PARAMETERS
        and capacity > 1
        and capacity * _slot_bytes(variables, activation_rows, histograms) <= MAX_RING_BYTES
    )


def _joint_key(shape):
    """Shapes with equal keys join along their first axis: the rank, then every dimension but the first."""
    return (len(shape), shape[1:])


def _runs(shapes):
    """`(start, stop)` of each run of consecutive shapes that join along their first axis."""
    runs = []
    for index, shape in enumerate(shapes):
        if runs and len(shape) > 0 and _joint_key(shape) == _joint_key(shapes[runs[-1][0]]):
            runs[-1][1] = index + 1
        else:
            runs.append([index, index + 1])
    return [tuple(run) for run in runs]


def repays_compiling(steps_left, seconds, steps_read):
    """Whether compiling the read repays itself, from what uncompiled reads took so far.

    Args:
        steps_left: Steps still to be read (`None` when unknown).
        seconds: Seconds the uncompiled reads took so far.
        steps_read: Steps they read.

    Returns:
        With `steps_left` known: whether reading them as so far would take
        more than `COMPILE_WHEN_SECONDS_LEFT`. Unknown: whether the reads so
        far took `COMPILE_AFTER_SECONDS` (what compiling costs, about).
    """
    if steps_left is None:
        return seconds >= COMPILE_AFTER_SECONDS
    return steps_left * seconds / max(steps_read, 1) > COMPILE_WHEN_SECONDS_LEFT


class DeferredRing:
    """Raw gradients and weights of each recorded step, summarized when read.

    It reads like `gradflow.monitor.buffer.RingBuffer`: `read` returns the
    same arrays, and `halted` is the same flag.

    Args:
        variables: The model's trainable variables, in gradient order.
        capacity: How many steps the ring holds between two reads.
        histograms: Whether `read` also counts log10|g| histograms.
        activation_rows: Rows for activation gradients after the variables'
            (`read` returns them as the in-step ring does: their statistics,
            NaN in the weight columns, NaN rows where fewer were recorded).
            Defaults to 0.
    """

    def __init__(self, variables, capacity, histograms=False, activation_rows=0):
        self.capacity = int(capacity)
        self.variables = list(variables)
        self.rows = len(self.variables)
        self.histograms = histograms
        self.activation_rows = int(activation_rows)
        shapes = [tf.TensorShape(v.shape).as_list() for v in self.variables]
        # Slot layout: each shape group's tensors side by side, so that a
        # group's columns of the ring are a `[capacity, k, entries]` block.
        # Groups whose shapes differ only in their first dimension come next
        # to each other, so the step joins such tensors with one concat along
        # their first axis: a few ops per run of them instead of a reshape per
        # tensor, each op costing the step microseconds on CPU (the 20-layer
        # MLP's copy: 134 ops -> 64, `bench/bench_monitor_step.py --detail`).
        self.groups = sorted(
            ShapeGroups(shapes).groups, key=lambda group: _joint_key(shapes[group[0]])
        )
        self._order = [i for group in self.groups for i in group]
        self._runs = _runs([shapes[i] for i in self._order])
        # Each group, its first gradient column in a slot, and entries per tensor.
        self._columns = []
        offset = 0
        for group in self.groups:
            entries = int(np.prod(shapes[group[0]]))
            self._columns.append((group, offset, entries))
            offset += len(group) * entries
        # Where each variable's row lands among the groups' joined results.
        position = np.argsort(self._order)
        self._position = None if self._order == sorted(self._order) else position
        self.parameters = _parameters(self.variables)
        # One more slot than the ring holds: the steps `stop_on_nonfinite`
        # halted write there, which costs less than a branch around the write.
        self.steps = _local_variable(np.zeros([capacity + 1], np.int64), tf.int64)
        # Per slot: the gradients, the weights, the loss and the learning
        # rate, then the activation gradients' statistics and histograms.
        self._activations_at = 2 * self.parameters + 2
        width = self._activations_at + _activation_width(self.activation_rows, histograms)
        self.raw = _local_variable(np.zeros([capacity + 1, width], np.float32), tf.float32)
        self.halted = _local_variable(0, tf.int32)
        self._reads = 0
        # Steps read, and seconds taken, by reads that were not compiled.
        self._uncompiled_steps = 0
        self._uncompiled_seconds = 0.0
        self.compiled = False  # whether reads run the compiled call (once set, for good)
        self._summarize = tf.function(
            self._summarize_slots,
            input_signature=[tf.TensorSpec([None], tf.int32)],
            autograph=False,
        )

    # In the step ----------------------------------------------------------------

    def pack(self, gradients, loss, learning_rate, activation_gradients=()):
        """One vector: the gradients, the weights as they are now (before the update), the loss,
        the learning rate, then the statistics of up to `activation_rows` activation gradients."""
        return tf.concat(
            self._flat([tf.cast(gradients[i], tf.float32) for i in self._order])
            + self._weight_pieces()
            + [tf.reshape(tf.cast(loss, tf.float32), [1]), tf.reshape(learning_rate, [1])]
            + self._activation_pieces(list(activation_gradients)),
            axis=0,
        )

    def _activation_pieces(self, activation_gradients):
        """The activation gradients' statistics then histograms, padded to `activation_rows`."""
        if not self.activation_rows:
            return []
        recorded = activation_gradients[: self.activation_rows]
        if recorded:
            stats, histograms = summarize(recorded, self.histograms)
        else:  # a model whose layers gave no output to record
            stats = tf.zeros([0, len(schema.STATISTICS)])
            histograms = tf.zeros([0, schema.HISTOGRAM_BINS]) if self.histograms else None
        # As in the in-step ring.
        stats, histograms = pad_rows(stats, histograms, self.activation_rows)
        pieces = [tf.reshape(stats, [-1])]
        if histograms is not None:
            pieces.append(tf.reshape(histograms, [-1]))
        return pieces

    def all_finite(self, packed):
        """Whether every gradient entry of `pack`'s vector is finite."""
        return tf.reduce_all(tf.math.is_finite(packed[: self.parameters]))

    def write(self, step, packed, halted=None):
        """Store one step (graph code, inside the train step); after a halt, into the spare slot."""
        slot = tf.math.floormod(step - 1, self.capacity)
        if halted is not None:
            slot = tf.where(halted, tf.constant(self.capacity, tf.int64), slot)
        _write_slot(self.raw, slot, packed)
        # Written last: a slot's step says its other values are complete.
        _write_slot(self.steps, slot, step)

    # When read ------------------------------------------------------------------

    def read(self, after_step, final_step=None):
        """Return the records newer than `after_step`, oldest first (eager).

        Only those slots are summarized: a read every 0.2 s of a slow model
        costs what its new steps cost, not what the whole ring would. A read
        runs in NumPy (op by op in TensorFlow with histograms) until
        compiling it would repay itself over the reads still to come
        (`COMPILE_WHEN_SECONDS_LEFT`).

        Args:
            after_step: Steps up to this one were read before.
            final_step: The step training is planned to end at, when known
                (`fit`'s epochs times its steps per epoch). Defaults to
                `None`: unknown (`COMPILE_AFTER_SECONDS` decides).

        Returns:
            `(steps, stats, metrics, histograms)` as `RingBuffer.read` does.
        """
        all_steps = self.steps.numpy()
        steps = all_steps[: self.capacity]  # not the spare slot
        fresh = np.flatnonzero(steps > after_step)
        if fresh.size == 0:
            return steps[:0], None, None, None
        fresh = fresh[np.argsort(steps[fresh])]
        newest = int(steps[fresh[-1]])
        self._decide_compiling(None if final_step is None else final_step - newest)
        start = time.perf_counter()
        if self.compiled or self.histograms:
            summarize = self._summarize if self.compiled else self._summarize_slots
            stats, metrics, histograms = summarize(tf.constant(fresh, tf.int32))
            stats, metrics = stats.numpy(), metrics.numpy()
            histograms = None if histograms is None else histograms.numpy()
        else:
            stats, metrics = self._summarize_in_numpy(fresh)
            histograms = None
        # The first read (often of one step, published at once) pays for
        # first uses: 10 ms for one step of the lab's MLP against 5 ms for
        # 45 later. It would make the steps to come look dear.
        if not self.compiled and self._reads > 0:
            self._uncompiled_seconds += time.perf_counter() - start
            self._uncompiled_steps += fresh.size
        self._reads += 1
        # Fresh steps follow one another (every step is recorded, and the
        # ring is read before it wraps), so the weights after a step are the
        # next row's weights before it, and after the newest step, or the one
        # `stop_on_nonfinite` halted at, the model's weights now. Should a
        # step ever be missing, the rows before the gap get no weight columns.
        steps = steps[fresh]
        gaps = np.flatnonzero(np.diff(steps) != 1)
        stats[gaps, :, len(schema.STATISTICS) :] = np.nan
        return steps, stats, metrics, histograms

    def _decide_compiling(self, steps_left):
        """Whether this read and every later one run the compiled call; decided once for good.

        The first read is never compiled: a lab run's first step is published
        at once and waited for, and tracing the compiled call there took the
        warm start to 0.9-2.4 s instead of 0.5 s (`bench/bench_runner.py`).
        Nor the second: the first is not timed, so nothing is known yet.
        """
        if self.compiled or self._uncompiled_steps == 0:
            return
        self.compiled = repays_compiling(
            steps_left, self._uncompiled_seconds, self._uncompiled_steps
        )

    def _weight_pieces(self):
        return self._flat([tf.cast(self.variables[i].value, tf.float32) for i in self._order])

    def _flat(self, tensors):
        """Tensors in slot order -> flat pieces that concatenate to each tensor flattened in turn."""
        pieces = []
        for start, stop in self._runs:
            run = tensors[start:stop]
            joined = run[0] if len(run) == 1 else tf.concat(run, axis=0)
            pieces.append(tf.reshape(joined, [-1]))
        return pieces

    def _rows(self, per_group):
        """Concatenate one `[count, k, ...]` result per group into the variables' order."""
        joined = tf.concat(per_group, axis=1) if len(per_group) > 1 else per_group[0]
        return joined if self._position is None else tf.gather(joined, self._position, axis=1)

    def _weight_norms(self, chosen, group, offset, width, count):
        """`[count, k, 3]`: ||w|| before and after each chosen step, and ||dw||, for a group.

        Row i + 1 of the ring holds the weights after step i (see `read`);
        after the newest step they are the model's weights now.
        """
        tensors = len(group)
        entries = width // tensors
        start = self.parameters + offset
        before = tf.reshape(chosen[:, start : start + width], [count, tensors, entries])
        now = tf.stack(
            [tf.reshape(tf.cast(self.variables[i].value, tf.float32), [-1]) for i in group]
        )
        return exact_l2_norms(_weight_squares, (before, now), entries)

    def _summarize_in_numpy(self, slots):
        """`_summarize_slots` without histograms, in NumPy: `(stats, metrics)` arrays."""
        parameters = self.parameters
        count = len(slots)
        # Only the chosen slots are copied out of the ring.
        chosen = tf.gather(self.raw, tf.constant(slots, tf.int32)).numpy()
        stats, squares = [], []
        for group, offset, entries in self._columns:
            tensors = len(group)
            width = tensors * entries
            # A view: splitting the last axis of a column slice copies nothing.
            gradients = chosen[:, offset : offset + width].reshape(count, tensors, entries)
            stats.append(summarize_rows_numpy(gradients))
            before = chosen[:, parameters + offset : parameters + offset + width]
            squares.append(self._weight_squares_in_numpy(before, group, count))
        stats = self._rows_in_numpy(stats)  # [count, variables, statistics]
        with np.errstate(all="ignore"):
            norm_before, norm_after, norm_change = np.moveaxis(
                np.sqrt(self._rows_in_numpy(squares)), -1, 0
            )
            update_ratio = np.where(
                norm_before > 0, norm_change / np.maximum(norm_before, 1e-30), _NAN
            )
            global_norm = norm_of_norms_numpy(
                stats[:, :, schema.STATISTICS.index("l2_norm")], axis=1
            )
        missing = np.full([count, self.rows], _NAN, np.float32)
        # In `schema.EXTRA_COLUMNS` order; no constraint and no clipping here.
        extras = np.stack([norm_after, missing, update_ratio, missing, missing], axis=-1)
        rows = np.concatenate([stats, extras.astype(np.float32)], axis=-1)
        metrics = np.concatenate(
            [
                chosen[:, 2 * parameters : self._activations_at],
                global_norm[:, np.newaxis],
                np.full([count, 2], _NAN, np.float32),
            ],
            axis=1,
        ).astype(np.float32)
        if self.activation_rows:
            statistics = len(schema.STATISTICS)
            at, activations = self._activations_at, self.activation_rows
            recorded = chosen[:, at : at + activations * statistics]
            recorded = recorded.reshape(count, activations, statistics)
            extras = np.full([count, activations, len(ROW_COLUMNS) - statistics], _NAN, np.float32)
            rows = np.concatenate([rows, np.concatenate([recorded, extras], axis=-1)], axis=1)
        return rows, metrics

    def _weight_squares_in_numpy(self, before, group, count):
        """`_weight_norms`, squared, in NumPy (float64), from the group's `[count, k x entries]` weights before."""
        tensors = len(group)
        before = before.reshape(count, tensors, -1)
        now = np.stack(
            [np.asarray(self.variables[i].numpy(), np.float32).reshape(-1) for i in group]
        )
        return exact_sums_of_squares_numpy(_weight_squares_numpy, (before, now), before.shape[-1])

    def _rows_in_numpy(self, per_group):
        """`_rows` for NumPy arrays."""
        joined = np.concatenate(per_group, axis=1)
        return joined if self._position is None else joined[:, self._position]

    def _summarize_slots(self, slots):
        parameters = self.parameters
        count = tf.shape(slots)[0]
        # Gathers from the variable itself: only the chosen slots are copied.
        chosen = tf.gather(self.raw, slots)

        stats, histograms, norms = [], [], []
        for group, offset, entries in self._columns:
            tensors = len(group)
            width = tensors * entries
            # Each group's columns are sliced out of `chosen` once (a slice
            # across columns is a copy; slicing all gradients first, then the
            # group, copied them twice, and the weights three times).
            gradients = chosen[:, offset : offset + width]
            group_stats, group_histograms = summarize_rows(
                tf.reshape(gradients, [-1, entries]), self.histograms
            )
            stats.append(tf.reshape(group_stats, [count, tensors, len(schema.STATISTICS)]))
            if group_histograms is not None:
                histograms.append(
                    tf.reshape(group_histograms, [count, tensors, schema.HISTOGRAM_BINS])
                )
            norms.append(self._weight_norms(chosen, group, offset, width, count))

        stats = self._rows(stats)  # [count, variables, statistics]
        norm_before, norm_after, norm_change = tf.unstack(self._rows(norms), num=3, axis=-1)
        update_ratio = tf.where(norm_before > 0, norm_change / tf.maximum(norm_before, 1e-30), _NAN)
        missing = tf.fill([count, self.rows], _NAN)
        # In `schema.EXTRA_COLUMNS` order; no constraint and no clipping here.
        extras = tf.stack([norm_after, missing, update_ratio, missing, missing], axis=-1)
        rows = tf.concat([stats, extras], axis=-1)
        assert rows.shape[-1] == len(ROW_COLUMNS)

        gradient_norm = stats[:, :, schema.STATISTICS.index("l2_norm")]
        global_norm = norm_of_norms(gradient_norm, axis=1)
        metrics = tf.concat(
            [
                chosen[:, 2 * parameters : self._activations_at],
                global_norm[:, tf.newaxis],
                tf.fill([count, 2], _NAN),
            ],
            axis=1,
        )
        assert metrics.shape[1] == len(STEP_METRICS)
        histograms = self._rows(histograms) if histograms else None
        if self.activation_rows:
            rows, histograms = self._with_activation_rows(chosen, count, rows, histograms)
        return rows, metrics, histograms

    def _with_activation_rows(self, chosen, count, rows, histograms):
        """The variables' rows, then the activation rows the step summarized."""
        statistics = len(schema.STATISTICS)
        at, activations = self._activations_at, self.activation_rows
        stats = tf.reshape(
            chosen[:, at : at + activations * statistics], [-1, activations, statistics]
        )
        extras = tf.fill([count, activations, len(ROW_COLUMNS) - statistics], _NAN)
        rows = tf.concat([rows, tf.concat([stats, extras], axis=-1)], axis=1)
        if histograms is not None:
            at += activations * statistics
            counts = chosen[:, at : at + activations * schema.HISTOGRAM_BINS]
            counts = tf.reshape(counts, [-1, activations, schema.HISTOGRAM_BINS])
            histograms = tf.concat([histograms, counts], axis=1)
        return rows, histograms


def _weight_squares(tensors):
    """`[count, k, 3]` ||w||^2 before and after each step and ||dw||^2, from `(before, now)`.

    `before`: `[count, k, entries]` weights before each step; `now`: `[k,
    entries]`, the weights after the newest one.
    """
    before, now = tensors
    # One fused pass each, no temporary (`statistics.sum_of_squares`;
    # the read runs outside XLA).
    before_squares = tf.square(tf.math.reduce_euclidean_norm(before, axis=-1))
    now_squares = tf.square(tf.math.reduce_euclidean_norm(now, axis=-1))[tf.newaxis]
    # Slices along the first axis: no copies.
    change_squares = tf.concat(
        [
            tf.reduce_sum(tf.math.squared_difference(before[1:], before[:-1]), axis=-1),
            tf.reduce_sum(tf.math.squared_difference(now, before[-1]), axis=-1)[tf.newaxis],
        ],
        axis=0,
    )
    after_squares = tf.concat([before_squares[1:], now_squares], axis=0)
    return tf.stack([before_squares, after_squares, change_squares], axis=-1)


def _weight_squares_numpy(arrays):
    """`_weight_squares` in NumPy."""
    before, now = arrays
    before_squares = sum_of_squares_numpy(before)
    now_squares = sum_of_squares_numpy(now)[np.newaxis]
    change_squares = np.concatenate(
        [
            sum_of_squares_numpy(before[1:] - before[:-1], overwrite=True),
            sum_of_squares_numpy(now - before[-1], overwrite=True)[np.newaxis],
        ]
    )
    after_squares = np.concatenate([before_squares[1:], now_squares])
    return np.stack([before_squares, after_squares, change_squares], axis=-1)
