"""`GradientMonitor(through_time=True)` against a hand-written tape.

The reference trains a copy of the recurrent model (same weights, same batch
order) with its own persistent tape: the loss's gradient updates the weights,
and the gradient of the outputs (summed with alternating signs) w.r.t. the
input sequence gives, split along time, what each row through time must hold.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from gradflow import schema
from gradflow.monitor import GradientMonitor
from gradflow.monitor.through_time import chunk_sizes, row_labels

N, BATCH, STEPS_IN_TIME, CLASSES = 24, 8, 12, 3  # 3 training steps per epoch


def make_sequences(steps_in_time=STEPS_IN_TIME, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, steps_in_time, 2)).astype("float32")
    y = rng.integers(0, CLASSES, size=N)
    return x, y


def make_model(steps_in_time=STEPS_IN_TIME, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((steps_in_time, 2)),
            keras.layers.SimpleRNN(6, return_sequences=True, name="rnn"),
            keras.layers.GRU(5, name="gru"),
            keras.layers.Dense(CLASSES, activation="softmax", name="out"),
        ],
        name="recurrent",
    )


def copy_of(model):
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def alternating_sum(y):
    signs = np.where(np.arange(y.shape[-1]) % 2 == 0, 1.0, -1.0).astype("float32")
    return tf.reduce_sum(y * signs)


def reference_rows(model, optimizer, x, y, epochs, sizes):
    """{(step, row): gradient of the outputs w.r.t. the input's time steps in that row}."""
    loss_function = keras.losses.SparseCategoricalCrossentropy()
    found, step = {}, 0
    bounds = np.cumsum([0] + list(sizes))
    for _ in range(epochs):
        for start in range(0, len(x), BATCH):
            xb = tf.constant(x[start : start + BATCH])
            yb = y[start : start + BATCH]
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(xb)
                predicted = model(xb, training=True)
                loss = loss_function(yb, predicted)
                probe = alternating_sum(predicted)
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
            through_time = tape.gradient(probe, xb).numpy()
            step += 1
            for row in range(len(sizes)):
                found[(step, row)] = through_time[:, bounds[row] : bounds[row + 1]]
    return found


def monitored_fit(model, optimizer, x, y, epochs, **monitor_kwargs):
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    monitor = GradientMonitor(through_time=True, **monitor_kwargs)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[monitor])
    return monitor


def assert_rows_match(history, reference, rtol):
    rows = history[history["tensor"] == schema.TIME_STEP]
    assert len(rows) == len(reference)
    for row in rows.itertuples():
        g = np.asarray(reference[(row.step, row.layer_index)], np.float64).ravel()
        np.testing.assert_allclose(row.max_abs, np.abs(g).max(), rtol=rtol)
        np.testing.assert_allclose(row.l2_norm, np.sqrt(np.sum(g * g)), rtol=rtol)
        np.testing.assert_allclose(row.mean_abs, np.abs(g).mean(), rtol=rtol)
        np.testing.assert_allclose(row.std, g.std(), rtol=rtol, atol=1e-9)
        np.testing.assert_allclose(row.zero_fraction, np.mean(g == 0.0), rtol=1e-6)
        assert row.nonfinite == 0


@pytest.mark.parametrize(
    "optimizer_class,clipnorm,every",
    [
        (keras.optimizers.SGD, None, 1),
        (keras.optimizers.Adam, 0.5, 1),
        (keras.optimizers.SGD, None, 2),
    ],
    # SGD unclipped takes the deferred path (the read summarizes the weight
    # gradients); clipping keeps the in-step path, and so does `every > 1`,
    # where the rows through time are made inside the cond of the steps that record.
    ids=["sgd_deferred", "adam_clipped_in_step", "sgd_every_2"],
)
def test_rows_through_time_equal_a_hand_written_tape(optimizer_class, clipnorm, every):
    x, y = make_sequences()
    model = make_model()
    twin = copy_of(model)
    kwargs = {"learning_rate": 0.05} | ({"clipnorm": clipnorm} if clipnorm else {})
    monitor = monitored_fit(
        model, optimizer_class(**kwargs), x, y, epochs=2, activations=True, every=every
    )

    reference = reference_rows(twin, optimizer_class(**kwargs), x, y, 2, [1] * STEPS_IN_TIME)
    reference = {key: g for key, g in reference.items() if key[0] % every == 0}
    history = monitor.history
    assert_rows_match(history, reference, rtol=1e-4)
    rows = history[(history["tensor"] == schema.TIME_STEP) & (history["step"] == 6)]
    assert list(rows["layer"]) == [f"t={t:02d}" for t in range(1, STEPS_IN_TIME + 1)]
    assert list(rows["layer_index"]) == list(range(STEPS_IN_TIME))
    assert set(rows["variable"]) == {"input"}
    # The second backward pass changed nothing the optimizer did.
    for mine, theirs in zip(model.get_weights(), twin.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-6)
    # The layers' own rows are all still there, activations included.
    assert set(history["layer"]) >= {"rnn", "gru", "out"}
    assert (history["tensor"] == schema.ACTIVATION).any()


def test_a_long_sequence_shares_rows_between_time_steps():
    steps_in_time = 250
    x, y = make_sequences(steps_in_time)
    model = make_model(steps_in_time)
    twin = copy_of(model)
    monitor = monitored_fit(model, keras.optimizers.SGD(0.05), x, y, epochs=1)

    sizes = chunk_sizes(steps_in_time)
    assert len(sizes) <= 100 and sum(sizes) == steps_in_time
    reference = reference_rows(twin, keras.optimizers.SGD(0.05), x, y, 1, sizes)
    assert_rows_match(monitor.history, reference, rtol=1e-4)
    labels = monitor.history.query("tensor == 'time_step' and step == 1")["layer"]
    assert list(labels)[:2] == ["t=001–003", "t=004–006"] and list(labels)[-1] == "t=250"


def test_token_inputs_record_the_embeddings_time_steps():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(N, 9))
    y = rng.integers(0, CLASSES, size=N)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((9,), dtype="int32"),
            keras.layers.Embedding(20, 4, name="embedding"),
            keras.layers.LSTM(5, name="lstm"),
            keras.layers.Dense(CLASSES, activation="softmax", name="out"),
        ]
    )
    twin = copy_of(model)
    monitor = monitored_fit(model, keras.optimizers.SGD(0.1), x, y, epochs=1)

    rows = monitor.history.query("tensor == 'time_step'")
    assert set(rows["variable"]) == {"embedding"}
    assert sorted(set(rows["layer_index"])) == list(range(9))
    # Reference: the gradient w.r.t. the embedding's output at each step.
    xb = x[:BATCH]
    with tf.GradientTape() as tape:
        embedded = twin.get_layer("embedding")(xb)
        tape.watch(embedded)
        predicted = twin.get_layer("out")(twin.get_layer("lstm")(embedded))
        probe = alternating_sum(predicted)
    expected = tape.gradient(probe, embedded).numpy()
    first = rows[rows["step"] == 1].sort_values("layer_index")
    np.testing.assert_allclose(
        first["l2_norm"], np.sqrt(np.sum(expected**2, axis=(0, 2))), rtol=1e-4
    )


def test_a_model_without_a_sequence_warns_and_records_the_rest():
    x = np.random.default_rng(0).normal(size=(N, 4)).astype("float32")
    y = np.random.default_rng(1).integers(0, CLASSES, size=N)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(CLASSES, activation="softmax", name="out")]
    )
    with pytest.warns(UserWarning, match=r"through_time=True\) records nothing through time"):
        monitor = monitored_fit(model, keras.optimizers.SGD(0.1), x, y, epochs=1)
    history = monitor.history
    assert not (history["tensor"] == schema.TIME_STEP).any()
    assert sorted(set(history["step"])) == [1, 2, 3]
    # No events: the same empty table `diagnose` gives (its steps were objects).
    from gradflow.diagnosis import diagnose

    assert monitor.events.empty and monitor.events.equals(diagnose(history))


def test_a_softmax_output_does_not_cancel_to_zero():
    # d(sum of a softmax)/dx is exactly 0: the alternating signs keep it.
    x, y = make_sequences()
    monitor = monitored_fit(make_model(), keras.optimizers.SGD(0.05), x, y, epochs=1)
    rows = monitor.history.query("tensor == 'time_step'")
    assert (rows["l2_norm"] > 0).all()


def test_off_by_default_and_checked():
    x, y = make_sequences()
    model = make_model()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    monitor = GradientMonitor()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no word about time when not asked for
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    assert not (monitor.history["tensor"] == schema.TIME_STEP).any()
    with pytest.raises(ValueError, match="through_time"):
        GradientMonitor(through_time="yes")


@pytest.mark.parametrize(
    "length,sizes",
    [(1, [1]), (30, [1] * 30), (100, [1] * 100), (101, [2] * 50 + [1]), (250, [3] * 83 + [1])],
)
def test_chunk_sizes_cover_every_time_step_in_at_most_100_rows(length, sizes):
    assert chunk_sizes(length) == sizes
    labels = row_labels(sizes)
    width = len(str(length))  # "t=01" ... "t=30": sorted as text, still in time order
    assert labels[0] == ("t=" + "1".zfill(width)) + (
        "" if sizes[0] == 1 else f"–{sizes[0]:0{width}d}"
    )
    assert labels[-1].endswith(str(length)) and sorted(labels) == labels


def test_a_recurrent_lab_run_records_through_time_and_an_mlp_does_not(tmp_path):
    """The SimpleRNN preset said its heatmaps could not show the gradient fading through time."""
    from gradflow import export, figures, train
    from gradflow.diagnosis import diagnose
    from gradflow.lab.config import RunConfig

    store = tmp_path / "runs.db"
    small = dict(dataset="adding", sequence_length=12, n_samples=60, steps=4, width=4)
    run = train(RunConfig(architecture="rnn", depth=2, **small), store=store)
    stats = run.layer_stats
    rows = stats[stats["tensor"] == schema.TIME_STEP]
    assert sorted(set(rows["step"])) == [1, 2, 3, 4]
    assert list(rows[rows["step"] == 4]["layer"]) == [f"t={t:02d}" for t in range(1, 13)]
    assert set(rows["variable"]) == {"input"}
    assert (rows["l2_norm"] > 0).all() and rows["l2_norm"].notna().all()

    charts = export.run_charts(stats, run.metrics)
    through_time = charts["through_time_heatmap"]
    assert through_time.figure.layout.yaxis.title.text == "time step (first at the bottom)"
    assert through_time.title.endswith("reaching each time step")  # short: cut at 1280 px
    # A slide's picture of it too: the lesson pack's profile was the kernels' alone.
    assert charts["through_time_profile"].figure.layout.xaxis.title.text == (
        "time step (first on the left)"
    )
    # The layers' heatmaps keep their layers only.
    kernels = charts["max_abs_heatmap"].data
    assert not kernels["layer"].astype(str).str.startswith("t=").any()
    assert (
        not figures.layer_lines(stats, "max_abs", figures.ALL_WEIGHTS)
        .data["layer"]
        .astype(str)
        .str.startswith("t=")
        .any()
    )

    # Lines and the profile name time steps, not layers.
    lines = figures.layer_lines(stats, "l2_norm", schema.TIME_STEP)
    assert "reaching each time step, over training" in lines.title
    scale = [
        t for t in lines.figure.data if getattr(t.marker, "colorbar", None) and t.marker.showscale
    ]
    assert scale and scale[0].marker.colorbar.title.text == "time step"
    profile = figures.profile(stats, tensor=schema.TIME_STEP)
    assert profile.figure.layout.xaxis.title.text == "time step (first on the left)"
    # One step's profile through time is noisy: the median of the recorded steps up to it.
    assert "at steps 1–4 (median of 4)" in profile.title
    medians = rows.groupby("layer_index")["max_abs"].median().to_numpy()
    np.testing.assert_allclose(profile.data["max_abs"], medians, rtol=1e-12)
    assert list(profile.data["layer"])[:2] == ["t=01", "t=02"]

    mlp = train(RunConfig(architecture="mlp", dataset="circles", steps=2), store=store)
    assert not (mlp.layer_stats["tensor"] == schema.TIME_STEP).any()

    # The layer rules compare layers: time steps all at 1e-12 are no vanishing
    # *layer*, and nothing fades from the last time step to the first.
    faded = rows.assign(l2_norm=1e-12, max_abs=1e-12, mean_abs=1e-12)
    assert diagnose(faded).empty


def test_the_alerts_tell_the_simple_rnn_preset_from_the_lstm_preset(tmp_path):
    """The SimpleRNN preset's lesson, vanishing through time, showed "No alerts".

    Untrained, both fade through time; the LSTM learns to carry the gradient
    back (about step 300), the SimpleRNN does not (seeds 0-3 in
    `Thresholds`' docstring).
    """
    from gradflow import export, train
    from gradflow.diagnosis import diagnose
    from gradflow.lab.presets import get_preset

    said = {}
    for key in ("rnn_simple", "rnn_lstm"):
        run = train(get_preset(key).config, store=tmp_path / "runs.db")
        stored = run.events
        through = stored[stored["layer"] == "t=01"]
        said[key] = list(zip(through["step"], through["kind"], strict=True))
        assert said[key][0][1] == "vanishing" and said[key][0][0] <= 50, said[key]
        # The monitor stored what the rules find in the stored statistics.
        found = diagnose(run.layer_stats)
        assert found[found["layer"] == "t=01"]["message"].tolist() == through["message"].tolist()
        # and the dashboard's and the exports' alerts tell it once.
        alerts = export.run_alerts(run.layer_stats, stored)
        assert (alerts["layer"] == "t=01").sum() == len(through)
    assert said["rnn_simple"][-1][1] == "vanishing", said["rnn_simple"]
    assert [kind for _, kind in said["rnn_lstm"]] == ["vanishing", "info"], said["rnn_lstm"]
    assert 200 <= said["rnn_lstm"][1][0] <= 500, said["rnn_lstm"]


def test_fits_diagnosed_one_by_one_find_what_the_whole_history_shows_through_time(
    monkeypatch,
):
    """Each `fit`'s end reads its steps and the few before them: through time, a median
    of `time_window` recorded steps reaches further back than the other rules."""
    from gradflow.diagnosis import Thresholds, diagnose
    from gradflow.monitor import callback as monitor_callback

    monkeypatch.setattr(monitor_callback, "_DIAGNOSED_ROWS", 30)  # pieces within a fit too
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 10, 2)).astype("float32")
    y = x[:, 0, :1] + rng.normal(size=(64, 1)).astype("float32")
    model = keras.Sequential(
        [keras.Input((10, 2)), keras.layers.SimpleRNN(4), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.SGD(0.5), "mse")
    # Shares that cross 0.05 and 0.5 back and forth (seen: 0.005 to 7).
    rules = Thresholds(vanishing_through_time=0.05, time_window=5, repeat_after=2, growth_window=1)
    monitor = GradientMonitor(through_time=True, rules=rules)
    for _ in range(15):
        model.fit(x, y, batch_size=16, verbose=0, shuffle=False, callbacks=[monitor])

    def through_time(events):
        found = events[events["layer"] == "t=01"]
        return sorted(zip(found["step"].astype(int), found["kind"], found["message"], strict=True))

    said = through_time(monitor.events)
    assert said == through_time(diagnose(monitor.history, rules))
    assert len(said) >= 3 and {kind for _, kind, _ in said} == {"vanishing", "info"}


def test_a_second_fit_with_another_length_keeps_the_history_whole(tmp_path):
    """A notebook's second `fit` on longer sequences left NaN rows through time: `.history`
    then raised IntCastingNaNError, and the dashboard drew them as NaN gradients."""
    from gradflow import RunStore

    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((None, 2)), keras.layers.LSTM(4, name="lstm"), keras.layers.Dense(1)]
    )
    model.compile(optimizer="sgd", loss="mse")
    monitor = GradientMonitor(through_time=True, store=tmp_path / "runs.db")
    y = rng.normal(size=(N, 1))
    model.fit(rng.normal(size=(N, 12, 2)), y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    with pytest.warns(UserWarning, match="varying number of time steps.*pad every sequence"):
        model.fit(rng.normal(size=(N, 20, 2)), y, batch_size=BATCH, verbose=0, callbacks=[monitor])

    history = monitor.history
    in_time = history["tensor"] == schema.TIME_STEP
    assert sorted(set(history["step"])) == [1, 2, 3, 4, 5, 6]
    assert sorted(set(history.loc[in_time, "step"])) == [1, 2, 3]  # the first fit's
    assert history["l2_norm"].notna().all()
    stored = RunStore(tmp_path / "runs.db").layer_stats(monitor.run_id)
    assert len(stored) == len(history) and stored["l2_norm"].notna().all()


def test_two_inputs_without_a_sequence_are_named_in_the_warning():
    first, second = keras.Input((4,)), keras.Input((3,))
    joined = keras.layers.Concatenate()([first, second])
    model = keras.Model([first, second], keras.layers.Dense(1)(joined))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    with pytest.warns(UserWarning, match="it has 2 inputs, and no layer gives an output shaped"):
        model.fit(
            [rng.normal(size=(N, 4)), rng.normal(size=(N, 3))],
            rng.normal(size=(N, 1)),
            batch_size=BATCH,
            verbose=0,
            callbacks=[GradientMonitor(through_time=True)],
        )
