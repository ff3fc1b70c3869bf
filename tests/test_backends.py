"""gradflow needs Keras 3 on TensorFlow, float32 lab models and channels-last layers.

A user's `KERAS_BACKEND=jax` (or `~/.keras/keras.json`), a tf_keras (Keras 2)
model, `set_floatx("float16")` and `set_image_data_format("channels_first")`
each met a deep traceback or wrong numbers: they are said in words, kept out
of gradflow's own processes, or do not reach the lab's models.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import gradflow
from gradflow import checks
from gradflow.lab.config import RunConfig
from gradflow.lab.datasets import load_dataset
from gradflow.lab.models import build_model
from gradflow.probe.chain import chain_gradients, split_cnn, toy_batch
from gradflow.probe.examples import load_example

REPO = pathlib.Path(__file__).resolve().parent.parent
NEEDS_TENSORFLOW = "needs Keras 3 on the TensorFlow backend"


def tiny_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


# --- Another Keras backend -------------------------------------------------

# Each entry point in a process whose Keras runs on another backend; the last
# one uncaught, so that the process fails with it.
_OTHER_BACKEND_SCRIPT = textwrap.dedent(
    """
    import sys
    try:
        import keras
    except ImportError as error:  # this backend's own package is missing
        print(f"no backend: {error}")
        sys.exit(77)
    import numpy as np
    import gradflow

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    attempts = {
        "monitor": lambda: model.fit(
            x, y, callbacks=[gradflow.GradientMonitor()], verbose=0
        ),
        "chain": lambda: gradflow.chain_gradients([model], x, y),
        "train": lambda: gradflow.train(
            gradflow.RunConfig(depth=1, width=2, steps=1), store=sys.argv[1]
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except RuntimeError as error:
            print(f"{name}: {error}")
    gradflow.snapshot(model, x, y)
    """
)


def _run_on_backend(backend, tmp_path):
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", _OTHER_BACKEND_SCRIPT, str(tmp_path / "runs.db")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_entry_points_say_in_words_that_another_backend_cannot_run_them(tmp_path):
    """Under KERAS_BACKEND=numpy: "Cannot convert a symbolic tf.Tensor", an
    AttributeError on `distribute_strategy`, a failed lab run."""
    # Keras 3.15's numpy backend imports jax: without it, try the others.
    for backend in ("numpy", "jax", "torch"):
        done = _run_on_backend(backend, tmp_path)
        if done.returncode != 77:
            break
    else:
        pytest.skip("no other Keras backend can be imported here (numpy's needs jax)")
    assert done.returncode == 1, done.stdout + done.stderr
    said = f"uses {backend!r} (set by $KERAS_BACKEND={backend})"
    for name in ("monitor", "chain", "train"):
        assert f"{name}: gradflow." in done.stdout, done.stdout + done.stderr
    assert done.stdout.count(said) == 3, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: gradflow.snapshot {NEEDS_TENSORFLOW}"), done.stderr
    assert said in last and "KERAS_BACKEND=tensorflow python train.py" in last


@pytest.fixture
def jax_backend(monkeypatch):
    """This process's Keras (on TensorFlow) as if it were on jax, chosen by $KERAS_BACKEND."""
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    monkeypatch.setenv("KERAS_BACKEND", "jax")


@pytest.mark.parametrize(
    "name, attempt",
    [
        ("gradflow.snapshot", lambda m, x, y: gradflow.snapshot(m, x, y)),
        ("gradflow.snapshot", lambda m, x, y: gradflow.GradientProbe(m)),
        ("gradflow.input_sensitivity", lambda m, x, y: gradflow.input_sensitivity(m, x)),
        ("gradflow.chain_gradients", lambda m, x, y: gradflow.chain_gradients([m], x, y)),
        ("gradflow.GradientMonitor", lambda m, x, y: gradflow.GradientMonitor()),
        ("gradflow.GradientLog", lambda m, x, y: gradflow.GradientLog(m)),
    ],
)
def test_each_entry_point_checks_the_backend_first(jax_backend, name, attempt):
    model, x, y = tiny_model(), np.ones((2, 3), "float32"), np.ones((2, 1), "float32")
    with pytest.raises(RuntimeError) as caught:
        attempt(model, x, y)
    assert str(caught.value) == (
        f"{name} {NEEDS_TENSORFLOW}; this process uses 'jax' (set by $KERAS_BACKEND=jax). "
        "Set KERAS_BACKEND=tensorflow before Keras is imported (e.g. "
        "`KERAS_BACKEND=tensorflow python train.py`)."
    )


def test_a_foreground_lab_run_checks_the_backend_before_it_makes_a_run(jax_backend, tmp_path):
    store = gradflow.RunStore(tmp_path / "runs.db")
    with pytest.raises(RuntimeError, match=f"gradflow.train {NEEDS_TENSORFLOW}"):
        gradflow.train(RunConfig(depth=1, width=2, steps=1), store=store)
    assert store.runs().empty


def test_the_message_names_keras_json_when_it_chose_the_backend(monkeypatch, tmp_path):
    (tmp_path / "keras.json").write_text('{"backend": "jax", "floatx": "float32"}')
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    monkeypatch.delenv("KERAS_BACKEND")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    message = checks.backend_problem("gradflow.snapshot")
    config = tmp_path / "keras.json"
    assert f'(set by "backend": "jax" in {config})' in message
    assert message.endswith(f'or "backend": "tensorflow" in {config}.')
    # Set after Keras was imported: too late, and said so.
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert "$KERAS_BACKEND=tensorflow came too late" in checks.backend_problem()
    monkeypatch.setattr(keras.backend, "backend", lambda: "tensorflow")
    assert checks.backend_problem() is None
    checks.check_backend()


def test_workers_and_upload_children_use_tensorflow_whatever_the_parent_exports(
    monkeypatch, tmp_path
):
    """Workers kept a user's exported KERAS_BACKEND=jax (setdefault) and crashed."""
    from gradflow.lab import runner
    from gradflow.safety import sandbox

    monkeypatch.setenv("KERAS_BACKEND", "jax")
    assert sandbox.child_environment(tmp_path)["KERAS_BACKEND"] == "tensorflow"

    started = []

    class Started(Exception):
        pass

    def popen(command, **options):
        started.append(options["env"])
        raise Started

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    manager = runner.RunManager(store=tmp_path / "runs.db", prewarm=False)
    try:
        with pytest.raises(Started):
            manager._spawn()
    finally:
        manager.shutdown()
    assert started[0]["KERAS_BACKEND"] == "tensorflow"
    assert os.environ["KERAS_BACKEND"] == "jax"  # the parent's own is left alone


def test_the_dashboard_says_in_words_that_its_keras_runs_on_another_backend(jax_backend, tmp_path):
    from streamlit.testing.v1 import AppTest

    from tests.conftest import pages_on

    with pages_on(tmp_path / "runs.db"):
        app = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert [e.value for e in app.error] == [
        f"The gradflow dashboard {NEEDS_TENSORFLOW}; this process uses 'jax' "
        "(set by $KERAS_BACKEND=jax). Set KERAS_BACKEND=tensorflow before Keras is imported "
        "(e.g. `KERAS_BACKEND=tensorflow streamlit run app.py`)."
    ]


def test_the_cli_names_the_users_backend_and_puts_their_variable_back(
    jax_backend, tmp_path, capsys
):
    """It blamed "$KERAS_BACKEND=tensorflow", which `main()` had set itself, and kept it set."""
    from gradflow import cli
    from gradflow.store import RunStore

    RunStore(tmp_path / "runs.db")
    assert cli.main(["runs", "--db", str(tmp_path / "runs.db")]) == 0
    assert os.environ["KERAS_BACKEND"] == "jax"
    code = cli.main(["train", "--steps", "1", "--db", str(tmp_path / "runs.db")])
    assert code == cli.EXIT_FAILED
    assert os.environ["KERAS_BACKEND"] == "jax"
    said = capsys.readouterr().err
    assert "uses 'jax' (set by $KERAS_BACKEND=jax)" in said
    assert "`KERAS_BACKEND=tensorflow gradflow train ...`" in said


# --- tf_keras (Keras 2) ----------------------------------------------------


class FakeLegacySequential:
    """Stands for tf_keras's Sequential, without tf_keras installed."""


FakeLegacySequential.__module__ = "tf_keras.src.engine.sequential"


class UsersModel(FakeLegacySequential):
    """A user's subclass: its own module is `__main__`, its base's tf_keras."""


UsersModel.__module__ = "__main__"


def test_legacy_keras_words_recognise_keras_2_classes_and_their_subclasses():
    for model in (FakeLegacySequential(), UsersModel()):
        words = checks.legacy_keras_words(model)
        assert words.startswith("this is a tf_keras (Keras 2) model")
        assert "unset TF_USE_LEGACY_KERAS and build it with `import keras`" in words
        assert "keras.models.load_model('m.h5', compile=False)" in words
    old = type("Dense", (), {"__module__": "keras.src.engine.base_layer"})
    assert checks.legacy_keras_words(old()) is not None
    for keras3 in (tiny_model(), keras.layers.Dense(1), np.ones(2), "model"):
        assert checks.legacy_keras_words(keras3) is None


def test_probes_refuse_a_keras_2_model_in_words():
    """It said "`model` must be a Keras model, got Sequential" (it is one, of Keras 2)."""
    x, y = np.ones((2, 3), "float32"), np.ones((2, 1), "float32")
    for attempt in (
        lambda: gradflow.snapshot(UsersModel(), x, y, loss="mse"),
        lambda: gradflow.input_sensitivity(UsersModel(), x),
    ):
        with pytest.raises(TypeError, match=r"^`model` must be a Keras 3 model or layer: this"):
            attempt()
    with pytest.raises(TypeError, match=r"^`models\[1\]` must be a Keras 3 model or layer"):
        chain_gradients([tiny_model(), UsersModel()], x, y, loss="mse")
    with pytest.raises(TypeError, match=r"^`model` must be a Keras 3 model or layer: this"):
        gradflow.GradientLog(UsersModel())


def test_a_monitor_in_a_tf_keras_fit_says_what_to_do():
    """tf_keras's CallbackList raised AttributeError: '_implements_train_batch_hooks'."""
    tf_keras = pytest.importorskip("tf_keras")
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(3,))])
    model.compile("sgd", "mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    with pytest.raises(TypeError, match="GradientMonitor needs a Keras 3 model: this is a tf_k"):
        model.fit(x, y, callbacks=[gradflow.GradientMonitor()], verbose=0)
    with pytest.raises(TypeError, match="tf_keras .Keras 2. model .Sequential."):
        gradflow.snapshot(model, x, y, loss="mse")


def test_safe_load_model_says_a_saved_model_folder_is_not_supported(tmp_path):
    with pytest.raises(gradflow.UnsafeInputError, match="is a folder: SavedModel folders"):
        gradflow.safe_load_model(tmp_path)


# --- Global Keras config: floatx, image data format ------------------------


@pytest.fixture
def odd_keras_config():
    """float16 and channels-first, as `~/.keras/keras.json` or a user's script can set them."""
    floatx, image_format = keras.config.floatx(), keras.config.image_data_format()
    keras.config.set_floatx("float16")
    keras.config.set_image_data_format("channels_first")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_image_data_format(image_format)


def _layout(model):
    return [
        (layer.name, tuple(layer.output.shape), layer.dtype_policy.name) for layer in model.layers
    ]


@pytest.mark.parametrize(
    "options",
    [
        {"architecture": "cnn", "normalization": "batch", "residual": True},
        {"architecture": "mlp", "normalization": "layer", "dropout": 0.1},
    ],
)
def test_lab_models_are_float32_and_channels_last_whatever_the_global_config(options):
    config = RunConfig(depth=2, width=3, dataset="digits", **options)
    data = load_dataset(config)
    plain = build_model(config, data)
    floatx, image_format = keras.config.floatx(), keras.config.image_data_format()
    policy = keras.config.dtype_policy()
    keras.config.set_floatx("float16")
    keras.config.set_image_data_format("channels_first")
    keras.config.set_dtype_policy("mixed_float16")
    try:
        odd = build_model(config, data)
        # Put back after the build.
        assert keras.config.floatx() == "float16"
        assert keras.config.dtype_policy().name == "mixed_float16"
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_image_data_format(image_format)
        keras.config.set_dtype_policy(policy)
    assert _layout(odd) == _layout(plain)
    # Not the mixed policy's: the model took it, and `compile` a LossScaleOptimizer.
    assert odd.dtype_policy.name == "float32"
    assert not isinstance(odd.optimizer, keras.optimizers.LossScaleOptimizer)
    assert {policy for _, _, policy in _layout(odd)} == {"float32"}
    assert {v.dtype for v in odd.weights + odd.optimizer.variables} <= {"float32", "int64"}
    assert odd.loss.dtype == "float32"
    if options["architecture"] == "cnn":
        assert odd.get_layer("conv_1").output.shape == (None, 8, 8, 3)  # not 8 channels
    for a, b in zip(odd.weights, plain.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_split_cnn_and_the_examples_build_under_channels_first_and_float16(odd_keras_config):
    """split_cnn() failed under channels_first; the examples were float16."""
    parts = split_cnn()
    assert [tuple(p.output_shape) for p in parts] == [(None, 6, 6, 4), (None, 4, 4, 4), (None, 1)]
    assert {v.dtype for p in parts for v in p.weights} == {"float32"}
    x, y = toy_batch(4)
    result = chain_gradients(parts, x, y, loss=keras.losses.MeanSquaredError(dtype="float32"))
    assert [g.dtype for g in result[0]] == ["float32", "float32"]
    assert np.isfinite(result.loss)
    example = load_example("Residual CNN with BatchNorm and Dropout")
    assert tuple(example.model.get_layer("pool").output.shape) == (None, 4, 4, 8)
    assert {v.dtype for v in example.model.weights} == {"float32"}
    for name in ("MNIST-shaped MLP (5 × Dense 32, relu)", "Bidirectional LSTM + GRU (regression)"):
        example = load_example(name)
        assert {layer.dtype_policy.name for layer in example.model.layers} == {"float32"}
