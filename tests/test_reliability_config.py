"""Bad input everywhere: RunConfig fields, the user's data file, and the command line.

Every way a person can get a setting wrong must end in a `ValueError` that
names the field (or, for a data file, says what is wrong with it), never in
another exception, a traceback, or a silently different config. The ranges
below are written out from the documented contract (RunConfig's docstring),
not read back from the field metadata, so a change of a bound shows up here.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gradflow.lab.config import RunConfig
from gradflow.safety.errors import UnsafeInputError

# field -> (lowest valid, highest valid, just below, just above), as documented.
INTEGER_RANGES = {
    "depth": (1, 100),
    "width": (1, 1024),
    "batch_size": (1, 4096),
    "steps": (1, 1_000_000),
    "epochs": (1, 10_000),
    "n_samples": (10, 1_000_000),
    "sequence_length": (2, 1000),
    "seed": (0, 2**31 - 1),
    "record_every": (1, 1_000_000),
}
# field -> (low, high, low is allowed?)
NUMBER_RANGES = {
    "learning_rate": (0.0, 1e4, False),
    "init_stddev": (0.0, 100.0, False),
    "dropout": (0.0, 0.9, True),
    "clip_value": (0.0, 1e6, False),
    "max_norm": (0.0, 1e6, False),
}
CHOICES = {
    "architecture": ["mlp", "cnn", "rnn", "residual_mlp"],
    "activation": ["relu", "sigmoid", "tanh", "gelu", "linear"],
    "initializer": ["glorot_uniform", "he_normal", "random_normal"],
    "normalization": ["none", "batch", "layer"],
    "rnn_cell": ["simple_rnn", "lstm", "gru"],
    "optimizer": ["sgd", "momentum", "adam", "rmsprop"],
    "clipping": ["none", "value", "norm", "global_norm"],
    "loss": ["auto", "sparse_categorical_crossentropy", "mse"],
    "dataset": ["digits", "spirals", "moons", "file", "adding"],
}
FLAGS = ("residual", "histograms", "activations")
TEXTS = {"name": 200, "data_path": 4096}
OPTIONAL = {"epochs", "max_norm", "name", "data_path"}


def names_field(message, field):
    """True when an error message points at `field` (`field` or field=...)."""
    return f"`{field}" in message or f"{field}=" in message


def expect_field_error(field, **values):
    with pytest.raises(ValueError) as info:
        RunConfig(**values)
    assert names_field(str(info.value), field), str(info.value)
    return str(info.value)


# ---------------------------------------------------------------- bounds, table-driven


def _integer_cases():
    for field, (low, high) in INTEGER_RANGES.items():
        yield field, low, True
        yield field, high, True
        yield field, low - 1, False
        yield field, high + 1, False


@pytest.mark.parametrize("field, value, valid", list(_integer_cases()))
def test_integer_fields_at_and_beyond_their_bounds(field, value, valid):
    # A run records at most every `steps` steps (checked with the fields together, below).
    steps = {"steps": max(value, 300)} if field == "record_every" and valid else {}
    if valid:
        assert getattr(RunConfig(**{field: value}, **steps), field) == value
    else:
        message = expect_field_error(field, **{field: value})
        assert str(value) in message  # the value received is shown


def _number_cases():
    for field, (low, high, low_allowed) in NUMBER_RANGES.items():
        yield field, low, low_allowed
        yield field, math.nextafter(low, math.inf), True
        yield field, high, True
        yield field, math.nextafter(high, math.inf), False
        yield field, -1.0, False
        yield field, math.nan, False
        yield field, math.inf, False
        yield field, -math.inf, False


@pytest.mark.parametrize("field, value, valid", list(_number_cases()))
def test_number_fields_at_and_beyond_their_bounds(field, value, valid):
    if valid:
        assert getattr(RunConfig(**{field: value}), field) == value
    else:
        expect_field_error(field, **{field: value})


@pytest.mark.parametrize("field, max_length", list(TEXTS.items()))
def test_text_fields_at_and_beyond_their_length(field, max_length):
    extra = {"dataset": "file"} if field == "data_path" else {}
    assert len(getattr(RunConfig(**{field: "a" * max_length}, **extra), field)) == max_length
    expect_field_error(field, **{field: "a" * (max_length + 1)}, **extra)


@pytest.mark.parametrize("field", sorted(CHOICES))
@pytest.mark.parametrize("value", ["", "RELU ", "Relu", "no-such-thing", 3, None, ["relu"]])
def test_choice_fields_take_only_their_keras_identifiers(field, value):
    expect_field_error(field, **{field: value})


# ---------------------------------------------------------------- wrong types

WRONG_FOR_INTEGER = ["4", True, False, 4.0, 4.5, None, [4], {"v": 4}, b"4", complex(4, 0)]
WRONG_FOR_NUMBER = ["0.1", True, None, [0.1], b"0.1", complex(0.1, 0)]
WRONG_FOR_FLAG = ["true", "false", 1, 0, 1.0, None, [True]]
WRONG_FOR_TEXT = [5, 5.0, True, ["a"], b"name"]


def _wrong_type_cases():
    for field in INTEGER_RANGES:
        for value in WRONG_FOR_INTEGER:
            if value is None and field in OPTIONAL:
                continue
            yield field, value
    for field in NUMBER_RANGES:
        for value in WRONG_FOR_NUMBER:
            if value is None and field in OPTIONAL:
                continue
            yield field, value
    for field in FLAGS:
        for value in WRONG_FOR_FLAG:
            yield field, value
    for field in TEXTS:
        for value in WRONG_FOR_TEXT:
            yield field, value


@pytest.mark.parametrize("field, value", list(_wrong_type_cases()), ids=repr)
def test_wrong_types_are_refused_by_name(field, value):
    extra = {"dataset": "file"} if field == "data_path" else {}
    expect_field_error(field, **{field: value}, **extra)


def test_numpy_scalars_are_accepted_and_become_plain_python():
    config = RunConfig(depth=np.int64(7), learning_rate=np.float32(0.5), seed=np.uint8(3))
    assert type(config.depth) is int and config.depth == 7
    assert type(config.learning_rate) is float and config.learning_rate == 0.5
    assert json.loads(config.to_json())["seed"] == 3


# ---------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("key", ["colour", "Depth", "depth ", "", "lr", "__class__"])
def test_unknown_keys_are_named(key):
    for make in (RunConfig.from_dict, RunConfig.from_query):
        with pytest.raises(ValueError) as info:
            make({key: "1"})
        assert repr(key) in str(info.value)
    with pytest.raises(ValueError) as info:
        RunConfig.from_json(json.dumps({key: 1}))
    assert repr(key) in str(info.value)
    with pytest.raises(ValueError):
        RunConfig().replace(**{key: 1})


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[]", "null", "3", '"depth"', "{", '{"depth": NaN}', '{"depth": 1e400}'],
)
def test_from_json_refuses_anything_but_an_object_of_fields(text):
    with pytest.raises(ValueError):
        RunConfig.from_json(text)


@pytest.mark.parametrize(
    "field, text",
    [
        ("depth", "abc"),
        ("depth", "1e3"),
        ("depth", "4.0"),
        ("depth", ""),
        ("learning_rate", "fast"),
        ("learning_rate", "nan"),
        ("learning_rate", "-inf"),
        ("residual", "maybe"),
        ("residual", ""),
        ("seed", "0x10"),
        ("steps", "-5"),
        ("activation", "ReLU"),
        ("dropout", "1"),
    ],
)
def test_query_strings_that_do_not_parse_name_their_field(field, text):
    with pytest.raises(ValueError) as info:
        RunConfig.from_query({field: text})
    assert names_field(str(info.value), field), str(info.value)


def test_query_values_must_be_strings_or_one_element_lists():
    assert RunConfig.from_query({"depth": ["7"]}).depth == 7
    for value in (7, ["7", "8"], None):
        with pytest.raises(ValueError, match="`depth`"):
            RunConfig.from_query({"depth": value})


# ---------------------------------------------------------------- cross-field conflicts


@pytest.mark.parametrize(
    "values, fields",
    [
        ({"architecture": "cnn", "dataset": "spirals"}, ("architecture",)),
        ({"architecture": "rnn", "dataset": "moons"}, ("architecture",)),
        ({"dataset": "adding"}, ("dataset",)),
        ({"dataset": "file"}, ("dataset", "data_path")),
        ({"data_path": "x.npz"}, ("data_path",)),
        ({"dataset": "regression", "loss": "sparse_categorical_crossentropy"}, ("loss",)),
        ({"dataset": "regression", "loss": "categorical_crossentropy"}, ("loss",)),
        ({"loss": "binary_crossentropy"}, ("loss",)),
        ({"loss": "binary_crossentropy", "dataset": "gaussians"}, ("loss",)),
        # It completed with nothing recorded, no loss, no table, no warning.
        ({"steps": 20, "record_every": 50}, ("record_every",)),
    ],
)
def test_contradicting_fields_name_a_field(values, fields):
    with pytest.raises(ValueError) as info:
        RunConfig(**values)
    assert any(names_field(str(info.value), field) for field in fields), str(info.value)


# ---------------------------------------------------------------- property-based


def _valid_values(field):
    if field in INTEGER_RANGES:
        low, high = INTEGER_RANGES[field]
        return st.integers(low, high)
    if field in NUMBER_RANGES:
        low, high, low_allowed = NUMBER_RANGES[field]
        return st.floats(low, high, exclude_min=not low_allowed, allow_nan=False)
    if field in CHOICES:
        return st.sampled_from(CHOICES[field])
    if field in FLAGS:
        return st.booleans()
    # Text that the query form keeps as it is (see the xfail test below for the rest).
    return st.text(st.characters(blacklist_categories=("Z", "C")), min_size=1, max_size=40).filter(
        lambda text: text.strip() == text and text.lower() not in ("none", "null")
    )


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = [
    *INTEGER_RANGES,
    *NUMBER_RANGES,
    *CHOICES,
    *FLAGS,
    *TEXTS,
]


@st.composite
def field_dicts(draw):
    chosen = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=6))
    values = {}
    for field in chosen:
        # Mostly valid values, so that many examples reach the round trip.
        junk = draw(st.integers(0, 9)) == 0
        values[field] = draw(JUNK if junk else _valid_values(field))
    if draw(st.integers(0, 9)) == 0:
        values[draw(st.text(min_size=1, max_size=8))] = draw(JUNK)
    return values


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field_dicts())
def test_random_dicts_give_a_round_tripping_config_or_a_named_error(values):
    try:
        config = RunConfig.from_dict(values)
    except ValueError as error:
        message = str(error)
        if message.startswith("Unknown RunConfig field"):
            assert any(repr(key) in message for key in values if key not in FIELDS)
        else:
            assert any(names_field(message, field) for field in values), message
        return
    # Anything else (TypeError, OverflowError, ...) fails the test by propagating.
    event("valid config")
    assert RunConfig.from_dict(config.to_dict()) == config
    assert RunConfig.from_json(config.to_json()) == config
    assert RunConfig.from_query(config.to_query()) == config
    # The JSON is strict: no NaN or Infinity can get into a saved config.
    json.loads(config.to_json(), parse_constant=_refuse_constant)


def _refuse_constant(name):
    raise AssertionError(f"non-standard JSON constant {name}")


# A blank name is refused (`test_config.py::test_a_blank_run_name_is_refused`).
@pytest.mark.parametrize("name", [" padded ", "none", "Null"])
def test_names_round_trip_through_the_query_form(name):
    config = RunConfig(name=name)
    assert RunConfig.from_query(config.to_query()) == config


# ---------------------------------------------------------------- the user's data file


def _load(tmp_path, architecture="mlp", loss="auto", **arrays):
    from gradflow.lab.datasets import load_dataset

    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return load_dataset(
        RunConfig(dataset="file", data_path=str(path), architecture=architecture, loss=loss)
    )


X = np.arange(40, dtype="float32").reshape(20, 2)
Y = np.arange(20) % 2


@pytest.mark.parametrize(
    "arrays, pattern",
    [
        # Refused by the loader itself (an axis of length 0), in its own words.
        ({"x": np.zeros((0, 2), "float32"), "y": np.zeros(0, "int64")}, "'x' has no examples"),
        ({"x": np.float32(1.0), "y": np.int64(1)}, "empty"),
        ({"x": X, "y": Y[:15]}, "one row per example"),
        ({"x": X, "y": np.int64(1)}, "one row per example"),
        ({"x": X, "y": np.where(Y == 1, -1, 0)}, "labels must be whole numbers"),
        (
            {"x_train": X, "y_train": Y, "x_val": X[:4], "y_val": np.array([0, 1, -3, 1])},
            "labels must be whole numbers",
        ),
        ({"x_train": X, "y_train": Y, "x_val": X[:4], "y_val": Y[:3]}, "one row per example"),
        # It failed in Keras's input checks at the first validation, after an epoch.
        ({"x_train": X, "y_train": Y, "x_val": X[:4, :1], "y_val": Y[:4]}, "same features"),
        ({"x": np.where(X > 30, np.nan, X), "y": Y}, "finite"),
        ({"x": np.where(X > 30, np.inf, X), "y": Y}, "finite"),
        ({"data": X, "answers": Y}, "must hold arrays named 'x' and 'y'"),
    ],
    ids=[
        "empty",
        "scalar",
        "short-y",
        "scalar-y",
        "negative-label",
        "bad-val-label",
        "short-val-y",
        "val-features",
        "nan-x",
        "inf-x",
        "wrong-names",
    ],
)
def test_bad_data_files_fail_with_a_clear_value_error(tmp_path, arrays, pattern):
    with pytest.raises(ValueError, match=pattern):
        _load(tmp_path, **arrays)


def test_one_huge_label_is_refused_before_a_model_is_built(tmp_path):
    y = Y.copy()
    y[3] = 2_000_000_000
    with pytest.raises(ValueError, match="label"):
        _load(tmp_path, x=X, y=y)


def test_binary_loss_on_a_three_class_file_says_how_many_classes(tmp_path):
    with pytest.raises(ValueError, match="needs 2 classes, the data have 3"):
        _load(tmp_path, loss="binary_crossentropy", x=X, y=np.arange(20) % 3)


def test_images_for_a_cnn_must_have_an_image_shape(tmp_path):
    with pytest.raises(ValueError, match="architecture='cnn' needs images"):
        _load(tmp_path, architecture="cnn", x=X, y=Y)


def test_object_arrays_in_a_file_are_refused_as_unsafe(tmp_path):
    from gradflow.lab.datasets import load_dataset

    path = tmp_path / "data.npz"
    np.savez(path, x=np.array([{"a": 1}] * 20, dtype=object), y=Y)
    with pytest.raises(UnsafeInputError):
        load_dataset(RunConfig(dataset="file", data_path=str(path)))


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", b"not a zip at all"])
def test_corrupt_npz_files_are_refused_as_unsafe(tmp_path, content):
    from gradflow.lab.datasets import load_dataset

    path = tmp_path / "data.npz"
    path.write_bytes(content)
    with pytest.raises(UnsafeInputError):
        load_dataset(RunConfig(dataset="file", data_path=str(path)))


@pytest.mark.parametrize(
    "labels",
    [Y[:, np.newaxis], np.eye(2, dtype="float32")[Y]],
    ids=["a column of class numbers (CIFAR-10's)", "one-hot rows"],
)
def test_class_labels_in_keras_other_layouts_are_classes(tmp_path, labels):
    """They trained as a regression (a linear output, mse, no accuracy) without a word."""
    data = _load(tmp_path, x=X, y=labels)
    assert data.task == "classification" and data.n_classes == 2
    assert "2 classes" in data.description
    # A float column stays a target to predict.
    assert _load(tmp_path, x=X, y=X[:, :1] / 7).task == "regression"


@pytest.mark.parametrize(
    "arrays",
    [{"arr_0": X, "arr_1": Y}, {"X": X, "Y": Y}, {"features": X, "labels": Y}],
    ids=["np.savez(f, x, y)", "upper case", "features and labels"],
)
def test_arrays_named_as_people_name_them_load(tmp_path, arrays):
    """Only `x` and `y` were read: `np.savez(f, x, y)` stores `arr_0` and `arr_1`."""
    data = _load(tmp_path, **arrays)
    assert data.n_classes == 2 and len(data.x_train) + len(data.x_val) == 20


def test_a_good_file_loads(tmp_path):
    # The control case: the checks above refuse bad files, not every file.
    data = _load(tmp_path, x=X, y=Y)
    assert data.n_classes == 2 and len(data.x_train) + len(data.x_val) == 20


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--depth", "0"], "depth"),
        (["--depth", "1.5"], "depth"),
        (["--width", "-3"], "width"),
        (["--learning-rate", "inf"], "learning_rate"),
        (["--learning-rate", "0"], "learning_rate"),
        (["--steps", ""], "steps"),
        (["--dropout", "0.95"], "dropout"),
        (["--seed", "99999999999"], "seed"),
        (["--optimizer", "SGD"], "optimizer"),
        (["--dataset", "file"], "dataset"),
    ],
)
def test_cli_bad_flags_exit_2_with_one_line_and_no_traceback(tmp_path, flags, field):
    result = subprocess.run(
        [sys.executable, "-m", "gradflow", "train", *flags, "--db", str(tmp_path / "runs.db")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    # Named by its flag (the message's `learning_rate` was not what was typed).
    assert f"--{field.replace('_', '-')}" in result.stderr, result.stderr
