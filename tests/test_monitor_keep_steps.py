"""`GradientMonitor(keep_steps=...)`: a long run keeps only its last steps in memory.

Every recorded step used to stay in memory (about 44 bytes per weight tensor
and step): the lab's worker, which RunConfig lets train a 100-layer network
for a million steps, would have held gigabytes that only the store needed.
With `keep_steps`, `history` keeps the last steps, checked here against the
hand-written tape loop of `tests/test_monitor.py`; the store gets every step,
and the rules, which read the steps during the `fit` before old ones go,
find what they find in the whole run.
"""

import keras
import numpy as np
import pandas as pd
import pytest

from gradflow import diagnose
from gradflow.monitor import GradientMonitor
from gradflow.monitor import callback as callback_module
from gradflow.store import RunStore
from tests.test_monitor import (
    BATCH,
    assert_matches_reference,
    copy_of,
    make_data,
    make_model,
    reference_run,
)
from tests.test_monitor_outputs import blow_up_data, blow_up_model


class LastSteps:
    """A monitor's records, as a tape reference of the whole run gives them, from `first` on."""

    def __init__(self, rows, metrics, first):
        self.rows = {key: row for key, row in rows.items() if key[0] >= first}
        self.metrics = {key: value for key, value in metrics.items() if key[0] >= first}


def held_steps(monitor):
    """The recorded steps the monitor holds in memory (for `history` and for the rules)."""
    steps = [block[0] for block in monitor._blocks if len(block[0])]
    return np.unique(np.concatenate(steps)) if steps else np.zeros([0], np.int64)


def test_history_keeps_the_last_steps_and_they_match_the_tape():
    x, y = make_data()
    model = make_model()
    reference = copy_of(model)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    monitor = GradientMonitor(activations=True, histograms=True, keep_steps=4)
    model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[monitor])

    rows, metrics = reference_run(reference, keras.optimizers.Adam(0.05), x, y, epochs=4)
    # 12 steps recorded, the last 4 kept: 9 to 12.
    assert sorted(monitor.history["step"].unique()) == [9, 10, 11, 12]
    assert sorted(monitor.metrics["step"].unique()) == [9, 10, 11, 12]
    assert sorted(monitor.histogram_rows["step"].unique()) == [9, 10, 11, 12]
    kept = LastSteps(rows, metrics, first=9)
    assert_matches_reference(monitor, kept.rows, kept.metrics, rtol=1e-4)


def test_keep_steps_zero_keeps_nothing_in_memory_and_everything_in_the_store(tmp_path):
    x, y = make_data()
    store = RunStore(tmp_path / "runs.db")
    kept = GradientMonitor(store=store, keep_steps=0, histograms=True)
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[kept])
    assert kept.history.empty and kept.metrics.empty and kept.histogram_rows.empty
    assert list(kept.history.columns) == list(GradientMonitor().history.columns)
    assert kept.history["step"].dtype == "int64"  # as `.events`, and a table with rows

    full = GradientMonitor(histograms=True)
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[full])
    stored = store.layer_stats(kept.run_id)
    columns = ["step", "layer", "tensor", "max_abs", "l2_norm", "update_ratio"]

    def rows(frame):
        frame = frame[columns].astype({"layer": str, "tensor": str})
        return frame.sort_values(["step", "layer", "tensor"]).reset_index(drop=True)

    pd.testing.assert_frame_equal(rows(stored), rows(full.history), check_dtype=False)
    assert len(store.histograms(kept.run_id)) == len(full.histogram_rows)


def deep_sigmoid():
    """Eight sigmoid layers drawn small: the rules alert on them (vanishing, then exploding)."""
    keras.utils.set_random_seed(0)
    init = keras.initializers.RandomNormal(stddev=0.05)
    model = keras.Sequential(
        [keras.Input((4,))]
        + [
            keras.layers.Dense(8, "sigmoid", kernel_initializer=init, name=f"hidden_{i}")
            for i in range(8)
        ]
        + [keras.layers.Dense(1, "sigmoid", name="out")],
        name="deep_sigmoid",
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="binary_crossentropy")
    return model


@pytest.mark.parametrize("keep_steps", [0, 30])
def test_rules_read_every_step_and_memory_stays_bounded(monkeypatch, keep_steps):
    """A deep sigmoid MLP whose gradients vanish: the same alerts as a monitor that keeps all.

    The rules read pieces of 200 rows (not 100,000) here, and the ring is
    read after every batch, so a short `fit` drops old steps many times;
    what is held never grows with the run.
    """
    monkeypatch.setattr(callback_module, "_DIAGNOSED_ROWS", 200)
    monkeypatch.setattr(callback_module, "_READ_INTERVAL_S", 0.0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")

    full, kept = GradientMonitor(), GradientMonitor(keep_steps=keep_steps)
    most = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            most.append(len(held_steps(kept)))

    deep_sigmoid().fit(x, y, batch_size=8, epochs=12, shuffle=False, verbose=0, callbacks=[full])
    deep_sigmoid().fit(
        x, y, batch_size=8, epochs=12, shuffle=False, verbose=0, callbacks=[kept, Watch()]
    )
    assert full.history["step"].max() == 384
    found = full.events.query("kind != 'info'")
    assert len(found), "the test needs a run the rules alert on"
    pd.testing.assert_frame_equal(kept.events, full.events)
    pd.testing.assert_frame_equal(kept.events, diagnose(full.history))
    # Held: the rules' look-back (the 51 newest steps they read and the 10
    # of `growth_window` before them), the steps they have not read (200
    # rows are 12 steps of 18 tensors) and what `history` keeps; never the
    # run's 384.
    assert max(most) <= 51 + 10 + 12 + keep_steps, max(most)
    assert len(kept.history["step"].unique()) == keep_steps
    if keep_steps:
        tail = full.history[full.history["step"] > 384 - keep_steps].reset_index(drop=True)
        pd.testing.assert_frame_equal(kept.history, tail)


def test_events_are_in_step_order_as_a_monitor_that_keeps_all_tells_them(monkeypatch):
    """A NaN is told when its step is read, the rules' findings when they run: with
    `keep_steps`, during the fit, so the two monitors listed the same events in two orders
    (the practitioner's audit)."""
    monkeypatch.setattr(callback_module, "_DIAGNOSED_ROWS", 200)
    monkeypatch.setattr(callback_module, "_READ_INTERVAL_S", 0.0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * 120, 4)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    y[8 * 100 : 8 * 101] = np.nan  # the loss of step 101 is NaN
    full, kept = GradientMonitor(), GradientMonitor(keep_steps=0)
    for monitor in (full, kept):
        deep_sigmoid().fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    kinds = kept.events.set_index("step")["kind"]
    assert kinds[101] == "nonfinite" and (kinds[kinds.index < 101] != "nonfinite").any()
    assert kept.events["step"].is_monotonic_increasing
    pd.testing.assert_frame_equal(kept.events, full.events)


def test_a_later_fit_numbers_its_steps_after_the_steps_let_go(tmp_path):
    """A new optimizer counts from 0 again; steps dropped from memory still count as recorded."""
    x, y = make_data()
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store, keep_steps=0)
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")  # counts from 0 again
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    steps = sorted(store.layer_stats(monitor.run_id)["step"].unique())
    assert steps == list(range(1, 10))
    assert monitor.events["message"].str.contains("numbered on from step 7").any()


def test_a_diverged_runs_message_is_its_nan_not_an_earlier_event(tmp_path):
    """The run's status message was the monitor's first event, whatever it said."""
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store)
    model = blow_up_model()
    x, y = blow_up_data(bad_step=3)
    calm = x[np.abs(x).max(axis=1) < 100]
    model.fit(calm, y[: len(calm)], batch_size=BATCH, verbose=0, callbacks=[monitor])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")  # an `info` event next fit
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor.events["kind"].tolist()[:2] == ["info", "nonfinite"]
    info = store.run_info(monitor.run_id)
    assert info["status"] == "diverged"
    assert info["message"].startswith("First non-finite gradient at step")


def test_a_rule_that_fails_during_the_fit_warns_and_training_goes_on(tmp_path, monkeypatch):
    """With `keep_steps`, the rules run during the `fit`: their fault must not stop it."""
    monkeypatch.setattr(callback_module, "_DIAGNOSED_ROWS", 20)
    monkeypatch.setattr(callback_module, "_READ_INTERVAL_S", 0.0)

    def broken(*args, **kwargs):
        raise RuntimeError("a broken rule")

    monkeypatch.setattr(callback_module, "diagnose", broken)
    x, y = make_data()
    store = RunStore(tmp_path / "runs.db")
    monitor = GradientMonitor(store=store, keep_steps=2)
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with pytest.warns(UserWarning, match="the diagnosis rules failed .RuntimeError: a broken rule"):
        model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[monitor])
    assert int(model.optimizer.iterations.numpy()) == 12
    assert sorted(store.layer_stats(monitor.run_id)["step"].unique()) == list(range(1, 13))
    assert sorted(monitor.history["step"].unique()) == [11, 12]
    assert store.run_info(monitor.run_id)["status"] == "completed"


def test_a_fit_shorter_than_every_keeps_its_logged_metrics():
    """No step recorded yet: the compiled metrics of `fit`'s logs have no step to start from."""
    x, y = make_data()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    monitor = GradientMonitor(every=100, keep_steps=5)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor.history.empty
    assert monitor.metrics.query("name == 'mae'")["step"].tolist() == [1, 2, 3]


@pytest.mark.parametrize("value", [-1, 2.5, True, "100"])
def test_keep_steps_must_be_a_count_or_none(value):
    with pytest.raises(ValueError, match=r"`keep_steps` must be an integer >= 0 or None, got"):
        GradientMonitor(keep_steps=value)
