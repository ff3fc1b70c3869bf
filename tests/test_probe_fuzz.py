"""Differential fuzzing: `snapshot`, `GradientLog` and `chain_gradients` against a plain tape.

Hypothesis draws a small model (Sequential or Functional MLP, a Sequential
block nested in a Functional model, a tiny CNN, SimpleRNN/GRU/LSTM on floats
or on an Embedding with or without `mask_zero`, a residual `Add`, a layer
called twice, Layer- or BatchNormalization, an L2 regularizer), a loss, a
batch and each API's options (`snapshot`'s switches and a `GradientProbe`
reused across batch sizes; `GradientLog`'s `every`, update ratio,
histograms, `summarize`, sample weights, optimizer and a frozen layer;
`chain_gradients`' parts, a part used twice and both methods); the reference
is written here: the model's layers called one by one on an eager
`tf.GradientTape`, the loss's formula written out, the statistics in NumPy
float64 with the definitions of `gradflow.schema`. Nothing in the reference
goes through gradflow.

CI runs a few examples of each, derandomized. A long campaign:

    GRADFLOW_FUZZ_EXAMPLES=300 python -m pytest tests/test_probe_fuzz.py
    GRADFLOW_FUZZ_EXAMPLES=300 GRADFLOW_FUZZ_RANDOM=1 python -m pytest tests/test_probe_fuzz.py

Every assertion's message starts with the draw (`Case.label`), so a failure
says which model, loss and options broke.
"""

import dataclasses
import os

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import gradflow

# CI's counts; GRADFLOW_FUZZ_EXAMPLES=N runs N of each, GRADFLOW_FUZZ_RANDOM=1 new ones each run.
_LONG = int(os.environ.get("GRADFLOW_FUZZ_EXAMPLES", "0"))
_RANDOM = os.environ.get("GRADFLOW_FUZZ_RANDOM", "") not in ("", "0")


def fuzz_settings(ci_examples):
    return settings(
        max_examples=_LONG or ci_examples,
        deadline=None,
        derandomize=not _RANDOM,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


STATISTICS = ["max_abs", "l2_norm", "mean_abs", "std", "zero_fraction", "nonfinite"]
# Two float32 tapes (eager here, a traced graph in gradflow) may sum in another order.
RTOL = 1e-5
# The fixed histogram bins of gradflow.schema, written out: bin 0 below 1e-12, half
# decades up to 1e4, the last bin above.
HISTOGRAM_LOW, HISTOGRAM_WIDTH, HISTOGRAM_BINS = -12.0, 0.5, 34

ACTIVATIONS = ["relu", "tanh", "sigmoid", "linear"]
ARCHITECTURES = [
    "sequential_mlp",
    "functional_mlp",
    "nested",
    "conv",
    "rnn",
    "residual",
    "shared",
    "norm",
]
LOSSES = ["sparse_ce_logits", "mse", "bce"]


# ---------------------------------------------------------------- reference statistics


def numpy_statistics(gradient):
    """gradflow.schema's statistics of one tensor, in float64."""
    g = np.asarray(gradient, dtype=np.float64).ravel()
    finite = np.isfinite(g)
    if g.size == 0:
        return [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    if np.isnan(g).any():
        big = [np.nan] * 4
    else:
        a = np.abs(g)
        big = [a.max(), np.sqrt(np.sum(g**2)), a.mean(), g.std()]
    return [*big, float(np.mean(g == 0)), float(np.sum(~finite))]


def numpy_histogram(gradient):
    """Counts of log10|g| in the fixed bins, and how many entries lie within rounding of an edge."""
    g = np.asarray(gradient, dtype=np.float64).ravel()
    g = np.abs(g[np.isfinite(g)])
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(g)
        offset = (logs - HISTOGRAM_LOW) / HISTOGRAM_WIDTH
        position = np.floor(offset) + 1
        # float32's log10 may put an entry a hair from an edge in the next bin.
        near = np.isfinite(offset) & (np.abs(offset - np.round(offset)) < 1e-4)
    position = np.clip(np.nan_to_num(position, neginf=0), 0, HISTOGRAM_BINS - 1).astype(int)
    counts = np.bincount(position, minlength=HISTOGRAM_BINS)
    return counts, int(near.sum())


# Rounding noise, as a share of the largest gradient in the table. Each layer's gradient
# is a sum the two tapes (eager here, traced in gradflow) round differently, to ~1e-7 of
# the gradients it came from, not of itself: through a LayerNormalization of 2 units,
# entries of 2e-3 made of ones of 0.25 differed by 3e-8 (1.3e-5 of the entries).
NOISE = 2e-6
# BatchNormalization on batch statistics divides by the batch's std: with 2 samples
# whose values are close, a traced tape, gradflow's and the eager one differed by
# 2.5e-5 of the entries (0.124282, 0.124283, 0.124285), and the bias before it, whose
# gradient is 0 in exact arithmetic, was 0 in one tape and 1e-9 in another.
ILL_CONDITIONED = {"rtol": 1e-3, "noise": 1e-4}


def assert_statistics(table, gradients, label, rtol=RTOL, noise=NOISE):
    """gradflow's rows against NumPy's statistics of the reference gradients, row by row."""
    assert len(table) == len(gradients), f"{label}: {len(table)} rows, {len(gradients)} expected"
    expected = np.array([numpy_statistics(g) for g in gradients], np.float64)
    got = table[STATISTICS].to_numpy(np.float64)
    floor = noise_floor(gradients, noise)
    for i, (row, want, g) in enumerate(zip(got, expected, gradients, strict=True)):
        where = f"{label}, row {i} ({table.iloc[i]['layer']} {table.iloc[i]['tensor']})"
        np.testing.assert_allclose(
            row[:4],
            want[:4],
            rtol=rtol,
            atol=max(floor, 1e-30),
            equal_nan=True,
            err_msg=f"{where}: max_abs, l2_norm, mean_abs, std",
        )
        # An entry that is 0 in one tape and noise in the other (a sum that cancels) is
        # rounding, not another zero count; half an entry: gradflow's share is a float32.
        g = np.abs(np.asarray(g, np.float64).ravel())
        ambiguous = np.sum((g > 0) & (g <= floor))
        assert abs(row[4] - want[4]) * max(g.size, 1) <= ambiguous + 0.5, (
            f"{where}: zero_fraction {row[4]} against {want[4]}"
        )
        assert row[5] == want[5], f"{where}: nonfinite {row[5]} against {want[5]}"


def noise_floor(gradients, noise=NOISE):
    """What rounding can make of an entry: `noise` times the table's largest finite entry."""
    largest = [np.max(np.abs(g[np.isfinite(g)])) for g in gradients if np.isfinite(g).any()]
    return noise * max(largest, default=0.0)


def assert_histograms(histograms, gradients, label, noise=NOISE):
    counts = histograms.filter(regex=r"^b\d+$").to_numpy()
    assert counts.shape == (len(gradients), HISTOGRAM_BINS), f"{label}: histogram shape"
    floor = noise_floor(gradients, noise)
    for i, (row, g) in enumerate(zip(counts, gradients, strict=True)):
        want, near = numpy_histogram(g)
        # Noise may be 0 in gradflow's tape (bin 0), or in any bin up to the floor's.
        near += int(np.sum(np.abs(np.asarray(g, np.float64)) <= floor))
        assert row.sum() == want.sum(), f"{label}: histogram row {i} counts {row.sum()} entries"
        # An entry moved across an edge changes two bins by one each.
        assert np.abs(row - want).sum() <= 2 * near, (
            f"{label}: histogram row {i} {row.tolist()} against {want.tolist()}"
        )


def dense(gradient):
    return tf.convert_to_tensor(gradient).numpy()


# ---------------------------------------------------------------- the drawn models


@dataclasses.dataclass
class Case:
    """One drawn model and batch, and the reference's way through it."""

    label: str
    model: keras.Model
    x: np.ndarray
    y: np.ndarray
    loss: object  # what gradflow is given: a Keras loss object or name
    loss_kind: str
    # program(x, record, training) -> prediction: the layers called one by one, each
    # output appended to `record` as (path, tensor): the model's own forward pass.
    program: object
    penalties: list  # (coefficient, variable): the L2 regularizers' share of the loss
    float_input: bool
    batch_norm: bool = False  # ill-conditioned in training mode (`ILL_CONDITIONED`)


def reference_loss(kind, y, prediction):
    """The loss's formula written out (batch mean), on the prediction's values."""
    if kind == "mse":
        return tf.reduce_mean(tf.square(tf.cast(y, tf.float32) - prediction))
    if kind == "sparse_ce_logits":
        picked = tf.gather(prediction, tf.cast(y, tf.int32), batch_dims=1)
        return tf.reduce_mean(tf.reduce_logsumexp(prediction, axis=-1) - picked)
    # Binary cross-entropy of sigmoid probabilities, clipped as Keras clips them.
    eps = keras.backend.epsilon()
    p = tf.clip_by_value(prediction, eps, 1 - eps)
    y = tf.cast(y, tf.float32)
    return tf.reduce_mean(-(y * tf.math.log(p) + (1 - y) * tf.math.log(1 - p)))


def build_case(draw, architectures=ARCHITECTURES, regularize=True):
    """Draw a model, its loss and a batch (called in the test: it seeds Keras).

    `draw` is `hypothesis.strategies.data().draw`.
    """
    keras.utils.clear_session()
    seed = draw(st.integers(0, 2**16), label="seed")
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    architecture = draw(st.sampled_from(architectures), label="architecture")
    loss_kind = draw(st.sampled_from(LOSSES), label="loss")
    batch = draw(st.integers(1, 16), label="batch")
    as_name = draw(st.booleans(), label="loss as a name")
    penalty = regularize and draw(st.booleans(), label="l2 regularizer")
    Dense = keras.layers.Dense
    reg = keras.regularizers.L2(0.01) if penalty else None
    described = {"architecture": architecture, "loss": loss_kind, "batch": batch, "seed": seed}
    float_input = True

    def width(label):
        return draw(st.integers(1, 24), label=label)

    def activation(label):
        return draw(st.sampled_from(ACTIVATIONS), label=label)

    # The head, by loss.
    if loss_kind == "sparse_ce_logits":
        classes = draw(st.integers(2, 5), label="classes")
        head = Dense(classes, name="out")
        y = rng.integers(0, classes, batch)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    elif loss_kind == "mse":
        outputs = draw(st.integers(1, 4), label="outputs")
        head = Dense(outputs, name="out")
        y = rng.normal(size=(batch, outputs)).astype(np.float32)
        loss = "mse" if as_name else keras.losses.MeanSquaredError()
    else:
        head = Dense(1, activation="sigmoid", name="out")
        y = rng.integers(0, 2, (batch, 1)).astype(np.float32)
        loss = "binary_crossentropy" if as_name else keras.losses.BinaryCrossentropy()

    penalties = []
    if architecture in ("sequential_mlp", "functional_mlp"):
        features = width("features")
        depth = draw(st.integers(1, 4), label="depth")
        hidden = [
            Dense(
                width(f"width {i}"),
                activation=activation(f"activation {i}"),
                kernel_regularizer=reg if i == 0 else None,
                name=f"d{i}",
            )
            for i in range(depth - 1)
        ]
        layers = [*hidden, head]
        described["widths"] = [layer.units for layer in hidden]
        x = rng.normal(size=(batch, features)).astype(np.float32)

        def program(h, record, training):
            for layer in layers:
                h = layer(h, training=training)
                record.append((layer.name, h))
            return h

        if architecture == "sequential_mlp":
            model = keras.Sequential([keras.Input((features,)), *layers], name="fuzz")
        else:
            inputs = keras.Input((features,))
            model = keras.Model(inputs, program(inputs, [], False), name="fuzz")
        if hidden and penalty:
            penalties = [(0.01, hidden[0].kernel)]
    elif architecture == "conv":
        size = draw(st.integers(4, 7), label="image size")
        channels = draw(st.integers(1, 3), label="channels")
        conv = keras.layers.Conv2D(
            draw(st.integers(1, 4), label="filters"),
            draw(st.sampled_from([1, 2, 3]), label="kernel size"),
            padding=draw(st.sampled_from(["same", "valid"]), label="padding"),
            activation=activation("conv activation"),
            kernel_regularizer=reg,
            name="conv",
        )
        pool_kind = draw(st.sampled_from(["max", "average"]), label="pooling")
        pool = (keras.layers.MaxPooling2D if pool_kind == "max" else keras.layers.AveragePooling2D)(
            2, padding="same", name="pool"
        )
        layers = [conv, pool, keras.layers.Flatten(name="flatten"), head]
        described.update(conv=conv.get_config()["kernel_size"], pooling=pool_kind)
        x = rng.normal(size=(batch, size, size, channels)).astype(np.float32)

        def program(h, record, training):
            for layer in layers:
                h = layer(h, training=training)
                record.append((layer.name, h))
            return h

        inputs = keras.Input((size, size, channels))
        model = keras.Model(inputs, program(inputs, [], False), name="fuzz")
        if penalty:
            penalties = [(0.01, conv.kernel)]
    elif architecture == "rnn":
        steps = draw(st.integers(1, 5), label="time steps")
        cell = draw(st.sampled_from(["SimpleRNN", "GRU", "LSTM"]), label="cell")
        sequences = draw(st.booleans(), label="return_sequences")
        embedded = draw(st.booleans(), label="embedding")
        mask_zero = embedded and draw(st.booleans(), label="mask_zero")
        units = draw(st.integers(1, 8), label="units")
        rnn = getattr(keras.layers, cell)(units, return_sequences=sequences, name="rnn")
        layers = []
        if embedded:
            vocabulary = draw(st.integers(2, 9), label="vocabulary")
            layers.append(
                keras.layers.Embedding(
                    vocabulary,
                    draw(st.integers(1, 6), label="embedding size"),
                    mask_zero=mask_zero,
                    name="embed",
                )
            )
            x = rng.integers(0, vocabulary, (batch, steps)).astype(np.int32)
            x[:, 0] = rng.integers(1, vocabulary, batch)  # no sequence masked whole
            float_input = False
            shape, dtype = (steps,), "int32"
        else:
            features = draw(st.integers(1, 4), label="features")
            x = rng.normal(size=(batch, steps, features)).astype(np.float32)
            shape, dtype = (steps, features), "float32"
        layers.append(rnn)
        if sequences:
            layers.append(keras.layers.GlobalAveragePooling1D(name="pool"))
        layers.append(head)
        described.update(
            cell=cell,
            return_sequences=sequences,
            embedding=embedded,
            mask_zero=mask_zero,
            steps=steps,
        )

        def program(h, record, training):
            for layer in layers:
                h = layer(h, training=training)
                record.append((layer.name, h))
            return h

        inputs = keras.Input(shape, dtype=dtype)
        model = keras.Model(inputs, program(inputs, [], False), name="fuzz")
    elif architecture == "nested":
        # A Sequential block inside a Functional model: rows are `block/d0`, ...
        features = width("features")
        depth = draw(st.integers(1, 3), label="block depth")
        inner = [
            Dense(width(f"width {i}"), activation=activation(f"activation {i}"), name=f"d{i}")
            for i in range(depth)
        ]
        block = keras.Sequential([keras.Input((features,)), *inner], name="block")
        x = rng.normal(size=(batch, features)).astype(np.float32)
        described["widths"] = [layer.units for layer in inner]

        def program(h, record, training):
            for layer in inner:
                h = layer(h, training=training)
                record.append((f"block/{layer.name}", h))
            h = head(h, training=training)
            record.append(("out", h))
            return h

        inputs = keras.Input((features,))
        model = keras.Model(inputs, head(block(inputs)), name="fuzz")
    elif architecture in ("residual", "shared", "norm"):
        features = width("features")
        units = width("units")
        first = Dense(
            units, activation=activation("first activation"), name="d0", kernel_regularizer=reg
        )
        x = rng.normal(size=(batch, features)).astype(np.float32)
        if architecture == "residual":
            branch = Dense(units, activation=activation("branch activation"), name="branch")
            add = keras.layers.Add(name="add")

            def program(h, record, training):
                a = first(h, training=training)
                record.append(("d0", a))
                b = branch(a, training=training)
                record.append(("branch", b))
                s = add([a, b], training=training)
                record.append(("add", s))
                out = head(s, training=training)
                record.append(("out", out))
                return out
        elif architecture == "shared":
            shared = Dense(units, activation=activation("shared activation"), name="shared")

            def program(h, record, training):
                a = first(h, training=training)
                record.append(("d0", a))
                b = shared(a, training=training)
                record.append(("shared", b))
                c = shared(b, training=training)
                record.append(("shared#2", c))
                out = head(c, training=training)
                record.append(("out", out))
                return out
        else:
            kind = draw(st.sampled_from(["layer", "batch"]), label="normalization")
            norm = (
                keras.layers.LayerNormalization(name="norm")
                if kind == "layer"
                else keras.layers.BatchNormalization(name="norm")
            )
            after = keras.layers.Activation(activation("after norm"), name="act")
            described["normalization"] = kind

            def program(h, record, training):
                for layer in (first, norm, after, head):
                    h = layer(h, training=training)
                    record.append((layer.name, h))
                return h

        inputs = keras.Input((features,))
        model = keras.Model(inputs, program(inputs, [], False), name="fuzz")
        if penalty:
            penalties = [(0.01, first.kernel)]
    described["penalty"] = bool(penalties)
    label = ", ".join(f"{k}={v}" for k, v in described.items())
    batch_norm = described.get("normalization") == "batch"
    return Case(label, model, x, y, loss, loss_kind, program, penalties, float_input, batch_norm)


def reference_pass(case, training=False, x=None, y=None, sample_weight=None):
    """One eager tape over the case's layers: loss, weight, output and input gradients."""
    model = case.model
    x = tf.constant(case.x if x is None else x)
    y = case.y if y is None else y
    with tf.GradientTape(persistent=True) as tape:
        if case.float_input:
            tape.watch(x)
        record = []
        prediction = case.program(x, record, training)
        if sample_weight is None:
            value = reference_loss(case.loss_kind, y, prediction)
        else:
            value = weighted_loss(case.loss_kind, y, prediction, sample_weight)
        for coefficient, variable in case.penalties:
            value += coefficient * tf.reduce_sum(tf.square(variable))
        shown = tf.identity(prediction)
        shown_loss = reference_loss(case.loss_kind, y, shown)
        sums = [tf.reduce_sum(h) for _, h in record]
    weights = tape.gradient(value, model.trainable_variables)
    outputs = [tape.gradient(value, h) for _, h in record[:-1]]
    outputs.append(tape.gradient(shown_loss, shown))
    sensitivity = None
    if case.float_input:
        sensitivity = [float(np.abs(tape.gradient(s, x).numpy()).max()) for s in sums]
    return float(value), weights, [p for p, _ in record], outputs, sensitivity


def weighted_loss(kind, y, prediction, sample_weight):
    """Keras's "sum_over_batch_size" with sample weights: sum(w * loss) / batch."""
    y = tf.convert_to_tensor(y)
    if kind == "mse":
        per_sample = tf.reduce_mean(tf.square(tf.cast(y, tf.float32) - prediction), axis=-1)
    elif kind == "sparse_ce_logits":
        picked = tf.gather(prediction, tf.cast(y, tf.int32), batch_dims=1)
        per_sample = tf.reduce_logsumexp(prediction, axis=-1) - picked
    else:
        eps = keras.backend.epsilon()
        p = tf.clip_by_value(prediction, eps, 1 - eps)
        y = tf.cast(y, tf.float32)
        per_sample = tf.reduce_mean(-(y * tf.math.log(p) + (1 - y) * tf.math.log(1 - p)), -1)
    return tf.reduce_sum(per_sample * sample_weight) / tf.cast(tf.size(per_sample), tf.float32)


# ---------------------------------------------------------------- snapshot


@fuzz_settings(ci_examples=20)
@given(data=st.data())
def test_snapshot_matches_a_plain_tape(data):
    case = build_case(data.draw)
    training = data.draw(st.booleans(), label="training")
    histograms = data.draw(st.booleans(), label="histograms")
    sensitivity = data.draw(st.booleans(), label="sensitivity")
    # A `GradientProbe` called first on a part of the batch (another trace), then on the
    # batch, then on the part again (the first trace's layout).
    part = data.draw(st.integers(0, len(case.x) - 1), label="probe first on a part of it")
    label = (
        f"snapshot({case.label}, training={training}, histograms={histograms}, "
        f"sensitivity={sensitivity}, first on {part or 'nothing'})"
    )
    note(label)
    options = {"training": training, "histograms": histograms, "sensitivity": sensitivity}
    if part:
        probe = gradflow.GradientProbe(case.model, loss=case.loss, **options)
        first = probe(case.x[:part], case.y[:part])
        shot = probe(case.x, case.y)
        again = probe(case.x[:part], case.y[:part])
        for name in ("weights", "activations", "inputs", "histograms"):
            pd.testing.assert_frame_equal(
                getattr(again, name), getattr(first, name), obj=f"{label}: again, {name}"
            )
    else:
        shot = gradflow.snapshot(case.model, case.x, case.y, loss=case.loss, **options)
    value, weights, paths, outputs, expected_sensitivity = reference_pass(case, training)
    assert shot.loss == pytest.approx(value, rel=RTOL, abs=1e-6), f"{label}: loss"
    assert shot.no_gradient == {}, f"{label}: no_gradient {shot.no_gradient}"
    assert list(shot.weights["variable"]) == [v.path for v in case.model.trainable_variables], (
        f"{label}: weight rows"
    )
    weights = [dense(g) for g in weights]
    outputs = [dense(g) for g in outputs]
    tolerance = ILL_CONDITIONED if case.batch_norm and training else {}
    assert_statistics(shot.weights, weights, f"{label}: weights", **tolerance)
    assert list(shot.weights["shape"]) == [g.shape for g in weights], f"{label}: weight shapes"
    assert list(shot.activations["layer"]) == paths, f"{label}: activation rows"
    assert list(shot.activations["shape"]) == [g.shape for g in outputs], (
        f"{label}: activation shapes"
    )
    assert_statistics(shot.activations, outputs, f"{label}: activations", **tolerance)
    if histograms:
        noise = tolerance.get("noise", NOISE)
        assert_histograms(shot.histograms, weights + outputs, f"{label}: histograms", noise)
    else:
        assert shot.histograms.empty, f"{label}: histograms not asked for"
    assert list(shot.inputs["layer"]) == paths, f"{label}: input rows"
    maxima = shot.inputs["max_abs"].to_numpy(np.float64)
    if sensitivity and case.float_input:
        scale = max(expected_sensitivity)
        np.testing.assert_allclose(
            maxima,
            expected_sensitivity,
            rtol=RTOL,
            atol=max(1e-7, 2e-6 * scale),
            err_msg=f"{label}: input sensitivity",
        )
    else:
        assert np.isnan(maxima).all(), f"{label}: input sensitivity should be NaN"


# ---------------------------------------------------------------- GradientLog


@fuzz_settings(ci_examples=12)
@given(data=st.data())
def test_gradient_log_matches_the_loops_own_gradients(data):
    draw = data.draw
    case = build_case(draw, regularize=False)
    steps = draw(st.integers(1, 4), label="steps")
    every = draw(st.integers(1, 3), label="every")
    update_ratio = draw(st.booleans(), label="update_ratio")
    histograms = draw(st.booleans(), label="histograms")
    summarized = draw(st.booleans(), label="summarize inside the step")
    compiled = draw(st.booleans(), label="tf.function step")
    weighted = draw(st.booleans(), label="sample weights")
    optimizer_kind = draw(st.sampled_from(["SGD", "Adam"]), label="optimizer")
    rate = draw(st.sampled_from([0.01, 0.1, 0.5]), label="learning rate")
    model = case.model
    # A frozen layer: its weights are no variables of the loop, and have no rows.
    weighted_layers = [layer for layer in model.layers if layer.trainable_weights]
    frozen = len(weighted_layers) > 1 and draw(st.booleans(), label="freeze the first layer")
    if frozen:
        weighted_layers[0].trainable = False
    label = (
        f"GradientLog({case.label}, steps={steps}, every={every}, update_ratio={update_ratio}, "
        f"histograms={histograms}, summarize={summarized}, compiled={compiled}, "
        f"weighted={weighted}, {optimizer_kind}({rate}), frozen={frozen})"
    )
    note(label)
    optimizer = getattr(keras.optimizers, optimizer_kind)(rate)
    log = gradflow.GradientLog(
        model, optimizer=optimizer, every=every, update_ratio=update_ratio, histograms=histograms
    )
    variables = model.trainable_variables
    rng = np.random.default_rng(len(case.x))
    loss_kind = case.loss_kind

    def step(x, y, w):
        with tf.GradientTape() as tape:
            prediction = case.program(x, [], True)
            if w is None:
                loss = reference_loss(loss_kind, y, prediction)
            else:
                loss = weighted_loss(loss_kind, y, prediction, w)
        gradients = tape.gradient(loss, variables)
        optimizer.apply(gradients, variables)
        if summarized:
            return loss, gradients, log.summarize(gradients)
        return loss, gradients, None

    step = tf.function(step) if compiled else step
    seen = []
    for _ in range(steps):
        w = rng.uniform(0, 2, len(case.x)).astype(np.float32) if weighted else None
        before = [v.numpy().copy() for v in variables]
        loss, gradients, summary = step(tf.constant(case.x), tf.constant(case.y), w)
        after = [v.numpy().copy() for v in variables]
        log.record(gradients if summary is None else summary, loss=loss)
        seen.append(([dense(g) for g in gradients], before, after, float(loss)))
    recorded = [s for s in range(1, steps + 1) if s % every == 0]
    history = log.history
    assert sorted(history["step"].unique()) == recorded, f"{label}: recorded steps"
    paths = [v.path for v in variables]
    for number in recorded:
        gradients, before, after, loss = seen[number - 1]
        rows = history[history["step"] == number].set_index("variable").loc[paths]
        where = f"{label}, step {number}"
        assert_statistics(rows.reset_index(), gradients, where)
        np.testing.assert_allclose(
            rows["weight_norm"].to_numpy(np.float64),
            [np.linalg.norm(w.astype(np.float64)) for w in after],
            rtol=2e-5,
            atol=1e-30,
            err_msg=f"{where}: weight_norm",
        )
        ratios = rows["update_ratio"].to_numpy(np.float64)
        if update_ratio and not summarized:
            expected = [
                np.linalg.norm(w1.astype(np.float64) - w0) / np.linalg.norm(w0)
                if np.linalg.norm(w0) > 0
                else np.nan
                for w0, w1 in zip(before, after, strict=True)
            ]
            # ||w1 - w0|| of float32 weights is good to ~1e-7 x ||w|| only.
            atol = [
                2e-7 * np.linalg.norm(w1) / max(np.linalg.norm(w0), 1e-30)
                for w0, w1 in zip(before, after, strict=True)
            ]
            for i, (got, want) in enumerate(zip(ratios, expected, strict=True)):
                if np.isnan(want):
                    assert np.isnan(got), f"{where}: update_ratio of {paths[i]} {got}, not NaN"
                else:
                    assert abs(got - want) <= 1e-3 * want + atol[i], (
                        f"{where}: update_ratio of {paths[i]} {got} against {want}"
                    )
        else:
            assert np.isnan(ratios).all(), f"{where}: update_ratio should be NaN"
        metrics = log.metrics[log.metrics["step"] == number].set_index("name")["value"]
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6, err_msg=f"{where}: loss")
        global_norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in gradients))
        np.testing.assert_allclose(
            metrics["global_norm"], global_norm, rtol=2e-5, err_msg=f"{where}: global_norm"
        )
        np.testing.assert_allclose(
            metrics["learning_rate"], rate, rtol=1e-6, err_msg=f"{where}: learning_rate"
        )
        if histograms:
            # `histogram_rows` has no `variable`: its rows follow `history`'s at that step.
            table = log.histogram_rows
            at = table[table["step"] == number]
            shown = history[history["step"] == number]
            keys = ["layer", "tensor"]
            assert at[keys].values.tolist() == shown[keys].values.tolist(), f"{where}: histograms"
            by_path = dict(zip(paths, gradients, strict=True))
            counts = pd.DataFrame(
                np.stack(at["counts"].to_list()), columns=[f"b{i}" for i in range(HISTOGRAM_BINS)]
            )
            assert_histograms(
                counts, [by_path[v] for v in shown["variable"]], f"{where}: histograms"
            )


# ---------------------------------------------------------------- chain_gradients


def build_split(draw):
    """2-3 parts of an MLP or a tiny CNN, and the batch (`draw`: `st.data().draw`)."""
    keras.utils.clear_session()
    seed = draw(st.integers(0, 2**16), label="seed")
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["mlp", "cnn"]), label="parts of")
    loss_kind = draw(st.sampled_from(LOSSES), label="loss")
    batch = draw(st.integers(1, 16), label="batch")
    count = draw(st.integers(2, 3), label="parts")
    if loss_kind == "sparse_ce_logits":
        classes = draw(st.integers(2, 5), label="classes")
        head = keras.layers.Dense(classes, name="out")
        y = rng.integers(0, classes, batch)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    elif loss_kind == "mse":
        outputs = draw(st.integers(1, 4), label="outputs")
        head = keras.layers.Dense(outputs, name="out")
        y = rng.normal(size=(batch, outputs)).astype(np.float32)
        loss = "mse"
    else:
        head = keras.layers.Dense(1, activation="sigmoid", name="out")
        y = rng.integers(0, 2, (batch, 1)).astype(np.float32)
        loss = "binary_crossentropy"
    if kind == "mlp":
        features = draw(st.integers(1, 12), label="features")
        x = rng.normal(size=(batch, features)).astype(np.float32)
        widths = [draw(st.integers(1, 12), label=f"width {i}") for i in range(count - 1)]
        acts = [
            draw(st.sampled_from(ACTIVATIONS), label=f"activation {i}") for i in range(count - 1)
        ]
        shapes = [(features,), *[(w,) for w in widths]]
        # The last part is the head alone.
        bodies = [[keras.layers.Dense(w, activation=a)] for w, a in zip(widths, acts, strict=True)]
        bodies.append([])
    else:
        size = draw(st.integers(4, 6), label="image size")
        x = rng.normal(size=(batch, size, size, 1)).astype(np.float32)
        filters = draw(st.integers(1, 3), label="filters")
        conv = keras.layers.Conv2D(
            filters, 3, padding="same", activation=draw(st.sampled_from(ACTIVATIONS), label="act")
        )
        pooled = (size + 1) // 2
        bodies = [[conv, keras.layers.MaxPooling2D(2, padding="same")], [keras.layers.Flatten()]]
        shapes = [(size, size, 1), (pooled, pooled, filters)]
        if count == 3:
            bodies.append([keras.layers.Dense(draw(st.integers(1, 8), label="dense"), "tanh")])
            shapes.append((pooled * pooled * filters,))
    bodies[-1].append(head)
    parts = [
        keras.Sequential([keras.Input(shape), *layers], name=f"part{i}")
        for i, (shape, layers) in enumerate(zip(shapes, bodies, strict=True))
    ]
    if kind == "mlp" and draw(st.booleans(), label="a part used twice"):
        # Documented: each use gets an entry with its share; their sum is the joint tape's.
        twice = keras.Sequential(
            [keras.Input(shapes[-1]), keras.layers.Dense(shapes[-1][0], activation="tanh")],
            name="twice",
        )
        parts = [*parts[:-1], twice, twice, parts[-1]]
    label = f"chain({kind}, {len(parts)} parts, loss={loss_kind}, batch={batch}, seed={seed})"
    return label, parts, x, y, loss, loss_kind


@fuzz_settings(ci_examples=10)
@given(data=st.data())
def test_chain_gradients_match_one_joint_tape(data):
    label, parts, x, y, loss, loss_kind = build_split(data.draw)
    method = data.draw(st.sampled_from(["vjp", "jacobian"]), label="method")
    label = f"{label}, method={method}"
    note(label)
    result = gradflow.chain_gradients(parts, x, y, loss=loss, method=method)
    with tf.GradientTape(persistent=True) as tape:
        h, outputs = tf.constant(x), []
        for part in parts:
            h = part(h, training=False)
            outputs.append(h)
        value = reference_loss(loss_kind, y, h)
        shown = tf.identity(h)
        shown_loss = reference_loss(loss_kind, y, shown)
    assert result.loss == pytest.approx(float(value), rel=RTOL, abs=1e-6), f"{label}: loss"
    assert len(result) == len(parts), f"{label}: {len(result)} entries"
    for i, part in enumerate(parts):
        expected = tape.gradient(value, part.trainable_variables)
        uses = [k for k, other in enumerate(parts) if other is part]
        assert all(len(result[k]) == len(expected) for k in uses), f"{label}: part {i} count"
        for j, want in enumerate(expected):
            # A part used twice: the joint tape's gradient is the sum of its uses' entries.
            got = sum(dense(result[k][j]).astype(np.float64) for k in uses)
            want = dense(want)
            scale = float(np.max(np.abs(want))) if want.size else 0.0
            np.testing.assert_allclose(
                got,
                want,
                rtol=1e-5,
                atol=max(1e-7, 2e-6 * scale),
                err_msg=f"{label}: part {i}, {part.trainable_variables[j].path}",
            )
    received = [tape.gradient(value, out) for out in outputs[:-1]]
    received.append(tape.gradient(shown_loss, shown))
    for i, (got, want) in enumerate(zip(result.upstream, received, strict=True)):
        want = dense(want)
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        np.testing.assert_allclose(
            dense(got),
            want,
            rtol=1e-5,
            atol=max(1e-7, 2e-6 * scale),
            err_msg=f"{label}: upstream of part {i}",
        )
