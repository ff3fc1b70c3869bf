"""GradientMonitor against a hand-written tf.GradientTape training loop.

The reference below trains a copy of the model (same initial weights, same
batch order) one step at a time with its own tape, its own clipping and its
own max-norm constraint, and computes every statistic with numpy. The
monitor's recorded rows must match it step by step.
"""

import functools

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

from gradflow import schema
from gradflow.monitor import GradientMonitor
from gradflow.monitor import step as step_module

N, BATCH = 24, 8  # 3 steps per epoch


def make_data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 3)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    return x, y


def make_model(seed=0, max_norm=None):
    keras.utils.set_random_seed(seed)
    constraint = None if max_norm is None else keras.constraints.MaxNorm(max_norm)
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(5, activation="tanh", kernel_constraint=constraint, name="d0"),
            keras.layers.Dense(4, activation="relu", name="d1"),
            keras.layers.Dense(1, name="d2"),
        ],
        name="mlp",
    )


# --- the independent reference ---------------------------------------------


def numpy_stats(g):
    g = np.asarray(g, np.float64).ravel()
    return {
        "max_abs": np.abs(g).max(),
        "l2_norm": np.sqrt(np.sum(g * g)),
        "mean_abs": np.abs(g).mean(),
        "std": g.std(),
        "zero_fraction": np.mean(g == 0.0),
        "nonfinite": np.sum(~np.isfinite(g)),
    }


def reference_clip(grads, clip):
    kind, value = clip or (None, None)
    if kind == "clipnorm":
        return [g * value / max(np.linalg.norm(g), value) for g in grads]
    if kind == "clipvalue":
        return [np.clip(g, -value, value) for g in grads]
    if kind == "global_clipnorm":
        total = np.sqrt(sum(np.sum(g * g) for g in grads))
        return [g * value / max(total, value) for g in grads]
    return grads


def reference_max_norm(w, max_value):
    norms = np.sqrt(np.sum(w * w, axis=0, keepdims=True))
    return w * (np.clip(norms, 0, max_value) / (1e-7 + norms))


def reference_run(model, optimizer, x, y, epochs, clip=None, max_norm=None, sample_weight=None):
    """Train `model` with a plain tape; return {(step, layer, tensor): row} and metrics."""
    variables = model.trainable_variables
    rows, metrics, step = {}, {}, 0
    for _ in range(epochs):
        for start in range(0, len(x), BATCH):
            xb, yb = x[start : start + BATCH], y[start : start + BATCH]
            with tf.GradientTape() as tape:
                outputs, h = [], tf.constant(xb)
                for layer in model.layers:
                    h = layer(h, training=True)
                    outputs.append(h)
                per_sample = tf.reduce_mean(tf.square(yb - h), axis=-1)
                if sample_weight is None:
                    loss = tf.reduce_mean(per_sample)
                else:
                    loss = tf.reduce_sum(per_sample * sample_weight[start : start + BATCH]) / len(
                        xb
                    )
            grads = tape.gradient(loss, variables + outputs)
            weight_grads = [g.numpy() for g in grads[: len(variables)]]
            clipped = reference_clip(weight_grads, clip)
            before = [v.numpy() for v in variables]
            optimizer.apply_gradients(
                zip([tf.constant(g) for g in clipped], variables, strict=False)
            )
            step += 1
            for i, v in enumerate(variables):
                unconstrained = v.numpy()
                row = numpy_stats(weight_grads[i])
                row["weight_norm_unconstrained"] = np.nan
                if max_norm is not None and i == 0:
                    row["weight_norm_unconstrained"] = np.linalg.norm(unconstrained)
                    v.assign(reference_max_norm(unconstrained, max_norm))
                after = v.numpy()
                row["weight_norm"] = np.linalg.norm(after)
                norm_before = np.linalg.norm(before[i])
                row["update_ratio"] = (
                    np.linalg.norm(after - before[i]) / norm_before if norm_before > 0 else np.nan
                )
                row["l2_norm_clipped"] = np.linalg.norm(clipped[i]) if clip else np.nan
                row["max_abs_clipped"] = np.abs(clipped[i]).max() if clip else np.nan
                layer, tensor = v.path.split("/")[-2:]
                rows[(step, layer, tensor)] = row
            for layer, g in zip(model.layers, grads[len(variables) :], strict=False):
                rows[(step, layer.name, "activation")] = numpy_stats(g.numpy())
            metrics[(step, "loss")] = float(loss)
            metrics[(step, "global_norm")] = np.sqrt(sum(np.sum(g * g) for g in weight_grads))
            if clip:
                metrics[(step, "global_norm_clipped")] = np.sqrt(
                    sum(np.sum(g * g) for g in clipped)
                )
    return rows, metrics


def copy_of(model, max_norm=None):
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    for v in clone.trainable_variables:
        v.constraint = None  # the reference applies max-norm itself
    return clone


def assert_matches_reference(monitor, rows, metrics, rtol):
    history = monitor.history
    assert len(history) == len(rows)
    for record in history.itertuples(index=False):
        expected = rows[(record.step, record.layer, record.tensor)]
        for column, value in expected.items():
            np.testing.assert_allclose(
                getattr(record, column),
                value,
                rtol=rtol,
                atol=1e-6,
                err_msg=f"step {record.step} {record.layer}/{record.tensor} {column}",
            )
    recorded = monitor.metrics.set_index(["step", "name"])["value"]
    for key, value in metrics.items():
        np.testing.assert_allclose(recorded[key], value, rtol=rtol, atol=1e-6, err_msg=str(key))


CASES = [
    # name, optimizer, clipping, max_norm, rtol
    ("sgd", keras.optimizers.SGD, None, None, 1e-5),
    ("adam", keras.optimizers.Adam, None, None, 1e-4),
    ("sgd_clipnorm", keras.optimizers.SGD, ("clipnorm", 0.05), None, 1e-5),
    ("adam_clipvalue", keras.optimizers.Adam, ("clipvalue", 0.02), None, 1e-4),
    ("sgd_global_clipnorm", keras.optimizers.SGD, ("global_clipnorm", 0.1), None, 1e-5),
    ("sgd_max_norm", keras.optimizers.SGD, None, 0.3, 1e-5),
    # The update ratio comes from the optimizer's own increment for these...
    (
        "sgd_nesterov",
        functools.partial(keras.optimizers.SGD, momentum=0.9, nesterov=True),
        None,
        None,
        1e-5,
    ),
    (
        "rmsprop_centered_momentum",
        functools.partial(keras.optimizers.RMSprop, momentum=0.5, centered=True),
        None,
        None,
        1e-4,
    ),
    ("adagrad", keras.optimizers.Adagrad, None, None, 1e-4),
    ("nadam", keras.optimizers.Nadam, None, None, 1e-4),
    ("adamax", keras.optimizers.Adamax, None, None, 1e-4),
    # ...and from the weights before and after for these (weight decay).
    ("adamw", keras.optimizers.AdamW, None, None, 1e-4),
    (
        "sgd_weight_decay",
        functools.partial(keras.optimizers.SGD, weight_decay=0.1),
        None,
        None,
        1e-5,
    ),
]


@pytest.mark.parametrize(
    "name,optimizer_class,clip,max_norm,rtol", CASES, ids=[c[0] for c in CASES]
)
def test_statistics_equal_a_hand_written_tape_loop(name, optimizer_class, clip, max_norm, rtol):
    x, y = make_data()
    model = make_model(max_norm=max_norm)
    reference = copy_of(model)
    clip_kwargs = {clip[0]: clip[1]} if clip else {}
    model.compile(optimizer=optimizer_class(learning_rate=0.05, **clip_kwargs), loss="mse")
    monitor = GradientMonitor(activations=True)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    # Without clipping or a constraint this small model takes the deferred
    # path (activation statistics in the step, the rest at the read).
    assert monitor._plan.deferred is (clip is None and max_norm is None)

    rows, metrics = reference_run(
        reference, optimizer_class(learning_rate=0.05), x, y, epochs=2, clip=clip, max_norm=max_norm
    )
    assert list(monitor.history.columns) == list(schema.LAYER_STATS_COLUMNS)
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3, 4, 5, 6]
    assert_matches_reference(monitor, rows, metrics, rtol)
    np.testing.assert_allclose(
        monitor.metrics.query("name == 'learning_rate'")["value"], 0.05, rtol=1e-6
    )
    if clip:
        clipped = monitor.metrics.query("name == 'clipped'")["value"].to_numpy()
        expected = [
            float(metrics[(s, "global_norm_clipped")] < metrics[(s, "global_norm")] * (1 - 1e-6))
            for s in range(1, 7)
        ]
        np.testing.assert_array_equal(clipped, expected)
    # The model trained exactly like the reference: same final weights.
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=False):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6)


# Keras compiles the train step with XLA by default when a GPU is present
# (`jit_compile="auto"`), and the instrumented step is compiled with it: it
# must compile and record the same numbers. Forced here on the CPU, with every
# option on (histograms once failed to compile: bincount's length came from
# the data).
XLA_CASES = [
    c
    for c in CASES
    if c[0] in ("sgd", "adam", "adam_clipvalue", "sgd_global_clipnorm", "sgd_max_norm")
]


@pytest.mark.parametrize(
    "name,optimizer_class,clip,max_norm,rtol", XLA_CASES, ids=[c[0] for c in XLA_CASES]
)
def test_under_xla_statistics_equal_a_hand_written_tape_loop(
    name, optimizer_class, clip, max_norm, rtol
):
    x, y = make_data()
    model = make_model(max_norm=max_norm)
    reference = copy_of(model)
    clip_kwargs = {clip[0]: clip[1]} if clip else {}
    model.compile(
        optimizer=optimizer_class(learning_rate=0.05, **clip_kwargs),
        loss="mse",
        jit_compile=True,
        steps_per_execution=2,
    )
    monitor = GradientMonitor(activations=True, histograms=True, stop_on_nonfinite=True)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert model.jit_compile is True

    rows, metrics = reference_run(
        reference, optimizer_class(learning_rate=0.05), x, y, epochs=2, clip=clip, max_norm=max_norm
    )
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3, 4, 5, 6]
    assert_matches_reference(monitor, rows, metrics, rtol)
    counts = monitor.histogram_rows.query("layer == 'd0' and tensor == 'kernel'")["counts"]
    assert [int(c.sum()) for c in counts] == [15] * 6  # a 3x5 kernel, every entry finite
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=False):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("one_op_at_a_time", [False, True], ids=["parallel", "sequential"])
@pytest.mark.parametrize("optimizer_class", [keras.optimizers.SGD, keras.optimizers.Adam])
def test_repeated_shapes_and_a_large_kernel_match_the_reference(
    optimizer_class, one_op_at_a_time, monkeypatch
):
    # Same-shaped kernels and biases are reduced together and their norms
    # after the update come from the copy before it plus the increment; a
    # kernel of 300 x 300 entries is reduced on its own and read again.
    # "sequential": the order the step takes with one inter-op thread (the
    # lab's workers), statistics before the update.
    monkeypatch.setattr(step_module, "_one_op_at_a_time", lambda: one_op_at_a_time)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((3,))]
        + [keras.layers.Dense(8, activation="tanh", name=f"d{i}") for i in range(3)]
        + [keras.layers.Dense(300, activation="relu", name=f"w{i}") for i in range(2)]
        + [keras.layers.Dense(1, name="out")],
        name="shapes",
    )
    reference = copy_of(model)
    x, y = make_data()
    model.compile(optimizer=optimizer_class(learning_rate=0.01), loss="mse")
    monitor = GradientMonitor(activations=True)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    rows, metrics = reference_run(reference, optimizer_class(learning_rate=0.01), x, y, epochs=2)
    assert_matches_reference(monitor, rows, metrics, rtol=1e-4)


def test_sample_weights_validation_data_and_compiled_metrics():
    x, y = make_data()
    weights = np.linspace(0.5, 2.0, N).astype("float32")
    model = make_model()
    reference = copy_of(model)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    monitor = GradientMonitor()
    history = model.fit(
        x,
        y,
        sample_weight=weights,
        validation_data=(x[:8], y[:8]),
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[monitor],
    )
    rows, metrics = reference_run(
        reference, keras.optimizers.SGD(0.05), x, y, epochs=2, sample_weight=weights
    )
    rows = {key: row for key, row in rows.items() if key[2] != "activation"}
    assert_matches_reference(monitor, rows, metrics, 1e-5)
    validation = monitor.metrics.query("name == 'val_loss'")
    assert validation["step"].tolist() == [3, 6]
    # Compiled metrics arrive per batch, as Keras's running epoch means.
    mae = monitor.metrics.query("name == 'mae'")
    assert mae["step"].tolist() == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(mae["value"].iloc[-1], history.history["mae"][-1], rtol=1e-6)
    np.testing.assert_allclose(
        validation["value"].iloc[-1], model.evaluate(x[:8], y[:8], verbose=0)[0], rtol=1e-5
    )


@pytest.mark.parametrize(
    "optimizer_class,clip",
    [(keras.optimizers.SGD, None), (keras.optimizers.Adam, ("clipnorm", 0.05))],
    ids=["sgd", "adam_clipnorm"],
)
def test_run_eagerly_records_what_the_compiled_step_does(optimizer_class, clip):
    # `compile(run_eagerly=True)` is how a Keras user steps through a NaN in
    # a debugger: the monitor must keep the step eager (a breakpoint in
    # `call` still stops) and record the same numbers.
    x, y = make_data()
    model = make_model()
    reference = copy_of(model)
    clip_kwargs = {clip[0]: clip[1]} if clip else {}
    eager = []

    def mse(y_true, y_pred):  # Keras's own, and a look at how the step runs
        eager.append(tf.executing_eagerly())
        return keras.losses.mean_squared_error(y_true, y_pred)

    model.compile(optimizer=optimizer_class(0.05, **clip_kwargs), loss=mse, run_eagerly=True)
    monitor = GradientMonitor(activations=True)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert eager == [True] * 6
    rows, metrics = reference_run(reference, optimizer_class(0.05), x, y, epochs=2, clip=clip)
    assert_matches_reference(monitor, rows, metrics, 1e-4)


def test_class_weights_record_the_weighted_gradients():
    # Keras turns `class_weight` into per-example weights; the recorded
    # gradients are those of the weighted loss, as a tape with the same
    # weights computes them.
    x, y = make_data()
    labels = (y > 0).astype("float32")
    model = make_model()
    reference = copy_of(model)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    monitor = GradientMonitor()
    model.fit(
        x,
        labels,
        class_weight={0: 0.5, 1: 2.0},
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[monitor],
    )
    weights = np.where(labels[:, 0] == 1.0, 2.0, 0.5).astype("float32")
    rows, metrics = reference_run(
        reference, keras.optimizers.SGD(0.05), x, labels, epochs=2, sample_weight=weights
    )
    rows = {key: row for key, row in rows.items() if key[2] != "activation"}
    assert_matches_reference(monitor, rows, metrics, 1e-5)


def fit_history(**fit_kwargs):
    x, y = make_data()
    model = make_model()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        steps_per_execution=fit_kwargs.pop("steps_per_execution", 1),
    )
    monitor = GradientMonitor(**fit_kwargs)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    return monitor


def test_steps_per_execution_records_every_step():
    # 6 batches per epoch: executions of 3, 3 steps; 12 steps in all.
    single = fit_history()
    multi = fit_history(steps_per_execution=3)
    assert sorted(multi.history["step"].unique()) == list(range(1, 13))
    stat_columns = list(schema.STATISTICS + schema.EXTRA_COLUMNS)
    np.testing.assert_allclose(
        multi.history[stat_columns].to_numpy(),
        single.history[stat_columns].to_numpy(),
        rtol=1e-5,
        atol=1e-7,
    )


def test_steps_per_execution_with_a_partial_last_execution():
    multi = fit_history(steps_per_execution=4)  # 6 batches: 4 + 2 per epoch
    assert sorted(multi.history["step"].unique()) == list(range(1, 13))


@pytest.mark.parametrize("every,expected", [(2, [2, 4, 6, 8, 10, 12]), (5, [5, 10])])
def test_every_records_only_multiples(every, expected):
    monitor = fit_history(every=every, steps_per_execution=3)
    assert sorted(monitor.history["step"].unique()) == expected
    assert sorted(monitor.metrics["step"].unique()) == expected


def test_histograms_count_every_finite_entry():
    monitor = fit_history(histograms=True, activations=True)
    frame = monitor.histogram_rows
    assert len(frame) == len(monitor.history)
    # Counts add up to the tensor's size: d0 kernel 3x5, d0 activation 4x5 (batch 4).
    kernel = frame.query("layer == 'd0' and tensor == 'kernel'")["counts"].iloc[0]
    activation = frame.query("layer == 'd0' and tensor == 'activation'")["counts"].iloc[0]
    assert len(kernel) == schema.HISTOGRAM_BINS
    assert kernel.sum() == 15 and activation.sum() == 20


def test_the_monitors_own_histograms_draw_as_the_stored_ones_do(tmp_path):
    """Without a store, `histogram_rows` was the only way to the histograms,
    and `histogram_heatmap` refused it (missing columns b0..b33)."""
    from gradflow import figures
    from gradflow.store import RunStore

    store = RunStore(tmp_path / "runs.db")
    monitor = fit_history(histograms=True, store=store)
    own = figures.histogram_heatmap(monitor.histogram_rows, "d0")
    stored = figures.histogram_heatmap(store.histograms(monitor.run_id), "d0")
    pd.testing.assert_frame_equal(own.data, stored.data)
    assert len(own.data) and own.data.equals(stored.data)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"every": 0}, "`every` must be a positive integer, got 0"),
        ({"every": 1.5}, "`every` must be a positive integer, got 1.5"),
        ({"probe_every": -2}, "`probe_every` must be a positive integer, got -2"),
        ({"every": 10**30}, r"`every` must be a positive integer no larger than 2\*\*63 - 1"),
        ({"run_id": "abc"}, "`run_id` needs a `store`"),
        # Refused when the monitor is made, not at the start of `fit` as `name`.
        ({"run_name": "slides\x1b[2J"}, "`run_name` must not contain control characters"),
    ],
)
def test_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GradientMonitor(**kwargs)


def test_train_step_is_restored_after_fit():
    x, y = make_data()
    model = make_model()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[GradientMonitor()])
    assert "train_step" not in model.__dict__
    model.fit(x, y, batch_size=BATCH, verbose=0)  # Keras's own step again
    assert model.optimizer.iterations.numpy() == 6


def graph_ops(function):
    """Op types in every graph behind Keras's `model.train_function`, nested functions included."""
    function = getattr(function, "__wrapped__", function)  # the monitor's guard around it
    functions = [
        cell.cell_contents
        for cell in function.__closure__ or ()
        if hasattr(cell.cell_contents, "_list_all_concrete_functions")
    ]
    assert functions, "Keras's train function no longer wraps a tf.function in its closure"
    ops = set()
    for concrete in (c for f in functions for c in f._list_all_concrete_functions()):
        graph = concrete.graph.as_graph_def()
        ops.update(node.op for node in graph.node)
        ops.update(node.op for f in graph.library.function for node in f.node_def)
    return ops


def wide_model():
    """A model too large for the deferred path, with a kernel of 65,536+ entries
    (reduced before the update, which waits for it)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(300), keras.layers.Dense(256), keras.layers.Dense(1)]
    )


@pytest.mark.parametrize(
    "build, options",
    [
        (make_model, {}),
        (make_model, {"stop_on_nonfinite": True}),
        (wide_model, {}),
        (wide_model, {"stop_on_nonfinite": True}),
    ],
    ids=["deferred", "deferred_stop_on_nonfinite", "in_step", "in_step_stop_on_nonfinite"],
)
def test_a_first_fit_does_not_check_variable_initialization_at_every_step(build, options):
    """A fresh model's optimizer creates its variables in its first update.

    Traced inside the monitor's step after control dependencies, their
    initializers could not be lifted out of the graph, and TensorFlow then
    ran the step inside a cond that checked, at every step, that each
    optimizer variable was initialized.
    """
    x, y = make_data()
    model = build()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    seen = {}

    class Inspect(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.setdefault("ops", graph_ops(self.model.train_function))

    monitor = GradientMonitor(**options)
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor, Inspect()])
    assert monitor._plan.deferred is (build is make_model)
    assert "ResourceScatterUpdate" in seen["ops"]  # the monitor's step, not Keras's
    assert "VarIsInitializedOp" not in seen["ops"]


def test_diagnosis_rules_run_at_the_end_of_training():
    from gradflow.diagnosis import Thresholds

    x, y = make_data()
    model = make_model()
    model.compile(optimizer="sgd", loss="mse")
    # Any gradient counts as exploding under this threshold: each layer
    # gets one event, at the first step of its streak.
    monitor = GradientMonitor(rules=Thresholds(exploding_norm=1e-12))
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    exploding = monitor.events.query("kind == 'exploding'")
    assert sorted(exploding["layer"]) == ["d0", "d1", "d2"]
    assert exploding["step"].tolist() == [1, 1, 1]


class Twice(keras.Model):
    """Subclassed, unbuilt until fit traces it, with a nested block called twice."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = keras.Sequential(
            [keras.layers.Dense(4, activation="tanh", name="a"), keras.layers.Dense(3, name="b")],
            name="block",
        )
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.block(x) + self.block(x * 0.5))


@pytest.mark.parametrize("loss_scaled", [False, True], ids=["sgd", "loss_scale_optimizer"])
def test_subclassed_model_built_during_fit(loss_scaled):
    x, y = make_data()
    keras.utils.set_random_seed(0)
    model = Twice()
    optimizer = keras.optimizers.SGD(0.05)
    if loss_scaled:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="mse")
    after_step_1 = {}

    class Keep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                after_step_1["weights"] = [v.numpy() for v in self.model.trainable_variables]

    monitor = GradientMonitor(activations=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[Keep(), monitor])

    reference = Twice()
    reference(x[:1])
    for variable, value in zip(
        reference.trainable_variables, after_step_1["weights"], strict=False
    ):
        variable.assign(value)
    xb, yb = x[BATCH : 2 * BATCH], y[BATCH : 2 * BATCH]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(yb - reference(xb)))
    grads = tape.gradient(loss, reference.trainable_variables)
    step2 = monitor.history.query("step == 2")
    weights = step2[step2["tensor"] != "activation"]
    assert weights["layer"].tolist() == ["block/a", "block/a", "block/b", "block/b", "head", "head"]
    for (_, row), grad in zip(weights.iterrows(), grads, strict=False):
        expected = numpy_stats(grad.numpy())
        for column in ("max_abs", "l2_norm", "mean_abs", "std"):
            np.testing.assert_allclose(
                row[column], expected[column], rtol=1e-5, atol=1e-7, err_msg=column
            )
    activations = step2[step2["tensor"] == "activation"]
    assert activations["layer"].tolist() == ["block/a", "block/b", "block/a#2", "block/b#2", "head"]
    assert activations["layer_index"].tolist() == [0, 1, 0, 1, 2]
