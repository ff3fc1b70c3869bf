"""The deferred path of small models (`gradflow.monitor.deferred`).

The step of a small model only copies its gradients and weights into a ring,
and the statistics are computed when the callback reads it. These tests hold
that path to the same hand-written tape reference as the in-step path
(`tests/test_monitor.py`), to the in-step path itself over many ring wraps,
and check which models take it.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradflow import schema
from gradflow.monitor import GradientMonitor, deferred
from gradflow.monitor.buffer import ROW_COLUMNS
from tests.test_monitor import (
    BATCH,
    CASES,
    assert_matches_reference,
    copy_of,
    make_data,
    make_model,
    reference_run,
)

PLAIN_CASES = [c for c in CASES if c[2] is None and c[3] is None]  # no clipping, no max-norm


@pytest.mark.parametrize(
    "name,optimizer_class,clip,max_norm,rtol", PLAIN_CASES, ids=[c[0] for c in PLAIN_CASES]
)
def test_deferred_statistics_equal_a_hand_written_tape_loop(
    name, optimizer_class, clip, max_norm, rtol
):
    x, y = make_data()
    model = make_model()
    reference = copy_of(model)
    model.compile(optimizer=optimizer_class(learning_rate=0.05), loss="mse")
    monitor = GradientMonitor()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor._plan.deferred

    rows, metrics = reference_run(reference, optimizer_class(learning_rate=0.05), x, y, epochs=2)
    rows = {key: row for key, row in rows.items() if key[2] != "activation"}
    assert sorted(monitor.history["step"].unique()) == [1, 2, 3, 4, 5, 6]
    assert_matches_reference(monitor, rows, metrics, rtol)
    np.testing.assert_allclose(
        monitor.metrics.query("name == 'learning_rate'")["value"], 0.05, rtol=1e-6
    )
    assert not monitor.metrics["name"].isin(["global_norm_clipped", "clipped"]).any()
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=False):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6)


def shared_shapes_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((3,))]
        + [keras.layers.Dense(8, activation="relu", name=f"d{i}") for i in range(4)]
        + [keras.layers.Dense(1, name="out")]
    )


def train(model, steps_per_execution, monkeypatch, in_step, activations=False, histograms=True):
    if in_step:
        monkeypatch.setattr(deferred, "MAX_PARAMETERS", 0)
    # Whether the read compiles is timed: on a loaded machine the reads to come
    # look slow enough to compile. These fits read uncompiled, always (the
    # compiled read has its own test).
    monkeypatch.setattr(deferred, "COMPILE_WHEN_SECONDS_LEFT", np.inf)
    rng = np.random.default_rng(5)
    # 601 samples in batches of 4: the last batch of the epoch holds one, so
    # the activation gradients change shape within the run.
    x = rng.normal(size=(150 * 4 + 1, 3)).astype("float32")
    y = (x[:, :1] * 2.0 + 1.0).astype("float32")
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=steps_per_execution
    )
    monitor = GradientMonitor(histograms=histograms, activations=activations)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    monkeypatch.undo()
    assert monitor._plan.deferred is not in_step
    return monitor


def assert_same_records(monitor, other):
    """Two monitors kept the same rows, metrics and histograms (up to float32 rounding)."""
    keys = ["step", "layer", "tensor"]
    assert monitor.history[keys].equals(other.history[keys])
    columns = list(schema.STATISTICS + schema.EXTRA_COLUMNS)
    np.testing.assert_allclose(
        monitor.history[columns].to_numpy(dtype=float),
        other.history[columns].to_numpy(dtype=float),
        rtol=1e-5,
        atol=1e-7,
    )
    assert monitor.metrics[["step", "name"]].equals(other.metrics[["step", "name"]])
    np.testing.assert_allclose(monitor.metrics["value"], other.metrics["value"], rtol=1e-5)
    if not monitor.histograms:
        assert monitor.histogram_rows.empty and other.histogram_rows.empty
        return
    counts = np.stack(monitor.histogram_rows["counts"])
    np.testing.assert_array_equal(counts, np.stack(other.histogram_rows["counts"]))
    assert counts.sum() > 0


@pytest.mark.parametrize(
    "steps_per_execution,activations,histograms",
    [(1, False, True), (3, False, True), (1, True, True), (3, True, True), (1, False, False)]
    + [(3, True, False)],
    ids=[
        "weights",
        "weights-3-per-execution",
        "activations",
        "activations-3-per-execution",
        "weights-numpy-reads",
        "activations-3-per-execution-numpy-reads",
    ],
)
def test_deferred_and_in_step_paths_record_the_same_numbers(
    steps_per_execution, activations, histograms, monkeypatch
):
    # 151 steps: the ring (64 executions) wraps twice, and reads come both
    # every 64 executions and every 0.2 s, so the weights after a step come
    # from the next slot and, for the newest step of each read, from the
    # model itself.
    model, twin = twins()
    options = {"activations": activations, "histograms": histograms}
    fast = train(model, steps_per_execution, monkeypatch, in_step=False, **options)
    slow = train(twin, steps_per_execution, monkeypatch, in_step=True, **options)
    # Without histograms every read ran in NumPy, with them op by op in
    # TensorFlow.
    assert not fast._plan.buffer.compiled

    assert sorted(fast.history["step"].unique()) == list(range(1, 152))
    tensors = set(fast.history["tensor"])
    assert ("activation" in tensors) is activations
    assert_same_records(fast, slow)
    for a, b in zip(model.get_weights(), twin.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def fit_epochs(model, epochs, monkeypatch, compiles=None, histograms=True):
    """`epochs` epochs of 4 steps, shuffled by a fixed seed; the monitor reads at each epoch's end.

    `compiles`: True makes the read compile at its second read, False never,
    None leaves the rule as it is.
    """
    if compiles is not None:
        monkeypatch.setattr(deferred, "COMPILE_WHEN_SECONDS_LEFT", 0.0 if compiles else np.inf)
    rng = np.random.default_rng(11)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = (x[:, :1] - x[:, 1:2]).astype("float32")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    monitor = GradientMonitor(histograms=histograms)
    model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0, callbacks=[monitor])
    monkeypatch.undo()
    assert monitor._plan.deferred
    return monitor


def twins():
    model = shared_shapes_model()
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return model, twin


def test_a_short_fit_never_compiles_its_read(monkeypatch):
    # Compiling the read costs about 0.4 s: a fit that will end within a
    # few reads never traces it, with histograms (reads op by op) or without
    # (reads in NumPy).
    for histograms in (True, False):
        short = fit_epochs(shared_shapes_model(), 3, monkeypatch, histograms=histograms)
        ring = short._plan.buffer
        assert not ring.compiled and ring._summarize.experimental_get_tracing_count() == 0
        assert sorted(short.history["step"].unique()) == list(range(1, 13))


@pytest.mark.parametrize("histograms", [True, False], ids=["op-by-op", "numpy"])
def test_a_compiled_read_records_what_an_uncompiled_one_does(histograms, monkeypatch):
    # 40 epochs, a read at each epoch's end: the first two reads are never
    # compiled, the third compiles (the threshold set to 0), once.
    model, twin = twins()
    long = fit_epochs(model, 40, monkeypatch, compiles=True, histograms=histograms)
    assert long._plan.buffer.compiled
    assert long._plan.buffer._summarize.experimental_get_tracing_count() == 1
    uncompiled = fit_epochs(twin, 40, monkeypatch, compiles=False, histograms=histograms)
    assert not uncompiled._plan.buffer.compiled
    assert uncompiled._plan.buffer._summarize.experimental_get_tracing_count() == 0

    assert sorted(long.history["step"].unique()) == list(range(1, 161))
    assert_same_records(long, uncompiled)


def test_compiling_repays_itself_over_the_reads_to_come():
    limit = deferred.COMPILE_WHEN_SECONDS_LEFT
    # 10 ms for 10 steps so far: 1 ms a step.
    assert not deferred.repays_compiling(int(limit * 1000) - 1, seconds=0.01, steps_read=10)
    assert deferred.repays_compiling(int(limit * 1000) + 1, seconds=0.01, steps_read=10)
    # Steps to come unknown: once the reads so far took what compiling costs.
    assert not deferred.repays_compiling(None, deferred.COMPILE_AFTER_SECONDS / 2, 10)
    assert deferred.repays_compiling(None, deferred.COMPILE_AFTER_SECONDS, 10)


def test_the_read_compiles_from_its_third_read_at_the_earliest(monkeypatch):
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    gradients = [tf.ones_like(v) for v in layer.trainable_variables]

    def ring_after_reads(final_step, reads=3, steps_per_read=5):
        ring = deferred.DeferredRing(layer.trainable_variables, capacity=64)
        step = 0
        for read in range(reads):
            for _ in range(steps_per_read):
                step += 1
                packed = ring.pack(gradients, loss=1.0, learning_rate=tf.constant(0.1))
                ring.write(tf.constant(step, tf.int64), packed)
            ring.read(step - steps_per_read, final_step)
            if read < 2:
                # The first read is not timed: nothing to judge by until the third.
                assert not ring.compiled
        return ring

    monkeypatch.setattr(deferred, "COMPILE_WHEN_SECONDS_LEFT", 0.0)
    monkeypatch.setattr(deferred, "COMPILE_AFTER_SECONDS", 0.0)
    assert ring_after_reads(final_step=1000).compiled
    assert ring_after_reads(final_step=None).compiled
    # No steps left: nothing to repay.
    assert not ring_after_reads(final_step=0).compiled
    # Decided once: a later read with no steps left stays compiled.
    ring = ring_after_reads(final_step=None)
    ring.read(0, final_step=0)
    assert ring.compiled
    monkeypatch.setattr(deferred, "COMPILE_WHEN_SECONDS_LEFT", np.inf)
    monkeypatch.setattr(deferred, "COMPILE_AFTER_SECONDS", np.inf)
    assert not ring_after_reads(final_step=1000, reads=5).compiled
    assert not ring_after_reads(final_step=None, reads=5).compiled


class OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def wide_model():
    # 3*200 + 200 + 200*200 + 200 + 201 parameters: more than the ring takes.
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(200), keras.layers.Dense(200), keras.layers.Dense(1)]
    )


@pytest.mark.parametrize(
    "case,monitor_kwargs,optimizer_kwargs,expected",
    [
        ("default", {}, {}, True),
        ("stop_on_nonfinite", {"stop_on_nonfinite": True}, {}, True),
        ("every_2", {"every": 2}, {}, False),
        ("activations", {"activations": True}, {}, True),
        ("activations_every_2", {"activations": True, "every": 2}, {}, False),
        ("clipnorm", {}, {"clipnorm": 1.0}, False),
        ("global_clipnorm", {}, {"global_clipnorm": 1.0}, False),
        ("max_norm", {}, {}, False),
        ("too_many_parameters", {}, {}, False),
        ("ring_too_large", {}, {}, False),
        ("own_train_step", {}, {}, False),
    ],
)
def test_which_models_take_the_deferred_path(case, monitor_kwargs, optimizer_kwargs, expected):
    x, y = make_data()
    if case == "max_norm":
        model = make_model(max_norm=1.0)
    elif case == "too_many_parameters":
        model = wide_model()
        assert model.count_params() > deferred.MAX_PARAMETERS
    elif case == "ring_too_large":
        # 20,441 parameters, but 8 steps per execution: a ring of 8 x 64
        # steps would take 84 MB.
        model = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(140),
                keras.layers.Dense(140),
                keras.layers.Dense(1),
            ]
        )
        assert model.count_params() <= deferred.MAX_PARAMETERS
    elif case == "own_train_step":
        model = OwnStep([keras.Input((3,)), keras.layers.Dense(1)])
    else:
        model = make_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, **optimizer_kwargs),
        loss="mse",
        steps_per_execution=8 if case == "ring_too_large" else 1,
    )
    monitor = GradientMonitor(**monitor_kwargs)
    with pytest.warns(UserWarning) if case == "own_train_step" else contextlib.nullcontext():
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor._plan.deferred is expected
    # Either way every recorded step is there.
    every = monitor_kwargs.get("every", 1)
    assert sorted(monitor.history["step"].unique()) == [s for s in (1, 2, 3) if s % every == 0]


def test_a_missing_step_leaves_the_weight_columns_of_the_step_before_it_empty():
    # Recorded steps always follow one another; should one ever be missing,
    # the weights after the step before the gap are unknown, not guessed.
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    ring = deferred.DeferredRing(layer.trainable_variables, capacity=8)
    gradients = [tf.ones_like(v) for v in layer.trainable_variables]
    for step in (1, 2, 4):
        packed = ring.pack(gradients, loss=1.0, learning_rate=tf.constant(0.1))
        ring.write(tf.constant(step, tf.int64), packed)
    steps, stats, metrics, _ = ring.read(0)
    assert steps.tolist() == [1, 2, 4]
    columns = list(ROW_COLUMNS)
    weight_norm = stats[:, :, columns.index("weight_norm")]
    update_ratio = stats[:, :, columns.index("update_ratio")]
    assert np.isnan(weight_norm[1]).all() and np.isnan(update_ratio[1]).all()  # step 2
    # Step 1: the weights did not change between the copies of steps 1 and 2
    # (the kernel's ratio is 0; the zero bias has none).
    assert update_ratio[0, 0] == 0.0 and np.isnan(update_ratio[0, 1])
    # Step 4, the newest: its weights after are the layer's weights now.
    now = [np.linalg.norm(v.numpy()) for v in layer.trainable_variables]
    np.testing.assert_allclose(weight_norm[2], now, rtol=1e-6)
    np.testing.assert_allclose(
        stats[:, :, columns.index("l2_norm")], [[np.sqrt(6), np.sqrt(2)]] * 3
    )
    np.testing.assert_allclose(metrics[:, 0], 1.0)
    # The first read ran op by op; later ones run the compiled call: the same numbers.
    again = ring.read(0)
    np.testing.assert_array_equal(again[0], steps)
    np.testing.assert_allclose(again[1], stats, rtol=1e-6)
    np.testing.assert_allclose(again[2], metrics, rtol=1e-6)


def test_tensors_that_differ_in_their_first_dimension_are_copied_with_one_concat():
    # The slot holds each tensor flattened, one after another in slot order;
    # runs of shapes that differ only in their first dimension are joined with
    # one concat along it instead of a reshape each. Scalars never join.
    shapes = [[3, 4], [4], [5, 4], [], [2, 3, 4], [6, 4], [4], [7, 3, 4], [], [4, 2]]
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.normal(size=shape).astype("float32")) for shape in shapes]
    ring = deferred.DeferredRing(variables, capacity=4)
    assert sorted(ring._order) == list(range(len(shapes)))
    assert len(ring._runs) < len(shapes)
    for start, stop in ring._runs:
        run = [shapes[i] for i in ring._order[start:stop]]
        assert all(len(s) > 0 and s[1:] == run[0][1:] for s in run) or len(run) == 1
    gradients = [2.0 * v for v in variables]
    packed = ring.pack(gradients, loss=1.5, learning_rate=tf.constant(0.25)).numpy()
    expected = np.concatenate(
        [gradients[i].numpy().ravel() for i in ring._order]
        + [variables[i].numpy().ravel() for i in ring._order]
        + [[1.5, 0.25]]
    )
    np.testing.assert_array_equal(packed, expected)
    # Read back, every variable's statistics land in its own row.
    ring.write(tf.constant(1, tf.int64), tf.constant(packed))
    steps, stats, _, _ = ring.read(0)
    assert steps.tolist() == [1]
    l2 = stats[0, :, list(ROW_COLUMNS).index("l2_norm")]
    np.testing.assert_allclose(l2, [np.linalg.norm(g.numpy()) for g in gradients], rtol=1e-5)
