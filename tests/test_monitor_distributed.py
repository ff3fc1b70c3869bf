"""GradientMonitor under tf.distribute.MirroredStrategy on two logical CPUs.

Logical devices must be configured before TensorFlow initializes, so the
training runs in a fresh subprocess. It trains the same model (same initial
weights, same batches) once on one device and once mirrored on two, and saves
both histories; the test compares them here.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd

from gradflow import schema

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    import keras
    from gradflow.monitor import GradientMonitor

    out, through_time = sys.argv[1], sys.argv[2] == "through_time"
    rng = np.random.default_rng(0)
    # A sequence (batch, time, features) for the rows through time.
    x = rng.normal(size=(32, 6, 2) if through_time else (32, 3)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        first = (
            keras.layers.SimpleRNN(5, name="d0")
            if through_time
            else keras.layers.Dense(5, activation="tanh", name="d0")
        )
        model = keras.Sequential([keras.Input(x.shape[1:]), first, keras.layers.Dense(1, name="d1")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    def run(model):
        monitor = GradientMonitor(activations=True, through_time=through_time)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
        return monitor

    single = run(build())
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        mirrored_model = build()
    mirrored = run(mirrored_model)
    single.history.to_pickle(out + "/single.pkl")
    mirrored.history.to_pickle(out + "/mirrored.pkl")
    single.metrics.to_pickle(out + "/single_metrics.pkl")
    mirrored.metrics.to_pickle(out + "/mirrored_metrics.pkl")
    """
)


def run_script(tmp_path, mode="dense"):
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return (
        pd.read_pickle(tmp_path / "single.pkl"),
        pd.read_pickle(tmp_path / "mirrored.pkl"),
        pd.read_pickle(tmp_path / "single_metrics.pkl"),
        pd.read_pickle(tmp_path / "mirrored_metrics.pkl"),
    )


def test_mirrored_strategy_records_the_same_statistics_as_one_device(tmp_path):
    single, mirrored, single_metrics, mirrored_metrics = run_script(tmp_path)
    assert len(single) == len(mirrored) == 8 * (4 + 2)  # 8 steps x (4 variables + 2 outputs)
    key = ["step", "layer", "tensor"]
    assert mirrored[key].values.tolist() == single[key].values.tolist()
    for column in schema.STATISTICS + ("weight_norm", "update_ratio"):
        np.testing.assert_allclose(
            mirrored[column], single[column], rtol=1e-4, atol=1e-6, err_msg=column
        )
    np.testing.assert_allclose(
        mirrored_metrics["value"], single_metrics["value"], rtol=1e-4, atol=1e-6
    )


def test_mirrored_strategy_records_the_same_rows_through_time(tmp_path):
    """The rows through time of each replica's half of the batch are put back together."""
    single, mirrored, _, _ = run_script(tmp_path, "through_time")
    rows = single[single["tensor"] == schema.TIME_STEP]
    assert len(rows) == 8 * 6  # 8 steps x 6 time steps
    key = ["step", "layer", "tensor"]
    assert mirrored[key].values.tolist() == single[key].values.tolist()
    for column in schema.STATISTICS:
        np.testing.assert_allclose(
            mirrored[column], single[column], rtol=1e-4, atol=1e-6, err_msg=column
        )
