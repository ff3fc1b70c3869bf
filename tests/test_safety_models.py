"""gradflow.safe_load_model: real models load, hostile `.keras` files are refused.

Every attack file is built here, in tmp_path, either by saving a real model
that carries the gadget or by writing the zip and config.json by hand. A
refusal must be an UnsafeInputError saying what was found and where, the
canary file a gadget would create must stay absent, and refusals that happen
before the child process must not allocate what the file declares.
"""

import copy
import io
import json
import os
import tempfile
import tracemalloc
import zipfile

import h5py
import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradflow import UnsafeInputError, safe_load_model
from gradflow.safety.models import check_keras_file

MiB = 2**20


# ---------------------------------------------------------------- helpers


def write_keras(path, config, weights=b"", metadata=None, extra=()):
    """Writes a `.keras` zip by hand, the way an attacker would."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("metadata.json", json.dumps(metadata or {"keras_version": "3.15.1"}))
        text = config if isinstance(config, str) else json.dumps(config)
        archive.writestr("config.json", text)
        archive.writestr("model.weights.h5", weights)
        for name, data in extra:
            archive.writestr(name, data)
    return path


def read_entry(path, name):
    with zipfile.ZipFile(path) as archive:
        return archive.read(name)


def h5_bytes(build):
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        build(f)
    return buffer.getvalue()


def refused_with_peak(fn):
    tracemalloc.start()
    try:
        fn()
    except UnsafeInputError as e:
        error = e
    else:
        error = None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert error is not None, "the file was not refused"
    return str(error), peak


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A real saved Sequential model: (path, config dict, weights bytes)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(2)]
    )
    path = tmp_path_factory.mktemp("tiny") / "tiny.keras"
    model.save(path)
    return path, json.loads(read_entry(path, "config.json")), read_entry(path, "model.weights.h5")


def with_layer(config, layer, at=1):
    config = copy.deepcopy(config)
    config["config"]["layers"].insert(at, layer)
    return config


def layer(class_name, module="keras.layers", registered_name=None, **config):
    return {
        "module": module,
        "class_name": class_name,
        "config": {"name": class_name.lower(), **config},
        "registered_name": registered_name,
    }


# ---------------------------------------------------------------- happy paths


def test_sequential_loads_and_predicts_like_the_original(tmp_path):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6, 3)),
            keras.layers.Conv1D(4, 3, activation="gelu", kernel_regularizer="l2"),
            keras.layers.BatchNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(5, kernel_constraint="max_norm", activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x = np.random.default_rng(0).normal(size=(8, 6, 3)).astype("float32")
    model.fit(x, np.arange(8) % 5, epochs=1, verbose=0)  # non-trivial moving statistics
    model.save(tmp_path / "seq.keras")

    loaded = safe_load_model(tmp_path / "seq.keras")

    assert [type(layer).__name__ for layer in loaded.layers] == [
        type(layer).__name__ for layer in model.layers
    ]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def test_functional_recurrent_model_loads_and_predicts_like_the_original(tmp_path):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5, 3))
    sequence = keras.layers.LSTM(4, return_sequences=True)(inputs)
    summary = keras.layers.Bidirectional(keras.layers.GRU(2))(sequence)
    skip = keras.layers.GlobalAveragePooling1D()(sequence)
    merged = keras.layers.Concatenate()([summary, skip])
    outputs = keras.layers.Dense(1, activation="sigmoid")(merged)
    model = keras.Model(inputs, outputs)
    model.save(tmp_path / "fn.keras")
    x = np.random.default_rng(1).normal(size=(4, 5, 3)).astype("float32")

    loaded = safe_load_model(tmp_path / "fn.keras")

    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def cnn():
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            L.Conv2D(4, 3, padding="same"),
            L.LeakyReLU(),
            L.MaxPooling2D(),
            L.SeparableConv2D(4, 3),
            L.DepthwiseConv2D(2),
            L.GlobalAveragePooling2D(),
            L.LayerNormalization(),
            L.Dense(3, activation="softmax"),
        ]
    )


def embedding_rnn():
    L = keras.layers
    inputs = keras.Input((6,), dtype="int32")
    sequence = L.SimpleRNN(3, return_sequences=True)(L.Embedding(20, 4)(inputs))
    outputs = L.Dense(1)(L.Flatten()(L.TimeDistributed(L.Dense(2))(sequence)))
    return keras.Model(inputs, outputs)


def residual():
    L = keras.layers
    inputs = keras.Input((5,))
    hidden = L.PReLU()(L.Dense(5, kernel_initializer="he_normal")(inputs))
    merged = L.UnitNormalization()(L.Add()([inputs, hidden]))
    regularizer = keras.regularizers.L1L2(0.1, 0.1)
    return keras.Model(inputs, L.Dense(2, kernel_regularizer=regularizer)(merged))


def nested():
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.ReLU()])
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(1)(inner(inputs)))


@pytest.mark.parametrize("build", [cnn, embedding_rnn, residual, nested])
def test_common_architectures_pass_the_checks(tmp_path, build):
    model = build()
    # Loss and metric *functions* are saved as references; compile_config allows them.
    model.compile(
        keras.optimizers.Adam(1e-3),
        loss=keras.losses.mean_squared_error,
        metrics=[keras.metrics.mean_absolute_error, "mae"],
    )
    model.save(tmp_path / "m.keras")
    config = check_keras_file(
        tmp_path / "m.keras", max_bytes=MiB, max_entries=16, max_weight_entries=10_000
    )
    assert config["class_name"] == type(model).__name__


def written_with_ops():
    """`x + shortcut`, `h * 2.0` and `keras.ops.mean`: Keras records them as op layers."""
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(6, activation="relu")(inputs)
    merged = keras.ops.mean((hidden + inputs) * 2.0, axis=-1, keepdims=True)
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Rescaling(0.5)(merged)))


def attention_and_preprocessing():
    L = keras.layers
    inputs = keras.Input((4, 8))
    scaled = L.Normalization(mean=0.5, variance=4.0)(inputs)
    attended = L.MultiHeadAttention(num_heads=2, key_dim=4)(scaled, scaled)
    projected = L.EinsumDense("abc,cd->abd", output_shape=(None, 5), bias_axes="d")(attended)
    pooled = L.GlobalAveragePooling1D()(L.ActivityRegularization(l2=0.01)(projected))
    return keras.Model(inputs, L.Dense(3)(pooled))


def conv_lstm():
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input((3, 6, 6, 2)),
            L.ConvLSTM2D(4, 3),
            L.RandomFlip("horizontal"),
            L.Flatten(),
            L.Dense(2),
        ]
    )


@pytest.mark.parametrize("build", [written_with_ops, attention_and_preprocessing, conv_lstm])
def test_common_layers_and_op_layers_load_and_predict_like_the_original(tmp_path, build):
    """A residual `x + shortcut` was refused as "the CVE-2025-1550 gadget"."""
    keras.utils.set_random_seed(3)
    model = build()
    shape = (5, *model.input_shape[1:])
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    model.save(tmp_path / "m.keras")
    loaded = safe_load_model(tmp_path / "m.keras")
    assert loaded.count_params() == model.count_params()
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-5)


def test_ops_that_make_arrays_of_a_size_from_the_config_are_still_refused(tmp_path):
    inputs = keras.Input((3,))
    filled = keras.ops.add(inputs, keras.ops.tile(inputs, (1, 1)))
    model = keras.Model(inputs, keras.layers.Dense(1)(filled))
    model.save(tmp_path / "tile.keras")
    with pytest.raises(UnsafeInputError, match="'Tile'"):
        safe_load_model(tmp_path / "tile.keras")


@keras.saving.register_keras_serializable("gradflow_tests")
def shifted_mse(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred + 1.0), axis=-1)


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        (keras.losses.SparseCategoricalCrossentropy(from_logits=True), "logits"),
        ("sparse_categorical_crossentropy", "probabilities"),
        (shifted_mse, None),  # the user's own: not rebuilt, and not refused either
    ],
)
def test_the_saved_loss_comes_back_with_its_settings(tmp_path, loss, expected):
    """A logits model read with the bare loss name got gradients 3-5x too large."""
    import tensorflow as tf

    import gradflow

    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(5)(inputs)))
    model.compile(optimizer="adam", loss=loss)
    model.save(tmp_path / "m.keras")
    loaded = safe_load_model(tmp_path / "m.keras")
    if expected is None:
        assert getattr(loaded, "loss", None) is None
        return
    assert isinstance(loaded.loss, keras.losses.SparseCategoricalCrossentropy)
    assert loaded.loss.get_config()["from_logits"] is (expected == "logits")
    x = np.random.default_rng(0).normal(size=(6, 4)).astype("float32")
    y = np.arange(6) % 3
    reference = keras.losses.SparseCategoricalCrossentropy(from_logits=expected == "logits")
    with tf.GradientTape() as tape:
        value = reference(y, loaded(x))
    gradients = tape.gradient(value, loaded.trainable_variables)
    shot = gradflow.snapshot(loaded, x, y)
    np.testing.assert_allclose(shot.loss, float(value), rtol=1e-6)
    np.testing.assert_allclose(
        shot.weights["l2_norm"], [np.linalg.norm(g) for g in gradients], rtol=1e-5
    )


# ---------------------------------------------------------------- code execution


def test_a_model_saved_before_it_was_built_is_explained_not_keras_words(tmp_path):
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])
    path = tmp_path / "unbuilt.keras"
    with pytest.warns(UserWarning, match="not yet been built"):
        model.save(path)
    with pytest.raises(UnsafeInputError, match="saved before it was built") as caught:
        safe_load_model(path)
    assert "count_params" not in str(caught.value)


def test_lambda_layer_that_writes_a_file_is_refused(tmp_path):
    canary = tmp_path / "canary.txt"
    # Built from source text so the saved bytecode holds the path as a constant.
    gadget = eval(
        f"lambda x: (__import__('pathlib').Path({str(canary)!r}).write_text('pwned'), x)[1]"
    )
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Lambda(gadget), keras.layers.Dense(1)]
    )
    model.save(tmp_path / "lambda.keras")
    canary.unlink()  # building the model ran the lambda once

    with pytest.raises(UnsafeInputError) as caught:
        safe_load_model(tmp_path / "lambda.keras")

    message = str(caught.value)
    assert "'Lambda'" in message and "config.layers[1] in config.json" in message
    assert "CVE-2024-3660" in message and "model.save('m.keras')" in message
    assert not canary.exists()
    # Control: the file really is an exploit when loaded carelessly.
    keras.saving.load_model(tmp_path / "lambda.keras", safe_mode=False)
    assert canary.read_text() == "pwned"


@pytest.mark.parametrize(
    "gadget, found",
    [
        ({"module": "os", "class_name": "system", "config": {}}, "'os'"),
        ({"module": "subprocess", "class_name": "check_output", "config": {}}, "'subprocess'"),
        ({"module": "builtins", "class_name": "exec", "config": {}}, "'builtins'"),
        ({"module": "os", "class_name": "function", "config": "system"}, "Python function"),
        ({"module": "keras.src.ops", "class_name": "Add", "config": {}}, "'keras.src.ops'"),
    ],
)
def test_module_import_gadget_is_refused_at_any_depth(tmp_path, tiny, gadget, found):
    canary = tmp_path / "canary.txt"
    gadget = copy.deepcopy(gadget)
    if isinstance(gadget["config"], dict):
        gadget["config"]["command"] = f"touch {canary}"
    gadget["registered_name"] = None
    config = copy.deepcopy(tiny[1])
    # Deep inside a layer, where a top-level scan would not look (CVE-2025-1550).
    config["config"]["layers"][1]["config"]["kernel_initializer"] = gadget
    path = write_keras(tmp_path / "gadget.keras", config, tiny[2])

    with pytest.raises(UnsafeInputError) as caught:
        safe_load_model(path)

    assert found in str(caught.value)
    assert "config.layers[1].config.kernel_initializer in config.json" in str(caught.value)
    assert not canary.exists()


@pytest.mark.parametrize(
    "bad, message",
    [
        (layer("StringLookup", vocabulary="/etc/passwd"), "CVE-2025-12058"),
        (layer("IntegerLookup", vocabulary="/etc/passwd"), "CVE-2025-12058"),
        (layer("TextVectorization", vocabulary="/etc/passwd"), "TextVectorization"),
        (layer("TFSMLayer", filepath="/srv/other-user/model"), "SavedModel from a path"),
        (layer("TorchModuleWrapper", module="keras.layers"), "unpickles"),
        (layer("MyLayer", module="my_package.layers"), "'my_package.layers'"),
        (layer("Dense", registered_name="evil>Dense", units=2), "'evil>Dense', a custom object"),
        (layer("CategoryEncoding"), "not on gradflow's allow-list"),
        (layer("Dense", units=2, activation="os.system"), "activation='os.system'"),
        (layer("Dense", units=2, kernel_initializer="exec"), "built-in Keras initializer"),
        (layer("Dense", units=2, f={"class_name": "__lambda__", "config": {}}), "bytecode"),
        (layer("Dense", units=2, t={"class_name": "__typespec__", "config": []}), "type spec"),
    ],
)
def test_layers_that_run_code_or_read_files_are_refused(tmp_path, tiny, bad, message):
    path = write_keras(tmp_path / "bad.keras", with_layer(tiny[1], bad), tiny[2])
    with pytest.raises(UnsafeInputError) as caught:
        safe_load_model(path)
    assert message in str(caught.value)
    assert "config.layers[1]" in str(caught.value)


# ---------------------------------------------------------------- archive structure


def test_legacy_hdf5_model_is_refused_by_its_magic_bytes(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.save(tmp_path / "legacy.h5")
    renamed = tmp_path / "innocent.keras"
    renamed.write_bytes((tmp_path / "legacy.h5").read_bytes())

    for path in (tmp_path / "legacy.h5", renamed):
        with pytest.raises(UnsafeInputError) as caught:
            safe_load_model(path)
        assert "HDF5" in str(caught.value) and "model.save('m.keras')" in str(caught.value)


def test_zip_bomb_is_refused_without_decompressing(tmp_path, tiny):
    path = tmp_path / "bomb.keras"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("metadata.json", json.dumps({"keras_version": "3.15.1"}))
        archive.writestr("config.json", json.dumps(tiny[1]))
        archive.writestr("model.weights.h5", bytes(48 * MiB))
    assert path.stat().st_size < MiB

    message, peak = refused_with_peak(lambda: safe_load_model(path))

    assert "zip bomb" in message and "'model.weights.h5'" in message
    assert peak < 8 * MiB


def test_weight_shape_bomb_is_refused_before_anything_is_built(tmp_path, tiny):
    bomb = layer("Dense", units=10**9)
    bomb["build_config"] = {"input_shape": [None, 4]}
    path = write_keras(tmp_path / "shape.keras", with_layer(tiny[1], bomb), tiny[2])

    message, peak = refused_with_peak(lambda: safe_load_model(path))

    assert "5,000,000,000 weight values" in message and "`max_weight_entries`" in message
    assert peak < 8 * MiB


def test_embedding_bomb_is_refused(tmp_path, tiny):
    bomb = layer("Embedding", input_dim=10**7, output_dim=10**3)
    path = write_keras(tmp_path / "emb.keras", with_layer(tiny[1], bomb), tiny[2])
    with pytest.raises(UnsafeInputError, match="10,000,000,000 weight values"):
        safe_load_model(path)


def inside_a_sequential(inner):
    """`inner` as a layer of a Sequential."""
    return keras.Sequential([keras.Input((4,)), inner])


def two_deep_in_a_functional(inner):
    """`inner` inside a Sequential inside a Functional model."""
    middle = keras.Sequential([keras.Input((4,)), inner], name="middle")
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(middle(inputs))
    return keras.Model(inputs, outputs)


def sublayer(model, name):
    for inner in getattr(model, "layers", []):
        found = inner if inner.name == name else sublayer(inner, name)
        if found is not None:
            return found
    return None


@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")  # the control load
@pytest.mark.parametrize("wrap", [inside_a_sequential, two_deep_in_a_functional])
def test_a_nested_model_saved_compiled_loads_without_its_training_settings(tmp_path, wrap):
    """`compile=False` skips only the top-level compile_config: Keras compiled the nested
    one, so a metric of 100,000 classes made an 80 GB matrix. A compiled pretrained
    backbone inside a new model is the transfer-learning recipe: refused, it could not be
    inspected at all (the review); its settings are dropped instead."""
    keras.utils.set_random_seed(5)
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="inner")
    outer = wrap(inner)
    outer.compile(optimizer="adam", loss="mse")
    inner.compile(optimizer="adam", loss="mse", metrics=[keras.metrics.MeanIoU(num_classes=3)])
    outer.save(tmp_path / "compiled.keras")
    # Control: Keras builds the nested metric although the model is loaded uncompiled.
    careless = keras.saving.load_model(tmp_path / "compiled.keras", compile=False)
    assert sublayer(careless, "inner").compiled and not careless.compiled
    # The same file with 100,000 classes: Keras would allocate an 80 GB confusion matrix.
    text = read_entry(tmp_path / "compiled.keras", "config.json").decode()
    assert text.count('"num_classes": 3') == 1
    text = text.replace('"num_classes": 3', '"num_classes": 100000')
    weights = read_entry(tmp_path / "compiled.keras", "model.weights.h5")
    path = write_keras(tmp_path / "bomb.keras", text, weights)
    before = path.read_bytes()

    tracemalloc.start()
    try:
        loaded = safe_load_model(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert peak < 64 * MiB  # no confusion matrix
    assert not sublayer(loaded, "inner").compiled
    assert isinstance(loaded.loss, keras.losses.MeanSquaredError)  # the outer model's
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), outer.predict(x, verbose=0), atol=1e-6)
    assert path.read_bytes() == before  # only the loader's private copy was rewritten


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            [("../../evil.py", b"print('pwned')")],
            "'../../evil.py', an absolute path or one with '..'",
        ),
        ([("/etc/cron.d/evil", b"")], "an absolute path"),
        ([("assets/vocabulary.txt", b"a\nb\n")], "extra entries such as assets/"),
    ],
)
def test_bad_entry_names_and_extra_entries_are_refused(tmp_path, tiny, extra, message):
    path = write_keras(tmp_path / "names.keras", tiny[1], tiny[2], extra=extra)
    with pytest.raises(UnsafeInputError) as caught:
        safe_load_model(path)
    assert message in str(caught.value)
    assert not (tmp_path.parent.parent / "evil.py").exists()


def deeply_nested(depth):
    node = {"class_name": "Zeros", "module": "keras.initializers", "config": {}}
    for _ in range(depth):
        node = {"wrap": node}
    return node


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda p, t: p.write_bytes(b"not a zip at all"), "not a zip archive"),
        (lambda p, t: write_keras(p, {"layers": []}, t[2]), "not a Keras model config"),
        (lambda p, t: write_keras(p, t[1], t[2], metadata={"keras_version": "2.15"}), "Keras 3"),
        (
            lambda p, t: write_keras(p, '{"x": ' * 100_000 + "1" + "}" * 100_000, t[2]),
            "not valid JSON",  # Python's own recursion limit, reported, not raised
        ),
        (
            lambda p, t: write_keras(p, {**t[1], "x": deeply_nested(100)}, t[2]),
            "nested deeper than 64",
        ),
    ],
)
def test_malformed_files_are_refused_with_a_message(tmp_path, tiny, build, message):
    path = tmp_path / "m.keras"
    build(path, tiny)
    with pytest.raises(UnsafeInputError) as caught:
        safe_load_model(path)
    assert message in str(caught.value)


def test_file_over_max_bytes_is_refused(tmp_path, tiny):
    with pytest.raises(UnsafeInputError, match="over the limit of `max_bytes`=1,000"):
        safe_load_model(tiny[0], max_bytes=1000)


@pytest.mark.parametrize("argument", ["max_bytes", "max_entries", "timeout", "memory_limit"])
def test_limit_arguments_are_validated(tiny, argument):
    with pytest.raises(ValueError, match=f"`{argument}` must be a positive"):
        safe_load_model(tiny[0], **{argument: 0})


@settings(max_examples=100, deadline=None)
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_corrupted_model_files_only_ever_raise_unsafe_input_error(tiny, flips, cut):
    data = bytearray(tiny[0].read_bytes())
    for position, byte in flips:
        data[position % len(data)] = byte
    if cut is not None:
        data = data[: cut % len(data)]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.keras")
        with open(path, "wb") as f:
            f.write(bytes(data))
        try:
            check_keras_file(path, max_bytes=MiB, max_entries=16, max_weight_entries=10**6)
        except UnsafeInputError:
            pass


# ---------------------------------------------------------------- weights file (child process)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda f, secret: f.create_dataset(
                "w", shape=(4,), dtype="f4", external=[(str(secret), 0, 16)]
            ),
            "external files",
        ),
        (lambda f, secret: f.__setitem__("l", h5py.ExternalLink(str(secret), "/")), "ExternalLink"),
        (lambda f, secret: f.__setitem__("s", h5py.SoftLink("/elsewhere")), "SoftLink"),
        (
            lambda f, secret: f.create_dataset("v", data=["a"], dtype=h5py.string_dtype()),
            "only numeric weights",
        ),
    ],
)
def test_hdf5_weights_that_reach_other_files_are_refused(tmp_path, tiny, build, message):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x00" * 16)
    path = write_keras(tmp_path / "w.keras", tiny[1], h5_bytes(lambda f: build(f, secret)))
    with pytest.raises(UnsafeInputError) as caught:
        safe_load_model(path)
    assert message in str(caught.value)


def test_model_that_builds_more_than_its_config_declares_is_stopped_by_the_memory_limit(
    tmp_path, tiny
):
    # A functional graph without build_configs whose recorded tensor shapes lie:
    # the config check estimates 60,000 weights, the graph builds 900,000,000.
    wide = 30_000
    config = {
        "module": "keras.src.models.functional",
        "class_name": "Functional",
        "registered_name": "Functional",
        "config": {
            "name": "liar",
            "layers": [
                {
                    **layer("InputLayer", batch_shape=[None, wide], dtype="float32"),
                    "name": "inputlayer",
                    "inbound_nodes": [],
                },
                {
                    **layer("Dense", units=wide),
                    "name": "dense",
                    "inbound_nodes": [
                        {
                            "args": [
                                {
                                    "class_name": "__keras_tensor__",
                                    "config": {
                                        "shape": [None, 1],
                                        "dtype": "float32",
                                        "keras_history": ["inputlayer", 0, 0],
                                    },
                                }
                            ],
                            "kwargs": {},
                        }
                    ],
                },
            ],
            "input_layers": [["inputlayer", 0, 0]],
            "output_layers": [["dense", 0, 0]],
        },
    }
    path = write_keras(tmp_path / "liar.keras", config, tiny[2])
    with pytest.raises(UnsafeInputError, match="memory_limit"):
        safe_load_model(path, max_weight_entries=10**9, memory_limit=3 * 2**30)


def test_slow_load_is_stopped_by_the_timeout(tiny):
    with pytest.raises(UnsafeInputError, match="longer than `timeout`=0.05 seconds"):
        safe_load_model(tiny[0], timeout=0.05)
