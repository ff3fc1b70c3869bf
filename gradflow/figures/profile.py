"""The per-layer profile at one step: the classic "gradient flow" picture."""

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from gradflow import schema
from gradflow.figures import grid as grid_lib
from gradflow.figures import heatmap as heatmap_lib
from gradflow.figures import logscale, style
from gradflow.figures.chart import Chart

_MARKER_HEADROOM = 0.35


def resolve_step(layer_stats, tensor, step):
    """The recorded step to show: the last one at or before `step`.

    Args:
        layer_stats: tidy layer-statistics DataFrame (already validated).
        tensor: tensor kind or `"all_weights"`.
        step: requested step, or None for the last recorded step.

    Returns:
        An int step, or None when nothing is recorded.

    Raises:
        ValueError: if `step` is before the first recorded step.
    """
    steps = layer_stats["step"].to_numpy()[grid_lib.tensor_mask(layer_stats, tensor)]
    if steps.size == 0:
        return None
    if step is None:
        return int(steps.max())
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"`step` must be an integer step number or None, got {step!r}.")
    earlier = steps[steps <= step]
    if earlier.size == 0:
        raise ValueError(
            f"`step` must be at or after the first recorded step {int(steps.min())} "
            f"(last: {int(steps.max())}), got {step}."
        )
    return int(earlier.max())


# A profile through time is the median of this many recorded steps up to the
# one shown: one step's is noisy. On the SimpleRNN preset the ratio of the
# first time steps to the last swings over three decades from step to step,
# and its last step (800) had 0.23 where the median of the last 100 is 1e-3.
TIME_WINDOW = 25


def profile_frame(layer_stats, step, tensor, statistics):
    """One row per layer at `step`: `layer_index, layer, step, <statistics>`.

    Rows through time (`tensor == "time_step"`) hold the median of the
    `TIME_WINDOW` recorded steps up to `step` (`time_window_steps`).
    """
    if tensor == schema.TIME_STEP:
        return _median_frame(layer_stats, step, tensor, statistics)
    at_step = layer_stats[layer_stats["step"].to_numpy() == step]
    frame = None
    for statistic in statistics:
        grid = grid_lib.layer_grid(at_step, statistic, tensor)
        column = grid.to_frame().drop(columns="step_last")
        frame = (
            column
            if frame is None
            else frame.merge(column, on=["layer_index", "layer", "step"], how="outer")
        )
    return frame.sort_values("layer_index", ignore_index=True)


def time_window_steps(layer_stats, tensor, step):
    """The recorded steps a profile through time takes the median of: up to `TIME_WINDOW`, ending at `step`."""
    steps = np.unique(layer_stats["step"].to_numpy()[grid_lib.tensor_mask(layer_stats, tensor)])
    return steps[steps <= step][-TIME_WINDOW:]


def _median_frame(layer_stats, step, tensor, statistics):
    window = time_window_steps(layer_stats, tensor, step)
    rows = layer_stats[np.isin(layer_stats["step"].to_numpy(), window)]
    frame = None
    for statistic in statistics:
        grid = grid_lib.layer_grid(rows, statistic, tensor)
        # NaN stays NaN (a broken step is not voted away); absent cells are left out.
        values = np.where(grid.present, grid.values, np.nan)
        median = np.array(
            [
                np.median(row[grid.present[i]]) if grid.present[i].any() else np.nan
                for i, row in enumerate(values)
            ]
        )
        column = pd.DataFrame(
            {
                "layer_index": grid.layer_index,
                "layer": list(grid.layer),
                "step": int(step),
                statistic: median,
            }
        )
        frame = (
            column
            if frame is None
            else frame.merge(column, on=["layer_index", "layer", "step"], how="outer")
        )
    return frame.sort_values("layer_index", ignore_index=True)


def profile(
    layer_stats,
    step=None,
    tensor="kernel",
    statistics=("max_abs", "mean_abs"),
    *,
    title=None,
    when=None,
    presentation=False,
):
    """Bars of gradient statistics per layer at one step (input on the left).

    Vanishing gradients show as bars shrinking towards the input, exploding
    ones as bars growing. The y axis is log10; NaN/Inf layers get a black
    marker above the bars.

    Example:

    ```python
    chart = profile(run.layer_stats, step=100)
    ```

    Args:
        layer_stats: tidy layer-statistics DataFrame.
        step: the step to show; the last recorded step at or before it is
            used. None (default): the last recorded step.
        tensor: tensor kind or `"all_weights"`. Default `"kernel"`.
        statistics: columns drawn as side-by-side bars. Default
            `("max_abs", "mean_abs")`.
        title: figure title, or None (default).
        when: words for when the statistics were taken, used in the title
            and description, such as `"on one batch"` for a snapshot. None
            (default): "at step N".
        presentation: large fonts for slides. Default False.

    Returns:
        A `Chart`; `.data` has columns `layer_index, layer, step` and one
        column per statistic.

    Raises:
        TypeError, ValueError: for an invalid frame, statistic, tensor or
            a `step` before the first recorded one.
    """
    statistics = [statistics] if isinstance(statistics, str) else list(statistics)
    for statistic in statistics:
        grid_lib.check_layer_stats(layer_stats, statistic)
    shown_step = resolve_step(layer_stats, tensor, step)
    if when is None and tensor == schema.TIME_STEP and shown_step is not None:
        when = median_words(time_window_steps(layer_stats, tensor, shown_step))
    when = when or f"at step {shown_step}"
    plain_title = title or f"Gradient flow {when} ({style.tensor_label(tensor)})"
    in_time = tensor == schema.TIME_STEP
    description = (
        f"Per-time-step {' and '.join(style.statistic_label(s) for s in statistics)} of the "
        f"gradient of the output w.r.t. the input sequence {when}, first time step on the left, log scale: how far back it reaches."
        if in_time
        else f"Per-layer {' and '.join(style.statistic_label(s) for s in statistics)} of the "
        f"{style.tensor_label(tensor)} gradients {when}, "
        "input layer on the left, log scale: the classic gradient-flow picture."
    )
    if shown_step is None:
        empty = pd.DataFrame(columns=["layer_index", "layer", "step", *statistics])
        return Chart(
            style.no_data_figure("No layer statistics recorded yet.", presentation),
            empty,
            plain_title,
            description,
        )

    data = profile_frame(layer_stats, shown_step, tensor, statistics)
    labels = style.layer_labels(data["layer"].tolist(), data["layer_index"].tolist())
    every = data[statistics].to_numpy(dtype=np.float64)
    log_min, log_max = logscale.log_range(every)
    figure = style.new_figure()
    for statistic, color in zip(statistics, style.OKABE_ITO, strict=False):
        values = data[statistic].to_numpy(dtype=np.float64)
        figure.add_trace(
            go.Bar(
                x=labels,
                y=np.power(10.0, logscale.to_log(values, log_min)),
                customdata=values,
                name=style.statistic_label(statistic),
                marker_color=color,
                hovertemplate=f"%{{x}}<br>{style.statistic_label(statistic)} %{{customdata:.3g}}<extra></extra>",
            )
        )
    bad_rows = np.flatnonzero(~np.isfinite(every).all(axis=1))
    if bad_rows.size:
        worst = np.where(np.isnan(every[bad_rows]).any(axis=1), np.nan, np.inf)
        label_array = np.asarray(labels, dtype=object)
        for trace in heatmap_lib.nonfinite_markers(
            label_array[bad_rows],
            np.full(bad_rows.size, 10.0 ** (log_max + _MARKER_HEADROOM / 2)),
            worst,
            label_array[bad_rows],
        ):
            figure.add_trace(
                trace.update(hovertemplate="%{customdata}<br>non-finite<extra></extra>")
            )
    _mark_zero_layers(figure, np.asarray(labels, dtype=object), every, log_min, log_max)
    tickvals, ticktext = logscale.decade_ticks(log_min, log_max)
    figure.update_layout(
        title=style.escape_label(plain_title),
        barmode="group",
        xaxis_title=(
            "time step (first on the left)"
            if in_time
            else style.layer_axis_title("layer (input on the left)", data["layer"].tolist())
        ),
        yaxis_title="|gradient| (log scale)",
    )
    figure.update_xaxes(type="category", categoryorder="array", categoryarray=labels)
    figure.update_yaxes(
        type="log",
        range=[log_min, log_max + _MARKER_HEADROOM],
        tickvals=[10.0**v for v in tickvals],
        ticktext=ticktext,
    )
    style.apply_style(figure, presentation)
    return Chart(figure, data, plain_title, description)


def _mark_zero_layers(figure, labels, every, log_min, log_max):
    """A ring with "0" above the layers whose gradient is exactly 0.

    A log axis has no bar for 0: a dead layer looked like missing data,
    beside the markers of the NaN layers.
    """
    rows = np.flatnonzero((every == 0).all(axis=1))
    if not rows.size:
        return
    height = 10.0 ** (log_min + 0.04 * (log_max - log_min))
    figure.add_trace(
        go.Scatter(
            x=labels[rows],
            y=np.full(rows.size, height),
            mode="markers+text",
            text=["0"] * rows.size,
            textposition="top center",
            marker=dict(symbol="circle-open", size=10, color="#444444"),
            name="exactly 0",
            hovertemplate="%{x}<br>gradient exactly 0 (no bar on a log scale)<extra></extra>",
        )
    )


def median_words(steps):
    """When a profile through time was taken: `"at step 800"`, or `"at steps 776–800 (median of 25)"`."""
    if len(steps) == 1:
        return f"at step {int(steps[0])}"
    return f"at steps {int(steps[0])}–{int(steps[-1])} (median of {len(steps)})"
