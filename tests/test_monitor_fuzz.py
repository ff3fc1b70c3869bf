"""GradientMonitor's options in combination, against a tf.GradientTape loop written here.

`tests/test_monitor.py` and its neighbours check each feature on its own.
This property test draws a whole configuration and holds every recorded row,
metric and histogram to an independent reference: a copy of the model (same
initial weights) trained on the same batches by a plain tape with a fresh
optimizer of the same settings, which clips and constrains by hand, and
numpy float64 statistics of the tape's gradients, of the weights before and
after each step and of the gradient through time.

Drawn: an MLP of 1-4 Dense layers (with BatchNormalization or a seeded
Dropout), a small Conv2D net, a SimpleRNN/GRU/LSTM, a Functional model with
a residual `Add`, two models over the deferred path's 32,768 parameters (one
with a 256 x 256 kernel); SGD (momentum, Nesterov), Adam, RMSprop, Adagrad,
Nadam, AdamW, with clipvalue, clipnorm, global_clipnorm or none, gradient
accumulation, EMA (with or without overwriting), a decaying learning rate; a
MaxNorm constraint; `every`, activation rows, histograms, rows through time,
`keep_steps`, `stop_on_nonfinite` (on healthy runs), steps per execution, a
smaller last batch, sample weights, validation data, one monitor over two
fits, reads of the ring after every execution or only at the end, and a
ring of two executions (not grown) that wraps around between reads.

A second test draws runs that go non-finite: an MLP with a `BlowUp` layer
whose gradient turns inf or NaN at a drawn step, with and without
`stop_on_nonfinite`; the reported step and origin layer, the rows before it
and the weights left by the halt are held to the tape loop's.

The CI runs 20 derandomized examples (10 of the non-finite runs); a longer campaign draws afresh:

    GRADFLOW_FUZZ_EXAMPLES=300 GRADFLOW_FUZZ_RANDOM=1 python -m pytest tests/test_monitor_fuzz.py
"""

import contextlib
import dataclasses
import os
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradflow import schema
from gradflow.monitor import GradientMonitor, buffer, callback, deferred

EXAMPLES = int(os.environ.get("GRADFLOW_FUZZ_EXAMPLES", "20"))
# A campaign may draw afresh each run; the CI's examples are always the same.
DERANDOMIZE = not os.environ.get("GRADFLOW_FUZZ_RANDOM")

ARCHITECTURES = ("mlp", "conv", "rnn", "residual", "wide", "large_kernel")
OPTIMIZERS = ("sgd", "sgd_momentum", "sgd_nesterov", "adam", "rmsprop", "adagrad", "nadam", "adamw")
CLIPS = (None, "clipvalue", "clipnorm", "global_clipnorm")


@dataclasses.dataclass(frozen=True)
class Config:
    architecture: str
    depth: int  # hidden Dense layers of the MLP
    widths: tuple
    activation: str
    cell: str  # SimpleRNN, GRU or LSTM
    batch_norm: bool
    dropout: bool
    classify: bool  # softmax head and sparse cross-entropy, else a linear head and MSE
    optimizer: str
    learning_rate: float
    clip: str
    clip_value: float
    accumulate: object  # the optimizer's gradient_accumulation_steps: None or an int
    ema: object  # None, or the optimizer's ema_overwrite_frequency (0: an average only)
    schedule: bool  # a decaying learning rate
    max_norm: bool
    every: int
    activations: bool
    histograms: bool
    steps_per_execution: int
    samples: int
    batch_size: int
    epochs: int
    sample_weights: bool
    stop_on_nonfinite: bool
    read_every_execution: bool  # else mostly at the end: reads come every 0.2 s
    through_time: bool  # recurrent models only
    fits: int  # one monitor over this many `fit` calls of `epochs` each
    keep_steps: object  # None or an int
    validation: bool  # validation data: the first samples again
    small_ring: bool  # a ring of 2 executions, never grown: it wraps around mid-fit
    seed: int
    blow_up: object = None  # (position in the MLP, step, "inf" or "nan"): see `nonfinite_configs`


@st.composite
def configs(draw):
    architecture = draw(st.sampled_from(ARCHITECTURES))
    batch_size = draw(st.integers(2, 8))
    # Mostly a smaller last batch; sometimes whole batches only.
    samples = batch_size * draw(st.integers(1, 3)) + draw(st.integers(0, batch_size - 1))
    # Half the draws take nothing that keeps a small model off the deferred
    # path (`every` > 1, clipping, a constraint), so that both paths are fuzzed.
    plain = draw(st.booleans())
    clip = None if plain else draw(st.sampled_from(CLIPS))
    return Config(
        architecture=architecture,
        depth=draw(st.integers(1, 4)),
        widths=tuple(draw(st.lists(st.integers(1, 24), min_size=4, max_size=4))),
        activation=draw(st.sampled_from(["tanh", "relu", "sigmoid", "linear"])),
        cell=draw(st.sampled_from(["SimpleRNN", "GRU", "LSTM"])),
        batch_norm=draw(st.booleans()),
        dropout=draw(st.booleans()),
        classify=draw(st.booleans()),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        learning_rate=draw(st.sampled_from([0.001, 0.01, 0.05])),
        clip=clip,
        clip_value=draw(st.sampled_from([0.01, 0.1, 1.0])),
        accumulate=draw(st.sampled_from([None, None, None, 2, 3])),
        ema=draw(st.sampled_from([None, None, None, 0, 2])),
        schedule=draw(st.booleans()),
        max_norm=False if plain else draw(st.booleans()),
        every=1 if plain else draw(st.integers(1, 3)),
        activations=draw(st.booleans()),
        histograms=draw(st.booleans()),
        steps_per_execution=draw(st.integers(1, 3)),
        samples=samples,
        batch_size=batch_size,
        epochs=draw(st.integers(1, 2)),
        sample_weights=draw(st.booleans()),
        stop_on_nonfinite=draw(st.booleans()),
        read_every_execution=draw(st.booleans()),
        through_time=architecture == "rnn" and draw(st.booleans()),
        fits=draw(st.sampled_from([1, 1, 2])),
        keep_steps=draw(st.sampled_from([None, None, None, 0, 1, 3])),
        validation=draw(st.booleans()),
        small_ring=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


# --- the models ----------------------------------------------------------------


@keras.saving.register_keras_serializable("gradflow_fuzz")
class BlowUp(keras.layers.Layer):
    """Scales its input by a weight; its gradients turn inf or NaN on a big input.

    Past |input| > `BIG / 10` the backward pass multiplies by inf (or NaN):
    the first non-finite gradient is its own weight's, and it flows down to
    the layers below it while those above it stay finite.
    """

    def __init__(self, kind="inf", **kwargs):
        super().__init__(**kwargs)
        self.kind = kind

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        bad = np.inf if self.kind == "inf" else np.nan

        @tf.custom_gradient
        def scaled(x, scale):
            factor = tf.where(tf.reduce_max(tf.abs(x)) > BIG / 10, bad, 1.0)

            def grad(upstream):
                return upstream * scale * factor, tf.reduce_sum(upstream * x, 0) * factor

            return x * scale, grad

        # A tensor, not the variable: eager custom gradients refuse variables.
        return scaled(x, tf.convert_to_tensor(self.scale))

    def get_config(self):
        return super().get_config() | {"kind": self.kind}


FEATURES, CLASSES, TIME = 3, 3, 4
BIG = 1e4  # the inputs of the batch that blows up (see `BlowUp`)
VALIDATION = 4  # samples


def input_shape(config):
    if config.architecture == "conv":
        return (5, 5, 2)
    if config.architecture == "rnn":
        return (TIME, FEATURES)
    return (FEATURES,)


def build_model(config):
    """The drawn model, built with the drawn seed (`copy_of` gives the reference its twin)."""
    keras.utils.set_random_seed(config.seed)
    constraint = keras.constraints.MaxNorm(0.5) if config.max_norm else None
    outputs = CLASSES if config.classify else 1
    head = keras.layers.Dense(
        outputs, activation="softmax" if config.classify else None, name="head"
    )
    inputs = keras.Input(input_shape(config))
    widths = [max(1, w) for w in config.widths]
    if config.architecture == "residual":
        a = keras.layers.Dense(
            widths[0], activation=config.activation, kernel_constraint=constraint, name="a"
        )(inputs)
        b = keras.layers.Dense(widths[0], activation="tanh", name="b")(a)
        joined = keras.layers.Add(name="add")([a, b])
        return keras.Model(inputs, head(joined), name="residual")
    layers = []
    if config.architecture == "mlp":
        for i in range(config.depth):
            layers.append(
                keras.layers.Dense(
                    widths[i],
                    activation=config.activation,
                    kernel_constraint=constraint if i == 0 else None,
                    # Under BatchNormalization a bias gets only rounding noise
                    # for a gradient (the batch mean takes it out), and trains
                    # on it: nothing to compare.
                    use_bias=not (i == 0 and config.batch_norm),
                    name=f"d{i}",
                )
            )
            if i == 0 and config.batch_norm:
                layers.append(keras.layers.BatchNormalization(name="bn"))
            if i == 0 and config.dropout:
                layers.append(keras.layers.Dropout(0.3, seed=7, name="drop"))
        if config.blow_up is not None:
            position, _, kind = config.blow_up
            layers.insert(position, BlowUp(kind, name="blowup"))
    elif config.architecture == "conv":
        layers.append(
            keras.layers.Conv2D(
                max(1, widths[0] // 4),
                3,
                activation=config.activation,
                kernel_constraint=constraint,
                use_bias=not config.batch_norm,
                name="conv",
            )
        )
        if config.batch_norm:
            layers.append(keras.layers.BatchNormalization(name="bn"))
        layers.append(keras.layers.Flatten(name="flat"))
        if config.dropout:
            layers.append(keras.layers.Dropout(0.3, seed=7, name="drop"))
    elif config.architecture == "rnn":
        cell = getattr(keras.layers, config.cell)
        layers.append(
            cell(max(1, widths[0] // 3), kernel_constraint=constraint, name=config.cell.lower())
        )
    elif config.architecture == "wide":
        # 3*200 + 200 + 200*160 + 160 + the head's: more than the deferred ring takes.
        layers.append(keras.layers.Dense(200, activation="tanh", kernel_constraint=constraint))
        layers.append(keras.layers.Dense(160, activation=config.activation, name="d1"))
    elif config.architecture == "large_kernel":
        # A 256 x 256 kernel: 65,536 entries, reduced on its own, never stacked.
        layers.append(keras.layers.Dense(256, activation="tanh", kernel_constraint=constraint))
        layers.append(keras.layers.Dense(256, activation=config.activation, name="d1"))
    layers.append(head)
    return keras.Sequential([inputs, *layers], name=config.architecture)


def forward(model, config, x, training=True):
    """The model's output and {layer name: output}, called layer by layer."""
    h = x
    outputs = {}
    if config.architecture == "residual":
        a = model.get_layer("a")(h, training=training)
        b = model.get_layer("b")(a, training=training)
        joined = model.get_layer("add")([a, b], training=training)
        y = model.get_layer("head")(joined, training=training)
        return y, {"a": a, "b": b, "add": joined, "head": y}
    for layer in model.layers:
        h = layer(h, training=training)
        outputs[layer.name] = h
    return h, outputs


def make_data(config):
    rng = np.random.default_rng(config.seed)
    x = rng.normal(size=(config.samples, *input_shape(config))).astype("float32")
    if config.classify:
        y = rng.integers(0, CLASSES, size=(config.samples,)).astype("int32")
    else:
        y = rng.normal(size=(config.samples, 1)).astype("float32")
    if config.blow_up is not None:
        _, step, _ = config.blow_up
        x[(step - 1) * config.batch_size : step * config.batch_size] *= BIG
    weights = None
    if config.sample_weights:
        weights = rng.uniform(0.2, 2.0, size=(config.samples,)).astype("float32")
    return x, y, weights


def make_optimizer(config, clipping=True):
    kind, lr = config.optimizer, config.learning_rate
    if config.schedule:
        lr = keras.optimizers.schedules.ExponentialDecay(lr, decay_steps=2, decay_rate=0.7)
    kwargs = {"learning_rate": lr, "gradient_accumulation_steps": config.accumulate}
    if config.ema is not None:
        kwargs |= {"use_ema": True, "ema_overwrite_frequency": config.ema or None}
    if clipping and config.clip:
        kwargs[config.clip] = config.clip_value
    if kind == "sgd":
        return keras.optimizers.SGD(**kwargs)
    if kind == "sgd_momentum":
        return keras.optimizers.SGD(momentum=0.9, **kwargs)
    if kind == "sgd_nesterov":
        return keras.optimizers.SGD(momentum=0.9, nesterov=True, **kwargs)
    if kind == "adam":
        return keras.optimizers.Adam(**kwargs)
    if kind == "rmsprop":
        return keras.optimizers.RMSprop(**kwargs)
    if kind == "adagrad":
        return keras.optimizers.Adagrad(**kwargs)
    if kind == "nadam":
        return keras.optimizers.Nadam(**kwargs)
    if kind == "adamw":
        return keras.optimizers.AdamW(weight_decay=0.1, **kwargs)
    raise ValueError(kind)


def make_loss(config):
    if config.classify:
        return keras.losses.SparseCategoricalCrossentropy()
    return keras.losses.MeanSquaredError()


# --- the independent reference ---------------------------------------------------


def numpy_stats(g):
    g = np.asarray(g, np.float64).ravel()
    return {
        "max_abs": np.abs(g).max(),
        "l2_norm": np.sqrt(np.sum(g * g)),
        "mean_abs": np.abs(g).mean(),
        "std": g.std(),
        "zero_fraction": np.mean(g == 0.0),
        "nonfinite": float(np.sum(~np.isfinite(g))),
        # Entries within float32 rounding of 0 (a saturated tanh's derivative,
        # 1 - tanh(x)^2, is 6e-8 or exactly 0 by how tanh(x) rounded): one
        # run's exact zero, the other's not.
        "_near_zero": np.mean(np.abs(g) <= 1e-6 * np.abs(g).max()),
    }


def numpy_histogram(g):
    """Counts of log10|g| in the schema's fixed bins, in float32 as the monitor bins."""
    g = np.asarray(g, np.float32).ravel()
    g = g[np.isfinite(g)]
    with np.errstate(divide="ignore"):
        log = np.log10(np.abs(g).astype(np.float64))
    log = np.clip(log, schema.HISTOGRAM_LOW - 1.0, schema.HISTOGRAM_HIGH + 1.0)
    position = np.floor((log - schema.HISTOGRAM_LOW) / schema.HISTOGRAM_BIN_WIDTH) + 1.0
    position = np.clip(position, 0, schema.HISTOGRAM_BINS - 1).astype(int)
    return np.bincount(position, minlength=schema.HISTOGRAM_BINS)


def norm(a):
    return float(np.sqrt(np.sum(np.asarray(a, np.float64) ** 2)))


def clip_by_hand(config, grads):
    value = config.clip_value
    if config.clip == "clipvalue":
        return [np.clip(g, -value, value) for g in grads]
    if config.clip == "clipnorm":
        return [g * (value / max(norm(g), value)) for g in grads]
    if config.clip == "global_clipnorm":
        total = np.sqrt(sum(norm(g) ** 2 for g in grads))
        return [g * (value / max(total, value)) for g in grads]
    return grads


def output_gradient(loss_fn, y, output, sample_weight):
    """dLoss/d(output) where the loss read the output's logits: the same loss on a copy."""
    copy = tf.identity(output)
    with tf.GradientTape() as tape:
        tape.watch(copy)
        loss = loss_fn(y, copy, sample_weight=sample_weight)
    return tape.gradient(loss, copy)


def reference_run(model, config, x, y, sample_weight):
    """Train `model` as `fit` would; return the rows, metrics and histograms of every step.

    Rows are keyed (step, variable path) for weights, (step, layer name)
    for layer outputs and (step, "time t") through time.
    """
    # Clipped here, by hand; under gradient accumulation Keras clips the mean
    # of the accumulated gradients, which only its own optimizer applies.
    optimizer = make_optimizer(config, clipping=bool(config.accumulate))
    loss_fn = make_loss(config)
    variables = model.trainable_variables
    accumulated = [np.zeros(v.shape) for v in variables]
    constraints = {id(v): v.constraint for v in variables}
    for v in variables:
        v.constraint = None  # applied here, by hand, where it can be measured
    rows, metrics, histograms, step = {}, {}, {}, 0
    for epoch in range(config.epochs * config.fits):
        if epoch and epoch % config.epochs == 0:
            # Keras's `fit` ends by setting the weights to their moving
            # averages (with `use_ema`); the next fit starts from them.
            optimizer.finalize_variable_values(variables)
        for start in range(0, config.samples, config.batch_size):
            stop = start + config.batch_size
            xb, yb = x[start:stop], y[start:stop]
            sw = None if sample_weight is None else tf.constant(sample_weight[start:stop])
            xb = tf.constant(xb)
            with tf.GradientTape(persistent=config.through_time) as tape:
                tape.watch(xb)
                prediction, outputs = forward(model, config, xb)
                loss = loss_fn(yb, prediction, sample_weight=sw)
                if config.through_time:
                    # The outputs summed with alternating signs along the units.
                    signs = 1.0 - 2.0 * (np.arange(prediction.shape[-1]) % 2)
                    probe = tf.reduce_sum(prediction * signs.astype("float32"))
            grads = tape.gradient(loss, variables + list(outputs.values()))
            if config.through_time:
                through = tape.gradient(probe, xb).numpy()
                for t in range(through.shape[1]):
                    rows[(step + 1, f"time {t}")] = numpy_stats(through[:, t]) | dict.fromkeys(
                        schema.EXTRA_COLUMNS, np.nan
                    )
                    histograms[(step + 1, f"time {t}")] = numpy_histogram(through[:, t])
            weight_grads = [g.numpy() for g in grads[: len(variables)]]
            output_grads = [
                (output_gradient(loss_fn, yb, out, sw) if g is None else g).numpy()
                for g, out in zip(grads[len(variables) :], outputs.values(), strict=True)
            ]
            before = [v.numpy() for v in variables]
            learning_rate = float(optimizer.learning_rate)  # the one this batch's update takes
            if config.accumulate:
                applied = [g + a for g, a in zip(weight_grads, accumulated, strict=True)]
                if (step + 1) % config.accumulate:  # accumulates only: nothing clipped
                    accumulated, clipped = applied, [np.full(g.shape, np.nan) for g in applied]
                    mean = clipped
                else:
                    accumulated = [np.zeros(v.shape) for v in variables]
                    mean = [g / config.accumulate for g in applied]
                    clipped = clip_by_hand(config, mean)
                optimizer.apply_gradients(zip(grads[: len(variables)], variables, strict=True))
            else:
                mean = weight_grads  # what clipping sees
                clipped = clip_by_hand(config, weight_grads)
                optimizer.apply_gradients(
                    zip([tf.constant(g) for g in clipped], variables, strict=True)
                )
            step += 1
            for i, v in enumerate(variables):
                row = numpy_stats(weight_grads[i])
                row["weight_norm_unconstrained"] = np.nan
                constraint = constraints[id(v)]
                if constraint is not None:
                    row["weight_norm_unconstrained"] = norm(v.numpy())
                    v.assign(constraint(v))
                after = v.numpy()
                row["weight_norm"] = norm(after)
                was = norm(before[i])
                row["update_ratio"] = norm(after - before[i]) / was if was > 0 else np.nan
                row["l2_norm_clipped"] = norm(clipped[i]) if config.clip else np.nan
                row["max_abs_clipped"] = np.abs(clipped[i]).max() if config.clip else np.nan
                rows[(step, v.path)] = row
                histograms[(step, v.path)] = numpy_histogram(weight_grads[i])
            for name, g in zip(outputs, output_grads, strict=True):
                # A layer output is no weight: no weight columns.
                rows[(step, name)] = numpy_stats(g) | dict.fromkeys(schema.EXTRA_COLUMNS, np.nan)
                histograms[(step, name)] = numpy_histogram(g)
            metrics[(step, "loss")] = float(loss)
            metrics[(step, "learning_rate")] = learning_rate
            metrics[(step, "global_norm")] = np.sqrt(sum(norm(g) ** 2 for g in weight_grads))
            if config.clip:
                metrics[(step, "global_norm_clipped")] = np.sqrt(sum(norm(g) ** 2 for g in clipped))
                # Not a recorded metric: the norm before clipping, for `clipped`.
                metrics[(step, "_before_clipping")] = np.sqrt(sum(norm(g) ** 2 for g in mean))
        if config.validation:  # Keras validates at the epoch's end, on the first samples
            prediction, _ = forward(model, config, tf.constant(x[:VALIDATION]), training=False)
            metrics[(step, "val_loss")] = float(loss_fn(y[:VALIDATION], prediction))
    optimizer.finalize_variable_values(variables)
    for v in variables:
        v.constraint = constraints[id(v)]
    return rows, metrics, histograms, list(outputs)


def copy_of(model):
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


# --- the comparison ------------------------------------------------------------------

RTOL = 2e-4
GRADIENT_COLUMNS = ("max_abs", "l2_norm", "mean_abs", "std")
# The weight columns' absolute slack: float32 rounding of weights near 1.
ATOL = {"update_ratio": 2e-6, "weight_norm": 1e-5, "weight_norm_unconstrained": 1e-5}


def assert_row_close(got, want, scale, what):
    """One recorded row against the reference's.

    `scale` is the largest gradient of the step's kind of rows (the global
    norm for weights): a gradient that is exactly 0 in exact arithmetic (a
    bias under BatchNormalization) comes out of float32 as rounding noise of
    that size, different in the step's graph and in the reference's eager
    ops, so the gradient columns get `1e-6 * scale` of absolute slack and a
    noise row's count of exact zeros is not compared.
    """
    noise = 1e-6 * scale
    for column, expected in want.items():
        if column.startswith("_"):
            continue
        value = float(got[column])
        if column == "zero_fraction":
            if want["max_abs"] > noise:
                assert abs(value - expected) <= want["_near_zero"] + 1e-7, (
                    f"{what}: {column} = {value!r}, expected {expected!r}"
                )
            continue
        if column == "update_ratio" and expected > 1e3:
            # The weight was all but 0 before the step: its norm is rounding
            # noise of the steps before it (an update that cancelled the one
            # before, to float32's last bit in one run and not the other).
            continue
        if np.isnan(expected):
            assert np.isnan(value), f"{what}: {column} = {value}, expected NaN"
            continue
        atol = noise if column in GRADIENT_COLUMNS else ATOL.get(column, 1e-7)
        assert abs(value - expected) <= atol + RTOL * abs(expected), (
            f"{what}: {column} = {value!r}, expected {expected!r}"
        )


def recorded_steps(config, total):
    return [s for s in range(1, total + 1) if s % config.every == 0]


def expected_path(config, model):
    """Whether the monitor should take the deferred path, or None where the ring's size decides."""
    eligible = (
        config.every == 1
        and config.clip is None
        and not config.max_norm
        and model.count_params() <= deferred.MAX_PARAMETERS
    )
    if eligible and model.count_params() > 8_000:
        return None  # large enough for the ring's byte limit to decide
    return eligible


def fit_monitored(model, config, monitor, x, y, weights):
    """`config.fits` fits of `model` with `monitor`, reading its ring as drawn."""
    # How often the callback reads the ring is timed; read after every
    # execution, the steps of one fit reach `.history` in many pieces.
    interval = 0.0 if config.read_every_execution else callback._READ_INTERVAL_S
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(callback, "_READ_INTERVAL_S", interval))
        if config.small_ring:
            # A ring of 2 executions' steps (the callback reads it when full),
            # not grown by the deferred path: runs of up to 12 steps wrap
            # around it and reuse its slots between reads.
            patches.enter_context(mock.patch.object(callback, "_EXECUTIONS_PER_READ", 2))
            patches.enter_context(mock.patch.object(deferred, "_MAX_GROWTH", 1))
        for _ in range(config.fits):  # a second fit numbers its steps on
            model.fit(
                x,
                y,
                sample_weight=weights,
                batch_size=config.batch_size,
                epochs=config.epochs,
                validation_data=(x[:VALIDATION], y[:VALIDATION]) if config.validation else None,
                shuffle=False,
                verbose=0,
                callbacks=[monitor],
            )
    return monitor


def compare_rows(config, history, rows, steps, order, what):
    """`history` (its rows of `steps`) against the reference's rows; returns their keys and scales."""
    # Every row the reference has on a recorded step, and no other.
    keys = [row_key(r) for r in history.itertuples(index=False)]
    expected_keys = [
        key
        for key in rows
        if key[0] in steps and (config.activations or kind_of(key) != schema.ACTIVATION)
    ]
    assert sorted(keys, key=str) == sorted(expected_keys, key=str), what
    scales = {}  # (step, kind of row) -> the largest gradient norm of that kind
    for key, row in rows.items():
        kind = (key[0], kind_of(key))
        scales[kind] = max(scales.get(kind, 0.0), row["l2_norm"])
    for key, record in zip(keys, history.to_dict("records"), strict=True):
        # Layers are numbered in the order the forward pass calls them; time steps in time.
        index = (
            int(key[1][5:]) if kind_of(key) == schema.TIME_STEP else order.index(record["layer"])
        )
        assert record["layer_index"] == index, f"{what} step {key[0]} {key[1]} layer_index"
        scale = scales[(key[0], kind_of(key))]
        assert_row_close(record, rows[key], scale, f"{what} step {key[0]} {key[1]}")
    return keys, scales


def compiled_with_monitor(model, config):
    """Compile `model` as `config` says; return the `GradientMonitor` it draws."""
    model.compile(
        optimizer=make_optimizer(config),
        loss=make_loss(config),
        steps_per_execution=config.steps_per_execution,
    )
    return GradientMonitor(
        every=config.every,
        activations=config.activations,
        histograms=config.histograms,
        stop_on_nonfinite=config.stop_on_nonfinite,
        through_time=config.through_time,
        keep_steps=config.keep_steps,
    )


def check(config):
    model = build_model(config)
    reference = copy_of(model)
    x, y, weights = make_data(config)
    monitor = compiled_with_monitor(model, config)
    fit_monitored(model, config, monitor, x, y, weights)
    rows, metrics, histograms, order = reference_run(reference, config, x, y, weights)
    total = max(key[0] for key in rows)
    path = "deferred" if monitor._plan.deferred else "in-step"
    what = f"{config} ({path} path)"

    expected = expected_path(config, model)
    if expected is not None:
        assert monitor._plan.deferred is expected, what
    steps = recorded_steps(config, total)
    if config.keep_steps is not None:  # only the last ones stay in memory
        steps = steps[len(steps) - min(config.keep_steps, len(steps)) :]
    if config.small_ring:
        assert monitor._plan.capacity == 2 * config.steps_per_execution, what
    history = monitor.history
    assert sorted(history["step"].unique()) == steps, what

    keys, scales = compare_rows(config, history, rows, steps, order, what)

    step_metrics = monitor.metrics[monitor.metrics["name"].isin(buffer.STEP_METRICS)]
    assert sorted(step_metrics["step"].unique()) == steps, what
    recorded = monitor.metrics.set_index(["step", "name"])["value"]
    for (step, name), value in metrics.items():
        if name == "val_loss":
            # At an epoch's last step, recorded or not; with `keep_steps`,
            # from the first step kept on.
            if config.keep_steps is None or (steps and step >= steps[0]):
                got = float(recorded[(step, name)])
                assert abs(got - value) <= 1e-6 + RTOL * abs(value), f"{what} {step} val_loss"
            continue
        if step in steps and not name.startswith("_"):
            if np.isnan(value):  # no clipping at a batch that only accumulates
                assert np.isnan(recorded.get((step, name), np.nan)), f"{what} step {step} {name}"
                continue
            got = float(recorded[(step, name)])
            assert abs(got - value) <= 1e-7 + RTOL * abs(value), (
                f"{what} step {step}: {name} = {got!r}, expected {value!r}"
            )
    for step in steps:
        if not config.clip:
            continue
        shrunk = metrics[(step, "global_norm_clipped")] / metrics[(step, "_before_clipping")]
        # Not on the edge, where float32 decides; nor NaN, where nothing was clipped.
        if abs(shrunk - 1) > 1e-4:
            assert recorded[(step, "clipped")] == float(shrunk < 1), f"{what} step {step} clipped"

    if config.histograms:
        by_row = {
            (r.step, r.layer, r.tensor): key
            for r, key in zip(history.itertuples(index=False), keys, strict=True)
        }
        frame = monitor.histogram_rows
        assert len(frame) == len(history), what
        for r in frame.itertuples(index=False):
            key = by_row[(r.step, r.layer, r.tensor)]
            if rows[key]["max_abs"] <= 1e-6 * scales[(key[0], kind_of(key))]:
                continue  # rounding noise (see `assert_row_close`): bins of its own
            want = histograms[key]
            counts = np.asarray(r.counts)
            assert counts.sum() == want.sum(), f"{what} histogram {key}"
            # An entry on a bin's edge may land on either side in float32.
            moved = np.abs(counts - want).sum() / 2
            assert moved <= max(1, 0.01 * want.sum()), (
                f"{what} histogram {key}: {counts.tolist()} against {want.tolist()}"
            )

    # The model trained as the reference did. Per tensor, not per entry: Adam
    # moves an entry whose gradient is rounding noise by about its learning
    # rate, in whichever direction the noise points.
    for v, a, b in zip(model.weights, model.get_weights(), reference.get_weights(), strict=True):
        assert norm(a - b) <= 1e-5 + 1e-3 * norm(b), f"{what}: final {v.path} differs"


def row_key(record):
    """A history row's key in the reference's rows."""
    if record.tensor == schema.ACTIVATION:
        return (record.step, record.layer)
    if record.tensor == schema.TIME_STEP:
        return (record.step, f"time {record.layer_index}")
    return (record.step, record.variable)


def kind_of(key):
    if key[1].startswith("time "):
        return schema.TIME_STEP
    return "weight" if "/" in key[1] else schema.ACTIVATION


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=DERANDOMIZE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
@given(configs())
def test_any_combination_of_options_matches_a_tape_loop(config):
    check(config)


# --- runs that go non-finite -------------------------------------------------------


@st.composite
def nonfinite_configs(draw):
    """An MLP with a `BlowUp` layer at a drawn depth, whose gradients blow up at a drawn step.

    No BatchNormalization, Dropout or squashing activation (they would keep
    the big batch from `BlowUp`), no EMA or accumulation (the weights "before
    the step" are then the applied ones) and one fit without validation.
    """
    config = draw(configs())
    batches = config.samples // config.batch_size  # whole batches of the first epoch
    return dataclasses.replace(
        config,
        architecture="mlp",
        activation="linear",
        batch_norm=False,
        dropout=False,
        accumulate=None,
        ema=None,
        through_time=False,
        fits=1,
        keep_steps=None,
        validation=False,
        blow_up=(
            draw(st.integers(0, config.depth)),
            draw(st.integers(1, batches)),
            draw(st.sampled_from(["inf", "nan"])),
        ),
    )


def reference_until(model, config, x, y, weights, steps):
    """`reference_run` over the first `steps` batches of the first epoch."""
    end = steps * config.batch_size
    short = dataclasses.replace(config, samples=end, epochs=1)
    return reference_run(model, short, x[:end], y[:end], None if weights is None else weights[:end])


def check_nonfinite(config):
    model = build_model(config)
    reference, before = copy_of(model), copy_of(model)
    x, y, weights = make_data(config)
    monitor = compiled_with_monitor(model, config)  # no through_time, no keep_steps
    with np.errstate(invalid="ignore", over="ignore"):
        fit_monitored(model, config, monitor, x, y, weights)
        bad = config.blow_up[1]
        rows, _, _, order = reference_until(reference, config, x, y, weights, bad)
    if bad > 1:
        reference_until(before, config, x, y, weights, bad - 1)
    what = f"{config} ({'deferred' if monitor._plan.deferred else 'in-step'} path)"

    # The reference's first non-finite step is the one built to blow up, and
    # its origin the layer nearest the loss with a non-finite gradient there
    # (an output row counts only where the monitor records output rows).
    broken = [
        key
        for key, row in rows.items()
        if row["nonfinite"] > 0 and (config.activations or kind_of(key) != schema.ACTIVATION)
    ]
    assert min(key[0] for key in broken) == bad, what
    owner = {v.path: layer.name for layer in reference.layers for v in layer.trainable_variables}
    layers = [owner.get(key[1], key[1]) for key in broken if key[0] == bad]
    origin = max(layers, key=order.index)
    events = monitor.events.query("kind == 'nonfinite'")
    if config.stop_on_nonfinite or bad % config.every == 0:
        assert events[["step", "layer"]].values.tolist() == [[bad, origin]], what
    else:  # unrecorded: the first recorded step after it, by then all NaN, is named
        assert all(events["step"] > bad), what

    # The steps before it are recorded as the reference has them.
    history = monitor.history
    steps = recorded_steps(config, bad - 1)
    earlier = history[history["step"] < bad].reset_index(drop=True)
    compare_rows(config, earlier, rows, steps, order, what)
    if not config.stop_on_nonfinite:
        return
    # Halted at that step (recorded whatever `every`), its update not applied.
    assert history["step"].max() == bad, what
    assert sorted(history["step"].unique()) == [*steps, bad], what
    for v, a, b in zip(model.weights, model.get_weights(), before.get_weights(), strict=True):
        assert np.isfinite(a).all(), f"{what}: {v.path} is not finite"
        assert norm(a - b) <= 1e-5 + 1e-3 * norm(b), f"{what}: {v.path} differs"


@settings(
    max_examples=max(1, EXAMPLES // 2),
    deadline=None,
    derandomize=DERANDOMIZE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
@given(nonfinite_configs())
def test_a_run_that_goes_nonfinite_is_reported_and_halted_where_a_tape_loop_breaks(config):
    check_nonfinite(config)
