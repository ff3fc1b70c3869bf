"""Line charts: a statistic per layer over steps, and loss/accuracy curves."""

import warnings

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from gradflow import checks, schema
from gradflow.figures import decimate, logscale, style
from gradflow.figures import grid as grid_lib
from gradflow.figures import heatmap as heatmap_lib
from gradflow.figures.chart import Chart

# Headroom above the data, in decades, where NaN/Inf markers are drawn.
_MARKER_HEADROOM = 0.35


def _select_layers(layer_grid, layers):
    if layers is None:
        return np.arange(len(layer_grid.layer))
    if isinstance(layers, (str, int, np.integer)):
        layers = [layers]  # one layer: "dense_1" is not the layers d, e, n, ...
    try:
        wanted = list(layers)
    except TypeError:
        raise ValueError(
            f"`layers` must be a layer's name or index, a list of them, or None, got {layers!r}."
        ) from None
    rows = []
    for item in wanted:
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            hits = np.flatnonzero(layer_grid.layer_index == item)
        else:
            hits = [i for i, name in enumerate(layer_grid.layer) if name == item]
        if len(hits) == 0:
            raise ValueError(
                f"`layers` must name layers (or layer indices) present in the data, got {item!r}; "
                f"available: {layer_grid.layer[:20]}{' ...' if len(layer_grid.layer) > 20 else ''}."
            )
        rows.extend(int(h) for h in hits)
    return np.array(rows, dtype=np.int64)


def layer_lines(
    layer_stats,
    statistic="max_abs",
    tensor="kernel",
    *,
    layers=None,
    max_points=decimate.DEFAULT_MAX_COLUMNS,
    power_of_two_blocks=False,
    title=None,
    presentation=False,
):
    """One line per layer: a gradient statistic over steps, log y axis.

    Long runs keep each block's maximum (spikes stay). Zeros are drawn at
    the bottom of the axis; NaN and Inf are gaps in the line with a black
    marker above the data at that step.

    Example:

    ```python
    chart = layer_lines(run.layer_stats, "l2_norm", layers=["dense", "dense_3"])
    ```

    Args:
        layer_stats: tidy layer-statistics DataFrame.
        statistic: the column to plot. Default `"max_abs"`.
        tensor: tensor kind or `"all_weights"` (see `heatmap`). Default
            `"kernel"`.
        layers: names or `layer_index` values to draw, or None (default) for
            all layers (coloured input dark -> output light when more than 8).
        max_points: most points per line. Default 1000.
        power_of_two_blocks: decimate by a power-of-two number of steps per
            point (see `decimate_max`), so that a live chart of a growing run
            keeps its earlier points. Default False.
        title: figure title, or None (default) for an automatic one.
        presentation: large fonts for slides. Default False.

    Returns:
        A `Chart`; `.data` has columns `layer_index, layer, step, step_last,
        <statistic>` (one row per drawn point).

    Raises:
        TypeError, ValueError: for an invalid frame, statistic, tensor or
            layer name.
    """
    full = decimate.decimate_max(
        grid_lib.layer_grid(layer_stats, statistic, tensor),
        checks.positive_int("max_points", max_points),
        power_of_two_blocks=power_of_two_blocks,
    )
    rows = _select_layers(full, layers)
    layer_grid = grid_lib.LayerGrid(
        values=full.values[rows],
        present=full.present[rows],
        step_first=full.step_first,
        step_last=full.step_last,
        layer_index=full.layer_index[rows],
        layer=[full.layer[r] for r in rows],
        statistic=statistic,
        tensor=tensor,
    )
    rows = style.row_noun(tensor)
    plain_title = title or style.chart_heading(statistic, tensor, over_training=True)
    description = (
        f"The {style.STATISTIC_LABELS.get(statistic, statistic)} of the "
        f"{style.tensor_label(tensor)} of each {rows} over steps, log scale. Exact zeros ("
        + ("a padded or masked time step" if rows == "time step" else "a dead layer")
        + ") lie on the line marked 0 at the bottom; hover over or tap a point for its value. Black markers "
        "above the lines show steps with NaN (x) or Inf (triangle)."
    )
    data = layer_grid.to_frame()
    if layer_grid.values.size == 0:
        return Chart(
            style.no_data_figure("No layer statistics recorded yet.", presentation),
            data,
            plain_title,
            description,
        )

    log_min, log_max = logscale.log_range(layer_grid.values[layer_grid.present])
    zero_at = logscale.zero_level(layer_grid.values[layer_grid.present], log_min)
    labels = style.layer_labels(layer_grid.layer, layer_grid.layer_index)
    colors = style.line_colors(len(labels))
    figure = style.new_figure()
    for row, (label, color) in enumerate(zip(labels, colors, strict=True)):
        drawn = layer_grid.present[row]
        values = layer_grid.values[row, drawn]
        y = np.power(10.0, logscale.to_log(values, log_min, zero_at))  # NaN/Inf -> gap
        figure.add_trace(
            go.Scatter(
                x=layer_grid.step_first[drawn],
                y=y,
                customdata=values,
                # A line needs two points: a layer with one drawn step was invisible.
                mode="lines" if np.isfinite(values).sum() > 1 else "markers",
                name=label,
                line=dict(color=color, width=2),
                hovertemplate=f"{label}<br>step %{{x}}<br>%{{customdata:.3g}}<extra></extra>",
                showlegend=len(labels) <= len(style.OKABE_ITO),
            )
        )
    if len(labels) > len(style.OKABE_ITO):
        in_time = tensor == schema.TIME_STEP
        named = "time step" if in_time else style.layer_axis_title("layer", layer_grid.layer)
        figure.add_trace(_depth_scale(labels, named, in_time))
    elif style.nested_in(layer_grid.layer):
        # What the legend's "…/" stands for (`style.layer_labels`).
        figure.update_layout(legend_title_text=style.layer_axis_title("layer", layer_grid.layer))
    rows_nf, cols_nf = np.nonzero(layer_grid.present & ~np.isfinite(layer_grid.values))
    marker_y = np.full(len(rows_nf), 10.0 ** (log_max + _MARKER_HEADROOM / 2))
    label_array = np.asarray(labels, dtype=object)
    for trace in heatmap_lib.nonfinite_markers(
        layer_grid.step_first[cols_nf],
        marker_y,
        layer_grid.values[rows_nf, cols_nf],
        label_array[rows_nf],
    ):
        figure.add_trace(trace)
    figure.update_layout(
        title=style.escape_label(plain_title),
        xaxis_title=heatmap_lib.step_axis_title(layer_grid),
        yaxis_title=style.statistic_label(statistic) + " (log scale)",
    )
    tickvals, ticktext = logscale.decade_ticks(log_min, log_max, zero_at=zero_at)
    figure.update_yaxes(
        type="log",
        range=[(log_min if zero_at is None else zero_at) - 0.1, log_max + _MARKER_HEADROOM],
        tickvals=[10.0**v for v in tickvals],
        ticktext=ticktext,
    )
    style.apply_style(figure, presentation)
    return Chart(figure, data, plain_title, description)


def _depth_scale(labels, named, in_time=False):
    """A colour bar from the input layer to the output one, instead of a legend.

    Beyond eight layers the lines are coloured by depth (`style.line_colors`);
    a legend of 20 to 100 names did not fit beside the chart (a PNG cut it
    after the tenth) and said less than the scale does. Hovering a line
    still names its layer.
    """
    last = len(labels) - 1
    return go.Scatter(
        x=[None],
        y=[None],
        mode="markers",
        showlegend=False,
        hoverinfo="skip",
        marker=dict(
            color=[0],
            cmin=0,
            cmax=last,
            colorscale=style.HEATMAP_COLORSCALE,
            showscale=True,
            colorbar=dict(
                title=dict(text=named, side="right"),
                tickvals=[0, last],
                ticktext=[labels[0] if in_time else f"{labels[0]} (input)", labels[last]],
                thickness=14,
            ),
        ),
    )


def check_metrics(metrics, argument="metrics"):
    """Raise a clear error unless `metrics` is a long step/name/value frame."""
    if not isinstance(metrics, pd.DataFrame):
        raise TypeError(
            f"`{argument}` must be a pandas DataFrame with columns step, name, value, got {type(metrics).__name__}."
        )
    missing = [c for c in schema.METRICS_COLUMNS if c not in metrics.columns]
    if missing:
        raise ValueError(
            f"`{argument}` is missing the columns {missing}; expected {list(schema.METRICS_COLUMNS)}."
        )


def _sorted_metric(metrics, name):
    """`(steps, values)` of one metric, in step order."""
    rows = metrics[metrics["name"] == name]
    steps = rows["step"].to_numpy(dtype=np.int64)
    values = rows["value"].to_numpy(dtype=np.float64, na_value=np.nan)
    order = np.argsort(steps, kind="stable")
    return steps[order], values[order]


def metric_series(metrics, name, max_points):
    """`(steps, values, block)` of one metric, sorted, decimated to its envelope.

    `block` is how many recorded points each kept point stands for (1: all kept).
    """
    return _envelope(*_sorted_metric(metrics, name), max_points)


def _envelope(steps, values, max_points):
    kept = decimate.decimate_envelope(steps, values, max_points)
    return (*kept, decimate.envelope_block(len(steps), max_points))


def block_means(steps, values, block):
    """`(steps, means)`: the mean of each block of `block` points of a sorted series.

    The step is the block's middle one; NaN and Inf are left to the
    envelope's markers (a block's mean skips NaN).
    """
    count = -(-len(steps) // block) * block
    padded = np.full((2, count), np.nan)
    padded[0, : len(steps)], padded[1, : len(steps)] = steps, values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a block of NaN only: its mean is NaN
        at, means = np.nanmean(padded.reshape(2, -1, block), axis=2)
    return np.round(at).astype(np.int64), means


_LOSS_AND_ACCURACY = ("loss", "accuracy")

# The most panels a loop's metrics get side by side (the loss and three of its own):
# beyond four, each panel of a half-width chart was too narrow to read.
MOST_LOOP_PANELS = 4


def loop_metric_names(metrics):
    """The panels of a training loop's own metrics: the loss first, then the loop's, in order.

    A `GradientLog` run keeps, at each recorded step, the loss and any
    keyword the loop gave `record` (a GAN's `d_loss`, `g_loss`; a reward).
    The numbers gradflow records itself (learning rate, global norm) are
    left out; a `val_<name>` goes in the panel of `<name>`. Ordered by the
    step each first appears at (so panels do not move as a run grows).

    Args:
        metrics: long DataFrame with columns `step, name, value`.

    Returns:
        A list of panel names; empty when the run recorded none.
    """
    check_metrics(metrics)
    first = metrics.sort_values("step", kind="stable").drop_duplicates("name")["name"]
    gradflows = _PER_STEP - {"loss"}
    panels = metric_panels(name for name in first if isinstance(name, str))
    return [panel for panel in panels if panel not in gradflows]


def metric_panels(names):
    """The panels of these metric names, in order, the loss first.

    `val_<name>` is drawn dashed in the panel of `<name>` (`metrics_chart`,
    `compare_metrics`); a metric a loop named `val_` alone is its own.

    Args:
        names: metric names, in the order to keep (after the loss).

    Returns:
        A list of panel names, each once.
    """
    panels = {}
    for name in names:
        panels.setdefault(name[4:] if name.startswith("val_") and name != "val_" else name, None)
    return sorted(panels, key=lambda panel: panel != "loss")


def metrics_chart(
    metrics,
    names=_LOSS_AND_ACCURACY,
    *,
    per_step=False,
    log_loss=False,
    max_points=decimate.DEFAULT_MAX_COLUMNS,
    title=None,
    presentation=False,
):
    """Loss and accuracy over steps, training solid and validation dashed.

    One panel per name in `names` that has data; `val_<name>` is drawn in
    the same panel when recorded. Long runs keep each block's minimum and
    maximum, so dips and spikes stay visible.

    Example:

    ```python
    chart = metrics_chart(run.metrics)                  # loss | accuracy
    chart = metrics_chart(run.metrics, ["global_norm"])
    chart = metrics_chart(log.metrics, per_step=True)   # loss | d_loss | g_loss
    ```

    Args:
        metrics: long DataFrame with columns `step, name, value`.
        names: metric names, one panel each. Default `("loss", "accuracy")`;
            with `per_step`, the default is the loss and the loop's own
            metrics (`loop_metric_names`), `MOST_LOOP_PANELS` panels at most
            (the description names those left out).
        per_step: True for a run whose metrics are each step's own numbers,
            as a training loop passed them (`GradientLog.record(loss=...,
            d_loss=...)`), not Keras's running mean over an epoch: their
            panels are titled by name alone, and the description says so.
            Default False (a `model.fit` run: compiled metrics are running
            means).
        log_loss: log y axis for `loss` panels. Default False.
        max_points: about this many points per line at most. Default 1000.
        title: figure title, or None (default).
        presentation: large fonts for slides. Default False.

    Returns:
        A `Chart`; `.data` has columns `step, name, value` (drawn points).

    Raises:
        TypeError, ValueError: if `metrics` is not a long metrics frame.
    """
    check_metrics(metrics)
    log_loss = checks.flag("log_loss", log_loss)
    per_step = checks.flag("per_step", per_step)
    asked = names is not _LOSS_AND_ACCURACY  # the defaults draw what there is
    left_out = []
    if per_step and not asked:
        names = loop_metric_names(metrics) or ["loss"]
        names, left_out = names[:MOST_LOOP_PANELS], names[MOST_LOOP_PANELS:]
    names = (names,) if isinstance(names, str) else names
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"`names` must be a metric's name or a list of them, got {names!r}.")
    recorded = set(metrics["name"].unique())
    panels = [n for n in names if n in recorded or f"val_{n}" in recorded]
    unknown = [n for n in names if n not in panels]
    if recorded and unknown and asked:
        raise ValueError(
            f"`names` must be metrics the run recorded, got {unknown!r}; it recorded "
            f"{sorted(recorded)}."
        )
    shown = panels or list(names)
    if per_step:
        plain_title = title or _listed(shown) + " over training"
        description = (
            _listed(shown)
            + " per recorded step, as your loop passed it (validation dashed, where given; on "
            "a long run, each block of steps as its lowest and highest value; the CSV's "
            "`block` column numbers the blocks)."
        )
        if left_out:
            description += (
                f" Not drawn ({MOST_LOOP_PANELS} panels at most): {', '.join(left_out)}; "
                "`gradflow export --format csv` writes every metric."
            )
    else:
        plain_title = title or " and ".join(shown) + " over training"
        description = (
            "Training (solid) and validation (dashed) "
            + ", ".join(shown)
            + " per step (on a long run, each block of steps as its lowest and highest value; "
            "the CSV's `block` column numbers the blocks). Training metrics other than the loss "
            "are Keras's running mean over "
            "the epoch so far (they jump at each new epoch); validation is measured after each "
            "epoch."
        )
    pieces = []
    if not panels:
        empty = pd.DataFrame(
            {"step": np.array([], dtype=np.int64), "name": [], "value": [], "block": []}
        )
        return Chart(
            style.no_data_figure("No metrics recorded yet.", presentation),
            empty,
            plain_title,
            description,
        )

    figure = make_subplots(
        figure=style.new_figure(),
        rows=1,
        cols=len(panels),
        subplot_titles=[style.escape_label(p if per_step else _panel_title(p)) for p in panels],
    )
    for col, panel in enumerate(panels, start=1):
        for name, dash, color in (
            (panel, "solid", style.OKABE_ITO[0]),
            (f"val_{panel}", "dash", style.OKABE_ITO[1]),
        ):
            if name not in recorded:
                continue
            # `block`: a long run's CSV is each block's lowest and highest
            # value, and it did not say so.
            every_step, every_value = _sorted_metric(metrics, name)
            steps, values, block = _envelope(every_step, every_value, max_points)
            pieces.append(
                pd.DataFrame({"step": steps, "name": name, "value": values, "block": block})
            )
            label = (
                style.escape_label("validation" if name.startswith("val_") else "training")
                + f" {style.escape_label(panel)}"
            )
            figure.add_trace(
                go.Scatter(
                    x=steps,
                    y=values,
                    mode="lines+markers" if len(steps) < 30 else "lines",
                    name=label + (" (each block's lowest and highest)" if block > 1 else ""),
                    # A long run's envelope is a band; its trend is drawn over it.
                    line=dict(color=color, dash=dash, width=1 if block > 1 else 2),
                    opacity=0.35 if block > 1 else None,
                    hovertemplate="step %{x}<br>%{y:.4g}<extra></extra>",
                ),
                row=1,
                col=col,
            )
            if block > 1:
                # A 20,000-step loss drawn as each block's lowest and highest
                # value was a solid band that hid whether it fell (an
                # overnight run's audit): the mean of each block over it.
                at, means = block_means(every_step, every_value, block)
                pieces.append(
                    pd.DataFrame(
                        {"step": at, "name": f"{name} (block mean)", "value": means, "block": block}
                    )
                )
                figure.add_trace(
                    go.Scatter(
                        x=at,
                        y=means,
                        mode="lines",
                        name=f"{label} (mean of each {block} steps)",
                        line=dict(color=color, dash=dash, width=2.5),
                        hovertemplate="steps around %{x}<br>mean %{y:.4g}<extra></extra>",
                    ),
                    row=1,
                    col=col,
                )
            bad = ~np.isfinite(values)
            if bad.any():
                # A diverged run ends in NaN: mark where, at the top of the data.
                finite = values[~bad]
                top = float(finite.max()) if finite.size else 1.0
                for trace in heatmap_lib.nonfinite_markers(
                    steps[bad],
                    np.full(bad.sum(), top),
                    values[bad],
                    np.full(bad.sum(), style.escape_label(name), dtype=object),
                ):
                    figure.add_trace(trace, row=1, col=col)
        figure.update_xaxes(title_text="step", row=1, col=col)
        if panel == "loss" and log_loss:
            figure.update_yaxes(type="log", row=1, col=col)
    figure.update_layout(title=style.escape_label(plain_title))
    style.apply_style(figure, presentation)
    style.legend_below(figure)
    return Chart(figure, pd.concat(pieces, ignore_index=True), plain_title, description)


# Recorded by the monitor at each step, not Keras's running means.
_PER_STEP = {"loss", "learning_rate", "global_norm", "global_norm_clipped", "clipped"}


def _panel_title(name):
    """A metric's panel title; a compiled metric's says it is an epoch's running mean.

    On a slide, training accuracy's jump at each new epoch read as a real
    jump: only the page's caption said why.
    """
    return name if name in _PER_STEP else f"{name} (running mean over each epoch)"


def _listed(names):
    """`"a"`, `"a and b"`, `"a, b and c"`."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
