"""The diagnosis rules on small synthetic tables, one case per rule and edge."""

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradflow.diagnosis import Thresholds, diagnose, diagnose_new, first_nonfinite

NAN = float("nan")
INF = float("inf")


def rows(*records):
    """Tidy rows from (step, layer, layer_index, tensor, l2_norm, **extra) tuples."""
    out = []
    for record in records:
        step, layer, index, tensor, norm, *extra = record
        row = {
            "step": step,
            "layer": layer,
            "layer_index": index,
            "tensor": tensor,
            "variable": "" if tensor == "activation" else f"m/{layer}/{tensor}",
            "max_abs": norm,
            "l2_norm": norm,
            "mean_abs": norm,
            "std": 0.0,
            "zero_fraction": 0.0,
            "nonfinite": 0 if np.isfinite(norm) else 1,
        }
        row.update(extra[0] if extra else {})
        out.append(row)
    return pd.DataFrame(out)


def healthy_run(steps=(1, 2, 3, 4, 5), layers=3, norm=0.1):
    return rows(
        *[
            (s, f"dense_{i}", i, tensor, norm)
            for s in steps
            for i in range(layers)
            for tensor in ("kernel", "bias")
        ]
    )


RULE_CASES = [
    # (name, table, thresholds, expected events as (step, layer, kind))
    ("healthy", healthy_run(), None, []),
    (
        "vanishing_floor",
        pd.concat([healthy_run(), rows((6, "dense_1", 1, "kernel", 2.1e-9))]),
        Thresholds(vanishing_ratio=1e-9),
        [(6, "dense_1", "vanishing")],
    ),
    (
        "vanishing_floor_reported_once_per_streak",
        rows(
            (1, "d", 0, "kernel", 1e-9),
            (2, "d", 0, "kernel", 1e-9),
            (3, "d", 0, "kernel", 1.0),
            (4, "d", 0, "kernel", 1e-9),
        ),
        Thresholds(repeat_after=1),
        [(1, "d", "vanishing"), (4, "d", "vanishing")],
    ),
    (
        # A norm hovering around the floor: one alert, not one per crossing.
        "vanishing_again_only_after_repeat_after_clear_steps",
        rows(
            *[(s, "d", 0, "kernel", 1e-9 if s in (1, 3, 6) else 1.0) for s in range(1, 7)],
        ),
        Thresholds(repeat_after=2),
        [(1, "d", "vanishing"), (6, "d", "vanishing")],
    ),
    (
        "hovering_by_default_is_one_alert",
        rows(*[(s, "d", 0, "kernel", 1e-9 if s % 3 else 1.0) for s in range(1, 40)]),
        None,
        [(1, "d", "vanishing")],
    ),
    (
        "vanishing_ratio_first_to_last",
        rows(
            (1, "first", 0, "kernel", 1e-5),
            (1, "mid", 1, "kernel", 1e-3),
            (1, "last", 2, "kernel", 0.5),
        ),
        None,
        [(1, "first", "vanishing")],
    ),
    (
        "vanishing_ratio_starts_at_a_later_step",
        rows(
            *[(s, "first", 0, "kernel", 1e-2 if s < 3 else 1e-6) for s in (1, 2, 3, 4)],
            *[(s, "last", 5, "kernel", 0.5) for s in (1, 2, 3, 4)],
        ),
        None,
        [(3, "first", "vanishing")],
    ),
    (
        "saturation_per_step_and_layer_pair",
        # Step 1: the gradient shrinks 1000x through b; step 2: through c.
        rows(
            *[
                (s, "a", 0, "activation", 1.0, {"mean_abs": 1e-6 if s == 1 else 1e-3})
                for s in (1, 2)
            ],
            *[
                (s, "b", 1, "activation", 1.0, {"mean_abs": 1e-3 if s == 1 else 1e-6})
                for s in (1, 2)
            ],
            *[(s, "c", 2, "activation", 1.0, {"mean_abs": 1e-3}) for s in (1, 2)],
            *[(s, "head", 3, "activation", 1.0, {"mean_abs": 1e-3}) for s in (1, 2)],
        ),
        None,
        [(1, "b", "saturation"), (2, "c", "saturation")],
    ),
    (
        # Under cross-entropy a confident softmax's output gradient stays near
        # 1/p while its logits' goes to 0: learning, not saturation.
        "no_saturation_of_the_last_layer",
        rows(
            (1, "hidden", 0, "activation", 1.0, {"mean_abs": 1e-6}),
            (1, "softmax", 1, "activation", 1.0, {"mean_abs": 1e-1}),
            (1, "softmax", 1, "kernel", 1e-2),
        ),
        None,
        [],
    ),
    (
        "layer_norm_combines_kernel_and_bias",
        # Each is below the 1e-7 floor, but sqrt(6e-8^2 + 8e-8^2) is just above it.
        rows((1, "d", 0, "kernel", 6e-8), (1, "d", 0, "bias", 8.000001e-8)),
        None,
        [],
    ),
    (
        "exploding_ceiling",
        pd.concat([healthy_run(), rows((6, "dense_2", 2, "kernel", 5e3))]),
        None,
        [(6, "dense_2", "exploding")],
    ),
    (
        "exploding_growth_within_window",
        rows(*[(s, "d", 0, "kernel", 0.01 * 2.0**s) for s in range(1, 13)]),
        Thresholds(growth_window=8, exploding_growth=200.0),
        # 2**8 = 256 > 200 from step 9 on (compared with step 1), and again
        # at step 10: a trend.
        [(10, "d", "exploding")],
    ),
    (
        "growth_of_one_batch_is_not_a_trend",
        rows(*[(s, "d", 0, "kernel", 2.0 if s == 8 else 0.01) for s in range(1, 13)]),
        Thresholds(growth_window=5),
        [],
    ),
    (
        "growth_not_reached",
        rows(*[(s, "d", 0, "kernel", 0.01 * 1.5**s) for s in range(1, 13)]),
        Thresholds(growth_window=5),
        [],
    ),
    (
        "dead_relu_from_bias_zeros",
        rows(
            (3, "dense_1", 1, "kernel", 0.1, {"zero_fraction": 0.7}),
            (3, "dense_1", 1, "bias", 0.1, {"zero_fraction": 0.75}),
            (3, "dense_2", 2, "bias", 0.1, {"zero_fraction": 0.2}),
        ),
        None,
        [(3, "dense_1", "dead_relu")],
    ),
    (
        "dead_relu_from_activation_zeros",
        rows(
            (2, "relu", 1, "activation", 0.1, {"zero_fraction": 0.95}),
            (2, "relu", 1, "kernel", 0.1),
        ),
        None,
        [(2, "relu", "dead_relu")],
    ),
    (
        "saturation_shrink_through_one_layer",
        rows(
            (1, "dense", 0, "activation", 1.0, {"mean_abs": 2e-6}),
            (1, "sigmoid_dense", 1, "activation", 1.0, {"mean_abs": 1e-3}),
            (1, "sigmoid_dense", 1, "kernel", 1e-2),
            (1, "head", 2, "activation", 1.0, {"mean_abs": 2e-3}),
        ),
        Thresholds(vanishing_ratio=1e-9),
        [(1, "sigmoid_dense", "saturation")],
    ),
    (
        "no_saturation_when_shrink_is_mild",
        rows(
            (1, "dense", 0, "activation", 1.0, {"mean_abs": 2e-4}),
            (1, "tanh_dense", 1, "activation", 1.0, {"mean_abs": 1e-3}),
        ),
        None,
        [],
    ),
    (
        "nonfinite_origin_is_layer_nearest_loss",
        rows(
            (1, "d0", 0, "kernel", 0.1),
            (2, "d0", 0, "kernel", NAN),
            (2, "d1", 1, "kernel", NAN),
            (2, "d2", 2, "kernel", 0.1),
            (3, "d2", 2, "kernel", NAN),
        ),
        None,
        [(2, "d1", "nonfinite")],
    ),
]


@pytest.mark.parametrize(
    "table, thresholds, expected",
    [case[1:] for case in RULE_CASES],
    ids=[case[0] for case in RULE_CASES],
)
def test_rules(table, thresholds, expected):
    events = diagnose(table.reset_index(drop=True), thresholds)
    assert list(events.columns) == ["step", "layer", "kind", "message"]
    found = sorted(zip(events["step"], events["layer"], events["kind"], strict=True))
    assert found == sorted(expected)
    for message in events["message"]:
        assert message.startswith("Layer ")


def test_vanishing_message_reads_plainly():
    table = rows((40, "dense_3", 3, "kernel", 2.1e-9))
    (message,) = diagnose(table)["message"]
    assert message.startswith(
        "Layer dense_3: gradient norm 2.1e-09 at step 40 is below 1e-07 — gradients are vanishing"
    )


def test_a_gradient_of_exactly_zero_is_told_as_none_reaching_the_layer():
    """A two-output model with `loss_weights=[1, 0]`: the second output's layer got
    exactly-zero gradients, and "barely learns" sent its user after a vanishing
    gradient (the fine-tuning audit)."""
    table = rows((40, "reg_out", 3, "kernel", 0.0))
    (message,) = diagnose(table)["message"]
    assert message.startswith(
        "Layer reg_out: gradient norm exactly 0 at step 40: no gradient reaches this layer's "
        "weights, so it does not learn."
    )
    assert "a loss weight of 0" in message


def test_an_exploding_gradient_the_optimizer_clipped_says_so():
    """A clipped run was told "try ... gradient clipping", word for word as the unclipped one:
    students read it as "clipping did nothing" (the teacher's audit, forty-first session)."""
    clipped = {"l2_norm_clipped": 3.0}
    table = pd.concat(
        [
            healthy_run(),
            rows(
                (6, "dense_2", 2, "kernel", 4e3, clipped), (6, "dense_2", 2, "bias", 3e3, clipped)
            ),
            # Clipping on, this layer's gradient under its threshold: unchanged.
            rows((6, "dense_1", 1, "kernel", 2e3, {"l2_norm_clipped": 2e3})),
        ]
    )
    found = diagnose(table).set_index("layer")["message"]
    assert found["dense_2"].endswith(
        "gradients are exploding; the optimizer's clipping cut it to 4.2e+00 before the update, "
        "so the weights moved less than this gradient says; a smaller learning rate tames the "
        "gradient itself."
    )
    assert "5.0e+03" in found["dense_2"]  # the norm before clipping, both tensors
    assert found["dense_1"].endswith("try a smaller learning rate or gradient clipping.")
    # No clipped norms recorded (a probe, an older store): as before.
    table = table.drop(columns="l2_norm_clipped")
    assert diagnose(table)["message"].str.endswith("or gradient clipping.").all()


def test_a_vanishing_ratio_alert_names_every_layer_below_it():
    """A blind student asked "in which layers do the gradients vanish?" heard only
    the first: dense_1 to dense_6 were all below the ratio, one alert named dense_1."""
    norms = [1e-6, 1e-5, 5e-5, 1e-4, 2e-4, 4e-4, 0.05, 0.5]  # dense_1 .. dense_7, output
    names = [f"dense_{i}" for i in range(1, 8)] + ["output"]
    table = rows(
        *((1, name, i, "kernel", n) for i, (name, n) in enumerate(zip(names, norms, strict=True)))
    )
    found = diagnose(table, Thresholds(vanishing_norm=1e-9))
    (message,) = found.loc[found["kind"] == "vanishing", "message"]
    assert message.startswith("Layer dense_1: gradient norm 1.0e-06 at step 1 is only 2.0e-06")
    assert "times that of the last layer ('output', 5.0e-01)" in message
    assert message.endswith(
        "Also below 1e-03 of it at this step: dense_2, dense_3, dense_4, dense_5, dense_6."
    )


ORIGIN_CASES = [
    # (name, table, expected (step, layer, tensor) or None)
    ("all_finite", healthy_run(), None),
    (
        "highest_layer_index_wins_at_first_step",
        rows((5, "d0", 0, "kernel", NAN), (5, "d3", 3, "bias", INF), (5, "d1", 1, "kernel", NAN)),
        (5, "d3", "bias"),
    ),
    (
        "earliest_step_wins_over_higher_layer",
        rows((7, "d9", 9, "kernel", NAN), (6, "d0", 0, "kernel", NAN)),
        (6, "d0", "kernel"),
    ),
    (
        "activation_before_weights_in_same_layer",
        rows((1, "d", 2, "kernel", NAN), (1, "d", 2, "activation", NAN)),
        (1, "d", "activation"),
    ),
    (
        "inf_max_abs_without_count",
        rows((4, "d", 1, "kernel", 1.0, {"max_abs": INF, "nonfinite": NAN})),
        (4, "d", "kernel"),
    ),
]


@pytest.mark.parametrize(
    "table, expected", [c[1:] for c in ORIGIN_CASES], ids=[c[0] for c in ORIGIN_CASES]
)
def test_first_nonfinite(table, expected):
    origin = first_nonfinite(table)
    if expected is None:
        assert origin is None
    else:
        assert (origin.step, origin.layer, origin.tensor) == expected


def test_accepts_any_object_with_layer_stats():
    class Shot:
        layer_stats = rows((0, "d", 0, "kernel", 1e-12))

    assert list(diagnose(Shot())["kind"]) == ["vanishing"]


def test_empty_table_gives_no_events():
    events = diagnose(healthy_run().iloc[:0])
    assert events.empty and list(events.columns) == ["step", "layer", "kind", "message"]


def through_time(shares, length=30, first=None, zeros=0.0, source="input"):
    """Rows through time, one recorded step per share: the first tenth of the
    time steps at `share` (with `zeros` exact zeros), the rest at 1 (`first`:
    the recorded steps, when not every step is; `source`: "input", or the
    layer whose output is the sequence)."""
    records = []
    steps = first or range(1, len(shares) + 1)
    for step, share in zip(steps, shares, strict=True):
        for t in range(length):
            early = t < max(1, length // 10)
            extra = {"zero_fraction": zeros if early else 0.0}
            extra["variable"] = source
            records.append((step, f"t={t + 1:02d}", t, "time_step", share if early else 1.0, extra))
    return rows(*records)


def test_a_gradient_that_fades_through_time_is_reported_and_so_is_its_coming_back():
    """The SimpleRNN preset's lesson, vanishing through time, had no alert."""
    # 60 steps at 1e-3, then 140 at 0.5. The median of 25 steps is told once
    # 13 of them could be compared (step 13); it passes 1e-1 when 13 are at
    # 0.5 (step 73), and 50 recorded steps later (step 122) the gradient is back.
    events = diagnose(through_time([1e-3] * 60 + [0.5] * 140))
    assert list(zip(events["step"], events["layer"], events["kind"], strict=True)) == [
        (13, "t=01", "vanishing"),
        (122, "t=01", "info"),
    ]
    alert, back = events["message"]
    assert alert.startswith(
        "Through time (training step 13): the first time steps (t=01 to t=03) get 1.0e-03 "
        "times the gradient the last ones (t=28 to t=30) get, below 1e-02 (median of the last "
        "13 recorded steps): the gradient vanishes through time, so the network can hardly "
        "learn from the start of the sequence."
    )
    # What to do, and when it is no fault.
    assert "a gated cell (LSTM or GRU) if it is not one already, shorter sequences" in alert
    assert "forecasting the next value), it is expected" in alert
    assert "padding" not in alert  # a float input: no tokens, no zeros
    assert back.startswith(
        "Through time (training step 122): since training step 73, the gradient reaches the "
        "first time steps (t=01 to t=03) again: they get 5.0e-01 times"
    )
    assert "at least 1e-01 for 50 recorded steps (median of the last 25 recorded steps)" in back
    assert back.endswith("Whether the network uses what it sees there shows in the loss.")
    # Tokens (an Embedding's output) are often padded at the front.
    tokens = diagnose(through_time([1e-3] * 20, source="embedding"))["message"][0]
    assert tokens.endswith(
        "Padding reads so too (pad_sequences pads at the front by default): mask it "
        "(mask_zero=True)."
    )

    # One noisy step in five does not start or end an alert: the median holds.
    noisy = [0.5 if step % 5 == 0 else 1e-3 for step in range(1, 201)]
    assert diagnose(through_time(noisy))["kind"].tolist() == ["vanishing"]
    calm = [1e-4 if step % 5 == 0 else 0.5 for step in range(1, 201)]
    assert diagnose(through_time(calm)).empty
    # A share hovering between 1e-2 and 1e-1 is not "back": the SimpleRNN
    # preset was told so by turns while its loss stayed at the baseline; nor
    # is "still vanishing" told again before it came back...
    hovering = [1e-3] * 40 + [3e-2] * 100 + [1e-3] * 60
    assert diagnose(through_time(hovering))["kind"].tolist() == ["vanishing"]
    # ... unless it was not low for `_BACK_WITHIN * repeat_after` (500) steps:
    # then it is said again, as such.
    hovering = [1e-3] * 40 + [3e-2] * 550 + [1e-3] * 60
    found = diagnose(through_time(hovering))
    assert found["step"].tolist() == [13, 603]
    assert found["message"][1].startswith("Through time (training step 603), again: the first")
    assert ", again" not in found["message"][0]
    # Back 220 steps after the last low one (the SimpleRNN preset, seed 1).
    late = [1e-3] * 40 + [3e-2] * 220 + [0.5] * 60 + [1e-3] * 40
    found = diagnose(through_time(late))
    assert found["kind"].tolist() == ["vanishing", "info", "vanishing"]
    assert ", again" not in found["message"][2]  # it came back between
    # Back once only, for the first streak after a low one; low again after it.
    twice = [1e-3] * 40 + [0.5] * 80 + [3e-2] * 30 + [0.5] * 80 + [1e-3] * 40
    found = diagnose(through_time(twice))
    assert found["kind"].tolist() == ["vanishing", "info", "vanishing"]
    # Its own thresholds; a short sequence compares its first and last step.
    rules = Thresholds(vanishing_through_time=1e-3, time_window=1, repeat_after=2)
    found = diagnose(through_time(calm[:20], length=4), rules)
    assert found["step"].tolist() == [5, 7, 10, 12, 15, 17, 20]
    assert "(t=01)" in found["message"][0] and "(t=04)" in found["message"][0]
    assert "(median of the last 1 recorded steps)" in found["message"][0]
    # A value at the limit is written so as not to read as the limit itself.
    at_limit = diagnose(through_time([0.0099999] * 20))["message"][0]
    assert "get 9.9999e-03 times" in at_limit


def test_padding_a_mask_a_single_time_step_or_no_gradient_is_no_fading():
    # Exact zeros at the front are padding or a mask, not a gradient that faded.
    assert diagnose(through_time([0.0] * 100)).empty
    assert diagnose(through_time([1e-3] * 100, length=1)).empty
    silent = through_time([1e-3] * 100).assign(l2_norm=0.0)
    assert diagnose(silent).empty
    # Mostly exact zeros: masked padding that only the longest sequences
    # reach; a perfect text classifier was told its gradient vanished.
    assert diagnose(through_time([1e-3] * 100, zeros=0.6)).empty
    assert diagnose(through_time([1e-3] * 100, zeros=0.4))["kind"].tolist() == ["vanishing"]
    # Told only once half the window could be compared: not from one batch.
    sparse = [1e-3 if step % 3 == 0 else 0.0 for step in range(1, 301)]
    assert diagnose(through_time(sparse)).empty
    # With every tenth step recorded, the windows count recorded steps: the
    # alert at the 13th (step 130); the median passes 1e-1 at the 13th step
    # at 1.0 (step 430), and 50 recorded steps on (step 920) it is back.
    steps = list(range(10, 1001, 10))
    events = diagnose(through_time([1e-3] * 30 + [1.0] * 70, first=steps))
    assert events["step"].tolist() == [130, 920]
    assert "since training step 430" in events["message"][1]


def test_the_new_steps_through_time_read_as_the_whole_run_does():
    """The live Alerts view reads a run's newest steps; a median through time looks
    `time_window` recorded steps further back than the other rules."""
    runs = {
        "back and low again": [1e-3] * 60 + [0.5] * 60 + [1e-3] * 80,
        # Back 90 steps after the last low one; low again 100 steps after.
        "back after a while": [1e-3] * 60 + [3e-2] * 40 + [0.5] * 100,
        "low again, not back": [1e-3] * 40 + [3e-2] * 100 + [1e-3] * 60,
        # Back 220 steps after the last low one, 170 past a shorter look-back.
        "back late": [1e-3] * 40 + [3e-2] * 220 + [0.5] * 60 + [1e-3] * 40,
    }
    kinds = {
        "back and low again": ["vanishing", "info", "vanishing"],
        "back after a while": ["vanishing", "info"],
        "low again, not back": ["vanishing"],
        "back late": ["vanishing", "info", "vanishing"],
    }
    for name, shares in runs.items():
        table = through_time(shares, length=10)
        whole = diagnose(table)
        assert whole["kind"].tolist() == kinds[name], name
        for after in range(0, len(shares), 3):
            new = diagnose_new(table, after)
            assert new.equals(whole[whole["step"] > after].reset_index(drop=True)), (name, after)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"vanishing_norm": 0}, ValueError, "`vanishing_norm`"),
        ({"exploding_norm": -1.0}, ValueError, "`exploding_norm`"),
        ({"dead_relu_fraction": 1.5}, ValueError, "`dead_relu_fraction`"),
        ({"growth_window": 2.5}, ValueError, "`growth_window`"),
        ({"time_window": 0}, ValueError, "`time_window`"),
        ({"vanishing_through_time": float("nan")}, ValueError, "`vanishing_through_time`"),
        ({"saturation_ratio": "small"}, TypeError, "`saturation_ratio`"),
    ],
)
def test_thresholds_validate(kwargs, error, words):
    with pytest.raises(error, match=words):
        Thresholds(**kwargs)


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="`layer_stats`"):
        diagnose([1, 2, 3])
    with pytest.raises(ValueError, match="layer_index"):
        diagnose(
            pd.DataFrame({"step": [1], "layer": ["d"], "tensor": ["kernel"], "l2_norm": [1.0]})
        )
    with pytest.raises(TypeError, match="`thresholds`"):
        diagnose(healthy_run(), thresholds={"vanishing_norm": 1e-3})
    for bad in ("10", None, True, NAN):
        with pytest.raises(TypeError, match="`after_step` must be a step number"):
            diagnose_new(healthy_run(), bad)
    with pytest.raises(TypeError, match="`layer_stats`"):
        diagnose_new([1, 2, 3], 0)
    import gradflow

    assert gradflow.diagnose_new is diagnose_new  # as the README calls it


def test_thresholds_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Thresholds().vanishing_norm = 1.0
    assert math.isclose(Thresholds().vanishing_norm, 1e-7)


def test_diagnosis_imports_no_tensorflow():
    code = "import gradflow.diagnosis, sys; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_infinite_output_gradient_is_no_saturation():
    # It once raised ZeroDivisionError: mean |gradient| 1 at the layer's
    # input over inf at its output made a ratio of 0, and the message
    # divided by it. Found by the property test below.
    table = rows(
        (1, "a", 0, "kernel", 1.0),
        (1, "a", 0, "activation", 1.0),
        (1, "b", 1, "kernel", 1.0),
        (1, "b", 1, "activation", INF),
    )
    events = diagnose(table)
    assert events["kind"].tolist() == ["nonfinite"]
    assert events["layer"].tolist() == ["b"]


def test_a_step_the_rules_cannot_judge_counts_as_clear():
    # Step 4's norm is NaN: whether it vanished there is unknown, so it
    # counts as a clear step. With alerts repeated after one clear step the
    # vanishing from step 5 on is a streak of its own. (Carrying the streak
    # across it made a step's events depend on steps arbitrarily far back,
    # and a look at a run's newest steps report what a whole look did not.)
    norms = [1e-9, 1e-9, 1e-9, NAN, 1e-9, 1e-9]
    table = rows(*[(step, "a", 0, "kernel", norm) for step, norm in enumerate(norms, 1)])
    events = diagnose(table, Thresholds(repeat_after=1))
    assert events.query("kind == 'vanishing'")["step"].tolist() == [1, 5]
    # By default one clear step is too few to say it again.
    assert diagnose(table).query("kind == 'vanishing'")["step"].tolist() == [1]
    assert events.query("kind == 'nonfinite'")["step"].tolist() == [4]
    once = Thresholds(repeat_after=1)
    assert diagnose_new(table, 4, once).equals(events.query("step > 4").reset_index(drop=True))
    assert diagnose_new(table, 4).empty


# Values near every rule's threshold: vanishing, exploding growth, dead and
# saturated units, and the odd NaN/Inf.
_NORMS = [0.0, 1e-9, 1e-3, 0.5, 1.0, 2.0, 50.0, 2e3, NAN, INF]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(st.integers(1, 4), min_size=1, max_size=25).map(
        lambda gaps: list(np.cumsum(gaps))
    ),
    cut=st.floats(0.0, 1.0),
    norms=st.lists(st.sampled_from(_NORMS), min_size=40, max_size=120),
    zero_fractions=st.lists(st.sampled_from([0.0, 0.5, 0.99, 1.0]), min_size=7),
    window=st.integers(1, 6),
    quiet=st.integers(1, 6),
    time_window=st.integers(1, 6),
)
def test_diagnosing_the_new_steps_finds_what_the_whole_table_shows_there(
    steps, cut, norms, zero_fractions, window, quiet, time_window
):
    """`diagnose_new`, which reads the new steps and a few before them, against `diagnose`."""
    records = []
    for i, step in enumerate(steps):
        for j, layer in enumerate(["a", "b", "c"]):
            for k, tensor in enumerate(["kernel", "bias", "activation"]):
                n = 9 * i + 3 * j + k
                extra = {"zero_fraction": zero_fractions[n % len(zero_fractions)]}
                records.append((step, layer, j, tensor, norms[n % len(norms)], extra))
        for t in range(3):  # rows through time
            records.append((step, f"t={t + 1}", t, "time_step", norms[(7 * i + t) % len(norms)]))
    table = rows(*records)
    rules = Thresholds(
        exploding_growth=3.0,
        growth_window=window,
        vanishing_ratio=0.1,
        repeat_after=quiet,
        vanishing_through_time=0.1,
        time_window=time_window,
    )
    # Every split, from nothing diagnosed yet to everything.
    after = [0, *steps][int(cut * len(steps))]
    new = diagnose_new(table, after, rules)
    whole = diagnose(table, rules)
    whole = whole[whole["step"] > after]

    def found(events):
        return sorted(events.itertuples(index=False, name=None))

    assert found(new) == found(whole)
    assert list(new.columns) == list(whole.columns)


def test_diagnosing_the_new_steps_reports_the_first_nonfinite_step_only_once():
    # Step 2 broke the gradients and they stay broken: the NaN origin is step
    # 2, whichever later steps a look reads.
    table = rows(*[(s, "a", 0, "kernel", 1.0 if s < 2 else NAN) for s in range(1, 30)])
    assert diagnose_new(table, 0)["kind"].tolist() == ["nonfinite"]
    assert diagnose_new(table, 0)["step"].tolist() == [2]
    assert diagnose_new(table, 1)["step"].tolist() == [2]
    for after in (2, 10, 28, 29):
        assert diagnose_new(table, after).empty


# Every kind of value a float64 table can hold, subnormal and negative too.
_ANY = [0.0, 5e-324, 1e-30, 1e-9, 1e-3, 0.5, 1.0, 2.0, 1e3, 1e30, 3e38, INF, NAN, -1.0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.integers(1, 5),
    values=st.lists(st.sampled_from(_ANY), min_size=5, max_size=120),
    zero_fractions=st.lists(st.sampled_from([0.0, 0.5, 1.0, NAN]), min_size=1, max_size=9),
    counts=st.lists(st.sampled_from([0, 1, NAN]), min_size=1, max_size=5),
    window=st.integers(1, 4),
)
def test_the_rules_never_raise_whatever_the_values(steps, values, zero_fractions, counts, window):
    """A table the rules choke on would take the dashboard's Alerts view down with it."""
    records = []
    for step in range(1, steps + 1):
        for j, layer in enumerate(["a", "b", "c", "t=1", "t=2"]):
            for tensor in ["kernel", "bias", "activation"] if j < 3 else ["time_step"]:
                n = len(records)
                extra = {
                    "max_abs": values[n % len(values)],
                    "mean_abs": values[(n + 2) % len(values)],
                    "zero_fraction": zero_fractions[n % len(zero_fractions)],
                    "nonfinite": counts[n % len(counts)],
                }
                records.append((step, layer, j, tensor, values[(n + 1) % len(values)], extra))
    events = diagnose(
        rows(*records),
        Thresholds(growth_window=window, exploding_growth=3.0, time_window=window),
    )
    assert list(events.columns) == ["step", "layer", "kind", "message"]
    assert (
        events["kind"]
        .isin(["nonfinite", "vanishing", "exploding", "dead_relu", "saturation", "info"])
        .all()
    )


def test_saturation_compares_a_layer_with_the_layer_it_reads_not_the_one_called_before():
    """A Transformer's linear value projection was "probably saturated": its input
    gradient was taken from the key projection, called just before it, while both read
    the embedding. The monitor keeps which layer reads which (`layer_inputs`)."""
    table = rows(
        (1, "embed", 0, "activation", 1.0, {"mean_abs": 1e-3}),
        (1, "mha/key", 1, "activation", 1.0, {"mean_abs": 4e-6}),
        (1, "mha/value", 2, "activation", 1.0, {"mean_abs": 2e-2}),
        (1, "sigmoid_dense", 3, "activation", 1.0, {"mean_abs": 1e-3}),
        (1, "head", 4, "activation", 1.0, {"mean_abs": 1e-3}),
    )
    chain = diagnose(table)
    assert set(chain.loc[chain["kind"] == "saturation", "layer"]) == {"mha/value"}
    reads = {
        "embed": None,
        "mha/key": "embed",
        "mha/value": "embed",
        "sigmoid_dense": "mha/value",
        "head": "sigmoid_dense",
    }
    assert not (diagnose(table, layer_inputs=reads)["kind"] == "saturation").any()
    assert diagnose_new(table, 0, layer_inputs=reads).empty
    with pytest.raises(TypeError, match="`layer_inputs` must be a dict"):
        diagnose(table, layer_inputs=list(reads))
    # A real shrink in a chain is still found with the map.
    reads_chain = dict(reads, **{"mha/value": "mha/key"})
    found = diagnose(table, layer_inputs=reads_chain)
    assert set(found.loc[found["kind"] == "saturation", "layer"]) == {"mha/value"}


@pytest.mark.parametrize(
    "update_ratio, exploding", [(0.04, False), (17.0, True), (float("nan"), True), (None, True)]
)
def test_a_large_norm_whose_update_is_small_is_not_exploding(update_ratio, exploding):
    """A healthy ResNet50 under Adam: conv1's norm 4,000 at step 1 (what BatchNorm after
    small weights gives), updates of 2-4% of the weights, and the loss falling. "Gradients
    are exploding; try a smaller learning rate" was wrong. Under SGD the same norm moved
    the weights 17-fold: that is exploding."""
    extra = {} if update_ratio is None else {"update_ratio": update_ratio}
    table = rows(
        (1, "conv1", 0, "kernel", 4017.0, extra),
        (1, "predictions", 1, "kernel", 2.0, extra and {"update_ratio": 0.01}),
    )
    found = diagnose(table)
    assert (found["kind"] == "exploding").any() == exploding
    if update_ratio == 17.0:  # a looser limit of one's own lets the same step pass
        looser = diagnose(table, Thresholds(exploding_update=20.0))
        assert not (looser["kind"] == "exploding").any()
