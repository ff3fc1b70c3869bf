"""One wording for a bad count or interval, at every public entry point.

`gradflow.checks` holds the checks; the second half of this file calls the
public functions and constructors that take counts, limits and intervals with
the values users get wrong (a bool, a float, a string, zero, a negative) and
expects the same message from each: the argument's name, the value, what is
allowed.
"""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradflow.checks import positive_int, positive_number

BAD_COUNTS = [0, -3, 1.5, 2.0, "3", True, np.bool_(True), None, float("nan")]
BAD_INTERVALS = [0, -0.5, "1", True, None, float("nan"), float("inf")]


@given(st.integers(min_value=1, max_value=2**63 - 1))
def test_positive_int_returns_whole_numbers_as_int(value):
    assert positive_int("n", value) == value
    assert type(positive_int("n", value)) is int


@given(st.integers(min_value=2**63, max_value=2**200))
def test_positive_int_refuses_what_no_int64_holds(value):
    """`GradientMonitor(every=10**30)` failed in `fit` with a bare OverflowError."""
    with pytest.raises(
        ValueError, match=r"`n` must be a positive integer no larger than 2\*\*63 - 1"
    ):
        positive_int("n", value)


@given(st.integers(min_value=1, max_value=2**62))
def test_positive_int_takes_numpy_integers(value):
    result = positive_int("n", np.int64(value))
    assert result == value and type(result) is int


@given(st.integers(max_value=0))
def test_positive_int_refuses_zero_and_below(value):
    with pytest.raises(ValueError, match=f"`n` must be a positive integer, got {value}"):
        positive_int("n", value)


@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
def test_positive_int_refuses_what_is_not_a_count(value):
    with pytest.raises(
        ValueError, match=re.escape(f"`n` must be a positive integer, got {value!r}.")
    ):
        positive_int("n", value)


def test_positive_int_none_where_allowed():
    assert positive_int("limit", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"`limit` must be a positive integer or None, got 0\."):
        positive_int("limit", 0, allow_none=True)


@given(st.floats(min_value=1e-300, max_value=1e300))
def test_positive_number_returns_float(value):
    assert positive_number("t", value) == value


@pytest.mark.parametrize("value", BAD_INTERVALS, ids=repr)
def test_positive_number_refuses(value):
    message = f"`t` must be a positive number of seconds, got {value!r}."
    with pytest.raises(ValueError, match=re.escape(message)):
        positive_number("t", value, unit="of seconds")


def test_positive_number_takes_ints_and_numpy_floats():
    assert positive_number("t", 2) == 2.0
    assert positive_number("t", np.float32(0.25)) == 0.25


# Public entry points. Each builds what it needs lazily, so that a test only
# imports TensorFlow where the entry point does.


def _monitor(**kwargs):
    from gradflow import GradientMonitor

    GradientMonitor(**kwargs)


def _run_control(**kwargs):
    from gradflow.lab.control import RunControl

    RunControl(store=None, run_id="run", **kwargs)


def _run_manager(tmp_path, **kwargs):
    from gradflow.lab.runner import RunManager

    RunManager(store=str(tmp_path / "runs.db"), prewarm=False, **kwargs)


def _load_arrays(tmp_path, **kwargs):
    from gradflow import load_arrays

    path = tmp_path / "batch.npz"
    np.savez(path, x=np.zeros((2, 3)), y=np.zeros(2))
    load_arrays(path, **kwargs)


def _safe_load_model(tmp_path, **kwargs):
    from gradflow import safe_load_model

    safe_load_model(tmp_path / "model.keras", **kwargs)


def _decimate_envelope(**kwargs):
    from gradflow.figures.decimate import decimate_envelope

    decimate_envelope(np.arange(3), np.ones(3), **kwargs)


def _steps_per_execution(**kwargs):
    from gradflow.lab.batches import steps_per_execution

    steps_per_execution(**{"steps_per_epoch": 45, "total_steps": 300, **kwargs})


def _chained_backprop(**kwargs):
    import keras

    from gradflow.probe.chain import ChainedBackprop

    part = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    ChainedBackprop([part], loss="mse", **kwargs)


COUNT_ARGUMENTS = [
    (_monitor, "every", False),
    (_monitor, "probe_every", False),
    (_run_control, "max_steps", True),
    (_run_manager, "runs_per_worker", False),
    (_load_arrays, "max_rows", False),
    (_load_arrays, "max_bytes", False),
    (_safe_load_model, "max_entries", False),
    (_safe_load_model, "memory_limit", False),
    (_decimate_envelope, "max_points", False),
    (_steps_per_execution, "total_steps", False),
    (_chained_backprop, "max_jacobian_entries", False),
]


def _call(entry, tmp_path, **kwargs):
    if entry in (_run_manager, _load_arrays, _safe_load_model):
        entry(tmp_path, **kwargs)
    else:
        entry(**kwargs)


@pytest.mark.parametrize("value", [0, -1, 2.5, "4", True], ids=repr)
@pytest.mark.parametrize(
    "entry,argument,none_allowed",
    COUNT_ARGUMENTS,
    ids=[f"{e.__name__.lstrip('_')}-{a}" for e, a, _ in COUNT_ARGUMENTS],
)
def test_public_counts_refuse_with_one_message(tmp_path, entry, argument, none_allowed, value):
    allowed = "a positive integer or None" if none_allowed else "a positive integer"
    message = f"`{argument}` must be {allowed}, got {value!r}."
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(entry, tmp_path, **{argument: value})


INTERVAL_ARGUMENTS = [
    (_run_control, "poll_interval"),
    (_run_control, "heartbeat_interval"),
    (_run_manager, "poll_interval"),
    (_safe_load_model, "timeout"),
]


@pytest.mark.parametrize("value", [0, -1.0, "0.5", False, float("nan")], ids=repr)
@pytest.mark.parametrize(
    "entry,argument",
    INTERVAL_ARGUMENTS,
    ids=[f"{e.__name__.lstrip('_')}-{a}" for e, a in INTERVAL_ARGUMENTS],
)
def test_public_intervals_refuse_with_one_message(tmp_path, entry, argument, value):
    message = f"`{argument}` must be a positive number of seconds, got {value!r}."
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(entry, tmp_path, **{argument: value})


def test_store_writer_flush_interval(tmp_path):
    from gradflow.store import RunStore

    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({})
    with pytest.raises(ValueError, match=r"`flush_interval` must be a positive number of seconds"):
        store.writer(run_id, flush_interval="fast")


def test_numpy_counts_are_accepted_where_users_compute_them(tmp_path):
    """A limit computed from an array (`x.shape[0] * 2`, `np.prod(...)`) is a NumPy integer."""
    from gradflow import GradientMonitor, load_arrays
    from gradflow.figures.decimate import decimate_envelope

    assert GradientMonitor(every=np.int64(3)).every == 3
    steps, _ = decimate_envelope(np.arange(10), np.ones(10), max_points=np.int32(4))
    assert len(steps) <= 5
    path = tmp_path / "batch.npz"
    np.savez(path, x=np.zeros((2, 3)))
    assert load_arrays(path, max_rows=np.int64(10))["x"].shape == (2, 3)
