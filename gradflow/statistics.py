"""The one statistics kernel of gradflow.

Every per-tensor statistic in gradflow (snapshot, monitor, runner) comes from
`summarize`, written to run inside `tf.function`.

Each tensor is reduced on its own with whole-tensor reductions. An earlier
version flattened all tensors into one vector and used segment operations to
keep the op count constant; on CPU that was 3-4x slower (segment kernels are
single-threaded and the concatenation copies every entry), while independent
whole-tensor reductions use Eigen's fast paths and run in parallel in the
graph executor. Measured with `python3 bench/bench_statistics.py`.
"""

import tensorflow as tf

from gradflow import schema

_NAN = float("nan")


def _dense_float(tensor):
    if isinstance(tensor, tf.IndexedSlices):
        # Embedding gradients: the implicit zeros count too.
        tensor = tf.convert_to_tensor(tensor)
    return tf.cast(tensor, tf.float32)


def _tensor_statistics(values):
    """The six statistics of one tensor, as a float32 vector in `schema.STATISTICS` order."""
    size = tf.cast(tf.size(values), tf.float32)
    count = tf.maximum(size, 1.0)
    magnitude = tf.abs(values)
    total = tf.reduce_sum(values)
    square_sum = tf.reduce_sum(tf.square(values))
    # An empty tensor's max is -inf; entries are >= 0, so clamping at 0 reports
    # 0 for it and changes nothing else (no branch: a cond per tensor is slow).
    max_abs = tf.maximum(tf.reduce_max(magnitude), 0.0)
    l2_norm = tf.sqrt(square_sum)
    # reduce_max does not promise to propagate NaN; the sum of squares does.
    max_abs = tf.where(tf.math.is_nan(l2_norm), _NAN, max_abs)
    # The corrected two-pass variance: E[g^2] - E[g]^2 cancels badly in
    # float32, and subtracting the summed deviations also corrects the
    # rounding of the mean, so entries sharing a large offset (2e3 +- 1e-2)
    # keep their std.
    centered = values - total / count
    deviation = tf.reduce_sum(centered)
    variance = (tf.reduce_sum(tf.square(centered)) - tf.square(deviation) / count) / count
    std = tf.sqrt(tf.where(variance < 0.0, 0.0, variance))  # keeps NaN
    zeros = size - tf.cast(tf.math.count_nonzero(values), tf.float32)
    nonfinite = size - tf.cast(tf.math.count_nonzero(tf.math.is_finite(values)), tf.float32)
    return tf.stack(
        [max_abs, l2_norm, tf.reduce_sum(magnitude) / count, std, zeros / count, nonfinite]
    )


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
    statistics = tf.stack([_tensor_statistics(values) for values in dense])
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
