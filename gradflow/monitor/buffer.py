"""Where the compiled train step leaves its statistics for the callback.

Keras fit returns only the `logs` dict from a train function, and with
`steps_per_execution > 1` only the last step's. So the step writes each
recorded step into a ring of non-trainable variables, one slot per step
(slot = (step - 1) % capacity), and the callback reads the whole ring now and
then. A slot also holds the step number that filled it, so a reader can tell
new records from old ones.

Under `tf.distribute` the variables are `ON_READ` with `ONLY_FIRST_REPLICA`
aggregation (like Keras's metric variables): each replica writes its own copy
without a cross-replica synchronization inside `tf.cond`, which
`tf.distribute` does not allow, and a read outside the step returns the first
replica's copy. The copies are equal because the step all-reduces the
gradients before it summarizes them.
"""

import numpy as np
import tensorflow as tf

from gradflow import schema

# Per row: the kernel's statistics, then the monitor's extra columns.
ROW_COLUMNS = schema.STATISTICS + schema.EXTRA_COLUMNS
# Per step scalars, in this order.
STEP_METRICS = ("loss", "learning_rate", "global_norm", "global_norm_clipped", "clipped")


def _local_variable(value, dtype):
    return tf.Variable(
        tf.constant(value, dtype=dtype),
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def replica_counter(strategy, value):
    """An int64 counter that each replica keeps (a read gives the first replica's)."""
    with strategy.scope():
        return _local_variable(value, tf.int64)


def pad_rows(stats, histograms, rows):
    """Pad a step's per-row records to the ring's `rows`.

    The ring keeps room for more layer outputs than a step may record; its
    rows that no tensor filled hold NaN statistics and empty histograms.

    Args:
        stats: float32 `[n, columns]`, n known while tracing.
        histograms: float32 `[n, HISTOGRAM_BINS]` or `None`.
        rows: The rows to pad to.

    Returns:
        `(stats, histograms)` with `rows` rows each.
    """
    padding = rows - stats.shape[0]
    stats = tf.pad(stats, [[0, padding], [0, 0]], constant_values=float("nan"))
    if histograms is not None:
        histograms = tf.pad(histograms, [[0, padding], [0, 0]])
    return stats, histograms


def _write_slot(variable, slot, value):
    """Write `value` into row `slot` (an int64 scalar) of a ring variable, in place."""
    if isinstance(variable, tf.distribute.DistributedValues):
        # Distributed variables implement no scatter; the ring is small, so
        # rewriting the replica's whole copy costs little.
        variable.assign(
            tf.tensor_scatter_nd_update(
                variable.read_value(), tf.reshape(slot, [1, 1]), value[tf.newaxis]
            )
        )
    else:
        # A scatter along the first axis, not `scatter_nd_update`: on one CPU
        # thread writing a 620 KB slot (a 78k-parameter model's deferred
        # slot) took 0.08-0.09 ms instead of 0.24-0.26; on the lab's 45 KB
        # and the 5-layer MLP's 122 KB slots the two are within this
        # machine's noise (`python3 bench/bench_ring_write.py`).
        variable.scatter_update(tf.IndexedSlices(value[tf.newaxis], tf.reshape(slot, [1])))


class RingBuffer:
    """A ring of recorded steps kept in variables.

    Args:
        strategy: The model's `tf.distribute` strategy (the default strategy
            works too); the variables are created in its scope.
        capacity: How many steps the ring holds before it overwrites.
        rows: Rows per step (trainable variables + activation slots).
        histograms: Whether to keep a `[rows, HISTOGRAM_BINS]` histogram per
            step too.
    """

    def __init__(self, strategy, capacity, rows, histograms=False):
        self.capacity = int(capacity)
        self.rows = int(rows)
        with strategy.scope():
            self.steps = _local_variable(np.zeros([capacity], np.int64), tf.int64)
            self.stats = _local_variable(
                np.zeros([capacity, rows, len(ROW_COLUMNS)], np.float32), tf.float32
            )
            self.metrics = _local_variable(
                np.zeros([capacity, len(STEP_METRICS)], np.float32), tf.float32
            )
            self.histograms = None
            if histograms:
                self.histograms = _local_variable(
                    np.zeros([capacity, rows, schema.HISTOGRAM_BINS], np.float32),
                    tf.float32,
                )
            # Set by the step when it met a non-finite gradient and
            # `stop_on_nonfinite` asked to halt: later steps then do nothing.
            self.halted = _local_variable(0, tf.int32)
            # Batches a `LossScaleOptimizer` skipped for overflow (mixed
            # precision), which the ring does not record.
            self.overflows = _local_variable(0, tf.int64)

    def write(self, step, stats, metrics, histograms=None):
        """Store one step (graph code, inside the train step).

        Args:
            step: int64 scalar, the 1-based optimizer step.
            stats: float32 `[rows, len(ROW_COLUMNS)]`.
            metrics: float32 `[len(STEP_METRICS)]`.
            histograms: float32 `[rows, HISTOGRAM_BINS]` or `None`.
        """
        slot = tf.math.floormod(step - 1, self.capacity)
        _write_slot(self.stats, slot, stats)
        _write_slot(self.metrics, slot, metrics)
        if self.histograms is not None:
            _write_slot(self.histograms, slot, histograms)
        # Written last: a slot's step says its other values are complete.
        _write_slot(self.steps, slot, step)

    def read(self, after_step, final_step=None):
        """Return the records newer than `after_step`, oldest first (eager).

        `final_step` is accepted for the deferred ring's sake and not used:
        this ring's statistics were computed in the step, so there is no
        read to compile.

        Returns:
            A tuple `(steps, stats, metrics, histograms)` of numpy arrays with
            the records on the first axis; `histograms` is `None` when the
            ring keeps none.
        """
        steps = self.steps.numpy()
        fresh = np.flatnonzero(steps > after_step)
        if fresh.size == 0:
            return steps[:0], None, None, None
        fresh = fresh[np.argsort(steps[fresh])]
        stats = self.stats.numpy()[fresh]
        metrics = self.metrics.numpy()[fresh]
        histograms = None if self.histograms is None else self.histograms.numpy()[fresh]
        return steps[fresh], stats, metrics, histograms
