"""load_dataset: shapes per architecture, determinism, targets per loss, checks, offline."""

import gzip
import urllib.error

import numpy as np
import pytest

from gradflow.lab.config import RunConfig
from gradflow.lab.datasets import DatasetDownloadError, load_dataset, needs_download


@pytest.mark.parametrize(
    "changes, input_shape",
    [
        ({}, (64,)),
        ({"architecture": "cnn"}, (8, 8, 1)),
        ({"architecture": "rnn"}, (8, 8)),
        ({"architecture": "residual_mlp"}, (64,)),
    ],
)
def test_digits_shaped_for_each_architecture(changes, input_shape):
    data = load_dataset(RunConfig(**changes))
    assert data.input_shape == input_shape
    assert data.x_train.shape[1:] == input_shape and data.x_val.shape[1:] == input_shape
    assert len(data.x_train) + len(data.x_val) == 1797
    assert len(data.x_val) == round(1797 * 0.2)
    assert data.x_train.dtype == np.float32
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0
    assert (data.n_classes, data.task) == (10, "classification")
    assert set(np.unique(data.y_train)) == set(range(10))


@pytest.mark.parametrize(
    "dataset, n_classes, features",
    [
        ("moons", 2, 2),
        ("circles", 2, 2),
        ("xor", 2, 2),
        ("gaussians", 3, 2),
        ("spirals", 3, 2),
        ("regression", None, 8),
    ],
)
def test_synthetic_sets(dataset, n_classes, features):
    config = RunConfig(dataset=dataset, n_samples=150, seed=3)
    data = load_dataset(config)
    assert data.n_classes == n_classes
    assert data.x_train.shape[1] == features
    assert 140 <= len(data.x_train) + len(data.x_val) <= 150
    if n_classes is None:
        assert data.task == "regression" and data.y_train.shape[1:] == (1,)
    else:
        assert sorted(np.unique(data.y_train)) == list(range(n_classes))
    again = load_dataset(config)
    np.testing.assert_array_equal(again.x_train, data.x_train)
    np.testing.assert_array_equal(again.y_val, data.y_val)
    other = load_dataset(config.replace(seed=4))
    assert not np.array_equal(other.x_train, data.x_train)


def test_xor_labels_follow_the_sign_rule():
    data = load_dataset(RunConfig(dataset="xor", n_samples=200))
    expected = (data.x_train[:, 0] * data.x_train[:, 1] > 0).astype(int)
    np.testing.assert_array_equal(data.y_train, expected)


def test_adding_problem_target_is_the_sum_of_the_two_marked_values():
    config = RunConfig(architecture="rnn", dataset="adding", sequence_length=12, n_samples=60)
    data = load_dataset(config)
    assert data.input_shape == (12, 2) and data.task == "regression" and data.n_classes is None
    for x, y in ((data.x_train, data.y_train), (data.x_val, data.y_val)):
        markers = x[:, :, 1]
        assert np.all(markers.sum(axis=1) == 2)
        # One marker in each half, so the first value must be carried.
        assert np.all(markers[:, :6].sum(axis=1) == 1)
        np.testing.assert_allclose(y[:, 0], (x[:, :, 0] * markers).sum(axis=1), rtol=1e-6)


@pytest.mark.parametrize(
    "loss, y_shape, dtype",
    [
        ("auto", (), np.int32),
        ("sparse_categorical_crossentropy", (), np.int32),
        ("categorical_crossentropy", (2,), np.float32),
        ("mse", (2,), np.float32),
        ("binary_crossentropy", (1,), np.float32),
    ],
)
def test_targets_shaped_for_the_loss(loss, y_shape, dtype):
    sparse = load_dataset(RunConfig(dataset="moons", n_samples=50))
    data = load_dataset(RunConfig(dataset="moons", n_samples=50, loss=loss))
    assert data.y_train.shape[1:] == y_shape and data.y_train.dtype == dtype
    # Every form encodes the same labels.
    labels = data.y_train.reshape(len(data.y_train), -1)
    decoded = labels.argmax(axis=1) if labels.shape[1] > 1 else labels[:, 0]
    np.testing.assert_array_equal(decoded, sparse.y_train)


# Downloaded sets: a fake cache made by the test, and no network.


@pytest.fixture
def keras_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    import keras.src.utils.file_utils as file_utils

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("network is blocked in this test")

    monkeypatch.setattr(file_utils, "urlretrieve", no_network)
    (tmp_path / "datasets").mkdir()
    return tmp_path


def _fake_mnist(path, y_train=(0, 1, 2, 9), x_rows=None):
    rng = np.random.default_rng(0)
    y_train = np.asarray(y_train, "uint8")
    n = len(y_train) if x_rows is None else x_rows
    np.savez(
        path,
        x_train=rng.integers(0, 256, (n, 28, 28), dtype="uint8"),
        y_train=y_train,
        x_test=rng.integers(0, 256, (2, 28, 28), dtype="uint8"),
        y_test=np.asarray([3, 4], "uint8"),
    )


@pytest.mark.parametrize("dataset", ["mnist", "fashion_mnist", "cifar10"])
def test_offline_without_cache_says_where_to_put_the_file(keras_home, dataset):
    expected = {
        "mnist": keras_home / "datasets" / "mnist.npz",
        "fashion_mnist": keras_home / "datasets" / "fashion-mnist" / "train-labels-idx1-ubyte.gz",
        "cifar10": keras_home / "datasets" / "cifar-10-python.tar.gz",
    }[dataset]
    architecture = "cnn"
    assert needs_download(dataset)  # the dashboard says so before Start
    with pytest.raises(DatasetDownloadError) as info:
        load_dataset(RunConfig(dataset=dataset, architecture=architecture))
    message = str(info.value)
    assert f"The {dataset} data set needs a one-time download of https://" in message
    assert str(expected) in message
    assert "dataset='digits'" in message
    assert not expected.exists()
    # A run that fails so says it in these words, without the class and the source line.
    from gradflow.lab.worker import _failure_message

    assert _failure_message(info.value) == message


def test_cached_mnist_loads_offline(keras_home):
    _fake_mnist(keras_home / "datasets" / "mnist.npz")
    assert not needs_download("mnist") and not needs_download("digits")
    data = load_dataset(RunConfig(dataset="mnist", architecture="cnn"))
    assert data.x_train.shape == (4, 28, 28, 1) and data.x_val.shape == (2, 28, 28, 1)
    assert data.x_train.max() <= 1.0 and data.n_classes == 10
    raw = np.load(keras_home / "datasets" / "mnist.npz")
    np.testing.assert_allclose(data.x_train[..., 0], raw["x_train"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.y_val, [3, 4])
    assert load_dataset(RunConfig(dataset="mnist", architecture="rnn")).input_shape == (28, 28)


def test_cached_fashion_mnist_reads_idx_files(keras_home):
    folder = keras_home / "datasets" / "fashion-mnist"
    folder.mkdir()
    rng = np.random.default_rng(1)
    arrays = {
        "train-labels-idx1-ubyte.gz": np.asarray([5, 0, 9], "uint8"),
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (3, 28, 28), dtype="uint8"),
        "t10k-labels-idx1-ubyte.gz": np.asarray([1], "uint8"),
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (1, 28, 28), dtype="uint8"),
    }
    for name, array in arrays.items():
        header = bytes([0, 0, 8, array.ndim]) + b"".join(
            int(size).to_bytes(4, "big") for size in array.shape
        )
        with gzip.open(folder / name, "wb") as f:
            f.write(header + array.tobytes())
    data = load_dataset(RunConfig(dataset="fashion_mnist"))
    assert data.x_train.shape == (3, 784)
    np.testing.assert_array_equal(data.y_train, [5, 0, 9])
    np.testing.assert_allclose(
        data.x_val[0], arrays["t10k-images-idx3-ubyte.gz"][0].reshape(-1) / 255.0, rtol=1e-6
    )


@pytest.mark.parametrize(
    "y_train, x_rows, message",
    [
        ((0, 1, 10), None, "The train labels must be whole numbers from 0 to 9, got 10"),
        ((0, 1, 2), 5, "The train data have 5 examples in x but y has shape (3,)"),
        ((), 0, "The train data are empty"),
    ],
)
def test_bad_arrays_are_rejected_clearly(keras_home, y_train, x_rows, message):
    _fake_mnist(keras_home / "datasets" / "mnist.npz", y_train=y_train, x_rows=x_rows)
    with pytest.raises(ValueError) as info:
        load_dataset(RunConfig(dataset="mnist"))
    assert message in str(info.value)


# The user's own file, through gradflow.safety.arrays.load_arrays.


@pytest.fixture
def load_arrays():
    return pytest.importorskip("gradflow.safety.arrays").load_arrays


def test_file_with_x_and_y_is_split_and_typed(tmp_path, load_arrays):
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x=rng.normal(size=(40, 3)), y=rng.integers(0, 3, 40))
    data = load_dataset(RunConfig(dataset="file", data_path=str(path)))
    assert (data.n_classes, data.task, data.input_shape) == (3, "classification", (3,))
    assert len(data.x_train) == 32 and len(data.x_val) == 8


def test_file_with_float_targets_is_regression_and_keeps_its_split(tmp_path, load_arrays):
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(
        path,
        x_train=rng.normal(size=(30, 5, 4)),
        y_train=rng.normal(size=30),
        x_val=rng.normal(size=(6, 5, 4)),
        y_val=rng.normal(size=6),
    )
    data = load_dataset(RunConfig(dataset="file", data_path=str(path), architecture="rnn"))
    assert (data.n_classes, data.task, data.input_shape) == (None, "regression", (5, 4))
    assert len(data.x_val) == 6


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1, -1, 0])}, "labels must be whole numbers"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1])}, "4 examples in x but y has shape (2,)"),
        ({"features": np.zeros((4, 2))}, "must hold arrays named 'x' and 'y'"),
    ],
)
def test_bad_files_are_rejected_clearly(tmp_path, load_arrays, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError) as info:
        load_dataset(RunConfig(dataset="file", data_path=str(path)))
    assert message in str(info.value)
