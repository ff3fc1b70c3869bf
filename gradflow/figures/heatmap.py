"""Layer x step heatmap of one gradient statistic on a log10 colour scale."""

import math

import numpy as np
import plotly.graph_objects as go

from gradflow import schema
from gradflow.figures import decimate, logscale, style
from gradflow.figures import grid as grid_lib
from gradflow.figures.chart import Chart

# NaN/Inf legend entries sit above the plot, right-aligned, out of the way.
LEGEND_ABOVE = dict(orientation="h", x=1.0, xanchor="right", y=1.02, yanchor="bottom")


def colorbar(statistic, log_min, log_max, zero_at=None):
    """A colour bar for a log10 scale, ticked in real units (1e-6, 1e-3, 1), and "0" at `zero_at`."""
    tickvals, ticktext = logscale.decade_ticks(log_min, log_max, zero_at=zero_at)
    return dict(
        title=dict(text=f"{style.statistic_label(statistic)}<br>(log scale)", side="right"),
        tickvals=tickvals,
        ticktext=ticktext,
    )


def nonfinite_markers(x, y, raw, hover_names, name_prefix="", at="step %{x}"):
    """Scatter traces marking NaN (x) and Inf (triangle) cells; may be empty.

    Args:
        x: numpy array of x positions of every candidate point.
        y: numpy array (or list) of y positions, same length.
        raw: the recorded values at those points.
        hover_names: text shown on hover (already escaped), same length.
        name_prefix: prefix for the legend entries (e.g. an escaped run name).
        at: the hover's line saying when (a Plotly template). Default
            `"step %{x}"`, for charts whose x axis is the step.

    Returns:
        A list of 0, 1 or 2 `go.Scatter` traces.
    """
    traces = []
    y = np.asarray(y, dtype=object) if not isinstance(y, np.ndarray) else y
    hover_names = np.asarray(hover_names, dtype=object)
    for label, symbol, selected in (
        ("NaN", style.NAN_SYMBOL, np.isnan(raw)),
        ("Inf", style.INF_SYMBOL, np.isinf(raw)),
    ):
        if not selected.any():
            continue
        traces.append(
            go.Scatter(
                x=x[selected],
                y=y[selected],
                mode="markers",
                name=f"{name_prefix}{label}",
                marker=dict(
                    symbol=symbol, color=style.NONFINITE_COLOR, size=9, line=dict(width=1.5)
                ),
                customdata=hover_names[selected],
                hovertemplate=f"%{{customdata}}<br>{at}<br>{label}<extra></extra>",
            )
        )
    return traces


def heatmap_traces(layer_grid, log_min, log_max, coloraxis=None, name_prefix="", zero_at=None):
    """The heatmap trace and non-finite markers for a (decimated) `LayerGrid`.

    Args:
        layer_grid: the `LayerGrid` to draw.
        log_min: log10 of the lowest value on the colour scale.
        log_max: log10 of the top of the colour scale.
        coloraxis: name of a shared layout colour axis (`"coloraxis"`) or
            None (default) for the trace's own colour bar.
        name_prefix: prefix for marker legend entries.
        zero_at: log10 position of exact zeros, the scale's bottom, ticked
            "0" (`logscale.zero_level`), or None (default): zeros at `log_min`.

    Returns:
        A list of traces: the `go.Heatmap` first.
    """
    labels = style.layer_labels(layer_grid.layer, layer_grid.layer_index)
    z = logscale.to_log(layer_grid.values, log_min, zero_at)
    z[~layer_grid.present] = np.nan
    label = style.statistic_label(layer_grid.statistic)
    heat = go.Heatmap(
        z=z,
        x=layer_grid.step_first,
        y=labels,
        customdata=layer_grid.values,
        hovertemplate=f"%{{y}}<br>step %{{x}}<br>{label} %{{customdata:.3g}}<extra></extra>",
        hoverongaps=False,
        showscale=True,
    )
    if coloraxis:
        heat.coloraxis = coloraxis
    else:
        heat.update(
            zmin=log_min if zero_at is None else zero_at,
            zmax=log_max,
            colorscale=style.HEATMAP_COLORSCALE,
            colorbar=colorbar(layer_grid.statistic, log_min, log_max, zero_at),
        )
    rows, cols = np.nonzero(layer_grid.present & ~np.isfinite(layer_grid.values))
    label_array = np.asarray(labels, dtype=object)
    markers = nonfinite_markers(
        layer_grid.step_first[cols],
        label_array[rows],
        layer_grid.values[rows, cols],
        label_array[rows],
        name_prefix,
    )
    return [heat, *markers]


_MOST_LAYER_LABELS = 34


def layer_ticks(layer_grid, most=_MOST_LAYER_LABELS):
    """The layer labels to write: all of them, or every k-th and always the top one.

    Left to itself Plotly labels every third row of a 100-layer heatmap from
    the bottom, and the output layer, the top row, had no label.

    Args:
        layer_grid: The heatmap's `LayerGrid`.
        most: The most labels to write (never more than 34, the default).
    """
    most = min(most, _MOST_LAYER_LABELS)
    names = list(style.layer_labels(layer_grid.layer, layer_grid.layer_index))  # as drawn
    if len(names) <= most:
        return names
    every = math.ceil(len(names) / most)
    kept = names[::every]
    if kept[-1] != names[-1]:
        kept[-1] = names[-1]  # the top row instead of the one just under it
    return kept


def axis_ranges(layer_grid):
    """x and y ranges that fit the heatmap cells exactly.

    Without them, autorange pads the axes for the NaN/Inf markers and leaves
    an empty band beside the heatmap.
    """
    steps = layer_grid.step_first
    half = (steps[1] - steps[0]) / 2 if len(steps) > 1 else 0.5
    half_last = (steps[-1] - steps[-2]) / 2 if len(steps) > 1 else 0.5
    x_range = [float(steps[0] - half), float(steps[-1] + half_last)]
    y_range = [-0.5, len(layer_grid.layer) - 0.5]
    return x_range, y_range


def step_axis_title(layer_grid):
    """x-axis title saying when columns are blocks of steps (max per block)."""
    if not layer_grid.decimated:
        return "step"
    block = int(np.max(layer_grid.step_last - layer_grid.step_first)) + 1
    return f"step (each column: max over up to {block} steps)"


# The output layer's activation gradient is left out of the colour scale when
# its largest value is this many times the other layers' largest.
_OUTPUT_APART = 100.0


def _scale_values(layer_grid, tensor, zmin, zmax):
    """The values the colour scale spans, and whether the output layer's row was left out.

    Under cross-entropy the gradient at a softmax output is about 1/p, up to
    4e5 on a ResNet50's first steps: with it the scale ran 1e-3..1e6 and the
    other 175 rows were one dark blue.
    """
    present = layer_grid.values[layer_grid.present]
    if tensor != "activation" or zmax is not None or len(layer_grid.layer) < 3:
        return present, False
    top = int(np.argmax(layer_grid.layer_index))
    rest = np.delete(layer_grid.present, top, axis=0)
    others = np.delete(layer_grid.values, top, axis=0)[rest]
    output = layer_grid.values[top][layer_grid.present[top]]
    others, output = others[np.isfinite(others)], output[np.isfinite(output)]
    if not others.size or not output.size or output.max() <= _OUTPUT_APART * others.max():
        return present, False
    return others, True


def heatmap(
    layer_stats,
    statistic="max_abs",
    tensor="kernel",
    *,
    zmin=None,
    zmax=None,
    max_columns=decimate.DEFAULT_MAX_COLUMNS,
    power_of_two_blocks=False,
    title=None,
    presentation=False,
):
    """Heatmap of a per-layer gradient statistic over training steps.

    Layers are rows in `layer_index` order with the input layer at the
    bottom; steps are columns. Colour is log10 of the statistic; the colour
    bar is labelled in real units (`1e-6`, `1e-3`, `1`). Exact zeros show at
    the bottom of the scale; NaN and Inf cells are blank with a black `x`
    (NaN) or triangle (Inf) on top; unrecorded cells are blank. Long runs
    are decimated to at most `max_columns` columns keeping each block's max.

    Example:

    ```python
    chart = heatmap(run.layer_stats, "l2_norm", tensor="all_weights", zmin=1e-8, zmax=10)
    st.plotly_chart(chart.figure, config=PLOTLY_CONFIG)
    ```

    Args:
        layer_stats: tidy layer-statistics DataFrame
            (`gradflow.schema.LAYER_STATS_COLUMNS`).
        statistic: the column to colour by. Default `"max_abs"`.
        tensor: `"kernel"` (default), `"bias"`, `"activation"`, any other
            tensor kind in the frame, or `"all_weights"` to combine all
            variables of a layer (max of `max_abs`, root-sum-square of
            `l2_norm`).
        zmin: bottom of the colour scale in the statistic's units (e.g.
            `1e-8`), or None (default) for the decade below the data. Pass
            the same `zmin`/`zmax` to several heatmaps to compare them.
        zmax: top of the colour scale in real units, or None (default).
        max_columns: most columns drawn. Default 1000.
        power_of_two_blocks: decimate by a power-of-two number of steps per
            column (see `decimate_max`), so that a live chart of a growing
            run keeps its earlier columns. Default False.
        title: figure title (escaped), or None (default) for an automatic one.
        presentation: large fonts for slides. Default False.

    Returns:
        A `Chart`; `.data` has columns `layer_index, layer, step, step_last,
        <statistic>`: one row per drawn cell, values as recorded.

    Raises:
        TypeError: if `layer_stats` is not a DataFrame.
        ValueError: if `statistic` is not a column, `tensor` has no rows,
            or `zmin`/`zmax`/`max_columns` are invalid.
    """
    layer_grid = _decimated_grid(layer_stats, statistic, tensor, max_columns, power_of_two_blocks)
    scaled, output_apart = _scale_values(layer_grid, tensor, zmin, zmax)
    log_range = logscale.log_range(scaled, zmin, zmax)
    return _drawn(layer_grid, log_range, output_apart, title, presentation)


def heatmaps_on_one_scale(
    layer_stats,
    statistics,
    tensor="kernel",
    *,
    max_columns=decimate.DEFAULT_MAX_COLUMNS,
    power_of_two_blocks=False,
    presentation=False,
):
    """Heatmaps of several statistics on one colour scale, each as `heatmap` draws it.

    With gradient clipping the norms before and after it are drawn one
    under the other; each on its own scale, the same yellow meant 1000 above
    and 1 below, and the clipping could not be seen. The scale spans the
    cells drawn in all of them; each statistic's table is read once.

    Example:

    ```python
    before, after = heatmaps_on_one_scale(stats, ["l2_norm", "l2_norm_clipped"])
    ```

    Args:
        layer_stats: tidy layer-statistics DataFrame.
        statistics: the columns, one heatmap each.
        tensor, max_columns, power_of_two_blocks, presentation: as for
            `heatmap`.

    Returns:
        A list of `Chart`s, one per statistic, in order.

    Raises:
        As `heatmap`.
    """
    grids = [
        _decimated_grid(layer_stats, statistic, tensor, max_columns, power_of_two_blocks)
        for statistic in statistics
    ]
    scaled = [_scale_values(layer_grid, tensor, None, None) for layer_grid in grids]
    log_range = logscale.log_range(np.concatenate([values for values, _ in scaled]))
    return [
        _drawn(layer_grid, log_range, apart, None, presentation)
        for layer_grid, (_, apart) in zip(grids, scaled, strict=True)
    ]


def _decimated_grid(layer_stats, statistic, tensor, max_columns, power_of_two_blocks):
    return decimate.decimate_max(
        grid_lib.layer_grid(layer_stats, statistic, tensor),
        max_columns,
        power_of_two_blocks=power_of_two_blocks,
    )


def _drawn(layer_grid, log_range, output_apart, title, presentation):
    """The `Chart` of a decimated grid on the colour scale `log_range` (log10 bounds)."""
    statistic, tensor = layer_grid.statistic, layer_grid.tensor
    log_min, log_max = log_range
    # Rows through time are a sequence's time steps (GradientMonitor's
    # `through_time`), the first at the bottom, where a vanishing gradient
    # fades to, as the input layer is in the layers' heatmaps.
    in_time = tensor == schema.TIME_STEP
    plain_title = title or style.chart_heading(statistic, tensor)
    description = (
        f"Heatmap of the {style.STATISTIC_LABELS.get(statistic, statistic)} of the "
        f"{style.tensor_label(tensor)}: "
        + (
            "one row per time step of the sequence (the first at the bottom): the gradient of "
            "the network's outputs with respect to its input at that time step, how much of "
            "it still reaches the output"
            if in_time
            else "one row per layer (input at the bottom)"
        )
        + ", one column per step, colour on a log10 scale. Exact zeros ("
        + ("a padded or masked time step" if in_time else "a dead layer")
        + ") take the bottom colour, marked 0 on the colour bar; hover over or tap a cell for its value. Blank cells with a black x are NaN, with "
        "a triangle Inf."
    ) + (
        " The output layer's row, the loss's own gradient (about 1/p under cross-entropy), is "
        "far above the others: it is left out of the colour scale and drawn in its top colour."
        if output_apart
        else ""
    )
    if layer_grid.values.size == 0:
        figure = style.no_data_figure("No layer statistics recorded yet.", presentation)
        return Chart(figure, layer_grid.to_frame(), plain_title, description)
    zero_at = logscale.zero_level(layer_grid.values[layer_grid.present], log_min)
    figure = style.new_figure(heatmap_traces(layer_grid, log_min, log_max, zero_at=zero_at))
    figure.update_layout(
        title=style.escape_label(plain_title),
        xaxis_title=step_axis_title(layer_grid),
        yaxis_title=(
            "time step (first at the bottom)"
            if in_time
            else style.layer_axis_title("layer (input at the bottom)", layer_grid.layer)
        ),
        height=min(900, max(380, 60 + 22 * len(layer_grid.layer))),
        legend=LEGEND_ABOVE,
    )
    x_range, y_range = axis_ranges(layer_grid)
    figure.update_yaxes(
        type="category",
        showgrid=False,
        range=y_range,
        tickmode="array",
        tickvals=layer_ticks(layer_grid),
    )
    figure.update_xaxes(showgrid=False, range=x_range)
    style.apply_style(figure, presentation)
    return Chart(figure, layer_grid.to_frame(), plain_title, description)
