"""The dashboard's uploads are differentiated in a child process with limits, not in the server.

The checks of `safe_load_model` allow layers that make outputs of any size
from a few weights: a 16 KB `.keras` file with `RepeatVector(2_000_000)`
took 2 GB of the server's memory once the Inspect page ran its snapshot
there, and a model of 400 `Activation` layers 134 s (the upload audit,
forty-third session). Each test here gives `snapshot_of_upload` such a file
with limits small enough for CI, and checks the page's message.
"""

import pathlib
import resource

import keras
import numpy as np
import pandas as pd
import pytest

import gradflow
from gradflow.probe import uploads


def saved(model, path):
    model.save(path)
    return path


def batch(path, x, y):
    np.savez(path, x=x, y=y)
    return path


def test_an_upload_is_snapshotted_in_the_child_as_it_would_be_here(tmp_path):
    """What comes back through Parquet equals `gradflow.snapshot` in this process."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="relu", name="hidden"),
            keras.layers.Dense(3, name="out"),
        ]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss)
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    path = saved(model, tmp_path / "m.keras")
    shot, note = uploads.snapshot_of_upload(
        path, batch(tmp_path / "d.npz", x, y), uploads.SAVED_LOSS
    )
    assert note is None, note
    # The same file loaded here (a loaded model's variables are named without the outer model).
    here = gradflow.snapshot(keras.saving.load_model(path, compile=False), x, y, loss=loss)
    for name in ("weights", "activations", "inputs", "histograms"):
        pd.testing.assert_frame_equal(getattr(shot, name), getattr(here, name), rtol=1e-6)
    assert shot.weights["shape"].tolist() == [(5, 4), (4,), (4, 3), (3,)]
    assert shot.loss == pytest.approx(here.loss, rel=1e-6)
    assert (shot.training, shot.no_gradient, shot.layer_inputs) == (
        here.training,
        here.no_gradient,
        here.layer_inputs,
    )


def test_a_tiny_file_whose_outputs_are_huge_is_stopped_by_the_childs_memory_limit(tmp_path):
    """RepeatVector(5,000,000) on 8 rows of 4: 16 KB of file, about 3 GB of activations."""
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.RepeatVector(5_000_000),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )
    path = saved(model, tmp_path / "bomb.keras")
    assert path.stat().st_size < 64_000
    data = batch(tmp_path / "d.npz", np.ones((8, 4), "float32"), np.zeros((8, 2), "float32"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shot, message = uploads.snapshot_of_upload(path, data, "mse", memory_limit=4 * 2**30)
    assert shot is None
    assert message.startswith(
        "Working out this model's gradients needed more memory than each upload may use (4 GiB)"
    ), message
    # Not in this process (the server): its peak did not grow by the bomb's gigabytes.
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grew_kib < 500_000


def test_a_model_too_slow_to_differentiate_is_stopped_by_the_childs_time_limit(tmp_path):
    """200 Activation layers: cheap to check and load, slow to differentiate layer by layer."""
    model = keras.Sequential(
        [keras.Input((4,))]
        + [keras.layers.Activation("relu", name=f"a{i}") for i in range(200)]
        + [keras.layers.Dense(2)]
    )
    path = saved(model, tmp_path / "deep.keras")
    data = batch(tmp_path / "d.npz", np.ones((8, 4), "float32"), np.zeros((8, 2), "float32"))
    shot, message = uploads.snapshot_of_upload(path, data, "mse", timeout=8)
    assert shot is None
    assert message == (
        "Working out this model's gradients took longer than 8 seconds, so it was stopped. "
        "Try a smaller batch or a smaller model."
    )


def test_a_refused_file_is_said_for_the_page(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda t: t * 2)])
    path = saved(model, tmp_path / "lambda.keras")
    data = batch(tmp_path / "d.npz", np.ones((8, 4), "float32"), np.zeros((8, 4), "float32"))
    shot, message = uploads.snapshot_of_upload(path, data, "mse")
    assert shot is None
    assert message.startswith("That file was refused: ") and "Lambda" in message


def test_a_spare_child_takes_one_upload_as_a_new_child_would(tmp_path):
    """The Inspect page starts a spare while the files are picked (TensorFlow's start-up
    was most of an upload's time in a new child)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="out")])
    path = saved(model, tmp_path / "m.keras")
    data = batch(tmp_path / "d.npz", np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"))
    spare = uploads.SpareChild()
    shot, message = uploads.snapshot_of_upload(path, data, "mse", spare=spare)
    fresh, _ = uploads.snapshot_of_upload(path, data, "mse")
    assert message is None
    pd.testing.assert_frame_equal(shot.weights, fresh.weights)
    assert spare.process.poll() == 0  # one request, then it is done
    assert not pathlib.Path(spare.folder).exists()


def test_a_spare_child_ends_with_its_server_and_is_not_used_with_other_limits(tmp_path):
    spare = uploads.SpareChild(memory_limit=6 * 2**30)
    assert spare.usable(6 * 2**30) and not spare.usable(8 * 2**30)
    spare.process.stdin.close()  # the server is gone
    assert spare.process.wait(timeout=120) == 0
    assert not spare.usable(6 * 2**30)
    spare.close()
    assert not pathlib.Path(spare.folder).exists()


def test_a_model_whose_inputs_are_named_with_dashes_and_dots_can_be_uploaded(tmp_path):
    """The .npz names its arrays after the inputs; 'img-in.npy' was refused as not a
    plain array name (the review)."""
    image, meta = keras.Input((3,), name="img-in"), keras.Input((2,), name="meta.v2")
    joined = keras.layers.Concatenate()([image, meta])
    model = keras.Model([image, meta], keras.layers.Dense(2, name="out")(joined))
    path = saved(model, tmp_path / "two.keras")
    data = tmp_path / "two.npz"
    np.savez(
        data,
        y=np.zeros((4, 2), "float32"),
        **{"img-in": np.ones((4, 3), "float32"), "meta.v2": np.ones((4, 2), "float32")},
    )
    shot, message = uploads.snapshot_of_upload(path, data, "mse")
    assert message is None and shot is not None, message
    assert shot.weights["layer"].tolist() == ["out", "out"]
