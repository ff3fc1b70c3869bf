"""The statistics kernel against numpy, one case per kind of tensor."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradflow import schema
from gradflow.statistics import (
    ShapeGroups,
    exact_sums_of_squares_numpy,
    summarize,
    summarize_rows,
    summarize_rows_numpy,
)

NAN = np.nan
INF = np.inf


def numpy_statistics(array):
    """gradflow's six statistics of one array, computed plainly in float64."""
    values = np.asarray(array, dtype=np.float64).ravel()
    finite = np.isfinite(values)
    nonfinite = float(np.sum(~finite))
    if values.size == 0:
        return [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    if np.isnan(values).any():
        return [NAN, NAN, NAN, NAN, float(np.mean(values == 0)), nonfinite]
    magnitude = np.abs(values)
    with np.errstate(invalid="ignore"):  # inf - inf in the std of an Inf tensor
        std = values.std()
    return [
        magnitude.max(),
        np.sqrt(np.sum(values**2)),
        magnitude.mean(),
        std,
        float(np.mean(values == 0)),
        nonfinite,
    ]


def numpy_histogram(array):
    values = np.asarray(array, dtype=np.float64).ravel()
    values = values[np.isfinite(values)]
    counts = np.zeros(schema.HISTOGRAM_BINS)
    for value in np.abs(values):
        if value < 10.0**schema.HISTOGRAM_LOW:
            position = 0
        else:
            position = (
                int(np.floor((np.log10(value) - schema.HISTOGRAM_LOW) / schema.HISTOGRAM_BIN_WIDTH))
                + 1
            )
            position = min(position, schema.HISTOGRAM_BINS - 1)
        counts[position] += 1
    return counts


RNG = np.random.default_rng(0)

CASES = [
    ("normal_matrix", RNG.normal(size=(7, 5)).astype(np.float32)),
    ("large_offset_small_spread", (2e3 + RNG.normal(size=200) * 1e-2).astype(np.float32)),
    ("all_zeros", np.zeros((3, 4), np.float32)),
    ("some_zeros", np.array([0.0, 0.0, 1.5, -2.0, 0.0], np.float32)),
    ("scalar", np.float32(-3.0)),
    ("with_nan", np.array([1.0, NAN, -2.0, 0.0], np.float32)),
    ("with_inf", np.array([1.0, INF, -INF, 2.0], np.float32)),
    ("tiny_and_huge", np.array([1e-30, -3e-13, 2e-7, 5e3, -2e6], np.float32)),
    ("float64_input", RNG.normal(size=(4, 3))),
    ("float16_input", RNG.normal(size=(6,)).astype(np.float16)),
]


def _large(fill=None, side=300):
    # 300 x 300 entries: above the size where the kernel reduces a tensor on
    # its own (statistics._ALONE_FROM); 600 x 600 also above the size where it
    # branches (_BRANCH_ABOVE): one fused pass for sum g^2 and no NaN/Inf
    # count, unless the cheap checks find a NaN/Inf or a mean too large for it.
    array = RNG.normal(size=(side, side)).astype(np.float32)
    array[::7, ::3] = 0.0
    if fill is not None:
        array[123, 45] = fill
    return array


CASES += [
    ("large_finite", _large()),
    ("large_with_nan", _large(NAN)),
    ("large_with_inf", _large(INF)),
    ("large_offset", (5e2 + _large() * 1e-3).astype(np.float32)),
    ("huge_finite", _large(side=600)),
    ("huge_with_nan", _large(NAN, side=600)),
    ("huge_with_inf", _large(INF, side=600)),
    # The mean far above the spread: the one-pass variance would cancel.
    ("huge_offset", (5e2 + _large(side=600) * 1e-3).astype(np.float32)),
    ("huge_offset_at_the_edge", (4.0 + _large(side=600)).astype(np.float32)),
    ("huge_constant", np.full((600, 600), 3.0, np.float32)),
    # A dead layer of a large model: its norm read NaN, not 0 (its scale
    # squared overflowed, and 0 x inf is NaN).
    ("huge_zeros", np.zeros((600, 600), np.float32)),
]

# Gradients whose squares leave float32's range: the first layers of a deep
# sigmoid net (about 1e-20 at depth 30) and a diverging one. Their L2 norm
# and std once read 0 and Inf. (Powers of two: scaled exactly, the offset
# case keeps its float32 mean as exact as at scale 1.)
CASES += [
    (f"{name}_{size:.0e}", (array * size).astype(np.float32))
    for size in (2.0**-100, 2.0**-66, 2.0**73, 2.0**90)
    for name, array in (
        ("small", RNG.normal(size=(8, 6))),
        ("large", _large()),
        ("huge", _large(side=600)),
        ("huge_offset", 5e2 + _large(side=600) * 1e-3),
    )
]


def test_the_large_cases_take_each_path_of_the_kernel():
    # If a threshold moves, the cases above must still reach both paths.
    from gradflow import statistics

    assert 300 * 300 >= statistics._ALONE_FROM
    assert 300 * 300 <= statistics._BRANCH_ABOVE < 600 * 600


@pytest.mark.parametrize("array", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_statistics_match_numpy(array):
    statistics, histograms = summarize([tf.constant(array)], histogram=True)
    expected = numpy_statistics(array)
    np.testing.assert_allclose(statistics.numpy()[0], expected, rtol=1e-5, atol=1e-30)
    np.testing.assert_array_equal(histograms.numpy()[0], numpy_histogram(array))


def test_many_tensors_at_once_keep_their_own_rows():
    arrays = [c[1] for c in CASES]
    statistics, histograms = summarize([tf.constant(a) for a in arrays], histogram=True)
    assert statistics.shape == (len(arrays), len(schema.STATISTICS))
    for row, array in enumerate(arrays):
        np.testing.assert_allclose(
            statistics.numpy()[row], numpy_statistics(array), rtol=1e-5, atol=1e-30
        )
        np.testing.assert_array_equal(histograms.numpy()[row], numpy_histogram(array))


def test_large_tensors_of_one_shape_keep_their_own_rows():
    arrays = [_large(), _large(NAN), _large(), _large(-INF)]

    @tf.function
    def kernel(tensors):
        return summarize(tensors)[0]

    statistics = kernel([tf.constant(a) for a in arrays]).numpy()
    for row, array in enumerate(arrays):
        np.testing.assert_allclose(statistics[row], numpy_statistics(array), rtol=1e-5, atol=1e-30)


def test_indexed_slices_count_implicit_zeros_and_sum_duplicates():
    values = np.array([[1.0, -2.0], [3.0, 4.0], [0.5, 0.5]], np.float32)
    indices = np.array([0, 3, 0])
    dense = np.zeros((5, 2), np.float32)
    np.add.at(dense, indices, values)
    slices = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([5, 2]))
    statistics, _ = summarize([slices])
    np.testing.assert_allclose(statistics.numpy()[0], numpy_statistics(dense), rtol=1e-5)
    assert statistics.numpy()[0][4] == pytest.approx(0.6)  # 6 of 10 entries are zero


def test_histogram_bin_edges():
    probes = {
        0.0: 0,
        5e-13: 0,
        2e-12: 1,  # [1e-12, 3.16e-12)
        1.0: 25,  # [1, 3.16)
        -4.0: 26,  # [3.16, 10)
        9e3: schema.HISTOGRAM_BINS - 2,
        2e4: schema.HISTOGRAM_BINS - 1,
        1e30: schema.HISTOGRAM_BINS - 1,
    }
    _, histograms = summarize([tf.constant([v], tf.float32) for v in probes], histogram=True)
    for row, expected_bin in enumerate(probes.values()):
        counts = histograms.numpy()[row]
        assert counts.sum() == 1 and counts[expected_bin] == 1, (list(probes)[row], counts)
    assert len(schema.histogram_bin_labels()) == schema.HISTOGRAM_BINS


def test_nonfinite_entries_are_not_binned():
    _, histograms = summarize([tf.constant([NAN, INF, 1.0], tf.float32)], histogram=True)
    assert histograms.numpy()[0].sum() == 1


def test_inside_tf_function():
    arrays = [RNG.normal(size=(3, 3)).astype(np.float32), np.array([0.0, 2.0], np.float32)]
    compiled = tf.function(lambda tensors: summarize(tensors)[0])
    statistics = compiled([tf.constant(a) for a in arrays]).numpy()
    for row, array in enumerate(arrays):
        np.testing.assert_allclose(statistics[row], numpy_statistics(array), rtol=1e-5)


BRANCHED = [c for c in CASES if c[0].startswith("huge")]
# Forty tensors of one shape, each below the size reduced alone: one stacked
# group above _BRANCH_ABOVE, which takes the branch, as a 20-layer MLP's
# kernels would; in the second set one tensor's mean is 70 std from zero,
# where the one-pass variance would be off by 3e-4 (its own generator: the
# cases above keep their data).
MEDIUM = [np.random.default_rng(1).normal(size=(100, 80)).astype(np.float32) for _ in range(40)]
MEDIUM_OFFSET = [*MEDIUM[:-1], (7.0 + MEDIUM[-1] * 0.1).astype(np.float32)]


def test_the_medium_group_takes_the_branch():
    from gradflow import statistics

    assert 100 * 80 < statistics._ALONE_FROM
    assert 40 * 100 * 80 > statistics._BRANCH_ABOVE


@pytest.mark.parametrize("arrays", [MEDIUM, MEDIUM_OFFSET], ids=["medium", "medium_offset"])
def test_a_large_stacked_group_keeps_its_rows_and_matches_numpy(arrays):
    statistics = tf.function(lambda tensors: summarize(tensors)[0])(
        [tf.constant(a) for a in arrays]
    ).numpy()
    for row, array in enumerate(arrays):
        np.testing.assert_allclose(statistics[row], numpy_statistics(array), rtol=1e-5, atol=1e-30)


def test_under_xla_every_path_compiles_and_matches_numpy():
    # Keras compiles the train step with XLA when a GPU is present, and the
    # kernel runs inside it: every op of every path needs an XLA kernel.
    arrays = [c[1] for c in CASES if c[1].dtype != np.float16] + MEDIUM_OFFSET
    compiled = tf.function(lambda tensors: summarize(tensors)[0], jit_compile=True)
    statistics = compiled([tf.constant(a) for a in arrays]).numpy()
    for row, array in enumerate(arrays):
        # XLA rounds the mean differently; around a mean 2e5 std from zero
        # (`large_offset_small_spread`) the std then differs by 5e-5.
        np.testing.assert_allclose(statistics[row], numpy_statistics(array), rtol=1e-4, atol=1e-30)


@pytest.mark.parametrize("array", [c[1] for c in BRANCHED], ids=[c[0] for c in BRANCHED])
def test_rows_of_a_matrix_match_numpy_on_every_path(array):
    # `summarize_rows` (the deferred ring's read) may take the fused sum of
    # squares; each row is one tensor, here the same one three times, the
    # middle copy scaled so the rows differ.
    rows = np.stack([array.ravel(), 3.0 * array.ravel(), array.ravel()])
    compiled = tf.function(
        lambda r: summarize_rows(r)[0], input_signature=[tf.TensorSpec([None, rows.shape[1]])]
    )
    statistics = compiled(tf.constant(rows)).numpy()
    for row, values in enumerate(rows):
        np.testing.assert_allclose(statistics[row], numpy_statistics(values), rtol=1e-5, atol=1e-30)


FLOAT32_CASES = [c for c in CASES if c[1].dtype == np.float32 and c[1].ndim > 0]


@pytest.mark.parametrize("array", [c[1] for c in FLOAT32_CASES], ids=[c[0] for c in FLOAT32_CASES])
def test_the_numpy_kernel_matches_numpy_and_the_tensorflow_kernel(array):
    # `summarize_rows_numpy` is the deferred ring's read when it is not
    # compiled: the same statistics as `summarize_rows`, NaN and Inf included,
    # on both sides of the large-group branch (the huge cases reach it: three
    # rows of 360,000 entries).
    rows = np.stack([array.ravel(), 3.0 * array.ravel(), array.ravel()])
    statistics = summarize_rows_numpy(rows)
    assert statistics.dtype == np.float32 and statistics.shape == (3, len(schema.STATISTICS))
    kernel = summarize_rows(tf.constant(rows))[0].numpy()
    # 6,000 +- 0.03 (the scaled row of `large_offset_small_spread`): the
    # float32 mean's rounding alone moves the std by 1e-4 in both kernels
    # (9e-5 in TensorFlow's), each summing in its own order.
    with np.errstate(invalid="ignore"):  # the std of a row with Inf
        rtol = 3e-4 if np.abs(rows).max() > 1e5 * np.std(rows[1]) else 1e-5
    for row, values in enumerate(rows):
        np.testing.assert_allclose(statistics[row], numpy_statistics(values), rtol=rtol, atol=1e-30)
    np.testing.assert_allclose(statistics, kernel, rtol=rtol, atol=1e-30)


def test_the_numpy_kernel_reduces_the_last_axis_of_a_strided_view():
    # The ring's read hands it `[steps, tensors, entries]` views of column
    # slices, and empty rows must give zeros as in TensorFlow.
    ring = RNG.normal(size=(4, 50)).astype(np.float32)
    view = ring[:, 10:40].reshape(4, 3, 10)
    assert not view.flags.c_contiguous
    statistics = summarize_rows_numpy(view)
    assert statistics.shape == (4, 3, len(schema.STATISTICS))
    for step in range(4):
        for tensor in range(3):
            np.testing.assert_allclose(
                statistics[step, tensor], numpy_statistics(view[step, tensor]), rtol=1e-5
            )
    np.testing.assert_array_equal(summarize_rows_numpy(np.zeros((2, 0), np.float32)), 0.0)


_ENTRIES = st.one_of(
    st.floats(-1e6, 1e6, width=32),
    st.sampled_from([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-38, -1e-40, 1e-45, 3e38]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=hnp.arrays(
        np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=40), elements=_ENTRIES
    )
)
def test_the_numpy_kernel_equals_the_tensorflow_kernel_on_any_rows(rows):
    # Subnormal entries too (below 1.2e-38): TensorFlow flushes them to zero.
    expected = summarize_rows(tf.constant(rows))[0].numpy()
    statistics = summarize_rows_numpy(rows)
    # NaN where TensorFlow has NaN, Inf where it has Inf, the rest equal up
    # to the order of float32 sums: a constant row's std is 0 or one ulp of
    # its mean, so the tolerance scales with each row's largest entry.
    np.testing.assert_array_equal(np.isnan(statistics), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(statistics), np.isinf(expected))
    with np.errstate(invalid="ignore"):
        scale = np.nanmax(np.where(np.isfinite(rows), np.abs(rows), 0.0), axis=1, initial=0.0)
    atol = np.broadcast_to(1e-6 + 1e-6 * scale[:, np.newaxis], expected.shape)
    finite = np.isfinite(expected)
    with np.errstate(invalid="ignore"):  # Inf - Inf where both are Inf
        close = np.abs(statistics - expected) <= atol + 1e-4 * np.abs(expected)
    assert close[finite].all(), (statistics, expected)


@pytest.mark.parametrize(
    "width, rows, block",
    [
        (255 * 700, 2, 255),  # every block full: a count of 255 still fits a byte
        (250 * 600, 1, 250),
        (131_101, 2, None),  # a prime width: no block divides it, counted in float32
        (64, 4, 64),  # too small to count in blocks
    ],
)
def test_mask_counts_per_row_are_exact_in_blocks_or_not(width, rows, block):
    from gradflow import statistics

    assert statistics._block_size(width) == block
    rng = np.random.default_rng(width)
    mask = rng.random((rows, width)) < 0.4
    mask[0] = True  # all true: the uint8 blocks at their fullest
    for keepdims in (False, True):
        counted = statistics._count_per_row(tf.constant(mask), keepdims=keepdims).numpy()
        expected = mask.sum(axis=1).astype(np.float32)
        np.testing.assert_array_equal(counted, expected[:, None] if keepdims else expected)
    # Rows unknown while traced (layer outputs), judged by a guess; and under XLA.
    for jit in (False, True):
        counted = tf.function(
            lambda m: statistics._count_per_row(m, rows_guess=16),
            input_signature=[tf.TensorSpec([None, width], tf.bool)],
            jit_compile=jit,
        )(tf.constant(mask)).numpy()
        np.testing.assert_array_equal(counted, mask.sum(axis=1))


def test_empty_list_is_refused():
    with pytest.raises(ValueError, match="`tensors`"):
        summarize([])


def test_empty_tensor_gives_zeros():
    statistics, _ = summarize([tf.zeros([0, 3]), tf.ones([2])])
    np.testing.assert_array_equal(statistics.numpy()[0], np.zeros(6))
    assert statistics.numpy()[1][0] == 1.0


def test_layer_outputs_of_any_batch_length_keep_their_own_rows():
    # Inside a train step layer outputs have an unknown first dimension (the
    # batch). Those whose rows have the same size are reduced together, and
    # nothing may assume their first dimensions are equal when the step runs:
    # here they are 5, 0, 3, 2, 3 and 4 rows, between tensors of other shapes.
    # A generator of its own: the module's `RNG` draws depend on which tests ran first.
    rng = np.random.default_rng(5)
    arrays = [
        rng.normal(size=(5, 4, 2)).astype(np.float32),
        np.zeros((0, 4, 2), np.float32),
        np.array([[[0.0, 1.0]] * 4, [[NAN, 2.0]] * 4, [[3.0, -INF]] * 4], np.float32),
        np.zeros((2, 4, 2), np.float32),
        rng.normal(size=(3, 8)).astype(np.float32),  # rows of the same size, another shape
        (2e3 + rng.normal(size=(4, 8)) * 1e-2).astype(np.float32),
        np.float32(-3.0),  # a known shape, between them
        rng.normal(size=(6, 3)).astype(np.float32),  # the only rows of their size
        (rng.normal(size=(2, 5, 3)) * 1e-24).astype(np.float32),  # squares below float32's range
        (rng.normal(size=(3, 5, 3)) * 1e24).astype(np.float32),  # and above it
        np.array([0.0, 4.0, -1.0], np.float32),  # one entry per row
        np.zeros((3, 0), np.float32),  # rows of no entries
    ]
    signature = [
        tf.TensorSpec([None, *a.shape[1:]], tf.float32) if np.ndim(a) else tf.TensorSpec([])
        for a in arrays
    ]

    @tf.function(input_signature=[signature])
    def kernel(tensors):
        return summarize(tensors, histogram=True)

    statistics, histograms = kernel([tf.constant(a) for a in arrays])
    assert statistics.shape == (len(arrays), len(schema.STATISTICS))
    for row, array in enumerate(arrays):
        expected = numpy_statistics(array)
        # Around 2e3 +- 1e-2 a float32 mean can be off by one spacing of
        # float32 there (eps = 1.2e-4), which adds eps^2 to the variance:
        # (eps / std)^2 / 2 = 7e-5 of the std, whatever the kernel does.
        rtol = 1e-4 if row == 5 else 1e-5
        np.testing.assert_allclose(statistics.numpy()[row], expected, rtol=rtol, atol=1e-30)
        np.testing.assert_array_equal(histograms.numpy()[row], numpy_histogram(array))


def _wide_outputs(offset=None, fill=None):
    """Layer outputs of 9,000 entries per batch row: 16 rows of them are above
    the size where the kernel branches (`_BRANCH_ABOVE`)."""
    rng = np.random.default_rng(2)
    arrays = [
        rng.normal(size=(5, 100, 90)).astype(np.float32),
        np.zeros((0, 100, 90), np.float32),
        rng.normal(size=(3, 9000)).astype(np.float32),  # rows of the same size
        rng.normal(size=(2, 100, 90)).astype(np.float32) * 1e-4,
    ]
    if offset is not None:
        arrays[0] = (offset + 0.1 * arrays[0]).astype(np.float32)
    if fill is not None:
        arrays[2][1, 17] = fill
    return arrays


def test_wide_layer_outputs_take_the_branch():
    from gradflow import statistics

    widths = [int(np.prod(a.shape[1:])) for a in _wide_outputs()]
    assert sum(widths) * statistics._BATCH_GUESS > statistics._BRANCH_ABOVE


@pytest.mark.parametrize(
    "arrays",
    [
        _wide_outputs(),
        _wide_outputs(offset=7.0),
        _wide_outputs(fill=NAN),
        _wide_outputs(fill=INF),
        [(a * 1e-22).astype(np.float32) for a in _wide_outputs()],
        [(a * 1e25).astype(np.float32) for a in _wide_outputs()],
        [np.zeros_like(a) for a in _wide_outputs()],
    ],
    ids=["finite", "offset", "nan", "inf", "vanishing", "exploding", "dead"],
)
def test_wide_layer_outputs_of_any_batch_length_match_numpy(arrays):
    # The one-pass branch when it holds; a mean 70 std from zero, a NaN or an
    # Inf sends every tensor of the step back to the counted, two-pass path.
    signature = [tf.TensorSpec([None, *a.shape[1:]], tf.float32) for a in arrays]
    kernel = tf.function(lambda tensors: summarize(tensors)[0], input_signature=[signature])
    statistics = kernel([tf.constant(a) for a in arrays]).numpy()
    for row, array in enumerate(arrays):
        np.testing.assert_allclose(statistics[row], numpy_statistics(array), rtol=1e-5, atol=1e-30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # Normal float32s: TensorFlow's CPU kernels read subnormals as zero.
    exponents=st.lists(st.integers(-37, 37), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_weight_norms_are_exact_over_float32s_normal_range(exponents, seed):
    """`ShapeGroups.l2_norms` and the NumPy sums against float64, whatever the scale.

    Three tensors (two of one shape, stacked) of entries about 10^e: float32
    squares flush to zero below about 1e-19 and overflow above 1.8e19.
    """
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (3, 4), (7,)]
    values = [
        (rng.uniform(1, 2, size=shape) * rng.choice([-1, 1], size=shape) * 10.0**e).astype(
            np.float32
        )
        for shape, e in zip(shapes, exponents, strict=True)
    ]
    expected = [np.sqrt(np.sum(np.square(v.astype(np.float64)))) for v in values]
    groups = ShapeGroups(shapes)
    norms = tf.function(lambda ts: groups.l2_norms(groups.stack(ts)))(
        [tf.constant(v) for v in values]
    )
    np.testing.assert_allclose(norms.numpy(), expected, rtol=2e-6)
    squares = exact_sums_of_squares_numpy(
        lambda arrays: np.stack([np.square(a).sum() for a in arrays]), values, [12, 12, 7]
    )
    assert squares.dtype == np.float64
    np.testing.assert_allclose(np.sqrt(squares), expected, rtol=2e-6)
