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
# Tensors with at least this many entries are reduced on their own: stacking
# copies them, which costs more than the ops it saves.
_ALONE_FROM = 1 << 16
# Groups above this many entries count NaN/Inf only when there is one.
_BRANCH_ABOVE = 1 << 16


def _dense_float(tensor):
    if isinstance(tensor, tf.IndexedSlices):
        # Embedding gradients: the implicit zeros count too.
        tensor = tf.convert_to_tensor(tensor)
    return tf.cast(tensor, tf.float32)


def _rows(stacked):
    """View a `[k, ...]` stack as `[k, entries]` (a scalar gets one entry)."""
    return tf.reshape(stacked, [tf.shape(stacked)[0], -1])


def _stacked_statistics(stacked):
    """The six statistics of each tensor of a `[k, ...]` stack: `[k, 6]`.

    Written for few passes over the entries and few full-size temporaries,
    which is what a large tensor costs: one `|g|`, one `(g - mean)^2` and one
    zero mask. Everything else comes from reductions of those and of `g`.
    """
    values = _rows(stacked)
    size = tf.cast(tf.shape(values)[1], tf.float32)
    count = tf.maximum(size, 1.0)
    total = tf.reduce_sum(values, axis=1)
    mean = total / count
    magnitude = tf.abs(values)
    sum_abs = tf.reduce_sum(magnitude, axis=1)
    # Two-pass variance around the (rounded) mean: E[g^2] - E[g]^2 cancels
    # badly in float32 when entries share a large offset (2e3 +- 1e-2).
    deviations = tf.reduce_sum(tf.math.squared_difference(values, mean[:, tf.newaxis]), axis=1)
    # sum |g| is NaN exactly when an entry is NaN, and finite exactly when
    # every entry is finite (an overflowing sum overflows sum g^2 too).
    has_nan = tf.math.is_nan(sum_abs)
    all_finite = tf.math.is_finite(sum_abs)
    # sum g^2 = sum (g - mean)^2 + n mean^2: both terms are >= 0, so no
    # cancellation, and no pass of its own.
    l2_norm = tf.sqrt(deviations + size * tf.square(mean))
    l2_norm = tf.where(all_finite, l2_norm, tf.where(has_nan, _NAN, float("inf")))
    # An empty tensor's max is -inf; entries are >= 0, so clamping at 0 reports
    # 0 for it and changes nothing else (no branch: a cond is slow).
    # reduce_max does not promise to propagate NaN; sum |g| does.
    max_abs = tf.where(has_nan, _NAN, tf.maximum(tf.reduce_max(magnitude, axis=1), 0.0))
    std = tf.sqrt(deviations / count)  # keeps NaN
    zeros = tf.cast(tf.reduce_sum(tf.cast(tf.equal(values, 0.0), tf.int32), axis=1), tf.float32)
    nonfinite = _nonfinite_counts(values, all_finite)
    mean_abs = sum_abs / count
    return tf.stack([max_abs, l2_norm, mean_abs, std, zeros / count, nonfinite], axis=1)


def _nonfinite_counts(values, all_finite):
    """NaN/Inf entries per row; counted only when some row has one.

    A healthy step skips the count (one cheap branch instead of a pass over
    every entry): a finite sum of |g| already proves every entry finite.
    """

    def count():
        finite = tf.reduce_sum(tf.cast(tf.math.is_finite(values), tf.int32), axis=1)
        return tf.cast(tf.shape(values)[1] - finite, tf.float32)

    rows = tf.shape(values)[0]
    if values.shape.num_elements() is not None and values.shape.num_elements() <= _BRANCH_ABOVE:
        return count()  # small: counting costs less than a branch
    return tf.cond(
        tf.reduce_all(all_finite), lambda: tf.zeros([rows], tf.float32), count
    )


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
            alone = not shape.is_fully_defined() or shape.num_elements() >= _ALONE_FROM
            key = ("alone", index) if alone else tuple(shape.as_list())
            groups.setdefault(key, []).append(index)
        self.groups = list(groups.values())
        self.count = len(shapes)
        order = [index for group in self.groups for index in group]
        # Where each tensor's row lands in the concatenated group results.
        self._position = None if order == sorted(order) else sorted(range(len(order)), key=order.__getitem__)

    def stack(self, tensors):
        """One `[k, ...]` stack per group (a copy of the values, except for a group of one)."""
        return Stacked([_stack([tensors[i] for i in group]) for group in self.groups], self)

    def rows(self, per_group):
        """Concatenate one result per group back into the tensors' order."""
        joined = tf.concat(per_group, axis=0) if len(per_group) > 1 else per_group[0]
        return joined if self._position is None else tf.gather(joined, self._position)

    def l2_norms(self, stacks):
        return self.rows([_stacked_l2_norms(s) for s in stacks])

    def max_abs(self, stacks):
        return self.rows([_stacked_max_abs(s) for s in stacks])


def _stack(tensors):
    # A group of one needs no copy: add the leading axis instead.
    return tensors[0][tf.newaxis] if len(tensors) == 1 else tf.stack(tensors)


def _stacked_l2_norms(stacked):
    if stacked.shape[0] == 1:
        # One fused pass, no temporary the size of the tensor.
        return tf.sqrt(2.0 * tf.nn.l2_loss(stacked))[tf.newaxis]
    return tf.sqrt(tf.reduce_sum(tf.square(_rows(stacked)), axis=1))


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
