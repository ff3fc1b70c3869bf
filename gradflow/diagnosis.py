"""Rules that turn per-layer gradient statistics into plain-language events.

`diagnose` reads gradflow's tidy layer statistics (a training history, a run's
`layer_stats`, or a snapshot's tables) and reports what a teacher would point
at on the heatmap: vanishing and exploding gradients, dead ReLUs, saturated
sigmoid/tanh units, where the first NaN/Inf came from, and, for a run
recorded through time, a gradient that vanishes through time. It uses pandas only,
so the dashboard and the run store can call it without TensorFlow.

A layer's *gradient norm* at a step is the L2 norm of all its weight
gradients together: sqrt(sum of `l2_norm`^2 over its `kernel`, `bias`, ...
rows). Rows with `tensor == "activation"` are gradients w.r.t. the layer's
output (dLoss/d output) and are used only by the rules that say so.

A condition that holds for many steps in a row is reported once, at the first
step of each such streak, and a layer's alert of one kind comes again only
once the condition has been clear for `Thresholds.repeat_after` recorded steps:
a value hovering around a threshold would otherwise start a new alert at every
crossing, and a long run would drown the reader in them. A recorded step where
a rule cannot judge a layer (its norm is NaN, the last layer has no gradient
to compare with) counts as clear: so each step's events depend on a few
recorded steps before it only, and `diagnose_new` can follow a growing run by
reading its newest steps.

Example:

```python
from gradflow.diagnosis import diagnose, Thresholds
events = diagnose(run.layer_stats, Thresholds(vanishing_norm=1e-6))
events[["step", "layer", "kind", "message"]]
```
"""

import dataclasses
import math
import numbers

import numpy as np
import pandas as pd

from gradflow import schema

_REQUIRED = ("step", "layer", "layer_index", "tensor")


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The limits the rules compare against; every field has a default.

    Attributes:
        vanishing_norm: A layer's gradient norm below this is vanishing.
            Defaults to 1e-7.
        vanishing_ratio: Vanishing also when (norm of the first layer with
            weights) / (norm of the last layer with weights) at one step is
            below this. Defaults to 1e-3.
        exploding_norm: A layer's gradient norm above this is exploding.
            Defaults to 1e3.
        exploding_update: Where the update ratio ||Δw|| / ||w|| was
            recorded, a norm above `exploding_norm` is exploding only if the
            step's update moved the layer's weights by more than this share
            of their norm. Adam's step does not grow with the gradient, and
            a healthy ResNet50 under it had a norm of 4,000 at its first
            layer with updates of 2-4% (advice about the learning rate was
            wrong there). A norm 1,000 times `exploding_norm` or more is
            exploding whatever the update: its squares near float32's
            limit break Adam's moments too. Defaults to 0.1.
        exploding_growth: Exploding also when a layer's norm grew by more than
            this factor within `growth_window` steps, at two recorded steps
            in a row (one large batch among small ones is not a trend).
            Defaults to 100.
        growth_window: The number of steps `exploding_growth` looks back.
            Defaults to 10.
        dead_relu_fraction: A layer whose bias gradient has more than this
            share of exact zeros has dead units: a ReLU unit that outputs 0
            for every sample of the batch passes no gradient, so its bias
            gradient is exactly 0. Defaults to 0.5.
        dead_activation_fraction: The same for the activation gradient
            (dLoss/d output), for layers recorded with activations: more than
            this share of exact zeros. Defaults to 0.9.
        saturation_ratio: Saturation when the mean |gradient| shrinks by more
            than this factor as it passes back through ONE layer, i.e.
            mean_abs(dLoss/d input of layer k) / mean_abs(dLoss/d output of
            layer k) is below it, while layer k's own weight gradient is not
            vanishing. That is the signature of sigmoid/tanh units stuck near
            their limits, where their slope is almost 0. Needs activation
            rows. A layer is compared with the layer it reads when the run
            recorded it (`diagnose`'s `layer_inputs`), else with the layer
            before it in `layer_index` order, which is right for plain stacks
            only. Not for the last layer: under
            cross-entropy the gradient at a softmax's or sigmoid's output
            stays near 1/p while the one at its logits goes to 0 as the
            model gets its samples right, which is learning, not saturation.
            Defaults to 1e-2.
        repeat_after: A layer's alert of one kind is given again only after
            its condition was clear for this many recorded steps. Defaults
            to 50.
        vanishing_through_time: For a run recorded with `through_time=True`:
            the gradient vanishes through time when the gradient reaching the
            first tenth of the sequence's time steps is below this share of
            the gradient reaching the last tenth, as the median over
            `time_window` recorded steps (one step's share moves tenfold from
            step to step), told once half of them could be compared. It is
            back, an `info` event, when that median has been 10 times this
            for `repeat_after` recorded steps; the alert is told again only
            after that (or after `10 * repeat_after` steps not below). A tenth
            whose gradient is mostly exact zeros (padding under a mask) is
            not compared. On the adding problem over 30 steps (presets
            `rnn_simple` and `rnn_lstm`, seeds 0-3, 800 steps) both alert at
            steps 13-39; the LSTM's is back at steps 350-511, the
            SimpleRNN's for a while in two seeds of four. Defaults to 1e-2.
        time_window: The number of recorded steps whose median
            `vanishing_through_time` compares. Defaults to 25.
    """

    vanishing_norm: float = 1e-7
    vanishing_ratio: float = 1e-3
    exploding_norm: float = 1e3
    exploding_update: float = 0.1
    exploding_growth: float = 100.0
    growth_window: int = 10
    dead_relu_fraction: float = 0.5
    dead_activation_fraction: float = 0.9
    saturation_ratio: float = 1e-2
    repeat_after: int = 50
    vanishing_through_time: float = 1e-2
    time_window: int = 25

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # NumPy numbers count (a threshold computed from a table is one).
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"`{field.name}` must be a number, got {value!r}.")
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"`{field.name}` must be a positive finite number, got {value!r}.")
        for name in ("dead_relu_fraction", "dead_activation_fraction"):
            if getattr(self, name) >= 1:
                raise ValueError(
                    f"`{name}` is a share of entries and must be below 1, got {getattr(self, name)!r}."
                )
        for name in ("growth_window", "repeat_after", "time_window"):
            if int(getattr(self, name)) != getattr(self, name):
                raise ValueError(
                    f"`{name}` must be a whole number of steps, got {getattr(self, name)!r}."
                )


def run_layer_inputs(config):
    """The layers each recorded layer reads (`diagnose`'s `layer_inputs`), from a run's config, or None."""
    given = (config or {}).get("layer_inputs") if isinstance(config, dict) else None
    return given if isinstance(given, dict) else None


def run_thresholds(config):
    """The `Thresholds` of a run's alerts: those its monitor was given, or the defaults.

    A `GradientMonitor(rules=...)` keeps its thresholds in the run's config
    (`alert_rules`), so that the dashboard and the exports, which run the
    rules again on the stored statistics, say what the monitor said.

    Args:
        config: The run's config dict (`RunStore.run_info(run_id)["config"]`),
            or None.

    Returns:
        A `Thresholds`; the defaults where the config holds none, or holds
        values `Thresholds` refuses (a store written by other code).
    """
    given = (config or {}).get("alert_rules") if isinstance(config, dict) else None
    if not isinstance(given, dict):
        return Thresholds()
    names = {field.name for field in dataclasses.fields(Thresholds)}
    try:
        return Thresholds(**{k: v for k, v in given.items() if k in names})
    except (TypeError, ValueError):
        return Thresholds()


@dataclasses.dataclass(frozen=True)
class NonfiniteOrigin:
    """Where the first NaN/Inf gradient appeared.

    Attributes:
        step: The first step with a non-finite gradient entry anywhere.
        layer: At that step, the layer nearest the loss (highest
            `layer_index`) with a non-finite gradient: the first one backprop
            reaches, so the NaN starts there (or in the loss itself).
        layer_index: That layer's index.
        tensor: Its first non-finite tensor in backprop order (`activation`
            before the weights).
        count: The number of non-finite entries in that tensor (NaN when the
            table has no `nonfinite` count).
    """

    step: int
    layer: str
    layer_index: int
    tensor: str
    count: float


def _table(layer_stats):
    """Accept a DataFrame or anything with a `layer_stats` DataFrame (a Snapshot)."""
    if hasattr(layer_stats, "layer_stats") and not isinstance(layer_stats, pd.DataFrame):
        layer_stats = layer_stats.layer_stats
    if not isinstance(layer_stats, pd.DataFrame):
        raise TypeError(
            "`layer_stats` must be a pandas DataFrame of tidy layer statistics "
            f"(or a gradflow Snapshot), got {type(layer_stats).__name__}."
        )
    missing = [c for c in _REQUIRED if c not in layer_stats.columns]
    if "l2_norm" not in layer_stats.columns and "max_abs" not in layer_stats.columns:
        missing.append("l2_norm")
    if missing:
        raise ValueError(
            f"`layer_stats` lacks the columns {missing}; it has {list(layer_stats.columns)}. "
            f"Expected gradflow's tidy columns {list(schema.LAYER_STATS_COLUMNS)}."
        )
    return layer_stats


def _carried_inputs(layer_stats, layer_inputs):
    """`layer_inputs`, or else those the table carries in `attrs["layer_inputs"]`.

    A `GradientMonitor`'s `.history`, a `Run`'s `.layer_stats` and a
    `Snapshot`'s carry them: called on those alone, as the README shows, the saturation rule
    compared a Transformer's value projection with the key projection called
    before it and said it was saturated, which the monitor did not.
    """
    if layer_inputs is not None:
        return layer_inputs
    if isinstance(layer_stats, pd.DataFrame):
        carried = layer_stats.attrs.get("layer_inputs")
    else:  # a Snapshot holds them itself (its `layer_stats` carries them only if any)
        carried = getattr(layer_stats, "layer_inputs", None) or None
    return carried if isinstance(carried, dict) else None


def _nonfinite_mask(table):
    if "nonfinite" in table.columns:
        counts = pd.to_numeric(table["nonfinite"], errors="coerce")
        flagged = counts > 0
    else:
        flagged = pd.Series(False, index=table.index)
    if "max_abs" in table.columns:
        magnitude = pd.to_numeric(table["max_abs"], errors="coerce")
        # An infinite max_abs is an Inf entry even where no count was stored.
        flagged |= np.isinf(magnitude)
    return flagged


def _every_layer_broken(table, step):
    """Whether every layer recorded at `step` has a non-finite gradient (and there are several)."""
    at_step = table[table["step"] == step]
    layers = at_step.groupby("layer_index", observed=True).size().index
    broken = at_step[_nonfinite_mask(at_step)]["layer_index"].unique()
    return len(layers) > 1 and len(broken) == len(layers)


def first_nonfinite(layer_stats):
    """Find the first step and the first layer, in backprop order, with a NaN/Inf gradient.

    Example:

    >>> import pandas as pd
    >>> table = pd.DataFrame({"step": [1, 2, 2], "layer": ["a", "a", "b"],
    ...     "layer_index": [0, 0, 1], "tensor": ["kernel"] * 3,
    ...     "l2_norm": [1.0, float("nan"), float("nan")], "nonfinite": [0, 3, 5]})
    >>> first_nonfinite(table).layer
    'b'

    Args:
        layer_stats: Tidy layer statistics (DataFrame) or a Snapshot.

    Returns:
        A `NonfiniteOrigin`, or `None` when every gradient is finite.

    Raises:
        TypeError: if `layer_stats` is not a DataFrame.
        ValueError: if required columns are missing.
    """
    table = _table(layer_stats)
    broken = table[_nonfinite_mask(table)]
    if broken.empty:
        return None
    step = broken["step"].min()
    at_step = broken[broken["step"] == step].copy()
    # Backprop reaches the highest layer_index first and, within a layer, its
    # output gradient (the activation row) before its weight gradients.
    at_step["_weights_later"] = (at_step["tensor"] != schema.ACTIVATION).astype(int)
    origin = at_step.sort_values(
        ["layer_index", "_weights_later"], ascending=[False, True], kind="stable"
    ).iloc[0]
    count = float(origin["nonfinite"]) if "nonfinite" in at_step.columns else float("nan")
    return NonfiniteOrigin(
        step=int(step),
        layer=str(origin["layer"]),
        layer_index=int(origin["layer_index"]),
        tensor=str(origin["tensor"]),
        count=count,
    )


def _layer_norms(table):
    """Per step and layer: the L2 norm of all weight gradients together."""
    weights = table[table["tensor"] != schema.ACTIVATION]
    if weights.empty or "l2_norm" not in weights.columns:
        return pd.DataFrame(columns=["step", "layer", "layer_index", "norm"])
    # float64: a float32 norm above 1.8e19 would overflow its own square.
    squares = pd.to_numeric(weights["l2_norm"], errors="coerce").astype("float64") ** 2
    broken = squares.isna()
    if "nonfinite" in weights.columns:
        broken |= pd.to_numeric(weights["nonfinite"], errors="coerce") > 0
    else:
        broken |= ~np.isfinite(squares)
    # The largest update ratio of the layer's weights at the step (NaN: not recorded).
    update = (
        pd.to_numeric(weights["update_ratio"], errors="coerce").astype("float64")
        if "update_ratio" in weights.columns
        else pd.Series(np.nan, index=weights.index)
    )
    # After the optimizer's clipping (NaN: not clipped, or not recorded).
    clipped = (
        pd.to_numeric(weights["l2_norm_clipped"], errors="coerce").astype("float64") ** 2
        if "l2_norm_clipped" in weights.columns
        else pd.Series(np.nan, index=weights.index)
    )
    norms = (
        weights.assign(_square=squares, _broken=broken, _update=update, _clipped=clipped)
        .groupby(["step", "layer", "layer_index"], as_index=False, sort=True, observed=True)
        .agg(
            _square=("_square", "sum"),
            _broken=("_broken", "any"),
            update=("_update", "max"),
            _clipped=("_clipped", "sum"),
            _clipped_rows=("_clipped", "count"),
        )
    )
    norms["norm"] = np.sqrt(norms.pop("_square"))
    # A layer with no clipped norm recorded is NaN, not 0.
    norms["clipped"] = np.sqrt(norms.pop("_clipped")).where(norms.pop("_clipped_rows") > 0)
    # A norm of +inf over entries that are all finite is beyond float32
    # itself (above 3.4e38): exploding, not broken.
    # NaN/Inf entries are the non-finite rule's.
    keep = ~norms.pop("_broken") & (np.isfinite(norms["norm"]) | (norms["norm"] == np.inf))
    return norms[keep].reset_index(drop=True)


def _beside(value, limit):
    """`value` in the `1.0e-07` style, with digits enough not to read as `limit`.

    "gradient norm 1.0e-07 ... is below 1e-07" read as a contradiction.
    """
    for digits in range(1, 7):
        text = f"{value:.{digits}e}"
        if float(text) != limit:
            return text
    return text


def _norm_text(norm, limit):
    if norm == np.inf:  # every entry finite, the sum of their squares not
        return "beyond float32's range (above 3.4e+38)"
    return _beside(norm, limit)


def _onsets(flagged, keys=("layer",)):
    """Keep the first step of each streak of consecutive recorded steps per key."""
    if flagged.empty:
        return flagged
    flagged = flagged.sort_values(list(keys) + ["step"])
    return flagged[flagged["_streak_start"]]


def _mark_streaks(frame, condition, steps, quiet, keys=("layer",)):
    """Rows where `condition` holds, marking those that start a streak.

    A row starts a streak when the condition held for its key at none of
    the `quiet` recorded steps before it (`Thresholds.repeat_after`; 1:
    not at the previous one). `steps` are the table's recorded steps
    (sorted, unique). A step where a rule could not judge a layer (no
    finite norm, a last layer with no gradient to compare with) counts as
    clear: so what a step reports depends on the recorded steps `quiet`
    back only, and a look at a run's newest steps finds what a look at the
    whole run does there (`diagnose_new`).
    """
    frame = frame.assign(_flag=condition.to_numpy()).sort_values(list(keys) + ["step"])
    position = np.searchsorted(steps, frame["step"].to_numpy()).astype("float64")
    # The position of the key's latest flagged recorded step before each row.
    flagged_at = pd.Series(np.where(frame["_flag"].to_numpy(), position, np.nan), index=frame.index)
    key = [frame[k] for k in keys]
    latest_before = flagged_at.groupby(key, observed=True).shift(1)
    latest_before = latest_before.groupby(key, observed=True).ffill().to_numpy()
    recent = position - latest_before <= quiet  # False where none (NaN)
    frame["_streak_start"] = frame["_flag"].to_numpy() & ~recent
    return frame[frame["_flag"]]


def _vanishing_message(row, thresholds):
    if row.norm == 0:
        # Not small but none: "barely learns" sent a user with an output of
        # loss weight 0 looking for a vanishing gradient (the fine-tuning audit).
        return (
            f"Layer {row.layer}: gradient norm exactly 0 at step {row.step}: no gradient "
            "reaches this layer's weights, so it does not learn. The layers above it may pass "
            "nothing back (dead ReLUs, saturated units), or its output may not count in the "
            "loss (a loss weight of 0)."
        )
    return (
        f"Layer {row.layer}: gradient norm {_beside(row.norm, thresholds.vanishing_norm)} "
        f"at step {row.step} is below "
        f"{thresholds.vanishing_norm:.0e} — gradients are vanishing, so this layer "
        "barely learns."
    )


def _vanishing(norms, thresholds, steps):
    events = []
    low = _mark_streaks(
        norms, norms["norm"] < thresholds.vanishing_norm, steps, thresholds.repeat_after
    )
    for row in _onsets(low).itertuples():
        events.append((row.step, row.layer, "vanishing", _vanishing_message(row, thresholds)))
    # First-to-last ratio, one value per step.
    ordered = norms.sort_values(["step", "layer_index"], kind="stable").groupby(
        "step", observed=True
    )
    first, last = ordered.first(), ordered.last()
    ratios = pd.DataFrame(
        {
            "layer": first["layer"],
            "norm": first["norm"],
            "last_layer": last["layer"],
            "last_norm": last["norm"],
        }
    ).reset_index()
    ratios = ratios[(first["layer_index"] != last["layer_index"]).to_numpy()]
    ratios = ratios[ratios["last_norm"] > 0]
    if ratios.empty:
        return events
    ratios["ratio"] = ratios["norm"] / ratios["last_norm"]
    small = _mark_streaks(
        ratios, ratios["ratio"] < thresholds.vanishing_ratio, steps, thresholds.repeat_after
    )
    for row in _onsets(small).itertuples():
        events.append(
            (
                row.step,
                row.layer,
                "vanishing",
                (
                    f"Layer {row.layer}: gradient norm {row.norm:.1e} at step {row.step} is only "
                    f"{row.ratio:.1e} times that of the last layer ('{row.last_layer}', "
                    f"{row.last_norm:.1e}), below {thresholds.vanishing_ratio:.0e} — gradients "
                    "vanish on their way back to the input."
                    + _also_below(norms, row, thresholds.vanishing_ratio)
                ),
            )
        )
    return events


def _also_below(norms, row, ratio):
    """The other layers below `ratio` of the last layer's norm at `row.step`, as a sentence.

    The alert is told once, for the layer nearest the input; the question a
    class is asked ("in which layers do the gradients vanish?") needs the
    others too (a screen-reader user has no heatmap to see them in).
    """
    at = norms[norms["step"] == row.step].sort_values("layer_index", kind="stable")
    below = at.loc[at["norm"] < ratio * row.last_norm, "layer"].astype(str).tolist()
    others = [name for name in below if name != str(row.layer)]
    if not others:
        return ""
    named = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
    return f" Also below {ratio:.0e} of it at this step: {named}."


# The gradient through time has come back when its median share is this many
# times `vanishing_through_time` (1e-1 by default) for `repeat_after` recorded
# steps: between the two it is neither vanishing nor back. Without the gap,
# the SimpleRNN preset's share, hovering about 1e-2, was told "back" and
# "vanishing" by turns while its loss stayed at the baseline.
_BACK_THROUGH_TIME = 10.0
# ... and it is told once, for the first such streak within this many times
# `repeat_after` recorded steps of the last low one: the LSTM preset's came
# 50 to 120 steps after it (seeds 0-3), its first streak cut short twice, and
# the SimpleRNN preset's (seed 1) 219 steps after it. The bound keeps what a
# step says a matter of the steps shortly before it (`look_back`).
_BACK_WITHIN = 10
# A tenth of the time steps whose gradient is mostly exact zeros is padding
# under a mask (only the longest sequences reach it): no comparison there.
_MASKED_SHARE = 0.5


def _median_words(judged, span):
    if judged == span:
        return f"median of the last {span} recorded steps"
    return f"median of the {judged} of the last {span} recorded steps that could be compared"


def _vanishing_through_time(rows, thresholds):
    """Alerts for a gradient that fades towards the first time steps, and for its coming back.

    Reads the rows through time (`tensor == "time_step"`, `layer_index` =
    position in time): at each recorded step, the mean norm of the first
    tenth of the rows (at least one) over that of the last tenth. The rule
    takes the median of that share over `time_window` recorded steps, once
    at least half of them could be compared, and alerts below
    `vanishing_through_time`; the gradient is back once that median has
    been `_BACK_THROUGH_TIME` times higher for `repeat_after` recorded steps
    (told for the first such streak within `_BACK_WITHIN * repeat_after`
    recorded steps of the last low one). An alert is told again only after
    the gradient came back, or was not low for that many steps. A step cannot be
    compared where a tenth has no gradient, exact zeros only, or mostly
    exact zeros (masked padding): it counts as clear, as in the other
    rules, and what a step says depends on the `(_BACK_WITHIN + 1) *
    repeat_after + time_window` recorded steps before it only (`look_back`).
    """
    if rows.empty:
        return []
    value = "l2_norm" if "l2_norm" in rows.columns else "max_abs"
    keys = ["step", "layer_index"]
    grid = rows.groupby(keys, observed=True)[value].first().unstack()
    grid = grid.sort_index().sort_index(axis=1).astype("float64")
    if grid.shape[1] < 2:
        return []
    if "zero_fraction" in rows.columns:
        zeros = rows.groupby(keys, observed=True)["zero_fraction"].first().unstack()
        # Not recorded (NaN): no sign of a mask.
        zeros = zeros.reindex(index=grid.index, columns=grid.columns).astype("float64")
        zeros = zeros.fillna(0.0)
    else:
        zeros = pd.DataFrame(0.0, index=grid.index, columns=grid.columns)
    labels = rows.drop_duplicates("layer_index").set_index("layer_index")["layer"].astype(str)
    share = max(1, grid.shape[1] // 10)
    first_rows, last_rows = list(grid.columns[:share]), list(grid.columns[-share:])
    with np.errstate(all="ignore"):
        first = grid[first_rows].mean(axis=1).to_numpy()
        last = grid[last_rows].mean(axis=1).to_numpy()
        unmasked = (zeros[first_rows].mean(axis=1).to_numpy() <= _MASKED_SHARE) & (
            zeros[last_rows].mean(axis=1).to_numpy() <= _MASKED_SHARE
        )
        judged = (first > 0) & (last > 0) & np.isfinite(last) & unmasked
        ratio = np.where(judged, first / last, np.nan)
    ratio[~np.isfinite(ratio)] = np.nan
    window, quiet = int(thresholds.time_window), int(thresholds.repeat_after)
    shares = pd.Series(ratio)
    median = shares.rolling(window, min_periods=(window + 1) // 2).median().to_numpy()
    counted = shares.rolling(window, min_periods=1).count().to_numpy()
    spans = np.minimum(np.arange(1, len(ratio) + 1), window)
    limit = thresholds.vanishing_through_time
    low = median < limit  # False where NaN
    back = median >= _BACK_THROUGH_TIME * limit
    position = np.arange(len(low), dtype="float64")
    latest_low = pd.Series(np.where(low, position, np.nan)).ffill().to_numpy()
    before = np.concatenate([[np.nan], latest_low[:-1]])
    # The length of the run of `back` steps ending at each step.
    runs = pd.Series(back.astype(int))
    back_run = runs.groupby((runs != runs.shift()).cumsum()).cumsum().to_numpy()
    streaks = back_run == quiet  # a streak long enough, at its `quiet`th step
    count = np.cumsum(streaks)
    since_low = np.where(np.isnan(latest_low), 0, latest_low).astype(int)
    horizon = _BACK_WITHIN * quiet
    came_back = (
        streaks
        & (position - latest_low <= horizon)  # False where no low (NaN)
        & (count - count[since_low] == 1)  # the first streak since the low
    )
    # An alert starts where the median was not low for `quiet` steps before,
    # and then only if it had not been low for `horizon` steps or came back
    # since: "still vanishing" told again and again is noise.
    told = np.cumsum(came_back)
    last = np.where(np.isnan(before), 0, before).astype(int)
    onset = (
        low
        & ~(position - before <= quiet)  # False where none before (NaN)
        & (np.isnan(before) | (position - before > horizon) | (told - told[last] > 0))
    )

    def span(rows_):
        names = [labels.get(i, str(i)) for i in rows_]
        return names[0] if len(names) == 1 else f"{names[0]} to {names[-1]}"

    first_words, last_words = span(first_rows), span(last_rows)
    where = labels.get(first_rows[0], str(first_rows[0]))
    steps = grid.index.to_numpy()
    events = []
    # Padding is likely where the sequence is made of tokens (an Embedding's
    # output is recorded, not the input) or its first steps hold exact zeros.
    tokens = rows["variable"].astype(str).ne("input").any() if "variable" in rows else False
    padded = tokens | (zeros[first_rows].mean(axis=1).to_numpy() > 0)
    # A new alert after an earlier low spell that did not come back (it was
    # not low for `horizon` steps) is a relapse.
    again = np.where(np.isnan(before) | (told - told[last] > 0), "", ", again")
    for i in np.flatnonzero(onset):
        events.append(
            (
                steps[i],
                where,
                "vanishing",
                (
                    f"Through time (training step {steps[i]}){again[i]}: the first time steps "
                    f"({first_words}) get {_beside(median[i], limit)} times the gradient the "
                    f"last ones ({last_words}) get, below {limit:.0e} "
                    f"({_median_words(int(counted[i]), int(spans[i]))}): the gradient vanishes "
                    "through time, so the network can hardly learn from the start of the "
                    "sequence. That matters when the answer depends on the early steps and the "
                    "loss has stalled: a gated cell (LSTM or GRU) if it is not one already, "
                    "shorter sequences or attention help. If only the recent steps matter "
                    "(forecasting the next value), it is expected."
                    + (
                        " Padding reads so too (pad_sequences pads at the front by default): "
                        "mask it (mask_zero=True)."
                        if padded[i]
                        else ""
                    )
                ),
            )
        )
    for i in np.flatnonzero(came_back):
        events.append(
            (
                steps[i],
                where,
                "info",
                (
                    f"Through time (training step {steps[i]}): since training step "
                    f"{steps[i - quiet + 1]}, the gradient reaches the first time steps "
                    f"({first_words}) again: they get "
                    f"{_beside(median[i], _BACK_THROUGH_TIME * limit)} times the gradient the "
                    f"last ones ({last_words}) get, at least {_BACK_THROUGH_TIME * limit:.0e} "
                    f"for {quiet} recorded steps ({_median_words(int(counted[i]), int(spans[i]))}"
                    "). Whether the network uses what it sees there shows in the loss."
                ),
            )
        )
    return events


def _exploding(norms, thresholds, steps):
    events = []
    if norms.empty:
        return events
    # A small update (recorded) takes a large norm in its stride: an adaptive optimizer's.
    moved = ~(norms["update"] <= thresholds.exploding_update)
    moved |= norms["norm"] >= 1e3 * thresholds.exploding_norm
    high = _mark_streaks(
        norms,
        (norms["norm"] > thresholds.exploding_norm) & moved,
        steps,
        thresholds.repeat_after,
    )
    for row in _onsets(high).itertuples():
        if row.clipped < 0.999 * row.norm:  # False where NaN (not clipped)
            # With clipping on, "try gradient clipping" read as "it did nothing".
            advice = (
                f"the optimizer's clipping cut it to {row.clipped:.1e} before the update, so "
                "the weights moved less than this gradient says; a smaller learning rate "
                "tames the gradient itself."
            )
        else:
            advice = "try a smaller learning rate or gradient clipping."
        events.append(
            (
                row.step,
                row.layer,
                "exploding",
                (
                    f"Layer {row.layer}: gradient norm {_norm_text(row.norm, thresholds.exploding_norm)} "
                    f"at step {row.step} "
                    f"is above {thresholds.exploding_norm:.0e} — gradients are exploding; " + advice
                ),
            )
        )
    # Growth: compare with the norm at the latest recorded step at least
    # `growth_window` steps back (none if the layer had no finite norm there).
    window = int(thresholds.growth_window)
    position = np.searchsorted(steps, norms["step"].to_numpy() - window, side="right")
    then = np.where(position > 0, steps[np.maximum(position - 1, 0)], -1)
    earlier = norms[["layer", "step", "norm"]].rename(
        columns={"step": "then_step", "norm": "then_norm"}
    )
    grown = norms.assign(then_step=then).merge(earlier, on=["layer", "then_step"], how="inner")
    # Growth needs two finite norms; one beyond float32's range is reported above.
    grown = grown[(grown["then_norm"] > 0) & np.isfinite(grown["then_norm"] * grown["norm"])]
    if grown.empty:
        return events
    grown = grown.assign(factor=grown["norm"] / grown["then_norm"])
    # One large batch among small ones grows the norm as much for one step:
    # a trend holds at the next recorded step too.
    grown = grown.sort_values(["layer", "step"])
    by_layer = grown.groupby("layer", observed=True)
    grown = grown.assign(
        step_before=by_layer["step"].shift(1), factor_before=by_layer["factor"].shift(1)
    )
    # The layer's row before is the previous recorded step (NaN: none).
    position = np.searchsorted(steps, grown["step"].to_numpy())
    recorded_before = np.where(position > 0, steps[np.maximum(position - 1, 0)], np.nan)
    limit = thresholds.exploding_growth
    confirmed = (
        (grown["factor"] > limit)
        & (grown["factor_before"] > limit)  # False where NaN
        & (grown["step_before"].to_numpy() == recorded_before)
    )
    fast = _mark_streaks(grown, confirmed, steps, thresholds.repeat_after)
    for row in _onsets(fast).itertuples():
        events.append(
            (
                row.step,
                row.layer,
                "exploding",
                (
                    f"Layer {row.layer}: gradient norm {row.norm:.1e} at step {row.step} is "
                    f"{row.factor:.1e} times its {row.then_norm:.1e} at step {row.then_step}, and at "
                    f"step {row.step_before:.0f} it was {row.factor_before:.1e} times up already: "
                    f"more than {thresholds.exploding_growth:g}x at two recorded steps in a "
                    "row — gradients are starting to explode."
                ),
            )
        )
    return events


def _dead_relu(table, thresholds, steps):
    if "zero_fraction" not in table.columns:
        return []
    events = []
    share = pd.to_numeric(table["zero_fraction"], errors="coerce")
    cases = (
        ("bias", thresholds.dead_relu_fraction, "bias gradient"),
        (schema.ACTIVATION, thresholds.dead_activation_fraction, "output gradient"),
    )
    for tensor, limit, what in cases:
        rows = table.assign(share=share)[table["tensor"] == tensor]
        if rows.empty:
            continue
        rows = rows.drop_duplicates(["step", "layer"])
        zeros = _mark_streaks(rows, rows["share"] > limit, steps, thresholds.repeat_after)
        for row in _onsets(zeros).itertuples():
            events.append(
                (
                    row.step,
                    row.layer,
                    "dead_relu",
                    (
                        f"Layer {row.layer}: {row.share:.0%} of its {what} entries are exactly 0 "
                        f"at step {row.step} (more than {limit:.0%}): no gradient flows through "
                        "many of its units. With ReLU they are dead (they output 0 for every "
                        "sample): try a smaller learning rate, He initialization or leaky_relu. "
                        "With tanh or sigmoid they are saturated (outputs pinned near tanh's ±1 or "
                        "sigmoid's 0 and 1, where the slope is almost 0): try "
                        "smaller initial weights or normalization."
                    ),
                )
            )
    return events


def _saturation(table, norms, thresholds, steps, layer_inputs=None):
    if "mean_abs" not in table.columns:
        return []
    outputs = table[table["tensor"] == schema.ACTIVATION]
    outputs = outputs.assign(size=pd.to_numeric(outputs["mean_abs"], errors="coerce"))
    outputs = outputs.sort_values(["step", "layer_index"]).drop_duplicates(["step", "layer_index"])
    if outputs.empty:
        return []
    # Pair each output gradient with the one of the next layer up: dLoss/d(output
    # of the layer below) is dLoss/d(input of the layer above).
    by_step = outputs.groupby("step", observed=True)
    above = by_step.shift(-1)
    # The last layer's output gradient is the loss's own: under cross-entropy
    # it stays near 1/p at a softmax while the one at its logits goes to 0
    # as the model learns (Thresholds.saturation_ratio).
    top = by_step["layer_index"].transform("max")
    frame = pd.DataFrame(
        {
            "step": outputs["step"],
            "layer": above["layer"],
            "in_size": outputs["size"],
            "out_size": above["size"],
            "below": outputs["layer"],
        }
    )[(above["layer_index"] != top).to_numpy()].dropna(subset=["layer"])
    if layer_inputs is not None:
        # Only where the layer below is the one this layer reads: a branch
        # (query, key and value reading one input) is no chain.
        fed = frame["layer"].astype(str).map(layer_inputs)
        frame = frame[(fed == frame["below"].astype(str)).to_numpy()]
    # An input gradient of exactly 0 is units that pass nothing back at all
    # (dead ReLUs, or a sigmoid past float32's reach): the dead-unit rule
    # reports those, from the share of zero entries. A non-finite one is
    # the NaN rule's.
    finite = np.isfinite(frame["in_size"]) & np.isfinite(frame["out_size"])
    frame = frame[(frame["out_size"] > 0) & (frame["in_size"] > 0) & finite]
    # A layer whose weights get no gradient at all is vanishing, not saturated.
    frame = frame.merge(norms[["step", "layer", "norm"]], on=["step", "layer"], how="left")
    frame = frame[~(frame["norm"] < thresholds.vanishing_norm)]
    frame = frame.assign(ratio=frame["in_size"] / frame["out_size"])
    if frame.empty:
        return []
    shrunk = _mark_streaks(
        frame, frame["ratio"] < thresholds.saturation_ratio, steps, thresholds.repeat_after
    )
    return [
        (
            row.step,
            row.layer,
            "saturation",
            (
                f"Layer {row.layer}: the gradient shrinks {row.out_size / row.in_size:.1e}-fold as it passes "
                f"back through this layer at step {row.step} (mean |gradient| {row.out_size:.1e} "
                f"at its output, {row.in_size:.1e} at its input) — its units are probably "
                "saturated: sigmoid/tanh outputs stuck near their limits, where the slope is "
                "almost 0."
            ),
        )
        for row in _onsets(shrunk).itertuples()
    ]


def no_gradient_message(layer, tensors):
    """What to tell about a layer that no gradient reaches (a `no_gradient` event).

    Args:
        layer: The layer's path.
        tensors: What of it gets no gradient: `kernel`, `bias`, `output`, ...
    """
    return (
        f"No gradient reaches layer {layer!r} ({', '.join(tensors)}): the loss does not "
        "depend on it, or only through an operation with no gradient (argmax, stop_gradient, "
        "a cast to integers). Training leaves its weights as they are, and gradflow leaves it "
        "out of the statistics. Check that the layer is used in `call` and that every output it feeds has "
        "a loss."
    )


def diagnose(layer_stats, thresholds=None, layer_inputs=None):
    """Apply every rule to tidy layer statistics and list what they found.

    Example:

    >>> import pandas as pd
    >>> table = pd.DataFrame({"step": [40], "layer": ["dense_3"], "layer_index": [3],
    ...     "tensor": ["kernel"], "l2_norm": [2.1e-9], "nonfinite": [0]})
    >>> print(diagnose(table)["message"][0])
    Layer dense_3: gradient norm 2.1e-09 at step 40 is below 1e-07 — gradients are vanishing, so this layer barely learns.

    Args:
        layer_stats: A DataFrame with gradflow's tidy columns (at least
            `step`, `layer`, `layer_index`, `tensor`, `l2_norm`; `max_abs`,
            `mean_abs`, `zero_fraction` and `nonfinite` enable more rules),
            or a `Snapshot`.
        thresholds: A `Thresholds`. Defaults to `Thresholds()`.
        layer_inputs: A dict from each layer (an activation row's `layer`) to
            the layer whose output it takes as input, or None where the two
            are not compared: not a recorded layer, or a layer without
            weights whose output holds another number of entries (pooling,
            where the mean |gradient| changes with the count alone), or a
            layer whose input comes with a Keras mask (exact zeros at the
            padded time steps, their share alone shrinking the mean).
            `GradientMonitor` records it in the run's config
            (`run_layer_inputs`) and in `.history.attrs["layer_inputs"]`.
            The saturation rule compares a layer's output gradient with its
            input's: without this it takes the layer called before as its
            input, which is right for a chain only. Default None: the
            table's `attrs["layer_inputs"]` if it has them (a monitor's
            `.history`, a `Run`'s `.layer_stats`), else a chain.

    Returns:
        A DataFrame with columns `step`, `layer`, `kind`, `message`, sorted by
        step. `kind` is one of `nonfinite`, `vanishing`, `exploding`,
        `dead_relu`, `saturation`, and `info` where a gradient that vanished
        through time reaches the first time steps again (its `layer` and
        that of the alert are the first row through time, `"t=01"`). At
        most one `nonfinite` event: the origin (see `first_nonfinite`).

    Raises:
        TypeError: if `layer_stats` is not a DataFrame, `thresholds` not a
            `Thresholds` or `layer_inputs` not a dict.
        ValueError: if required columns are missing.
    """
    layer_inputs = _carried_inputs(layer_stats, layer_inputs)
    table = _table(layer_stats)
    if layer_inputs is not None and not isinstance(layer_inputs, dict):
        raise TypeError(
            "`layer_inputs` must be a dict from a layer to the layer it reads, or None, got "
            f"{type(layer_inputs).__name__}."
        )
    if thresholds is None:
        thresholds = Thresholds()
    if not isinstance(thresholds, Thresholds):
        raise TypeError(
            "`thresholds` must be a gradflow.diagnosis.Thresholds or None, got "
            f"{type(thresholds).__name__}."
        )
    # Rows through time are a sequence's time steps, not layers: one rule
    # reads them; the others compare layers.
    in_time = (table["tensor"] == schema.TIME_STEP).to_numpy()
    events = _vanishing_through_time(table[in_time], thresholds)
    table = table[~in_time]
    origin = first_nonfinite(table)
    if origin is not None:
        count = "" if math.isnan(origin.count) else f", {origin.count:.0f} entries"
        if _every_layer_broken(table, origin.step):
            # A NaN made in the forward pass (or the loss) reaches every
            # gradient at once: the layer nearest the loss is then only where
            # backprop starts, not where the NaN was made.
            where = (
                f"Every layer's gradient turned NaN/Inf at once, from {origin.layer} down: "
                "what a NaN or infinite loss gives. It was most likely made in the forward "
                "pass (a layer's output: a log or square root of a negative number, a "
                "division by zero, an overflow from large weights or a large learning rate) "
                "or in the loss; gradients cannot say which layer made it."
            )
        else:
            where = (
                "It is the layer nearest the loss with a broken gradient, so the NaN starts "
                "here or in the loss; the layers below only inherit it."
            )
        events.append(
            (
                origin.step,
                origin.layer,
                "nonfinite",
                f"Layer {origin.layer}: first non-finite (NaN/Inf) gradient at step "
                f"{origin.step} ({origin.tensor}{count}). {where}",
            )
        )
    norms = _layer_norms(table)
    steps = np.unique(table["step"].to_numpy())  # the recorded steps
    events += _vanishing(norms, thresholds, steps)
    events += _exploding(norms, thresholds, steps)
    events += _dead_relu(table, thresholds, steps)
    events += _saturation(table, norms, thresholds, steps, layer_inputs)
    result = pd.DataFrame(events, columns=list(schema.EVENTS_COLUMNS))
    result["step"] = result["step"].astype(np.int64)
    return result.sort_values("step", kind="stable").reset_index(drop=True)


def look_back(thresholds, through_time=False):
    """`(window, quiet)` for `context_start`: how far back the rules of `thresholds` look.

    The growth rule compares a step with one `growth_window` steps back; an
    alert starts a streak unless it held at one of the `repeat_after`
    recorded steps before, and through time (`through_time`: the table has
    rows through time) that holding is a median of `time_window` recorded
    steps, and coming back looks for the last low one further back.
    """
    rules = thresholds or Thresholds()
    # Through time, an alert looks for the last low step up to
    # `_BACK_WITHIN * repeat_after` recorded steps back, and whether the
    # gradient came back since (`repeat_after` steps of it, which the
    # `repeat_after` above cover).
    extra = _BACK_WITHIN * rules.repeat_after + rules.time_window if through_time else 0
    return rules.growth_window, rules.repeat_after + extra


def context_start(steps, window, quiet=1):
    """The first of the recorded `steps` a diagnosis of later steps must see.

    A new step starts an alert unless its condition held at one of the
    `quiet` recorded steps before it (`Thresholds.repeat_after`); the
    growth rule's condition at a step compares it with the latest step at
    least `window` steps back (`Thresholds.growth_window`) and needs it at
    the recorded step before too. So: the `quiet + 1` newest steps, and the
    steps the oldest of them looks back to.

    Args:
        steps: The steps diagnosed already (an array, not empty; in any
            order, repeated or not: a table's `step` column will do).
        window: `Thresholds.growth_window`.
        quiet: `Thresholds.repeat_after`. Defaults to 1.
    """
    steps = np.unique(np.asarray(steps))
    before = steps[max(0, len(steps) - 1 - int(quiet))]
    reach = steps[steps <= before - window]
    return reach.max() if reach.size else steps.min()


def diagnose_new(layer_stats, after_step, thresholds=None, layer_inputs=None):
    """What `diagnose` of the whole table finds at the steps after `after_step`.

    For a view that follows a growing run (the dashboard's alerts): the rules
    read only the new steps and the few steps before them that they look
    back at (`context_start`), so a look costs a few passes over the
    table's columns, not the rules over its whole length (a 10,000-step run
    of 20 layers: 30-35 ms against 0.4-0.6 s for `diagnose`,
    `bench/bench_alerts.py`).

    Args:
        layer_stats: Tidy layer statistics, as for `diagnose`.
        after_step: The steps up to this one were diagnosed before.
        thresholds: A `Thresholds`. Defaults to `Thresholds()`.
        layer_inputs: As for `diagnose`.

    Returns:
        The events at steps after `after_step`, as `diagnose` returns them.

    Raises:
        TypeError: if `after_step` is not a number (a bool or NaN is
            refused too), or as `diagnose` does.
        ValueError: as `diagnose` does.
    """
    if (
        isinstance(after_step, (bool, np.bool_))
        or not isinstance(after_step, numbers.Real)
        or math.isnan(after_step)
    ):
        raise TypeError(
            "`after_step` must be a step number (an int: 0 when nothing was diagnosed yet), "
            f"got {type(after_step).__name__} {after_step!r}."
        )
    layer_inputs = _carried_inputs(layer_stats, layer_inputs)
    table = _table(layer_stats)
    rules = thresholds or Thresholds()
    step = table["step"].to_numpy()
    old = step <= after_step
    seen_nonfinite = False
    if old.all():
        table = table.iloc[:0]
    elif old.any():
        through_time = bool((table["tensor"] == schema.TIME_STEP).any())
        start = context_start(step[old], *look_back(rules, through_time))
        # Only the first non-finite step is reported: not a later one when
        # an earlier step, left out of the context, had one.
        seen_nonfinite = bool((_nonfinite_mask(table).to_numpy() & (step < start)).any())
        table = table[step >= start]
    found = diagnose(table, thresholds, layer_inputs)
    found = found[found["step"] > after_step]
    if seen_nonfinite:
        found = found[found["kind"] != "nonfinite"]
    return found.reset_index(drop=True)
