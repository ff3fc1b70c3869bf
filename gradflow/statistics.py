"""The one statistics kernel of gradflow.

Every per-tensor statistic in gradflow (snapshot, monitor, runner) comes from
`summarize`, written to run inside `tf.function`.

Tensors of the same shape are stacked and reduced together, over every axis
but the first: a 20-layer MLP has forty weight tensors but only a handful of
shapes, so the kernel adds a few dozen ops to a train step instead of
hundreds. On CPU that matters more than anything else, since each small op
costs microseconds to dispatch. An earlier version flattened everything into
one vector and used segment operations; those kernels are single-threaded on
CPU and the concatenation copies every entry, which made it slower still.
Measured with `python3 bench/bench_statistics.py`.
"""

import tensorflow as tf

from gradflow import schema

_NAN = float("nan")


def _dense_float(tensor):
    if isinstance(tensor, tf.IndexedSlices):
        # Embedding gradients: the implicit zeros count too.
        tensor = tf.convert_to_tensor(tensor)
    return tf.cast(tensor, tf.float32)


def _rows(stacked):
    """View a `[k, ...]` stack as `[k, entries]` (a scalar gets one entry)."""
    return tf.reshape(stacked, [tf.shape(stacked)[0], -1])


def _stacked_statistics(stacked):
    """The six statistics of each tensor of a `[k, ...]` stack: `[k, 6]`."""
    values = _rows(stacked)
    size = tf.cast(tf.shape(values)[1], tf.float32)
    count = tf.maximum(size, 1.0)
    magnitude = tf.abs(values)
    total = tf.reduce_sum(values, axis=1)
    l2_norm = tf.sqrt(tf.reduce_sum(tf.square(values), axis=1))
    # An empty tensor's max is -inf; entries are >= 0, so clamping at 0 reports
    # 0 for it and changes nothing else (no branch: a cond is slow).
    max_abs = tf.maximum(tf.reduce_max(magnitude, axis=1), 0.0)
    # reduce_max does not promise to propagate NaN; the sum of squares does.
    max_abs = tf.where(tf.math.is_nan(l2_norm), _NAN, max_abs)
    # The corrected two-pass variance: E[g^2] - E[g]^2 cancels badly in
    # float32, and subtracting the summed deviations also corrects the
    # rounding of the mean, so entries sharing a large offset (2e3 +- 1e-2)
    # keep their std.
    centered = values - (total / count)[:, tf.newaxis]
    deviation = tf.reduce_sum(centered, axis=1)
    variance = (tf.reduce_sum(tf.square(centered), axis=1) - tf.square(deviation) / count) / count
    std = tf.sqrt(tf.where(variance < 0.0, 0.0, variance))  # keeps NaN
    zeros = size - tf.cast(tf.math.count_nonzero(values, axis=1), tf.float32)
    nonfinite = size - tf.cast(tf.math.count_nonzero(tf.math.is_finite(values), axis=1), tf.float32)
    mean_abs = tf.reduce_sum(magnitude, axis=1) / count
    return tf.stack([max_abs, l2_norm, mean_abs, std, zeros / count, nonfinite], axis=1)


class Stacked(list):
    """One stack per shape group, made by `ShapeGroups.stack`; `.groups` is that `ShapeGroups`."""

    def __init__(self, stacks, groups):
        super().__init__(stacks)
        self.groups = groups


class ShapeGroups:
    """Tensors of one shape stacked together, so that one op reduces all of them.

    Args:
        shapes: The static shapes of the tensors, in order. A shape with an
            unknown dimension gets a group of its own.
    """

    def __init__(self, shapes):
        groups = {}
        for index, shape in enumerate(shapes):
            shape = tf.TensorShape(shape)
            key = tuple(shape.as_list()) if shape.is_fully_defined() else ("dynamic", index)
            groups.setdefault(key, []).append(index)
        self.groups = list(groups.values())
        self.count = len(shapes)
        order = [index for group in self.groups for index in group]
        # Where each tensor's row lands in the concatenated group results.
        self._position = None if order == sorted(order) else sorted(range(len(order)), key=order.__getitem__)

    def stack(self, tensors):
        """One `[k, ...]` stack per group (a copy of the values)."""
        return Stacked([tf.stack([tensors[i] for i in group]) for group in self.groups], self)

    def rows(self, per_group):
        """Concatenate one result per group back into the tensors' order."""
        joined = tf.concat(per_group, axis=0) if len(per_group) > 1 else per_group[0]
        return joined if self._position is None else tf.gather(joined, self._position)

    def l2_norms(self, stacks):
        return self.rows([tf.sqrt(tf.reduce_sum(tf.square(_rows(s)), axis=1)) for s in stacks])

    def max_abs(self, stacks):
        return self.rows([_stacked_max_abs(s) for s in stacks])


def _stacked_max_abs(stacked):
    rows = _rows(stacked)
    largest = tf.maximum(tf.reduce_max(tf.abs(rows), axis=1), 0.0)
    return tf.where(tf.reduce_any(tf.math.is_nan(rows), axis=1), _NAN, largest)


def by_shape(tensors, reduce_stack):
    """Apply `reduce_stack` to same-shaped tensors stacked together; keep the input order.

    Args:
        tensors: A list of tensors.
        reduce_stack: A function from a `[k, ...]` stack to a `[k, ...]`
            result (one row per tensor).

    Returns:
        The rows for `tensors`, in their order, stacked on the first axis.
    """
    groups = ShapeGroups([t.shape for t in tensors])
    return groups.rows([reduce_stack(stacked) for stacked in groups.stack(tensors)])


def summarize(tensors, histogram=False):
    """Compute gradflow's statistics for each tensor of a list.

    Example:

    >>> import tensorflow as tf
    >>> stats, _ = summarize([tf.constant([3.0, -4.0]), tf.zeros([2, 2])])
    >>> stats.numpy()[0].tolist()
    [4.0, 5.0, 3.5, 3.5, 0.0, 0.0]

    Args:
        tensors: A non-empty list of tensors (or `tf.IndexedSlices`) of any
            shapes and float dtypes.
        histogram: Whether to also count log10|g| into the fixed bins of
            `gradflow.schema` (costs one log per entry). Defaults to `False`.

    Returns:
        A tuple `(statistics, histograms)`: `statistics` is a float32 tensor of
        shape `[len(tensors), len(schema.STATISTICS)]`, columns in the order of
        `schema.STATISTICS`; `histograms` is a float32 tensor of shape
        `[len(tensors), schema.HISTOGRAM_BINS]` of counts, or `None`.

    Raises:
        ValueError: if `tensors` is empty.
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("`tensors` must hold at least one tensor, got an empty list.")
    dense = [_dense_float(tensor) for tensor in tensors]
    statistics = by_shape(dense, _stacked_statistics)
    histograms = tf.stack([_log_histogram(values) for values in dense]) if histogram else None
    return statistics, histograms


def _log_histogram(values):
    bins = schema.HISTOGRAM_BINS
    values = tf.reshape(values, [-1])
    finite = tf.math.is_finite(values)
    magnitude = tf.abs(tf.where(finite, values, 0.0))
    log_magnitude = tf.math.log(magnitude) / tf.math.log(10.0)
    # log10(0) is -inf; clipping sends it (and every underflow) to bin 0.
    log_magnitude = tf.clip_by_value(
        log_magnitude, schema.HISTOGRAM_LOW - 1.0, schema.HISTOGRAM_HIGH + 1.0
    )
    position = tf.floor((log_magnitude - schema.HISTOGRAM_LOW) / schema.HISTOGRAM_BIN_WIDTH) + 1.0
    position = tf.cast(tf.clip_by_value(position, 0.0, bins - 1.0), tf.int32)
    # Non-finite entries are counted in `nonfinite`, not binned.
    return tf.math.bincount(
        position, weights=tf.cast(finite, tf.float32), minlength=bins, maxlength=bins, dtype=tf.float32
    )
