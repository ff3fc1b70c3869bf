"""RunConfig: validation messages, cross-field rules, round trips, no TensorFlow."""

import dataclasses
import json
import subprocess
import sys

import pytest

from gradflow.lab.config import RunConfig, field_table
from gradflow.lab.presets import PRESETS, get_preset


def test_defaults_are_valid_and_small():
    config = RunConfig()
    assert (config.architecture, config.dataset, config.optimizer) == ("mlp", "digits", "sgd")
    assert config.steps <= 1000 and config.depth <= 10 and config.width <= 64
    assert config.to_query() == {}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"depth": 0}, "`depth` must be an integer from 1 to 100, got 0."),
        ({"depth": 101}, "`depth` must be an integer from 1 to 100, got 101."),
        ({"depth": "3"}, "`depth` must be an integer from 1 to 100, got '3' (a str)."),
        ({"depth": True}, "`depth` must be an integer from 1 to 100, got True (a bool)."),
        ({"depth": 2.5}, "`depth` must be an integer from 1 to 100, got 2.5."),
        ({"width": 1025}, "`width` must be an integer from 1 to 1024"),
        ({"learning_rate": 0}, "`learning_rate` must be a number greater than 0"),
        ({"learning_rate": 2e4}, "at most 10000, got 20000.0."),
        ({"learning_rate": float("nan")}, "`learning_rate` must be a number"),
        ({"learning_rate": "0.1"}, "got '0.1' (a str)"),
        ({"dropout": 0.95}, "`dropout` must be a number at least 0 and at most 0.9, got 0.95."),
        ({"dropout": -0.1}, "`dropout`"),
        ({"batch_size": 0}, "`batch_size` must be an integer from 1 to 4096"),
        ({"steps": 0}, "`steps`"),
        ({"epochs": 0}, "`epochs` must be None or an integer from 1 to 10000, got 0."),
        ({"clip_value": 0.0}, "`clip_value` must be a number greater than 0"),
        ({"max_norm": -1.0}, "`max_norm` must be None or a number greater than 0"),
        ({"record_every": 0}, "`record_every`"),
        ({"seed": -1}, "`seed`"),
        ({"residual": 1}, "`residual` must be True or False, got 1."),
        ({"activation": "Relu"}, "`activation` must be one of 'relu', 'leaky_relu'"),
        ({"initializer": "orthogonal"}, "`initializer` must be one of"),
        ({"optimizer": "lbfgs"}, "`optimizer` must be one of 'sgd', 'momentum'"),
        ({"loss": "hinge"}, "`loss` must be one of 'auto'"),
        ({"dataset": "imagenet"}, "`dataset` must be one of 'digits'"),
        ({"name": 3}, "`name` must be None or a string"),
        # Combinations that cannot train.
        ({"architecture": "cnn", "dataset": "moons"}, "`architecture='cnn'` needs an image"),
        ({"architecture": "rnn", "dataset": "xor"}, "`architecture='rnn'` needs a sequence"),
        (
            {"dataset": "adding"},
            "`dataset='adding'` is a sequence task and needs architecture='rnn'",
        ),
        ({"dataset": "file"}, "`dataset='file'` needs `data_path`"),
        ({"data_path": "x.npz"}, "`data_path` is only used with dataset='file'"),
        ({"dataset": "regression", "loss": "sparse_categorical_crossentropy"}, "regression task"),
        ({"loss": "binary_crossentropy"}, "needs two classes, but dataset='digits'"),
    ],
)
def test_invalid_values_name_the_field_and_what_is_allowed(changes, message):
    with pytest.raises(ValueError) as info:
        RunConfig(**changes)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "changes",
    [
        {"architecture": "cnn", "dataset": "mnist"},
        {"architecture": "rnn", "dataset": "adding", "rnn_cell": "gru"},
        {"architecture": "residual_mlp", "dataset": "spirals"},
        {"dataset": "moons", "loss": "binary_crossentropy"},
        {"dataset": "file", "data_path": "/tmp/data.npz", "architecture": "cnn"},
        {"learning_rate": 1e4, "clipping": "global_norm", "clip_value": 0.5},
        {"epochs": 3, "max_norm": 2.0, "dropout": 0.9},
    ],
)
def test_valid_combinations(changes):
    config = RunConfig(**changes)
    assert RunConfig.from_dict(config.to_dict()) == config


def test_integral_numbers_are_normalized():
    import numpy as np

    config = RunConfig(depth=np.int64(7), learning_rate=1)
    assert type(config.depth) is int and config.depth == 7
    assert type(config.learning_rate) is float and config.learning_rate == 1.0


def test_residual_mlp_implies_residual_connections():
    assert RunConfig(architecture="residual_mlp").residual_connections
    assert RunConfig(residual=True).residual_connections
    assert not RunConfig().residual_connections


def test_frozen_and_replace_validates():
    config = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.depth = 3
    assert config.replace(depth=8).depth == 8
    with pytest.raises(ValueError, match="`depth` must be an integer"):
        config.replace(depth=0)
    with pytest.raises(ValueError, match="Unknown RunConfig field\\(s\\) 'dpeth'"):
        config.replace(dpeth=3)


def test_dict_and_json_round_trip():
    config = RunConfig(depth=7, activation="tanh", epochs=2, max_norm=3.0, name="demo")
    assert RunConfig.from_json(config.to_json()) == config
    assert json.loads(config.to_json())["depth"] == 7
    with pytest.raises(ValueError, match="Unknown RunConfig field\\(s\\) 'colour'"):
        RunConfig.from_dict({"colour": "red"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        RunConfig.from_json("{not json")
    with pytest.raises(ValueError, match="needs a dict"):
        RunConfig.from_json("[1, 2]")


def test_query_holds_only_changed_fields_and_round_trips():
    config = RunConfig(
        depth=12, residual=True, learning_rate=0.003, epochs=4, max_norm=1.5, name="a b"
    )
    query = config.to_query()
    assert query == {
        "depth": "12",
        "residual": "true",
        "learning_rate": "0.003",
        "epochs": "4",
        "max_norm": "1.5",
        "name": "a b",
    }
    assert all(isinstance(value, str) for value in query.values())
    assert RunConfig.from_query(query) == config
    # Query-string parsers give lists; "none" resets an optional field.
    assert RunConfig.from_query({"depth": ["5"], "epochs": "none"}) == RunConfig(depth=5)


@pytest.mark.parametrize(
    "query, message",
    [
        ({"depth": "three"}, "`depth` must be an integer from 1 to 100, got 'three'."),
        ({"depth": "0"}, "`depth` must be an integer from 1 to 100, got 0."),
        ({"learning_rate": "fast"}, "`learning_rate` must be a number, got 'fast'."),
        ({"residual": "maybe"}, "`residual` must be true or false, got 'maybe'."),
        ({"activation": "softmax"}, "`activation` must be one of"),
        ({"wdth": "3"}, "Unknown RunConfig field(s) 'wdth'"),
    ],
)
def test_from_query_rejects_bad_strings(query, message):
    with pytest.raises(ValueError) as info:
        RunConfig.from_query(query)
    assert message in str(info.value)


def test_field_table_describes_every_field():
    table = field_table()
    assert [name for name, _, _ in table] == [f.name for f in dataclasses.fields(RunConfig)]
    for name, _, meta in table:
        assert meta["kind"] in ("choice", "int", "float", "bool", "str"), name
        assert meta["help"], name


def test_presets_are_valid_and_paired():
    assert {
        "deep_sigmoid",
        "relu_he",
        "large_init",
        "large_init_clipped",
        "batch_norm",
        "residual",
        "dead_relu",
        "rnn_simple",
        "rnn_lstm",
    } <= set(PRESETS)
    for key, preset in PRESETS.items():
        assert preset.key == key and preset.description
        assert RunConfig.from_query(preset.config.to_query()) == preset.config
        if preset.compare_with:
            assert preset.compare_with in PRESETS
    assert get_preset("large_init_clipped").config.clipping == "global_norm"
    with pytest.raises(ValueError, match="Unknown preset 'nope'; the presets are deep_sigmoid"):
        get_preset("nope")


def test_the_exploding_preset_records_the_gradient_that_doubles_on_its_way_back(tmp_path):
    """Its text said gradients double per layer, but it recorded only the weights'
    gradients, which are flat (280-430 in every layer); a lecturer found no doubling."""
    import gradflow

    config = dataclasses.replace(get_preset("large_init").config, steps=1)
    run = gradflow.train(config, store=tmp_path / "runs.db")
    outputs = run.layer_stats[run.layer_stats["tensor"] == "activation"]
    hidden = outputs[outputs["layer"].str.startswith("dense_")].sort_values("layer_index")
    norms = hidden["l2_norm"].to_numpy()
    assert len(norms) == 8 and "Activations" in get_preset("large_init").description
    assert (norms[:-1] > 1.3 * norms[1:]).all(), norms  # larger at each layer nearer the input
    assert norms[0] > 50 * norms[-1]


def test_config_and_presets_do_not_import_tensorflow():
    code = (
        "import sys, gradflow.lab.config, gradflow.lab.presets; "
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["", "   ", "\t\n"])
def test_a_blank_run_name_is_refused(name):
    """`--name "   "` named a run that showed as nothing in lists, subtitles and file names."""
    with pytest.raises(ValueError, match="`name` must be None or hold a visible character"):
        RunConfig(name=name)
