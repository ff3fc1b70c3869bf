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


def _pad_rows(per_tensor, n):
    """Sorted segment ops stop at the last non-empty tensor; add trailing rows."""
    missing = n - tf.shape(per_tensor)[0]
    padding = [[0, missing]] + [[0, 0]] * (per_tensor.shape.rank - 1)
    return tf.pad(per_tensor, padding)


def _segment_sums(columns, ids, n):
    """Per-tensor sums of several per-entry columns in one op.

    `ids` are sorted by construction, so the sorted `segment_sum` applies:
    on CPU it is several times faster than `unsorted_segment_sum`.
    """
    sums = tf.math.segment_sum(tf.stack(columns, axis=1), ids)
    return tf.unstack(_pad_rows(sums, n), num=len(columns), axis=1)


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
    nan_count, nonfinite, square_sum, abs_sum, value_sum, zero_count = _segment_sums(
        [
            tf.cast(tf.math.is_nan(values), tf.float32),
            tf.cast(tf.logical_not(finite), tf.float32),
            tf.square(values),
            magnitude,
            values,
            tf.cast(tf.equal(values, 0.0), tf.float32),
        ],
        ids,
        n,
    )
    # Sorted segment max gives 0 for an empty tensor. It does not promise to
    # propagate NaN; make that explicit.
    max_abs = _pad_rows(tf.math.segment_max(magnitude, ids), n)
    max_abs = tf.where(nan_count > 0, tf.fill([n], float("nan")), max_abs)
    l2_norm = tf.sqrt(square_sum)
    mean_abs = abs_sum / count
    # Two passes for the variance, as E[g^2] - E[g]^2 cancels badly in
    # float32; the second pass also sums the deviations, which corrects the
    # rounding error of the mean (the "corrected two-pass" algorithm), so
    # entries sharing a large offset (2e3 +- 1e-2) keep their std.
    centered = values - tf.gather(value_sum / count, ids)
    deviation_square, deviation = _segment_sums([tf.square(centered), centered], ids, n)
    variance = (deviation_square - tf.square(deviation) / count) / count
    std = tf.sqrt(tf.where(variance < 0.0, 0.0, variance))  # keeps NaN
    zero_fraction = zero_count / count
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
