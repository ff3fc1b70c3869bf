"""The statistics kernel against numpy, one case per kind of tensor."""

import numpy as np
import pytest
import tensorflow as tf

from gradflow import schema
from gradflow.statistics import summarize

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
    # counts NaN/Inf only when the cheap check finds one (_BRANCH_ABOVE).
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
    arrays = [
        RNG.normal(size=(5, 4, 2)).astype(np.float32),
        np.zeros((0, 4, 2), np.float32),
        np.array([[[0.0, 1.0]] * 4, [[NAN, 2.0]] * 4, [[3.0, -INF]] * 4], np.float32),
        np.zeros((2, 4, 2), np.float32),
        RNG.normal(size=(3, 8)).astype(np.float32),  # rows of the same size, another shape
        (2e3 + RNG.normal(size=(4, 8)) * 1e-2).astype(np.float32),
        np.float32(-3.0),  # a known shape, between them
        RNG.normal(size=(6, 3)).astype(np.float32),  # the only rows of their size
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
        np.testing.assert_allclose(statistics.numpy()[row], expected, rtol=1e-5, atol=1e-30)
        np.testing.assert_array_equal(histograms.numpy()[row], numpy_histogram(array))
