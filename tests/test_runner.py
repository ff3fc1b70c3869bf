"""Foreground lab runs: statistics against a plain GradientTape, seeds, final statuses."""

import numpy as np
import pytest

import gradflow
from gradflow.lab.config import RunConfig
from gradflow.store import RunStore

TINY = dict(depth=2, width=8, steps=12)
NUMERIC = [
    "step",
    "layer_index",
    "max_abs",
    "l2_norm",
    "mean_abs",
    "std",
    "zero_fraction",
    "nonfinite",
    "weight_norm",
    "update_ratio",
]


@pytest.fixture
def store(store_path):
    return RunStore(store_path)


def test_first_step_statistics_match_a_plain_gradient_tape(store):
    import keras
    import tensorflow as tf

    from gradflow.lab.datasets import load_dataset
    from gradflow.lab.models import build_model

    # One batch holds the whole training set, so shuffling cannot change step 1.
    config = RunConfig(depth=2, width=8, steps=2, batch_size=4096, seed=3)
    run = gradflow.train(config, store=store)
    assert run.status == "completed"

    data = load_dataset(config)
    model = build_model(config, data)
    x, y = tf.constant(data.x_train), tf.constant(data.y_train)
    with tf.GradientTape() as tape:
        probabilities = model(x, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, probabilities))
    gradients = tape.gradient(loss, model.trainable_variables)

    first = run.layer_stats.query("step == 1").set_index("variable")
    assert len(first) == len(model.trainable_variables)
    for variable, gradient in zip(model.trainable_variables, gradients, strict=True):
        row = first.loc[variable.path]
        g = gradient.numpy()
        np.testing.assert_allclose(
            row["l2_norm"], np.sqrt((g.astype(np.float64) ** 2).sum()), rtol=1e-4
        )
        np.testing.assert_allclose(row["max_abs"], np.abs(g).max(), rtol=1e-4)
    recorded_loss = run.metrics.query("step == 1 and name == 'loss'")["value"].item()
    np.testing.assert_allclose(recorded_loss, float(loss), rtol=1e-5)


def test_same_config_and_seed_give_identical_statistics(store):
    config = RunConfig(dropout=0.2, seed=7, **TINY)
    first, second = (gradflow.train(config, store=store) for _ in range(2))
    a, b = first.layer_stats, second.layer_stats
    assert len(a) == 12 * 6 and a["step"].max() == 12
    np.testing.assert_array_equal(a[NUMERIC].to_numpy(), b[NUMERIC].to_numpy())
    assert a["layer"].astype(str).tolist() == b["layer"].astype(str).tolist()
    other = gradflow.train(config.replace(seed=8), store=store).layer_stats
    assert not np.array_equal(a["l2_norm"].to_numpy(), other["l2_norm"].to_numpy())


def test_several_steps_per_call_train_exactly_as_one_step_per_call(store, monkeypatch):
    import gradflow.lab.batches

    # digits in batches of 512: 3 steps an epoch; 150 steps -> 3 steps a call.
    config = RunConfig(depth=2, width=8, steps=150, batch_size=512, dropout=0.2, seed=5)
    fast = gradflow.train(config, store=store)
    monkeypatch.setattr(gradflow.lab.batches, "MAX_STEPS_PER_EXECUTION", 1)
    plain = gradflow.train(config, store=store)
    assert fast.status == plain.status == "completed"
    a, b = fast.layer_stats, plain.layer_stats
    assert sorted(a["step"].unique()) == list(range(1, 151))
    np.testing.assert_allclose(a[NUMERIC].to_numpy(), b[NUMERIC].to_numpy(), rtol=1e-6)

    def metric(run, name):
        return run.metrics.query("name == @name").set_index("step")["value"]

    # The loss of every step; validation at every epoch's end.
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(metric(fast, name), metric(plain, name), rtol=1e-6)
    assert len(metric(fast, "val_loss")) == 50
    # Keras reports accuracy once a call: every third step, equal there.
    accuracy = metric(fast, "accuracy")
    assert accuracy.index.tolist() == list(range(3, 151, 3))
    np.testing.assert_allclose(accuracy, metric(plain, "accuracy").loc[accuracy.index], rtol=1e-6)


@pytest.mark.parametrize(
    "config, status, message",
    [
        (RunConfig(**TINY), "completed", None),
        (
            RunConfig(
                depth=2,
                width=8,
                steps=50,
                learning_rate=10.0,
                dataset="regression",
                n_samples=200,
                activation="linear",
            ),
            "diverged",
            "every gradient is non-finite",
        ),
        (
            RunConfig(dataset="file", data_path="/nonexistent/data.npz", steps=5),
            "failed",
            "/nonexistent/data.npz",
        ),
    ],
)
def test_final_status_and_reason(store, config, status, message):
    run = gradflow.train(config, store=store, name="case")
    assert (run.status, run.name) == (status, "case")
    if message is None:
        assert run.message is None
        assert run.layer_stats["step"].max() == config.steps == run.progress_step
    else:
        assert message in run.message
    if status == "diverged":
        nonfinite = run.events.query("kind == 'nonfinite'")
        last = run.layer_stats["step"].max()
        assert nonfinite["step"].tolist() == [last]
        assert last < config.steps  # it stopped at the NaN


def test_a_run_that_fails_outside_its_steps_keeps_every_recorded_step(store, monkeypatch):
    """A validation set that failed at an epoch's end left the store at step 1 of 5."""
    from gradflow.lab import control, worker

    def fail(self, epoch, logs=None):
        raise RuntimeError("the validation batch did not fit")

    monkeypatch.setattr(control.RunControl, "on_epoch_end", fail, raising=False)
    config = RunConfig(steps=500, batch_size=128, depth=2, width=8)
    run_id = store.create_run(config.to_dict(), name="fails")
    assert worker.execute(store, run_id) == "failed"
    info = store.run_info(run_id)
    assert "the validation batch did not fit" in info["message"]
    # Digits: 1,437 training examples, so 12 steps of 128 in the first epoch.
    assert sorted(store.layer_stats(run_id)["step"].unique()) == list(range(1, 13))


@pytest.mark.parametrize("steps, status", [(1, "completed"), (40, "stopped")])
def test_a_stop_that_comes_with_the_last_step_finds_the_run_completed(store, steps, status):
    """A stop that arrived on the last batch (a tab closed, a late click) ended a run
    that had trained all its steps as "stopped · 300 / 300"."""
    from gradflow.lab import worker

    config = RunConfig(steps=steps, depth=2, width=8)
    run_id = store.create_run(config.to_dict(), name="asked to stop")
    store.request(run_id, "stop")  # read at the first step's end
    assert worker.execute(store, run_id) == status
    info = store.run_info(run_id)
    if status == "stopped":
        assert "Stopped on request after 1 step (" in info["message"]
    assert info["progress_step"] == 1


def test_a_paced_run_trains_the_same_steps_at_its_pace(store):
    """`pace`: a class can watch a run live. One step per call then (an even
    pace), and the statistics of the run at full speed."""
    import time

    config = RunConfig(depth=2, width=4, steps=12, seed=3)
    full = gradflow.train(config, store=store)
    started = time.monotonic()
    paced = gradflow.train(config.replace(pace=20), store=store)
    assert time.monotonic() - started >= 11 / 20
    assert paced.status == "completed"
    columns = ["step", "layer", "tensor", "max_abs", "l2_norm"]
    np.testing.assert_allclose(
        paced.layer_stats[columns[3:]].to_numpy(), full.layer_stats[columns[3:]].to_numpy()
    )
    assert paced.layer_stats[columns[:3]].equals(full.layer_stats[columns[:3]])


def test_epochs_run_whole_passes(store):
    config = RunConfig(depth=1, width=4, epochs=2, batch_size=512, record_every=1)
    run = gradflow.train(config, store=store)
    # digits: 1437 training examples -> 3 batches of 512 per epoch.
    assert run.status == "completed" and run.layer_stats["step"].max() == 6
    assert store.run_info(run.run_id)["total_steps"] == 6  # "step 2 / 6" while it trains
    assert {"val_loss", "loss"} <= set(run.metrics["name"])


def test_a_run_of_epochs_that_would_record_nothing_fails_saying_why(store):
    """`--epochs 1 --record-every 100` trained 45 steps, "completed", with no statistics."""
    config = RunConfig(depth=1, width=4, epochs=1, batch_size=512, record_every=10)
    run = gradflow.train(config, store=store)
    assert run.status == "failed"
    assert run.message == (
        "Record every 10 steps is more than the 3 steps of this run (1 epoch(s) of 3): no step "
        "would be recorded. Use a number from 1 to 3."
    )


def test_a_bad_data_file_fails_in_words_without_the_source_line(store, tmp_path):
    """ "ValueError: The labels in bad.npz go up to ... (at datasets.py:385)"."""
    path = tmp_path / "bad.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.normal(size=(40, 3)), y=np.r_[np.zeros(39), 50_000].astype("int64"))
    run = gradflow.train(RunConfig(dataset="file", data_path=str(path), steps=5), store=store)
    assert run.status == "failed"
    assert run.message.startswith("The labels in bad.npz go up to 50000")
    assert "datasets.py" not in run.message


@pytest.mark.parametrize(
    "config, error, match",
    [
        ("depth=3", TypeError, "`config`"),
        ({"depth": 0}, ValueError, "depth"),
        ({"colour": "red"}, ValueError, "colour"),
    ],
)
def test_bad_config_is_rejected_before_anything_runs(store, config, error, match):
    with pytest.raises(error, match=match):
        gradflow.train(config, store=store)
    assert store.runs().empty


def test_run_reads_back_from_the_store_in_a_new_object(store):
    run = gradflow.train(RunConfig(**TINY), store=store)
    again = gradflow.Run(run.run_id, store.path)
    assert again.config == RunConfig(**TINY)
    assert again.status == "completed"
    with pytest.raises(ValueError, match="`run_id`"):
        gradflow.Run("no such run!", store)


@pytest.mark.parametrize("locked_closes", [1, 10], ids=["lock released", "lock kept"])
def test_a_run_whose_end_the_store_refused_is_retried_or_failed(store, monkeypatch, locked_closes):
    """The writer's close met a lock held past its 30 s wait: `fit` returned all the same,
    and the run was stored "completed" with its last steps missing (the review)."""
    import sqlite3

    from gradflow.lab import worker
    from gradflow.store import writer as store_writer

    close = store_writer.RunWriter.close
    refused = []

    def locked(self, *args, **kwargs):
        if len(refused) < locked_closes:
            refused.append(self)
            raise sqlite3.OperationalError("database is locked")
        return close(self, *args, **kwargs)

    monkeypatch.setattr(store_writer.RunWriter, "close", locked)
    config = RunConfig(steps=40, depth=2, width=8)
    run_id = store.create_run(config.to_dict(), name="locked at its end")
    status = worker.execute(store, run_id)
    info = store.run_info(run_id)
    if locked_closes == 1:
        assert status == info["status"] == "completed"
        assert sorted(store.layer_stats(run_id)["step"].unique()) == list(range(1, 41))
    else:
        assert status == info["status"] == "failed"
        assert info["message"].startswith(
            "Training finished, but its last steps could not be stored: GradientMonitor still "
            "cannot write run"
        )
        assert "another program holds the lock" in info["message"]
