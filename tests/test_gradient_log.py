"""GradientLog: a hand-written training loop's own gradients, against numpy.

Each test trains with its own `tf.GradientTape` loop (the loop a user
writes), keeps the gradients and the weights it saw, and computes every
statistic with numpy: the log's rows must match them step by step.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import gradflow
from gradflow import schema
from gradflow.store import RunStore
from tests.test_monitor import numpy_stats

N, BATCH = 24, 8


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(5, activation="tanh", name="d0"),
            keras.layers.Dense(4, activation="relu", name="d1"),
            keras.layers.Dense(1, name="d2"),
        ],
        name="mlp",
    )


def make_data(seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, 3)).astype("float32"), rng.normal(size=(N, 1)).astype("float32")


def loop_step(model, optimizer, summarize_with=None):
    """The user's `tf.function` step; with `summarize_with` (a log) it also returns its summary."""
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        if summarize_with is not None:
            return loss, gradients, summarize_with.summarize(gradients)
        return loss, gradients

    return train_step


def train_and_log(log, model, optimizer, steps, step_numbers=None):
    """The user's loop; returns what the reference needs: per step, grads, weights before/after, loss."""
    x, y = make_data()
    train_step = loop_step(model, optimizer)
    seen = []
    for i in range(steps):
        start = (i * BATCH) % N
        before = [v.numpy().copy() for v in model.trainable_variables]
        loss, gradients = train_step(x[start : start + BATCH], y[start : start + BATCH])
        after = [v.numpy().copy() for v in model.trainable_variables]
        step = None if step_numbers is None else step_numbers[i]
        log.record(gradients, loss=loss, step=step)
        seen.append(([g.numpy() for g in gradients], before, after, float(loss)))
    return seen


def assert_rows_match(log, seen, steps, update_ratio=True, first_ratio=True):
    history = log.history.set_index(["step", "variable"])
    paths = [v.path for v in log.variables]
    for step in steps:
        grads, before, after, loss = seen[step - 1]
        for path, g, w0, w1 in zip(paths, grads, before, after, strict=True):
            row = history.loc[(step, path)]
            for column, expected in numpy_stats(g).items():
                np.testing.assert_allclose(row[column], expected, rtol=2e-5, atol=1e-7)
            np.testing.assert_allclose(row["weight_norm"], np.linalg.norm(w1), rtol=2e-5)
            # Undefined from zero weights (a bias before its first update), as in the monitor.
            w0_norm = np.linalg.norm(w0)
            ratio = np.linalg.norm(w1 - w0) / w0_norm if w0_norm > 0 else np.nan
            if update_ratio and (first_ratio or step > 1):
                np.testing.assert_allclose(row["update_ratio"], ratio, rtol=1e-3, atol=1e-9)
            else:
                assert np.isnan(row["update_ratio"])
        metrics = log.metrics[log.metrics["step"] == step].set_index("name")["value"]
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
        global_norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in grads))
        np.testing.assert_allclose(metrics["global_norm"], global_norm, rtol=2e-5)


@pytest.mark.parametrize("optimizer_class", [keras.optimizers.SGD, keras.optimizers.Adam])
def test_a_loops_gradients_equal_numpys_statistics_step_by_step(optimizer_class):
    model = make_model()
    optimizer = optimizer_class(0.05)
    log = gradflow.GradientLog(model, optimizer=optimizer, update_ratio=True)
    seen = train_and_log(log, model, optimizer, steps=6)
    assert sorted(log.history["step"].unique()) == [1, 2, 3, 4, 5, 6]
    assert_rows_match(log, seen, range(1, 7))
    rates = log.metrics[log.metrics["name"] == "learning_rate"]["value"]
    np.testing.assert_allclose(rates, 0.05)
    # Named as `snapshot` names them: the same model's rows line up.
    shot = gradflow.snapshot(model, *make_data(), loss="mse")
    first = log.history[log.history["step"] == 1]
    assert first[["layer", "layer_index", "tensor", "variable"]].values.tolist() == (
        shot.weights[["layer", "layer_index", "tensor", "variable"]].values.tolist()
    )


def test_every_records_multiples_with_the_update_of_that_step_alone():
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    log = gradflow.GradientLog(model, optimizer=optimizer, every=3, update_ratio=True)
    seen = train_and_log(log, model, optimizer, steps=9)
    assert sorted(log.history["step"].unique()) == [3, 6, 9]
    assert_rows_match(log, seen, [3, 6, 9])


def test_a_step_skipped_by_the_loop_has_no_update_ratio():
    """The weights kept are those after step 3: a ratio at step 5 would add two updates."""
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    log = gradflow.GradientLog(model, optimizer=optimizer, update_ratio=True)
    seen = train_and_log(log, model, optimizer, steps=4, step_numbers=[1, 2, 3, 5])
    history = log.history
    assert history[history["step"] == 3]["update_ratio"].notna().all()
    assert history[history["step"] == 5]["update_ratio"].isna().all()
    assert_rows_match(log, seen[:3], [1, 2, 3])


def test_without_update_ratio_nothing_of_the_weights_is_kept():
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    log = gradflow.GradientLog(model, optimizer=optimizer)
    seen = train_and_log(log, model, optimizer, steps=2)
    assert log._before is None
    assert_rows_match(log, seen, [1, 2], update_ratio=False)


def test_a_learning_rate_schedule_is_recorded_as_it_changes():
    model = make_model()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    optimizer = keras.optimizers.SGD(schedule)
    log = gradflow.GradientLog(model, optimizer=optimizer)
    train_and_log(log, model, optimizer, steps=3)
    rates = log.metrics[log.metrics["name"] == "learning_rate"]["value"].tolist()
    # The rate each update used (it read the next one's: a warm-up shifted by a step).
    np.testing.assert_allclose(rates, [0.1, 0.05, 0.025], rtol=1e-6)


def test_an_embeddings_sparse_gradient_counts_its_implicit_zeros_and_repeated_rows():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,), dtype="int32"), keras.layers.Embedding(10, 3), keras.layers.Flatten()]
    )
    x = np.array([[1, 1, 2, 1]], np.int32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x)))
    (gradient,) = tape.gradient(loss, model.trainable_variables)
    assert isinstance(gradient, tf.IndexedSlices)
    log = gradflow.GradientLog(model)
    log.record([gradient], loss=loss)
    row = log.history.iloc[0]
    for column, expected in numpy_stats(tf.convert_to_tensor(gradient).numpy()).items():
        np.testing.assert_allclose(row[column], expected, rtol=2e-5, atol=1e-7)


def make_sqrt_model():
    """Dense -> relu -> sqrt: the sqrt's gradient at 0 is infinite, so `below` breaks first."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(3, activation="relu", name="below")(inputs)
    rooted = keras.layers.Lambda(tf.sqrt, name="root")(hidden)
    outputs = keras.layers.Dense(1, name="above")(rooted)
    model = keras.Model(inputs, outputs)
    below = model.get_layer("below")
    below.kernel.assign(np.zeros((2, 3), np.float32))  # relu(0) = 0 at every step
    return model


def test_the_first_nonfinite_gradient_is_told_at_its_layer_and_stops_the_loop(store_path):
    model = make_sqrt_model()
    optimizer = keras.optimizers.SGD(0.01)
    train_step = loop_step(model, optimizer)
    log = gradflow.GradientLog(model, store=store_path, stop_on_nonfinite=True, run_name="sqrt")
    x, y = np.ones((4, 2), np.float32), np.ones((4, 1), np.float32)
    with pytest.raises(FloatingPointError, match="layer 'below'") as raised, log:
        for _ in range(5):
            loss, gradients = train_step(x, y)
            log.record(gradients, loss=loss)
    assert np.isfinite(float(loss))
    assert "First non-finite gradient at step 1" in str(raised.value)
    events = log.events
    assert events[["step", "layer", "kind"]].values.tolist() == [[1, "below", "nonfinite"]]
    history = log.history
    assert history[history["layer"] == "above"]["nonfinite"].eq(0).all()
    store = RunStore(store_path)
    info = store.run_info(log.run_id)
    assert info["status"] == "diverged"
    assert store.events(log.run_id)["kind"].tolist() == ["nonfinite"]
    assert len(store.layer_stats(log.run_id)) == len(history)


def test_a_loss_that_overflows_alone_is_told_and_a_missing_loss_is_not_one():
    model = make_model()
    gradients = [tf.zeros_like(v) for v in model.trainable_variables]
    log = gradflow.GradientLog(model)
    log.record(gradients)  # no loss given: nothing to tell
    log.record(gradients, loss=float("inf"))
    assert log.events[["step", "kind"]].values.tolist() == [[2, "nonfinite"]]
    assert "loss was infinite at step 2" in log.events["message"][0]
    assert log.metrics[log.metrics["step"] == 1]["name"].tolist() == ["global_norm"]


def test_a_variable_no_gradient_reaches_is_left_out_and_told_once():
    model = make_model()
    gradients = [tf.ones_like(v) for v in model.trainable_variables]
    gradients[2] = gradients[3] = None  # d1's kernel and bias
    log = gradflow.GradientLog(model)
    log.record(gradients)
    log.record(gradients)
    assert "d1" not in set(log.history["layer"])
    assert log.events[["step", "layer", "kind"]].values.tolist() == [[1, "d1", "no_gradient"]]


def test_the_run_store_gets_every_row_and_the_extra_metrics(store_path, tmp_path):
    model = make_model()
    optimizer = keras.optimizers.Adam(0.01)
    x, y = make_data()
    train_step = loop_step(model, optimizer)
    with gradflow.GradientLog(
        model,
        optimizer=optimizer,
        store=store_path,
        run_name="my loop",
        total_steps=4,
        histograms=True,
        tensorboard_dir=tmp_path / "tb",
    ) as log:
        for _ in range(4):
            loss, gradients = train_step(x[:BATCH], y[:BATCH])
            log.record(gradients, loss=loss, accuracy=0.25)
    store = RunStore(store_path)
    info = store.run_info(log.run_id)
    assert (info["name"], info["status"], info["source"]) == ("my loop", "completed", "monitor")
    assert info["config"]["recorded_by"] == "GradientLog"
    keys = ["step", "layer", "tensor"]
    stored = store.layer_stats(log.run_id).astype({"layer": str, "tensor": str})
    both = log.history.merge(stored, on=keys, suffixes=("", "_stored"), validate="1:1")
    assert len(both) == len(log.history) == 4 * 6
    np.testing.assert_allclose(both["l2_norm_stored"], both["l2_norm"], rtol=1e-6)
    np.testing.assert_allclose(both["update_ratio_stored"], both["update_ratio"], rtol=1e-6)
    metrics = store.metrics(log.run_id)
    assert set(metrics["name"]) == {"loss", "learning_rate", "global_norm", "accuracy"}
    assert len(store.histograms(log.run_id)) == 4 * 6
    tags = set()
    for path in (tmp_path / "tb").iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            tags |= {value.tag for value in event.summary.value}
    assert {"gradients/d0/kernel/l2_norm", "gradflow/loss", "gradflow/accuracy"} <= tags


@pytest.mark.parametrize(
    "error,status", [(KeyboardInterrupt, "interrupted"), (ValueError("my bug"), "failed")]
)
def test_an_error_in_the_loop_closes_the_run_with_its_steps(store_path, error, status):
    model = make_model()
    gradients = [tf.ones_like(v) for v in model.trainable_variables]
    with pytest.raises(type(error) if isinstance(error, Exception) else error):
        with gradflow.GradientLog(model, store=store_path) as log:
            log.record(gradients, loss=1.0)
            raise error
    store = RunStore(store_path)
    assert store.run_info(log.run_id)["status"] == status
    assert store.layer_stats(log.run_id)["step"].unique().tolist() == [1]


SCRIPT = """
import numpy as np, keras, tensorflow as tf, gradflow
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
log = gradflow.GradientLog(model, store={db!r})
log.record([tf.ones_like(v) for v in model.trainable_variables], loss=1.0)
{end}
"""


@pytest.mark.parametrize(
    "end,status",
    [
        ("", "completed"),
        # An exit hook cannot tell `sys.exit(1)` from a clean end (the docstring says so).
        ("raise SystemExit('bad data')", "completed"),
        ("1 / 0", "failed"),
        ("raise KeyboardInterrupt", "interrupted"),
    ],
)
def test_a_script_that_ends_without_close_leaves_no_run_running(store_path, end, status):
    """A real interpreter's exit: the run was left "running" without `close()`."""
    script = textwrap.dedent(SCRIPT.format(db=str(store_path), end=end))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", script], env=env, timeout=120, capture_output=True)
    store = RunStore(store_path)
    (run_id,) = store.runs()["run_id"]
    assert store.run_info(run_id)["status"] == status
    assert store.layer_stats(run_id)["step"].tolist() == [1, 1]


def bad_calls(model):
    variables = model.trainable_variables
    ones = [tf.ones_like(v) for v in variables]
    return [
        (dict(gradients=ones[:-1]), "holds 5 gradients, but there are 6 trainable variables"),
        (dict(gradients=ones[::-1]), r"gradients\[0\]` has shape \(1,\), but its variable"),
        (dict(gradients=tf.ones([3])), "must be a list of gradients"),
        (dict(gradients=[None] * 6), "holds no gradient at step 1"),
        (dict(gradients=ones, loss=tf.ones([8])), r"`loss` must be one number.*shape \(8,\)"),
        (dict(gradients=ones, loss="big"), "`loss` must be one number"),
        (dict(gradients=ones, step=0), "must be greater than the last step recorded"),
        (dict(gradients=ones, step=2.5), "`step` must be a whole number"),
        (dict(gradients=ones, accuracy=[1, 2]), "`accuracy` must be one number"),
        (dict(gradients=[tf.ones_like(v, tf.int32) for v in variables]), "must hold floats"),
        # Its own metrics: one of two rows with the same name was dropped in the store.
        (dict(gradients=ones, learning_rate=0.5), "`learning_rate` is a metric GradientLog"),
    ]


def test_bad_calls_name_the_argument_and_record_nothing():
    model = make_model()
    log = gradflow.GradientLog(model)
    for kwargs, message in bad_calls(model):
        gradients = kwargs.pop("gradients")
        with pytest.raises(ValueError, match=message):
            log.record(gradients, **kwargs)
    assert log.history.empty and log.metrics.empty
    log.record([tf.ones_like(v) for v in model.trainable_variables])
    assert log.history["step"].unique().tolist() == [1]


def test_record_inside_a_tf_function_says_to_return_the_gradients():
    model = make_model()
    log = gradflow.GradientLog(model)

    @tf.function
    def step():
        log.record([tf.ones_like(v) for v in model.trainable_variables])

    with pytest.raises(RuntimeError, match="Return the gradients from your train step"):
        step()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(model="mlp"), "`model` must be a Keras 3 model or layer"),
        (dict(variables=[np.ones(3)]), r"`variables\[0\]` must be a Keras 3 variable"),
        (dict(optimizer="adam"), "`optimizer` must be a Keras optimizer"),
        (dict(every=0), "every"),
        (dict(total_steps=0), "total_steps"),
        (dict(histograms="yes"), "histograms"),
        (dict(store=123), "`store` must be a gradflow.RunStore"),
        (dict(run_name="slides\x07"), "`run_name` must not contain control characters"),
        # All its rows read as the model's own (two kernels under one name).
        (dict(variables=make_model(seed=1).trainable_variables), r"`variables\[0\]` \('mlp/d0"),
    ],
)
def test_bad_arguments_are_refused_when_the_log_is_made(kwargs, message):
    arguments = {"model": make_model(), **kwargs}
    with pytest.raises(ValueError, match=message):
        gradflow.GradientLog(**arguments)


def test_a_closed_log_refuses_more_steps_and_a_second_close_does_nothing(store_path):
    model = make_model()
    log = gradflow.GradientLog(model, store=store_path)
    log.record([tf.ones_like(v) for v in model.trainable_variables])
    log.close("stopped", "enough")
    log.close()
    assert RunStore(store_path).run_info(log.run_id)["status"] == "stopped"
    with pytest.raises(RuntimeError, match="closed \\(stopped\\)"):
        log.record([tf.ones_like(v) for v in model.trainable_variables])


def test_the_rules_run_at_close_and_their_alerts_are_stored(store_path):
    model = make_model()
    rules = gradflow.Thresholds(exploding_norm=1e-12)
    with gradflow.GradientLog(model, store=store_path, rules=rules) as log:
        log.record([tf.ones_like(v) for v in model.trainable_variables], loss=1.0)
    assert set(log.events["kind"]) == {"exploding"}
    assert set(RunStore(store_path).events(log.run_id)["kind"]) == {"exploding"}


def test_a_gans_two_networks_log_one_run_each_from_one_combined_model():
    """`variables=` picks the generator's: named by their paths in the combined model."""
    keras.utils.set_random_seed(0)
    generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="g")], name="gen")
    critic = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="c")], name="critic")
    gan = keras.Sequential([generator, critic], name="gan")
    log = gradflow.GradientLog(gan, variables=generator.trainable_variables)
    z = np.ones((4, 2), np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(gan(z))
    log.record(tape.gradient(loss, generator.trainable_variables), loss=loss)
    assert log.history[["layer", "tensor"]].values.tolist() == [
        ["gen/g", "kernel"],
        ["gen/g", "bias"],
    ]
    assert schema.LAYER_STATS_COLUMNS == tuple(log.history.columns)


def test_the_live_page_shows_a_loops_run(page_environment):
    """A loop's run has no activation rows, clipping or lab settings: the page draws it all the same."""
    from gradflow.ui.live import _VIEWS
    from tests.test_pages import live_chart_updates, live_view

    model = make_model()
    optimizer = keras.optimizers.SGD(0.05)
    with gradflow.GradientLog(
        model, optimizer=optimizer, store=page_environment, run_name="hand loop", total_steps=3
    ) as log:
        train_and_log(log, model, optimizer, steps=3)
    views = {view: live_view(log.run_id, view) for view in _VIEWS}
    infos = [info.value for info in views["Histograms"].info]
    assert any("`GradientLog(histograms=True)`" in info for info in infos), infos
    # The loss the loop gave is drawn; the run did not diverge.
    assert not [e.value for e in views["Loss"].error if "NaN" in e.value]
    assert views["Heatmaps"].get("plotly_chart") or live_chart_updates(views["Heatmaps"])


def test_statistics_made_inside_the_step_equal_those_record_makes():
    """`summarize` in the user's tf.function: the same rows, without the update ratio."""
    model = make_model()
    optimizer = keras.optimizers.Adam(0.05)
    in_step = gradflow.GradientLog(model, histograms=True)
    outside = gradflow.GradientLog(model, histograms=True)
    train_step = loop_step(model, optimizer, summarize_with=in_step)

    x, y = make_data()
    for i in range(3):
        loss, gradients, summary = train_step(
            x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]
        )
        in_step.record(summary, loss=loss)
        outside.record(gradients, loss=loss)
    columns = list(schema.STATISTICS) + ["weight_norm"]
    np.testing.assert_allclose(
        in_step.history[columns].to_numpy(float),
        outside.history[columns].to_numpy(float),
        rtol=1e-6,
    )
    assert in_step.history["update_ratio"].isna().all()
    assert in_step.metrics.equals(outside.metrics)
    counts = np.stack(in_step.histogram_rows["counts"])
    np.testing.assert_array_equal(counts, np.stack(outside.histogram_rows["counts"]))


def test_a_store_it_cannot_open_is_named_and_the_step_is_not_recorded(tmp_path):
    """A builtin FileExistsError came out of `record`, with the step already in `history`."""
    model = make_model()
    log = gradflow.GradientLog(model, store=tmp_path / "gone" / "runs.db")
    (tmp_path / "gone").write_text("the folder is a file now")
    gradients = [tf.ones_like(v) for v in model.trainable_variables]
    with pytest.raises(RuntimeError, match="GradientLog could not write to its `store`"):
        log.record(gradients, loss=1.0)
    assert log.history.empty and log.metrics.empty
    with pytest.raises(RuntimeError, match="could not write"):
        log.record(gradients, loss=1.0, step=1)  # the same step again: nothing was counted


def sgd_loop(rate):
    """`(model, optimizer, log, train_step, x, y)`: an SGD loop with a log of its optimizer."""
    model = make_model()
    optimizer = keras.optimizers.SGD(rate)
    log = gradflow.GradientLog(model, optimizer=optimizer)
    x, y = make_data()
    return model, optimizer, log, loop_step(model, optimizer), x, y


def test_the_optimizers_step_count_may_number_the_steps():
    model, optimizer, log, train_step, x, y = sgd_loop(0.1)
    for _ in range(2):
        loss, gradients = train_step(x[:BATCH], y[:BATCH])
        log.record(gradients, loss=loss, step=optimizer.iterations)
    assert log.history["step"].unique().tolist() == [1, 2]


def test_mixed_precision_gradients_are_recorded_unscaled_and_overflow_steps_skipped():
    """Scaled gradients were recorded (l2 23195 for 0.7) and "exploding"; an overflow the
    LossScaleOptimizer skipped, as it should, was stored as the run's divergence."""
    keras.utils.set_random_seed(0)
    model = make_model()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2**15)
    loss_fn = keras.losses.MeanSquaredError()
    log = gradflow.GradientLog(model, optimizer=optimizer, stop_on_nonfinite=True)
    x, y = make_data()
    seen = []
    for poison in (False, True, False):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[:BATCH], model(x[:BATCH]))
            scaled = optimizer.scale_loss(loss) * (np.inf if poison else 1.0)
        gradients = tape.gradient(scaled, model.trainable_variables)
        scale = float(optimizer.dynamic_scale.numpy()) if optimizer.built else 2.0**15
        optimizer.apply(gradients, model.trainable_variables)
        seen.append((gradients, scale))
        log.record(gradients, loss=loss)
    assert log.history["step"].unique().tolist() == [1, 3]
    for step in (1, 3):
        gradients, scale = seen[step - 1]
        rows = log.history[log.history["step"] == step]
        for g, (_, row) in zip(gradients, rows.iterrows(), strict=True):
            expected = numpy_stats(g.numpy() / scale)
            for column in ("max_abs", "l2_norm", "mean_abs", "std", "zero_fraction"):
                np.testing.assert_allclose(row[column], expected[column], rtol=2e-5, atol=1e-9)
    assert seen[2][1] == seen[0][1] / 2  # the overflow halved the scale step 3 used
    events = log.events
    assert events["kind"].tolist() == ["info"] and "Step 2 was skipped" in events["message"][0]
    rates = log.metrics[log.metrics["name"] == "learning_rate"]["value"]
    np.testing.assert_allclose(rates, 0.01, rtol=1e-6)


class HeadFirst(keras.Model):
    """Layers made head first, called stem first: `__init__`'s order is not the data's."""

    def __init__(self):
        super().__init__(name="head_first")
        self.head = keras.layers.Dense(1, name="head")
        self.body = keras.layers.Dense(4, activation="relu", name="body")
        self.stem = keras.layers.Dense(4, activation="relu", name="stem")

    def call(self, x):
        return self.head(self.body(self.stem(x)))


def test_a_subclassed_models_layers_are_numbered_as_its_pass_calls_them():
    """Numbered as `__init__` made them, the NaN origin named the input layer."""
    model = HeadFirst()
    x, y = make_data()
    model(x[:2])
    log = gradflow.GradientLog(model, stop_on_nonfinite=True)
    shot = gradflow.snapshot(model, x, y, loss="mse")
    gradients = [tf.fill(v.shape, np.nan) for v in model.trainable_variables]
    with pytest.raises(FloatingPointError, match="from layer 'head' down"):
        log.record(gradients, loss=float("nan"))
    order = log.history.drop_duplicates("layer").set_index("layer")["layer_index"].to_dict()
    assert order == {"stem": 0, "body": 1, "head": 2}
    assert (
        shot.weights.drop_duplicates("layer").set_index("layer")["layer_index"].to_dict() == order
    )


def test_a_layer_frozen_between_steps_is_followed():
    """It said "holds 6 gradients, but there are 8 variables": the list of the first step."""
    model = make_model()
    log = gradflow.GradientLog(model)
    log.record([tf.ones_like(v) for v in model.trainable_variables])
    model.get_layer("d1").trainable = False
    log.record([tf.ones_like(v) for v in model.trainable_variables])
    layers = log.history.groupby("step")["layer"].unique().map(sorted).to_dict()
    assert layers == {1: ["d0", "d1", "d2"], 2: ["d0", "d2"]}


def lso_loop(log_of, optimizer, poison_at, record_first=False, step_of=None):
    """A mixed-precision loop: SGD under a LossScaleOptimizer, an overflow at `poison_at`.

    Returns per step the gradients and the scale they were made with.
    """
    model = log_of.model
    loss_fn = keras.losses.MeanSquaredError()
    x, y = make_data()
    seen = []
    for step in range(1, 6):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[:BATCH], model(x[:BATCH]))
            scaled = optimizer.scale_loss(loss) * (np.inf if step == poison_at else 1.0)
        gradients = tape.gradient(scaled, model.trainable_variables)
        scale = float(optimizer.dynamic_scale.numpy()) if optimizer.built else 2.0**15
        seen.append((gradients, scale))
        number = None if step_of is None else step_of(optimizer)
        if record_first:
            log_of.record(gradients, loss=loss, step=number)
        optimizer.apply(gradients, model.trainable_variables)
        if not record_first:
            number = None if step_of is None else step_of(optimizer)
            log_of.record(gradients, loss=loss, step=number)
    return seen


def assert_unscaled(log, seen, steps):
    for number, step in steps:
        gradients, scale = seen[step - 1]
        rows = log.history[log.history["step"] == number]
        for g, (_, row) in zip(gradients, rows.iterrows(), strict=True):
            np.testing.assert_allclose(row["l2_norm"], np.linalg.norm(g.numpy() / scale), rtol=2e-5)


@pytest.mark.parametrize("record_first", [False, True], ids=["after apply", "before apply"])
def test_mixed_precision_steps_numbered_by_the_optimizer_or_recorded_before_the_update(
    record_first,
):
    """`step=optimizer.iterations` raised at the overflow (the count stays), and the next
    good step read "skipped"; recorded before the update, the overflow was a divergence."""
    model = make_model()
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2**15, dynamic_growth_steps=2
    )
    log = gradflow.GradientLog(model, optimizer=optimizer, stop_on_nonfinite=True)
    if record_first:
        seen = lso_loop(log, optimizer, poison_at=3, record_first=True)
        recorded = [(1, 1), (2, 2), (4, 4), (5, 5)]
    else:
        seen = lso_loop(log, optimizer, poison_at=3, step_of=lambda o: int(o.iterations.numpy()))
        recorded = [(1, 1), (2, 2), (3, 4), (4, 5)]  # numbered by the updates made
    assert log.history["step"].unique().tolist() == [n for n, _ in recorded]
    assert_unscaled(log, seen, recorded)
    assert log.events["kind"].tolist() == ["info"]  # one skip, no divergence
    assert seen[1][1] * 2 == seen[2][1]  # the scale grew after two good steps...
    assert seen[3][1] == seen[2][1] / 2  # ...and the overflow halved it


@pytest.mark.parametrize("numbered", ["by the log", "by optimizer.iterations"])
def test_a_skipped_step_keeps_the_update_ratio_and_its_number(tmp_path, numbered):
    """Given `step=optimizer.iterations` (the variable, as the README shows), the skip's
    event read "Step <Variable path=sgd/iteration ...>", never reached the store, and the
    rules failed at `close()`; and the step after a skip had a NaN update ratio, though the
    skipped update left the weights as they were."""
    model = make_model()
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2**15, dynamic_growth_steps=2
    )
    store = RunStore(tmp_path / "runs.db")
    log = gradflow.GradientLog(model, optimizer=optimizer, update_ratio=True, store=store)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "the diagnosis rules failed"
        with log:
            lso_loop(
                log,
                optimizer,
                poison_at=3,
                step_of=None if numbered == "by the log" else (lambda o: o.iterations),
            )
    skips = log.events[log.events["kind"] == "info"]
    assert len(skips) == 1 and "Variable" not in skips["message"].iloc[0]
    assert isinstance(skips["step"].iloc[0], (int, np.integer))
    assert store.events(log.run_id)["message"].tolist() == skips["message"].tolist()
    after_skip = 4 if numbered == "by the log" else 3
    ratios = log.history.query(f"step == {after_skip}")["update_ratio"]
    assert len(ratios) and np.isfinite(ratios).all() and (ratios > 0).all()


def test_updates_record_did_not_see_are_told_once():
    model = make_model()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2**15)
    log = gradflow.GradientLog(model, optimizer=optimizer)
    gradients = [tf.ones_like(v) for v in model.trainable_variables]
    optimizer.apply(gradients, model.trainable_variables)
    log.record(gradients)
    for _ in range(2):
        optimizer.apply(gradients, model.trainable_variables)
    with pytest.warns(UserWarning, match="made 2 updates between two `record` calls"):
        log.record(gradients)


def test_a_learning_rate_set_by_hand_is_the_one_each_step_used():
    """A warm-up that set the rate before each step read one step late."""
    model, optimizer, log, train_step, x, y = sgd_loop(0.0)
    for k in range(1, 4):
        optimizer.learning_rate = 0.1 * k
        loss, gradients = train_step(x[:BATCH], y[:BATCH])
        log.record(gradients, loss=loss)
    rates = log.metrics[log.metrics["name"] == "learning_rate"]["value"]
    np.testing.assert_allclose(rates, [0.1, 0.2, 0.3], rtol=1e-6)


def test_one_layer_frozen_and_another_of_its_shapes_unfrozen_is_followed():
    """Same count, same shapes: the gradients went under the wrong layers."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(3, name="a"), keras.layers.Dense(3, name="b")]
    )
    model.get_layer("b").trainable = False
    log = gradflow.GradientLog(model)
    log.record([tf.ones_like(v) for v in model.trainable_variables])
    model.get_layer("a").trainable, model.get_layer("b").trainable = False, True
    log.record([tf.fill(v.shape, 2.0) for v in model.trainable_variables])
    rows = log.history.groupby("step")["layer"].unique().map(list).to_dict()
    assert rows == {1: ["a"], 2: ["b"]}


def test_reading_the_optimizer_leaves_numpy_nothing_to_warn_of():
    """`keras.ops.convert_to_numpy` of a Keras variable (the step count, the rate) went through
    its `__array__`, which takes no `copy`: NumPy 2 warns at every `record`, and is to refuse it."""
    model, optimizer, log, train_step, x, y = sgd_loop(0.1)
    loss, gradients = train_step(x[:BATCH], y[:BATCH])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.record(gradients, loss=loss)
    assert not [w for w in caught if "copy keyword" in str(w.message)], [
        str(w.message) for w in caught
    ]
    assert log.metrics.query("name == 'learning_rate'")["value"].tolist() == [pytest.approx(0.1)]
