"""The one statistics kernel of gradflow.

Every per-tensor statistic in gradflow (snapshot, monitor, runner) comes from
`summarize`, written to run inside `tf.function`. One twin:
`summarize_rows_numpy`, the same definitions in NumPy for the monitor's
deferred reads that would not repay compiling (held equal to the TensorFlow
kernel by `tests/test_statistics.py`, NaN, Inf and subnormals included).

Tensors of the same shape are stacked and reduced together, over every axis
but the first: a 20-layer MLP has forty weight tensors but only a handful of
shapes. Each shape group takes only the reductions that need a pass over its
entries (`_raw_sums`); the arithmetic that turns sums into statistics runs
once, on the rows of every group joined (`_finish`). So the kernel adds about
fifteen ops per distinct shape to a train step, not dozens per tensor. On CPU that matters more than anything else, since each small op
costs microseconds to dispatch. An earlier version flattened everything into
one vector and used segment operations; those kernels are single-threaded on
CPU and the concatenation copies every entry, which made it slower still.
Measured with `python3 bench/bench_statistics.py`.

The sums are float32, as the gradients are. Squares leave float32's range
for entries below about 1e-19 (they flush to zero) or above about 1.8e19, and
the gradients of a 30-layer sigmoid net's first layers are about 1e-20: so
the spread is summed in units of max|g| (times the power of two of 1/max|g|,
exact) and the L2 norm and std are scaled back after the square root
(`_norm_scale`). Only a norm beyond float32 itself (3.4e38) reads +inf for
finite entries (`nonfinite` stays 0, which tells the two apart);
`gradflow.diagnose` reports such a layer as exploding.

Layer outputs (activation gradients) have a first dimension that is unknown
while the step is traced, so they cannot be stacked safely; those with rows
of equal size are joined along the first axis instead, and only their
per-row sums go through segment ops (`_raw_sums_of_batches`).
"""

import collections

import numpy as np
import tensorflow as tf

from gradflow import schema

_NAN = float("nan")
# Tensors with at least this many entries are reduced on their own: stacking
# copies them, which costs more than the ops it saves.
_ALONE_FROM = 1 << 16
# Groups above this many entries take one branch: when every entry is
# finite and the mean is small against the spread (nearly always), the
# variance follows from sum g^2 and nothing is counted; otherwise NaN/Inf are
# counted and the variance takes a second pass. On the 2-core CPU 18 stacked
# 64x64 kernels (73,728 entries) were 0-0.1 ms a step faster counted than
# branched, when the branch skipped only the count; with the variance too,
# the 512x512 kernels of the large MLPs (2^18 entries, reduced alone) gained
# about 0.5 ms a step on the 5-layer one and 0.6-1.1 ms on the 20-layer one
# (`bench_monitor_step.py --size large --baseline`, 2^17 against 2^18).
_BRANCH_ABOVE = 1 << 17
# The one-pass variance, sum g^2 - n mean^2, loses to rounding about
# 1e-7 x sum g^2 (float32 sums). Where the variance is at least this share of
# sum g^2 (|mean| <= 4.4 std), that is under 1e-5 of the std.
_ONE_PASS_SHARE = 0.05
# Layer outputs have an unknown batch dimension while the step is traced:
# their group's size is judged by this many rows. (At 32, the small CNN's
# outputs, 6,200 entries a row, branched and were no faster for it.)
_BATCH_GUESS = 16
# Counting a mask (zeros, finite entries) in float32 writes 4 bytes an entry
# and reads them back. A large one is counted in uint8 blocks of at most this
# many entries (a block's count fits in a byte), then the blocks in float32:
# 0.085 ms instead of 0.13 ms per 2^18 entries on one core (a third of a
# large tensor's statistics went to its zero count; in a whole train step
# the gain is within this machine's noise, docs/architecture.md). Small masks
# keep the three-op count: on them the block's two extra ops would weigh more
# than the bytes they save (not measured).
_BLOCK_AT_MOST = 255
_BLOCK_AT_LEAST = 32


def _dense_float(tensor):
    if isinstance(tensor, tf.IndexedSlices):
        # Embedding gradients: the implicit zeros count too.
        tensor = tf.convert_to_tensor(tensor)
    return tf.cast(tensor, tf.float32)


def _rows(stacked):
    """View a `[k, ...]` stack as `[k, entries]` (a scalar gets one entry)."""
    if stacked.shape.rank == 2:
        return stacked
    entries = stacked.shape[1:].num_elements()
    if entries is None:
        return tf.reshape(stacked, [tf.shape(stacked)[0], -1])
    return tf.reshape(stacked, [stacked.shape[0], entries])


def _entries(rows):
    """Entries per row of `[k, entries]`, as float32 `[k, 1]` (a constant when known)."""
    if rows.shape[1] is not None and rows.shape[0] is not None:
        return tf.constant(float(rows.shape[1]), shape=[rows.shape[0], 1])
    return tf.fill([tf.shape(rows)[0], 1], tf.cast(tf.shape(rows)[1], tf.float32))


# The columns of `_raw_sums`, reduced per group and finished once for all.
# `deviations` is sum ((g - mean) * scale)^2, `scale` from `_norm_scale`.
_RAW = ("entries", "total", "sum_abs", "deviations", "max_abs", "zeros", "nonfinite", "scale")
# Where every tensor's max |g| lies in [1 / _SAFE, _SAFE], sum g^2 and the
# one-pass variance lose nothing to float32's range: squares of entries
# under 1e-19 flush to zero, and those add at most entries x 1e-38 to a sum
# of at least 1e-24 (1e-8 of it even for 10^6 entries).
_SAFE = 1e12
# float32 bits: the exponent field, and 254 << 23, whose difference with a
# float's exponent field is the field of 1 / (its power of two).
_EXPONENT_BITS = 0x7F800000
_ONE_SQUARED_BITS = 254 << 23
_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)
# A finite float32 sum of n squares of at least n x this lost under 2^-20
# (1e-6) of itself to float32's range: each square under 2^-126 (1.2e-38)
# may flush to zero. Sums below (zero included) are taken again in float64
# (`exact_l2_norms`). Relative to n, not one bound: the bias of a Dense
# before a BatchNormalization gets gradients of about 1e-9 and under SGD
# stays near 1e-11 (sums of squares of 1e-20), which is exact enough and
# should not pay for float64 at every step.
_EXACT_SQUARES_PER_ENTRY = 2.0**-106


def _norm_scale(max_abs):
    """The power of two that brings max|g| into [1, 2) (per row); in [2^-126, 2^126].

    Multiplying by it before squaring keeps the squares of a tensor's largest
    entries near 1, inside float32's range whatever the gradients' size. A
    power of two, so the product is exact: `(g - mean)` of entries that share
    a large offset (2e3 +- 1e-2) would otherwise lose their spread to the
    product's rounding. Its exponent is the float's own, read off its bits,
    in six small ops (once per call for every shape group: `_raw_sums_by_shape`).
    Zero gets 2^126 (its entries are all zero), Inf 2^-126 (its row is
    non-finite anyway).
    """
    clamped = tf.clip_by_value(max_abs, _SMALLEST_NORMAL, 2.0**126)
    exponent = tf.bitwise.bitwise_and(tf.bitcast(clamped, tf.int32), _EXPONENT_BITS)
    return tf.bitcast(_ONE_SQUARED_BITS - exponent, tf.float32)


def _norm_scale_numpy(max_abs):
    """`_norm_scale` of a float32 array."""
    clamped = np.clip(max_abs, _SMALLEST_NORMAL, np.float32(2.0**126)).astype(np.float32)
    exponent = np.bitwise_and(clamped.view(np.int32), _EXPONENT_BITS)
    return (np.int32(_ONE_SQUARED_BITS) - exponent).astype(np.int32).view(np.float32)


def _raw_sums(stacked, fused=False):
    """The reductions behind the statistics of each tensor of a `[k, ...]` stack: `[k, 8]`.

    `fused`: whether sum g^2 may come from `sum_of_squares(fused=True)`,
    which XLA cannot compile (see there).

    Only what needs a pass over the entries happens here, per shape group;
    `_finish` turns the rows of every group into statistics at once, so the
    per-group op count stays small (every reduction keeps its axis, so the
    columns join without reshapes). Written for few passes and few
    full-size temporaries, which is what a large tensor costs: one `|g|`,
    one zero mask, and one `(g - mean)^2` where the variance takes its
    second pass (`_deviations_and_nonfinite`).
    """
    first = _first_pass(stacked)
    return _second_pass(first, _norm_scale(first.max_abs), fused)


class _FirstPass(
    collections.namedtuple(
        "_FirstPass", ["values", "entries", "total", "mean", "sum_abs", "max_abs", "zeros"]
    )
):
    """The sums of `_raw_sums` that need no scale, each `[k, 1]` (`values`: `[k, entries]`)."""


def _first_pass(stacked):
    values = _rows(stacked)
    entries = _entries(values)
    total = tf.reduce_sum(values, axis=1, keepdims=True)
    mean = total / tf.maximum(entries, 1.0)
    magnitude = tf.abs(values)
    sum_abs = tf.reduce_sum(magnitude, axis=1, keepdims=True)
    # reduce_max does not promise to propagate NaN; `_finish` uses sum |g|.
    max_abs = tf.reduce_max(magnitude, axis=1, keepdims=True)
    zeros = _count_per_row(tf.equal(values, 0.0), keepdims=True)
    return _FirstPass(values, entries, total, mean, sum_abs, max_abs, zeros)


def _second_pass(first, scale, fused=False):
    """The `[k, 8]` rows of `_raw_sums` from `_first_pass` and the rows' `_norm_scale`."""
    deviations, nonfinite = _deviations_and_nonfinite(
        first.values, first.entries, first.mean, first.sum_abs, fused, first.max_abs, scale
    )
    return tf.concat(
        [first.entries, first.total, first.sum_abs, deviations, first.max_abs, first.zeros]
        + [nonfinite, scale],
        axis=1,
    )


def _raw_sums_by_shape(tensors):
    """`_raw_sums` of tensors stacked by shape, in their order: `[len(tensors), 8]`.

    One `_norm_scale` for the rows of every group (a concat and a split)
    instead of its six small ops per group: on a small model each op costs
    the step more than the bytes it reads (the 20-layer MLP has five groups).
    """
    groups = ShapeGroups([t.shape for t in tensors])
    firsts = [_first_pass(stacked) for stacked in groups.stack(tensors)]
    counts = [first.max_abs.shape[0] for first in firsts]
    if len(firsts) == 1 or None in counts:
        scales = [_norm_scale(first.max_abs) for first in firsts]
    else:
        joined = tf.concat([first.max_abs for first in firsts], axis=0)
        scales = tf.split(_norm_scale(joined), counts, axis=0)
    return groups.rows([_second_pass(f, s) for f, s in zip(firsts, scales, strict=True)])


def _deviations_and_nonfinite(values, entries, mean, sum_abs, fused, max_abs, scale):
    """sum ((g - mean) * scale)^2 and the NaN/Inf count of each row of `[k, entries]`.

    Small groups take two passes, no branch. A large one takes a branch:
    when every entry is finite (a finite sum |g| proves it) and the mean is
    small against the spread, the variance comes from sum g^2
    (`sum_of_squares`: without the broadcast `squared_difference` and its
    temporary, 0.8 ms instead of 1.4 ms on 1.6M entries, or 0.5 ms fused)
    and there is nothing to count; otherwise both take their own pass.
    """

    def exact():
        return _two_pass_deviations(values, mean, scale), _nonfinite_counts(values)

    size = values.shape.num_elements()
    if size is not None and size <= _BRANCH_ABOVE:
        return exact()
    squares = sum_of_squares(values, fused)[:, tf.newaxis]
    return _one_pass_unless_unsafe(squares, entries, mean, sum_abs, max_abs, scale, exact)


def _one_pass_unless_unsafe(squares, entries, mean, sum_abs, max_abs, scale, exact):
    """`((sum g^2 - n mean^2) * scale^2, no NaN/Inf)` per tensor, or `exact()` when that is unsafe.

    Safe when every entry is finite (a finite sum |g| proves it), every
    max |g| is within float32's safe range for squares (`_SAFE`) and every
    variance is at least `_ONE_PASS_SHARE` of its sum g^2. One branch for
    all the tensors given: the arguments are per-tensor columns of one shape.
    """
    one_pass = squares - entries * tf.square(mean)
    # All zeros: 0 >= 0, and the one-pass value is exact.
    holds = tf.logical_and(
        tf.reduce_all(tf.math.is_finite(sum_abs)),
        tf.reduce_all(one_pass >= _ONE_PASS_SHARE * squares),
    )
    holds = tf.logical_and(holds, tf.reduce_all(max_abs <= _SAFE))
    holds = tf.logical_and(holds, tf.reduce_all((max_abs >= 1.0 / _SAFE) | (max_abs == 0.0)))
    # Times the scale twice, not its square: a tensor of zeros has the scale
    # 2^126, whose square overflows, and 0 x inf read NaN (a dead layer's norm).
    return tf.cond(holds, lambda: (one_pass * scale * scale, tf.zeros_like(sum_abs)), exact)


def _two_pass_deviations(values, mean, scale):
    # Around the (rounded) mean: E[g^2] - E[g]^2 cancels badly in float32
    # when entries share a large offset (2e3 +- 1e-2). Scaled before the
    # square (`_norm_scale`).
    return tf.reduce_sum(
        tf.math.squared_difference(values * scale, mean * scale), axis=1, keepdims=True
    )


def _finish(raw):
    """`[n, 8]` rows of `_raw_sums` -> `[n, 6]` statistics (`schema.STATISTICS`)."""
    entries, total, sum_abs, deviations, max_abs, zeros, nonfinite, scale = tf.unstack(
        raw, num=len(_RAW), axis=1
    )
    count = tf.maximum(entries, 1.0)
    mean = total / count
    # sum |g| is NaN exactly when an entry is NaN, and finite exactly when
    # every entry is finite (an overflowing sum overflows sum g^2 too).
    has_nan = tf.math.is_nan(sum_abs)
    all_finite = tf.math.is_finite(sum_abs)
    # sum g^2 = sum (g - mean)^2 + n mean^2: both terms are >= 0, so no
    # cancellation, and no pass of its own.
    # In units of max |g| (`scale`): squares near 1, whatever the gradients' size.
    l2_norm = tf.sqrt(deviations + entries * tf.square(mean * scale)) / scale
    l2_norm = tf.where(all_finite, l2_norm, tf.where(has_nan, _NAN, float("inf")))
    # An empty tensor's max is -inf; entries are >= 0, so clamping at 0 reports
    # 0 for it and changes nothing else (no branch: a cond is slow).
    max_abs = tf.where(has_nan, _NAN, tf.maximum(max_abs, 0.0))
    std = tf.sqrt(deviations / count) / scale  # keeps NaN
    return tf.stack([max_abs, l2_norm, sum_abs / count, std, zeros / count, nonfinite], axis=1)


def _nonfinite_counts(values):
    """NaN/Inf entries per row of `[k, entries]`."""
    return _count_per_row(tf.logical_not(tf.math.is_finite(values)), keepdims=True)


def _count_per_row(mask, keepdims=False, rows_guess=None):
    """True entries per row of a boolean `[k, entries]` mask, as float32 `[k]` (or `[k, 1]`).

    A mask above `_BRANCH_ABOVE` entries whose rows split into blocks of
    `_BLOCK_AT_LEAST` to `_BLOCK_AT_MOST` entries is counted in uint8 per
    block first (see there). `rows_guess`: the rows to judge its size by
    when `k` is unknown.
    """
    width = mask.shape[1]
    rows = mask.shape[0] if mask.shape[0] is not None else rows_guess
    large = width is not None and rows is not None and rows * width > _BRANCH_ABOVE
    block = _block_size(width) if large else None
    if block is None:
        return tf.reduce_sum(tf.cast(mask, tf.float32), axis=1, keepdims=keepdims)
    blocks = tf.reshape(tf.cast(mask, tf.uint8), [-1, width // block, block])
    per_block = tf.reduce_sum(blocks, axis=2)
    return tf.reduce_sum(tf.cast(per_block, tf.float32), axis=1, keepdims=keepdims)


def _block_size(width):
    """The largest divisor of `width` in [`_BLOCK_AT_LEAST`, `_BLOCK_AT_MOST`], else None."""
    for block in range(min(width, _BLOCK_AT_MOST), _BLOCK_AT_LEAST - 1, -1):
        if width % block == 0:
            return block
    return None


def _in_order(rows, order, axis=0):
    """Rows computed in `order` (a permutation of tensor indices), put back in index order."""
    if order == sorted(order):
        return rows
    return tf.gather(rows, sorted(range(len(order)), key=order.__getitem__), axis=axis)


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
        self._alone = set()
        # Entries of each tensor, in order (1 for an unknown shape).
        self.entries = np.array(
            [tf.TensorShape(shape).num_elements() or 1 for shape in shapes], np.float64
        )
        for index, shape in enumerate(shapes):
            shape = tf.TensorShape(shape)
            if _alone(shape):
                self._alone.add(index)
                groups[("alone", index)] = [index]
            else:
                groups.setdefault(tuple(shape.as_list()), []).append(index)
        self.groups = list(groups.values())
        # The order in which the concatenated group results hold the tensors.
        self._order = [index for group in self.groups for index in group]

    def stack(self, tensors):
        """One `[k, entries]` stack per group (a copy for several tensors, a view for one)."""
        return Stacked([stack_rows([tensors[i] for i in group]) for group in self.groups], self)

    def is_large(self, group):
        """Whether a group holds a tensor reduced on its own for its size."""
        return group[0] in self._alone

    def rows(self, per_group, axis=0):
        """Concatenate one result per group back into the tensors' order (along `axis`)."""
        joined = tf.concat(per_group, axis=axis) if len(per_group) > 1 else per_group[0]
        return _in_order(joined, self._order, axis)

    def l2_norms(self, stacks):
        """float32 L2 norms of the tensors of `stacks`, exact over float32's normal range (`exact_l2_norms`)."""
        return exact_l2_norms(self.sums_of_squares, list(stacks), self.entries)

    def sums_of_squares(self, stacks):
        """`sum x^2` of the tensors of `stacks` (one per group), in the tensors' order."""
        return self.rows([sum_of_squares(s) for s in stacks])

    def max_abs(self, stacks):
        return self.rows([_stacked_max_abs(s) for s in stacks])


def zeros_where_missing(gradients, sources):
    """The gradients, with zeros for those `tape.gradient` gives as None.

    None means the loss does not depend on that source (a weight or a layer
    output). The kernel needs a tensor in every place; callers note which
    ones were None and leave their rows out of what they record.
    """
    return [
        tf.zeros_like(tf.convert_to_tensor(s)) if g is None else tf.convert_to_tensor(g)
        for g, s in zip(gradients, sources, strict=True)
    ]


def stack_rows(tensors):
    """Tensors of one shape as `[k, entries]` float32 rows (a copy for several, a view for one).

    A tensor of another float type (a float64 layer, `set_floatx("float64")`)
    is cast: one stack holds one type, and the statistics are float32.
    """
    tensors = [t if t.dtype == tf.float32 else tf.cast(t, tf.float32) for t in tensors]
    if len(tensors) == 1:
        return tf.reshape(tensors[0], [1, -1])  # no copy
    return _rows(tf.stack(tensors))


def _alone(shape):
    """Whether a tensor of `shape` is reduced on its own: large (a stack would copy it) or unknown."""
    return not shape.is_fully_defined() or shape.num_elements() >= _ALONE_FROM


def sum_of_squares(stacked, fused=False):
    """`sum g^2` of each row of a `[k, ...]` stack: `[k]`, in the stack's type.

    Args:
        stacked: A `[k, ...]` float tensor.
        fused: Whether to take one fused pass per row with no temporary
            (`reduce_euclidean_norm`, squared: about 0.5 ms instead of 0.8
            ms on 1.6M entries). XLA has no kernel for it, and Keras
            compiles the train step with XLA when a GPU is present, so only
            code that runs outside the step may ask for it (the deferred
            ring's read).
    """
    if stacked.shape[0] == 1 and _alone(stacked.shape[1:]):
        # One fused pass, no temporary the size of the tensor.
        return tf.reshape(2.0 * tf.nn.l2_loss(stacked), [1])
    if fused:
        return tf.square(tf.math.reduce_euclidean_norm(_rows(stacked), axis=1))
    return tf.reduce_sum(tf.square(_rows(stacked)), axis=1)


def _stacked_max_abs(stacked):
    rows = _rows(stacked)
    largest = tf.maximum(tf.reduce_max(tf.abs(rows), axis=1), 0.0)
    return tf.where(tf.reduce_any(tf.math.is_nan(rows), axis=1), _NAN, largest)


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
    statistics = _finish(_raw_sums_of(dense))
    histograms = tf.stack([_log_histogram(values) for values in dense]) if histogram else None
    return statistics, histograms


def _raw_sums_of(tensors):
    """`_raw_sums` rows of each tensor, in order: `[len(tensors), 8]`.

    Tensors whose first dimension alone is unknown (a model's layer outputs
    inside a train step: the first dimension is the batch) go through
    `_raw_sums_of_batches`; every other tensor goes by shape.
    """
    batches = [i for i, tensor in enumerate(tensors) if _batch_width(tensor.shape) is not None]
    if not batches:
        return _raw_sums_by_shape(tensors)
    if len(batches) == len(tensors):
        return _raw_sums_of_batches(tensors)
    taken = set(batches)
    others = [i for i in range(len(tensors)) if i not in taken]
    joined = tf.concat(
        [
            _raw_sums_by_shape([tensors[i] for i in others]),
            _raw_sums_of_batches([tensors[i] for i in batches]),
        ],
        axis=0,
    )
    return _in_order(joined, others + batches)  # the monitor's order: weights first


def _batch_width(shape):
    """Entries per row of a tensor whose first dimension alone is unknown, else None."""
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank < 1 or shape[0] is not None:
        return None
    rest = shape[1:]
    return rest.num_elements() if rest.is_fully_defined() else None


def _raw_sums_of_batches(tensors):
    """`_raw_sums` of tensors whose first dimension alone is unknown: `[k, 8]`.

    Stacking them would need equal first dimensions when the step runs,
    which holds only if every one is the batch (a `tf.boolean_mask` output
    is not), and each would otherwise be a shape group of its own, with a
    NaN/Inf branch. Instead tensors whose rows have the same size are joined
    along the first axis, which takes any lengths; each row of a join is reduced, and
    the rows are summed per tensor with segment ops on `[rows]` vectors,
    which are short. The op count grows by about fifteen per row width, not
    by thirty per tensor, and on CPU each op costs a small model's step
    microseconds.
    """
    count = len(tensors)
    widths = [_batch_width(tensor.shape) for tensor in tensors]
    by_width = {}
    for index, width in enumerate(widths):
        by_width.setdefault(width, []).append(index)
    # Rows are laid out width by width, tensor by tensor; row r belongs to
    # the tensor `order[ids[r]]`, and per-tensor results come in `order`.
    order = [index for members in by_width.values() for index in members]
    matrices = {
        i: tensors[i] if tensors[i].shape.rank == 2 else tf.reshape(tensors[i], [-1, widths[i]])
        for i in order
    }
    lengths = tf.stack(tf.shape_n([matrices[i] for i in order], out_type=tf.int32))[:, 0]
    ends = tf.cumsum(lengths)
    ids = tf.searchsorted(ends, tf.range(ends[-1]), side="right")

    # With many entries per batch row, one branch: when every entry is
    # finite and no mean is large against its spread (nearly always), the
    # variance comes from sum g^2 and nothing is counted, as in `_raw_sums`.
    branched = sum(widths) * _BATCH_GUESS > _BRANCH_ABOVE
    joins, row_sums, row_maxima = [], [], []
    for members in by_width.values():
        pieces = [matrices[i] for i in members]
        values = tf.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0]
        magnitude = tf.abs(values)
        row_sums.append(
            tf.stack(
                [
                    tf.reduce_sum(values, axis=1),
                    tf.reduce_sum(magnitude, axis=1),
                    _count_per_row(tf.equal(values, 0.0), rows_guess=_BATCH_GUESS),
                    tf.reduce_sum(tf.square(values), axis=1)
                    if branched
                    else _finite_per_row(values),
                ],
                axis=1,
            )
        )
        row_maxima.append(tf.reduce_max(magnitude, axis=1))
        joins.append(values)

    def rows(parts):
        return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]

    sums = tf.math.unsorted_segment_sum(rows(row_sums), ids, count)
    total, sum_abs, zeros, squares_or_finite = tf.unstack(sums, num=4, axis=1)
    entries = tf.cast(lengths, tf.float32) * tf.constant([float(widths[i]) for i in order])
    mean = total / tf.maximum(entries, 1.0)
    # An empty tensor's max is the lowest float; `_finish` clamps it at 0.
    max_abs = tf.math.unsorted_segment_max(rows(row_maxima), ids, count)
    scale = _norm_scale(max_abs)

    def exact():
        # Two-pass variance, as `_raw_sums`: every entry around its tensor's
        # mean (a rounded mean then errs only to second order). Each join's
        # rows take their tensors' means through their own slice of `ids`.
        if len(joins) == 1:
            join_ids = [ids]
        else:
            group = [g for g, members in enumerate(by_width.values()) for _ in members]
            join_rows = tf.math.segment_sum(lengths, tf.constant(group))
            join_ids = tf.split(ids, join_rows, num=len(joins))
        deviations = tf.math.unsorted_segment_sum(
            rows(
                [
                    tf.reduce_sum(
                        tf.math.squared_difference(
                            values * tf.gather(scale, part)[:, tf.newaxis],
                            tf.gather(mean * scale, part)[:, tf.newaxis],
                        ),
                        axis=1,
                    )
                    for values, part in zip(joins, join_ids, strict=True)
                ]
            ),
            ids,
            count,
        )
        finite = squares_or_finite
        if branched:
            finite = tf.math.unsorted_segment_sum(
                rows([_finite_per_row(values) for values in joins]), ids, count
            )
        return deviations, entries - finite

    if branched:
        deviations, nonfinite = _one_pass_unless_unsafe(
            squares_or_finite, entries, mean, sum_abs, max_abs, scale, exact
        )
    else:
        deviations, nonfinite = exact()
    raw = tf.stack([entries, total, sum_abs, deviations, max_abs, zeros, nonfinite, scale], axis=1)
    return _in_order(raw, order)


def _finite_per_row(values):
    return _count_per_row(tf.math.is_finite(values), rows_guess=_BATCH_GUESS)


def summarize_rows(rows, histogram=False):
    """`summarize` for the rows of one `[k, entries]` matrix: each row is one flattened tensor.

    The monitor's deferred path keeps many steps of one variable as rows of
    a matrix and summarizes them in one call, long after the step, outside
    XLA: so it may use the fused sum of squares (`sum_of_squares`).

    Args:
        rows: A float32 tensor of shape `[k, entries]`.
        histogram: Whether to also count log10|g| per row. Defaults to `False`.

    Returns:
        A tuple `(statistics, histograms)`: `[k, len(schema.STATISTICS)]` and
        `[k, schema.HISTOGRAM_BINS]` (or `None`).
    """
    statistics = _finish(_raw_sums(rows, fused=True))
    if not histogram:
        return statistics, None
    return statistics, _log_histogram(rows, per_row=True)


_TINY = np.finfo(np.float32).tiny


def summarize_rows_numpy(rows):
    """`summarize_rows` without histograms, in NumPy, for each row along the last axis.

    The deferred ring's read runs between two executions of the train step,
    outside any `tf.function`. Op by op, TensorFlow took 15-25 ms for the few
    hundred small ops of a read of 45 steps of the lab's MLP (25-50 us of
    dispatch each); compiled, 2 ms, after about 0.4 s of tracing and graph
    optimization. The same arithmetic in NumPy takes about 4 ms and compiles
    nothing, so a read that would not repay compiling runs here
    (`gradflow.monitor.deferred`). The definitions are those of `_raw_sums`
    and `_finish`, the large-group branch included (a Python `if` here);
    `tests/test_statistics.py` holds the two kernels equal.

    Args:
        rows: A float32 array `[..., entries]`; each row is one flattened
            tensor. A strided view is fine: nothing is copied whole.

    Returns:
        A float32 array `[..., len(schema.STATISTICS)]`, columns in the order
        of `schema.STATISTICS`.
    """
    values = np.asarray(rows, np.float32)
    entries = values.shape[-1]
    count = np.float32(max(entries, 1))
    with np.errstate(all="ignore"):  # NaN/Inf are data here, as in TensorFlow
        magnitude = np.abs(values)
        # TensorFlow's CPU kernels flush subnormal floats (below 1.2e-38) to
        # zero, and so count them as zeros; NumPy keeps them, so they are
        # counted here by size. NaN compares false, as with `== 0`.
        zeros = np.count_nonzero(magnitude < _TINY, axis=-1)
        # A row of nothing but zeros and subnormals sums to 0 there: the
        # deepest layers of a vanishing-gradient net must not differ between
        # the deferred and the in-step path.
        flushed = zeros == entries
        total = np.where(flushed, 0.0, values.sum(axis=-1)).astype(np.float32)
        mean = total / count
        sum_abs = np.where(flushed, 0.0, magnitude.sum(axis=-1)).astype(np.float32)
        # An empty row's max is 0, as `_finish` clamps it; NaN propagates.
        max_abs = magnitude.max(axis=-1, initial=0.0)
        max_abs = np.where(max_abs < _TINY, 0.0, max_abs).astype(np.float32)
        del magnitude
        # Rows whose squares fit float32 (nearly always) skip the scaling
        # pass: a Python `if` costs nothing here, unlike a branch in a step.
        in_range = ((max_abs <= _SAFE) & ((max_abs >= 1.0 / _SAFE) | (max_abs == 0))).all()
        scale = np.ones_like(max_abs) if in_range else _norm_scale_numpy(max_abs)
        zeros = zeros.astype(np.float32)
        # A finite sum |g| proves every entry of its row finite.
        all_finite = np.isfinite(sum_abs)
        deviations = None
        nonfinite = np.zeros_like(sum_abs)
        if values.size > _BRANCH_ABOVE and all_finite.all() and in_range:
            squares = sum_of_squares_numpy(values)
            one_pass = squares - entries * np.square(mean)
            if (one_pass >= _ONE_PASS_SHARE * squares).all():
                deviations = one_pass * scale * scale
        if deviations is None:
            if in_range:
                centred = values - mean[..., np.newaxis]
            else:
                centred = values * scale[..., np.newaxis]
                centred -= (mean * scale)[..., np.newaxis]
            deviations = sum_of_squares_numpy(centred, overwrite=True)
            if not all_finite.all():
                finite = np.count_nonzero(np.isfinite(values), axis=-1)
                nonfinite = (entries - finite).astype(np.float32)
        has_nan = np.isnan(sum_abs)
        l2_norm = np.sqrt(deviations + entries * np.square(mean * scale)) / scale
        l2_norm = np.where(all_finite, l2_norm, np.where(has_nan, np.nan, np.inf))
        max_abs = np.where(has_nan, np.nan, max_abs)
        std = np.sqrt(deviations / count) / scale
        columns = [max_abs, l2_norm, sum_abs / count, std, zeros / count, nonfinite]
    return np.stack(columns, axis=-1).astype(np.float32)


def norm_of_norms(norms, axis=-1):
    """sqrt(sum n^2) of float32 L2 norms along `axis`: the norm of the tensors together.

    Summed in float64: a float32 square leaves float32's range for norms
    below about 1e-19 or above about 1.8e19, which a layer's exact norm
    (`summarize`) can be, and the global norm of finite gradients read 0 or
    +inf. `norms` is a short vector (one entry per tensor): the casts cost
    nothing worth measuring.
    """
    squares = tf.square(tf.cast(norms, tf.float64))
    return tf.cast(tf.sqrt(tf.reduce_sum(squares, axis=axis)), tf.float32)


def norm_of_norms_numpy(norms, axis=-1):
    """`norm_of_norms` of a NumPy array."""
    squares = np.square(np.asarray(norms, np.float64))
    return np.sqrt(np.sum(squares, axis=axis)).astype(np.float32)


def exact_l2_norms(sums_of_squares, tensors, entries):
    """float32 L2 norms from `sums_of_squares(tensors)`, exact over float32's normal range.

    For the norms of weights, of their updates and of clipped gradients,
    which the statistics kernel does not take (its own norms are scaled:
    `_norm_scale`). Weights of 1e25 (a run about to diverge) or a bias that
    has moved 1e-24 from zero (a deep sigmoid net) have float32 squares that
    overflow or flush to zero: their norm read +inf or 0, and the update
    ratio NaN. The sums are taken in float32, as before; only when one of
    them is +inf/NaN or so small that flushed squares may have mattered
    (`_EXACT_SQUARES_PER_ENTRY`, zero included) are they all taken again from
    the tensors in float64, in a branch. Casting every step instead would
    add a float64 copy of every weight to each norm (three passes over
    memory for one). A tensor of zeros (a zero bias before its first update)
    takes the branch too: slower, never wrong. Subnormal entries (under
    1.2e-38) still count as zero: TensorFlow's CPU kernels read them so.

    Args:
        sums_of_squares: A function of `tensors` (float32, or the same
            structure in float64) returning a tensor of sums of squares.
        tensors: A nested structure of float32 tensors.
        entries: How many squares each sum adds up: a number, or a NumPy
            array that broadcasts against the sums.

    Returns:
        A float32 tensor shaped like `sums_of_squares(tensors)`.
    """
    narrow = sums_of_squares(tensors)
    in_range = tf.reduce_all(
        tf.logical_and(narrow >= _exact_from(entries), narrow <= np.finfo(np.float32).max)
    )

    def wide():
        tensors64 = tf.nest.map_structure(lambda t: tf.cast(t, tf.float64), tensors)
        return tf.cast(tf.sqrt(sums_of_squares(tensors64)), tf.float32)

    return tf.cond(in_range, lambda: tf.sqrt(narrow), wide)


def exact_sums_of_squares_numpy(sums_of_squares, arrays, entries):
    """`exact_l2_norms`' sums of squares in NumPy: float64, exact over float32's range.

    `sums_of_squares` must not write into `arrays`.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = sums_of_squares(arrays)
        limit = np.finfo(np.float32).max
        if np.all((narrow >= _exact_from(entries)) & (narrow <= limit)):
            return narrow.astype(np.float64)
        return sums_of_squares([np.asarray(a, np.float64) for a in arrays])


def _exact_from(entries):
    return np.asarray(np.asarray(entries, np.float64) * _EXACT_SQUARES_PER_ENTRY, np.float32)


def sum_of_squares_numpy(values, overwrite=False):
    """sum x^2 along the last axis of a float32 array.

    Squares, then NumPy's pairwise sum: `np.einsum` or a dot product would
    take one pass with no temporary, but they accumulate in float32 lane by
    lane, which lost up to 2e-4 of the std on a few hundred thousand entries
    with a large mean (`tests/test_statistics.py`). `overwrite=True` squares
    `values` in place (a temporary of the caller's) instead of a copy.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # Inf and NaN are data here
        squares = np.square(values, out=values if overwrite else None)
        return squares.sum(axis=-1)


def _log_histogram(values, per_row=False):
    """log10|g| counts of a tensor (`[bins]`), or per row of a `[k, entries]` matrix (`[k, bins]`)."""
    position, weights = _histogram_positions(values if per_row else tf.reshape(values, [-1]))
    # The op under `tf.math.bincount`, with the number of bins as a constant:
    # bincount computes its length from the data, which XLA cannot compile,
    # and Keras compiles the train step with XLA by default when a GPU is
    # present. A 2-D input is counted row by row.
    return tf.raw_ops.DenseBincount(
        input=position,
        size=tf.constant(schema.HISTOGRAM_BINS, tf.int32),
        weights=weights,
        binary_output=False,
    )


def _histogram_positions(values):
    """The bin of every entry of `values` and a weight that leaves out NaN/Inf."""
    bins = schema.HISTOGRAM_BINS
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
    return position, tf.cast(finite, tf.float32)
