"""The one statistics kernel of gradflow.

Every per-tensor statistic in gradflow (snapshot, monitor, runner) comes from
`summarize`. It flattens a list of tensors into one vector and reduces it with
segment operations, so the cost in ops does not grow with the number of
layers: a 100-layer model adds the same dozen ops to a compiled train step as
a 2-layer one. It is written to run inside `tf.function`.
"""

import tensorflow as tf

from gradflow import schema


def _flatten(tensors):
    """One float32 vector of all entries, the segment id of each, and sizes."""
    flats = []
    for tensor in tensors:
        if isinstance(tensor, tf.IndexedSlices):
            # Embedding gradients: the implicit zeros count too.
            tensor = tf.convert_to_tensor(tensor)
        flats.append(tf.reshape(tf.cast(tensor, tf.float32), [-1]))
    sizes = tf.stack([tf.size(f) for f in flats])
    values = tf.concat(flats, axis=0)
    segment_ids = tf.repeat(tf.range(len(flats)), sizes)
    return values, segment_ids, tf.cast(sizes, tf.float32)


def _first_entries(values, sizes):
    """The first entry of each tensor (0 for an empty or non-finite one)."""
    starts = tf.cast(tf.cumsum(sizes, exclusive=True), tf.int32)
    padded = tf.concat([values, tf.zeros([1])], axis=0)
    first = tf.gather(padded, tf.minimum(starts, tf.size(values)))
    first = tf.where(sizes > 0, first, 0.0)
    return tf.where(tf.math.is_finite(first), first, 0.0)


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
    n = len(tensors)
    values, ids, sizes = _flatten(tensors)
    count = tf.maximum(sizes, 1.0)
    magnitude = tf.abs(values)
    finite = tf.math.is_finite(values)
    nan_count = tf.math.unsorted_segment_sum(
        tf.cast(tf.math.is_nan(values), tf.float32), ids, n
    )
    nonfinite = tf.math.unsorted_segment_sum(
        tf.cast(tf.logical_not(finite), tf.float32), ids, n
    )
    # Segment max does not promise to propagate NaN; make it explicit. An
    # empty segment's max is the lowest float: an empty tensor reports 0.
    max_abs = tf.math.unsorted_segment_max(magnitude, ids, n)
    max_abs = tf.where(sizes > 0, max_abs, 0.0)
    max_abs = tf.where(nan_count > 0, tf.fill([n], float("nan")), max_abs)
    l2_norm = tf.sqrt(tf.math.unsorted_segment_sum(tf.square(values), ids, n))
    mean_abs = tf.math.unsorted_segment_sum(magnitude, ids, n) / count
    # Two passes for the variance: E[g^2] - E[g]^2 cancels badly in float32.
    # Shifting each tensor by its first entry first keeps the mean's rounding
    # error small when the entries share a large offset (1e3 +- 1e-2).
    shift = _first_entries(values, sizes)
    shifted = values - tf.gather(shift, ids)
    mean = tf.math.unsorted_segment_sum(shifted, ids, n) / count
    centered = shifted - tf.gather(mean, ids)
    std = tf.sqrt(tf.math.unsorted_segment_sum(tf.square(centered), ids, n) / count)
    zero_fraction = (
        tf.math.unsorted_segment_sum(tf.cast(tf.equal(values, 0.0), tf.float32), ids, n)
        / count
    )
    statistics = tf.stack(
        [max_abs, l2_norm, mean_abs, std, zero_fraction, nonfinite], axis=1
    )
    histograms = _log_histograms(magnitude, finite, ids, n) if histogram else None
    return statistics, histograms


def _log_histograms(magnitude, finite, ids, n):
    bins = schema.HISTOGRAM_BINS
    log_magnitude = tf.math.log(tf.where(finite, magnitude, 0.0)) / tf.math.log(10.0)
    # log10(0) is -inf; clipping sends it (and every underflow) to bin 0.
    log_magnitude = tf.clip_by_value(
        log_magnitude, schema.HISTOGRAM_LOW - 1.0, schema.HISTOGRAM_HIGH + 1.0
    )
    position = tf.floor(
        (log_magnitude - schema.HISTOGRAM_LOW) / schema.HISTOGRAM_BIN_WIDTH
    ) + 1.0
    position = tf.cast(tf.clip_by_value(position, 0.0, bins - 1.0), tf.int32)
    counts = tf.math.unsorted_segment_sum(
        tf.cast(finite, tf.float32), ids * bins + position, n * bins
    )
    return tf.reshape(counts, [n, bins])
