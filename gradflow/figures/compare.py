"""Figures that put two or more runs side by side on one scale."""

import copy
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from gradflow import checks, schema
from gradflow.figures import decimate, lines, logscale, style
from gradflow.figures import grid as grid_lib
from gradflow.figures import heatmap as heatmap_lib
from gradflow.figures import profile as profile_lib
from gradflow.figures.chart import Chart

_MAX_COLUMNS_PER_ROW = 3


def _check_runs(runs, argument="runs"):
    if not hasattr(runs, "items") or len(runs) == 0:
        raise ValueError(
            f"`{argument}` must be a non-empty mapping of run name -> DataFrame, got {type(runs).__name__} "
            f"of length {len(runs) if hasattr(runs, '__len__') else '?'}."
        )
    return [(str(name), frame) for name, frame in runs.items()]


def compare_heatmaps(
    runs,
    statistic="max_abs",
    tensor="kernel",
    *,
    zmin=None,
    zmax=None,
    max_columns=decimate.DEFAULT_MAX_COLUMNS,
    title=None,
    presentation=False,
    columns=None,
):
    """Heatmaps of several runs side by side with ONE shared colour scale.

    All panels use one layout colour axis, so a colour means the same value
    in every panel (relu vs sigmoid reads at a glance).

    Example:

    ```python
    chart = compare_heatmaps({"relu": relu.layer_stats, "sigmoid": sig.layer_stats}, "l2_norm")
    ```

    Args:
        runs: mapping of run name -> tidy layer-statistics DataFrame (in
            display order).
        statistic: the column to colour by. Default `"max_abs"`.
        tensor: tensor kind or `"all_weights"`. Default `"kernel"`.
        zmin: bottom of the shared scale in real units, or None (default)
            for the decade below the smallest value of any run.
        zmax: top of the shared scale, or None (default).
        max_columns: most columns per panel. Default 1000.
        title: figure title, or None (default).
        presentation: large fonts for slides. Default False.
        columns: panels per row, or None (default) for up to three. With
            more than one, the figure's `layout.meta["gradflow_narrow"]`
            also holds the axes, titles and height of one panel per row,
            which the dashboard's live charts use on a narrow screen (a
            phone gave each of two panels about 60 px).

    Returns:
        A `Chart`; `.data` is the heatmap data of every run with a leading
        `run` column.

    Raises:
        TypeError, ValueError: for an empty `runs`, or an invalid frame,
            statistic or tensor (named with the run).
    """
    named = _check_runs(runs)
    grids = []
    for name, frame in named:
        try:
            grids.append(
                decimate.decimate_max(grid_lib.layer_grid(frame, statistic, tensor), max_columns)
            )
        except (TypeError, ValueError) as error:
            raise type(error)(f"Run {name!r}: {error}") from error
    every = np.concatenate([g.values[g.present] for g in grids])
    log_min, log_max = logscale.log_range(every, zmin, zmax)
    zero_at = logscale.zero_level(every, log_min)

    columns = checks.positive_int("columns", columns, allow_none=True)
    cols = min(len(grids), columns or _MAX_COLUMNS_PER_ROW)
    figure = _panels(named, grids, cols, presentation)
    pieces = []
    for number, ((name, _), layer_grid) in enumerate(zip(named, grids, strict=True)):
        row, col = divmod(number, cols)
        frame = layer_grid.to_frame()
        frame.insert(0, "run", name)
        pieces.append(frame)
        if layer_grid.values.size == 0:
            continue
        prefix = style.escape_label(name) + ": "
        for trace in heatmap_lib.heatmap_traces(
            layer_grid, log_min, log_max, "coloraxis", prefix, zero_at
        ):
            figure.add_trace(trace, row=row + 1, col=col + 1)
    figure.update_layout(
        coloraxis=dict(
            cmin=log_min if zero_at is None else zero_at,
            cmax=log_max,
            colorscale=style.HEATMAP_COLORSCALE,
            colorbar=heatmap_lib.colorbar(statistic, log_min, log_max, zero_at),
        ),
    )
    rows = style.row_noun(tensor)
    heading = style.chart_heading(statistic, tensor)
    plain_title = title or f"{heading}: " + " vs ".join(name for name, _ in named)
    # Each panel's title names its run: with the names in it too, the title of
    # two presets ran off the page ("...: it re").
    shown_title = style.escape_label(title or heading)
    if any(g.decimated for g in grids):
        longest = max(heatmap_lib.step_axis_title(g) for g in grids if g.decimated)
        shown_title += f"<br><sup>{longest.removeprefix('step (').rstrip(')')}</sup>"
    figure.update_layout(title=shown_title)
    style.apply_style(figure, presentation)
    # Room for the subtitle above the panels' own titles, which it covered,
    # and for the panel titles' second lines, which covered the title.
    font = style.font_size_of(presentation)
    extra = font + 12 if "<br>" in shown_title else 0
    wrapped = max((a.text or "").count("<br>") for a in figure.layout.annotations)
    extra += wrapped * (font + 14)
    if extra:
        # Taller by as much: the panels keep their size and their rows'
        # gaps (`_space_rows` set them in shares of the height between the margins).
        figure.update_layout(
            margin_t=figure.layout.margin.t + extra,
            height=figure.layout.height + extra,
            # At the top, not in the middle of the taller margin, where it
            # ran into the first line of three-line panel titles.
            title=dict(y=1, yref="container", yanchor="top", pad=dict(t=16)),
        )
    if cols > 1:
        # The same panels one per row (the axes keep their numbers, so the
        # traces stay on theirs): what the live chart swaps in when narrow.
        narrow = _one_per_row(named, grids, presentation)
        figure.update_layout(meta={"gradflow_narrow": narrow, "gradflow_columns": cols})
    description = (
        f"The {style.STATISTIC_LABELS.get(statistic, statistic)} of the "
        f"{style.tensor_label(tensor)} per {rows} and step for each run, on one shared "
        "log colour scale, so equal colours mean equal values across panels."
    )
    return Chart(figure, pd.concat(pieces, ignore_index=True), plain_title, description)


# (run names, each panel's layers or None, presentation) -> `_one_per_row`'s layout.
_ONE_PER_ROW = {}


def _one_per_row(named, grids, presentation):
    """The axes, subplot titles, height and legend of the panels one per row.

    Only the step axes' ranges change as runs grow, so the rest is made once
    per set of runs and layers: Plotly's subplots cost about 20 ms a figure,
    as much again as the comparison itself, at every tick of the Compare page.
    """
    key = (
        tuple(name for name, _ in named),
        tuple(tuple(map(str, g.layer)) if g.values.size else None for g in grids),
        presentation,
    )
    layout = _ONE_PER_ROW.get(key)
    if layout is None:
        stacked = _panels(named, grids, 1, presentation).layout
        layout = {
            name: stacked[name].to_plotly_json()
            for name in stacked
            if name.startswith(("xaxis", "yaxis")) and stacked[name] is not None
        }
        layout["annotations"] = [a.to_plotly_json() for a in stacked.annotations]
        layout["height"] = stacked.height
        layout["legend"] = stacked.legend.to_plotly_json()
        if len(_ONE_PER_ROW) >= 64:
            _ONE_PER_ROW.clear()
        _ONE_PER_ROW[key] = layout
    narrow = copy.deepcopy(layout)
    for number, layer_grid in enumerate(grids):
        if layer_grid.values.size:
            axis = f"xaxis{number + 1 if number else ''}"
            narrow[axis]["range"] = heatmap_lib.axis_ranges(layer_grid)[0]
    return narrow


# The characters of a panel title that fit on one line, with two panels to a
# row, at screen and at slide size (about 400 px each at 1280 px wide).
_TITLE_CHARACTERS = {False: 44, True: 30}


def _panels(named, grids, cols, presentation):
    """The subplots of `compare_heatmaps`, `cols` to a row: titles, axes and size, no traces.

    Made once more with one panel per row for narrow screens
    (`_one_per_row`), without decimating or drawing the runs again.
    """
    rows = math.ceil(len(grids) / cols)
    # Same layers in every run (the usual relu-vs-sigmoid lesson): one shared
    # layer axis labelled once, so the panels can sit close together.
    same_layers = all(g.layer == grids[0].layer for g in grids)
    in_time = any(g.tensor == schema.TIME_STEP for g in grids)
    panel = min(700, max(380, 60 + 18 * max(len(g.layer) for g in grids)))
    # Two presets' names side by side ran into each other at 1280 px
    # ("...it cannot remeLSTM on..."): two lines each when long.
    titles = [
        style.wrap_label(name, _TITLE_CHARACTERS[presentation] * 2 // cols) for name, _ in named
    ]
    gap = _row_gap(titles[cols:], presentation)
    height = rows * panel + (rows - 1) * gap
    # As many row labels as the panel's height holds at the font's size: the
    # 30 time steps of a recurrent run overlapped at slide size.
    labels = max(2, int((panel - 140) / (1.15 * style.font_size_of(presentation))))
    figure = make_subplots(
        figure=style.new_figure(),
        rows=rows,
        cols=cols,
        subplot_titles=titles,
        shared_yaxes=same_layers,
        horizontal_spacing=0.05 if same_layers else 0.22,
        # Set in pixels by `space_rows` once the margins are known: a share
        # of the height passed Plotly's limit of 1/(rows - 1) at seven runs.
        vertical_spacing=min(0.9 / (rows - 1), gap / height) if rows > 1 else 0.1,
    )
    for number, layer_grid in enumerate(grids):
        row, col = divmod(number, cols)
        if layer_grid.values.size == 0:
            continue
        x_range, y_range = heatmap_lib.axis_ranges(layer_grid)
        figure.update_xaxes(title_text="step", range=x_range, row=row + 1, col=col + 1)
        figure.update_yaxes(
            type="category",
            range=y_range,
            tickmode="array",
            tickvals=heatmap_lib.layer_ticks(layer_grid, most=labels),
            # Once per row of panels when they share the layers.
            title_text=(
                (
                    "time step (first at the bottom)"
                    if in_time
                    else style.layer_axis_title("layer (input at the bottom)", layer_grid.layer)
                )
                if col == 0 or not same_layers
                else None
            ),
            row=row + 1,
            col=col + 1,
        )
    figure.update_layout(
        height=height,
        legend=dict(orientation="h", x=0.0, y=-0.25 if rows == 1 else -0.12),
    )
    figure.update_xaxes(showgrid=False)
    figure.update_yaxes(showgrid=False)
    style.apply_style(figure, presentation)
    _space_rows(figure, len(grids), cols, gap)
    return figure


def _row_gap(titles, presentation):
    """Pixels between rows of panels: a row's step axis (its tick labels and
    title) and the titles of the panels below it, at the figures' font size.

    A fixed share of the height left about 90 px: at slide size a
    two-line run name below the first row was drawn over its "step".
    """
    font = style.font_size_of(presentation)
    lines = max((title.count("<br>") + 1 for title in titles), default=1)
    return round(3.5 * font + 1.4 * font * lines + 24)


def _space_rows(figure, count, cols, gap):
    """Rows of `count` panels, `cols` to a row, `gap` px apart, in the figure's height and margins.

    Plotly's subplots share out the height between the margins, so a gap
    set as a share of the figure shrank as the margins grew (a wrapped
    title, a subtitle). Run again after a margin changes.
    """
    rows = math.ceil(count / cols)
    if rows < 2:
        return
    margin = figure.layout.margin
    area = figure.layout.height - margin.t - margin.b
    panel = (area - (rows - 1) * gap) / rows
    for number in range(count):
        top = 1 - (number // cols) * (panel + gap) / area
        figure.layout[f"yaxis{number + 1 if number else ''}"].domain = [
            max(0.0, top - panel / area),
            top,
        ]
        figure.layout.annotations[number].y = top  # the panel's title


def compare_profiles(
    runs,
    step=None,
    statistic="max_abs",
    tensor="kernel",
    *,
    title=None,
    presentation=False,
):
    """Depth profiles of several runs overlaid: statistic vs layer index.

    Example:

    ```python
    chart = compare_profiles({"relu": a.layer_stats, "sigmoid": b.layer_stats}, step=200)
    ```

    Args:
        runs: mapping of run name -> tidy layer-statistics DataFrame.
        step: the step (last recorded at or before it, per run), or None
            (default) for each run's last step; for a run whose last step
            is NaN or Inf (it diverged), its last step with every value
            finite, where it can be compared with the others.
        statistic: the column to plot. Default `"max_abs"`.
        tensor: tensor kind or `"all_weights"`. Default `"kernel"`.
        title: figure title, or None (default).
        presentation: large fonts for slides. Default False.

    Returns:
        A `Chart`; `.data` has columns `run, depth, layer_index, layer,
        step, <statistic>`: `depth` counts a run's layers that have
        `tensor` (0 nearest the input), so that runs with extra layers
        between them (BatchNormalization, activations) line up.

    Raises:
        TypeError, ValueError: for an empty `runs`, an invalid frame or step.
    """
    named = _check_runs(runs)
    pieces = []
    before_last = {}  # run -> whether it is drawn before its last step (that one all NaN)
    for name, frame in named:
        try:
            grid_lib.check_layer_stats(frame, statistic)
            shown = profile_lib.resolve_step(frame, tensor, step)
        except (TypeError, ValueError) as error:
            raise type(error)(f"Run {name!r}: {error}") from error
        if shown is None:
            continue
        last = shown
        if step is None:
            drawn = _last_drawn_step(frame, tensor, statistic)
            # A diverged run's last step is all NaN: no line beside the other
            # runs. One with some finite values is drawn, its NaNs marked: a
            # run whose one broken layer was hidden by going back to its last
            # finite step read as healthy (the odd-runs audit).
            shown = drawn if drawn is not None else shown
        piece = profile_lib.profile_frame(frame, shown, tensor, [statistic])
        piece.insert(0, "run", name)
        before_last[name] = shown < last
        # Depth counts the layers with this tensor: by `layer_index`, a batch-norm
        # network's 10th dense layer stood at 30 (its BatchNormalization and
        # Activation layers counted), beside the plain network's at 10.
        # Time steps count from 1, as their labels (t=1, ...) do.
        first = 1 if tensor == schema.TIME_STEP else 0
        piece.insert(1, "depth", piece["layer_index"].rank(method="dense").astype(int) - 1 + first)
        pieces.append(piece)
    columns = ["run", "depth", "layer_index", "layer", "step", statistic]
    data = pd.concat(pieces, ignore_index=True) if pieces else pd.DataFrame(columns=columns)
    shown_steps = sorted({int(s) for s in data["step"]}) if len(data) else []
    # Which step it is: each run's last unless one was chosen (then each
    # run's step is in its legend entry: a title saying it was cut).
    at = (
        f" at step {shown_steps[0]}"
        if len(shown_steps) == 1
        else " at each run's last step"
        if step is None
        else f" at step {step} or the last before it"
    )
    in_time = tensor == schema.TIME_STEP
    if in_time:
        # One step's profile through time is noisy (`profile.profile_frame`).
        at += f", median of up to {profile_lib.TIME_WINDOW} recorded steps"
    plain_title = (
        title
        or f"{style.STATISTIC_LABELS.get(statistic, statistic)} by "
        + ("time step" if in_time else "depth")
        + f" ({style.tensor_label(tensor)}){at if shown_steps else ''}"
    )
    description = (
        f"The {style.STATISTIC_LABELS.get(statistic, statistic)} of the "
        f"{style.tensor_label(tensor)} against "
        + (
            "the time step (1 = the first), one line per run, log scale."
            if in_time
            else "depth (the n-th layer with one, 0 = input side), one line per run, log scale."
        )
    )
    if data.empty:
        return Chart(
            style.no_data_figure("No layer statistics recorded yet.", presentation),
            data,
            plain_title,
            description,
        )

    values = data[statistic].to_numpy(dtype=np.float64)
    log_min, log_max = logscale.log_range(values)
    zero_at = logscale.zero_level(values, log_min)
    figure = style.new_figure()
    broken = ~np.isfinite(values)
    for (name, piece), color in zip(
        data.groupby("run", sort=False), style.line_colors(len(pieces)), strict=False
    ):
        raw = piece[statistic].to_numpy(dtype=np.float64)
        label = style.escape_label(name)
        drawn_at = int(piece["step"].iloc[0])
        named = label
        if len(shown_steps) > 1:
            named += f" (step {drawn_at}" + (
                ", its last with a value)" if before_last[name] else ")"
            )
        # Whole paths: hover text has room, and no axis title says what "…/" is.
        layers = [style.escape_label(layer) for layer in piece["layer"].tolist()]
        figure.add_trace(
            go.Scatter(
                x=piece["depth"].to_numpy(),
                y=np.power(10.0, logscale.to_log(raw, log_min, zero_at)),
                customdata=np.stack([raw, piece["step"].to_numpy(dtype=np.float64)], axis=1),
                text=layers,
                mode="lines+markers",
                name=named,
                line=dict(color=color, width=2),
                hovertemplate=f"{label}<br>%{{text}} (step %{{customdata[1]}})<br>%{{customdata[0]:.3g}}<extra></extra>",
            )
        )
        bad = ~np.isfinite(raw)
        # Above the lines, at the layer's depth, as in the one-run profile.
        for trace in heatmap_lib.nonfinite_markers(
            piece["depth"].to_numpy()[bad],
            np.full(int(bad.sum()), 10.0 ** (log_max + _MARKER_HEADROOM / 2)),
            raw[bad],
            np.asarray([f"{label}<br>{layer}" for layer in layers], dtype=object)[bad],
            name_prefix=f"{label}: ",
            at=f"step {drawn_at}",
        ):
            figure.add_trace(trace)
    tickvals, ticktext = logscale.decade_ticks(log_min, log_max, zero_at=zero_at)
    figure.update_layout(
        title=style.escape_label(plain_title),
        xaxis_title=(
            # A long sequence's rows hold several steps each ("t=001–003").
            (
                "row of time steps"
                if data["layer"].astype(str).str.contains("–").any()
                else "time step"
            )
            + " (1 = the first)"
            if in_time
            else f"depth: {style.tensor_label(tensor)} layers, 0 = input side"
        ),
        yaxis_title=style.statistic_label(statistic) + " (log scale)",
    )
    # Whole depths: a two-layer network was ticked 0, 0.5 and 1.
    figure.update_xaxes(tick0=0, dtick=max(1, math.ceil(int(data["depth"].max()) / 10)))
    figure.update_yaxes(
        type="log",
        range=[
            log_min if zero_at is None else zero_at,
            log_max + (_MARKER_HEADROOM if broken.any() else 0),
        ],
        tickvals=[10.0**v for v in tickvals],
        ticktext=ticktext,
    )
    style.apply_style(figure, presentation)
    # Below the plot: beside it, the run names left a half-width chart 60 px
    # and the legend hid a run's line.
    style.legend_below(figure, columns=1)
    return Chart(figure, data, plain_title, description)


# Room above the lines for the NaN/Inf markers, in decades (as `profile.py`).
_MARKER_HEADROOM = 0.35


def _last_drawn_step(frame, tensor, statistic):
    """The last step at which some layer's `statistic` of `tensor` is finite, or None."""
    rows = frame[grid_lib.tensor_mask(frame, tensor)]
    finite = np.isfinite(rows[statistic].to_numpy(dtype=np.float64))
    some = pd.Series(finite).groupby(rows["step"].to_numpy()).any()
    some = some[some]
    return int(some.index.max()) if len(some) else None


def compare_metrics(
    runs,
    name="loss",
    *,
    validation=True,
    log_y=None,
    max_points=decimate.DEFAULT_MAX_COLUMNS,
    title=None,
    presentation=False,
):
    """One metric (e.g. loss) of several runs overlaid; validation dashed.

    Example:

    ```python
    chart = compare_metrics({"relu": a.metrics, "sigmoid": b.metrics}, "loss")
    ```

    Args:
        runs: mapping of run name -> long metrics DataFrame.
        name: the metric. Default `"loss"`.
        validation: also draw `val_<name>` dashed when recorded. Default True.
        log_y: log y axis (True), linear (False), or None (default): log
            when every value is positive and they span more than three
            decades. Beside a diverged run's loss of 1e7 a linear axis drew
            the other runs' losses as a flat 0.
        max_points: about this many points per line at most. Default 1000.
        title: figure title, or None (default).
        presentation: large fonts for slides. Default False.

    Returns:
        A `Chart`; `.data` has columns `run, step, name, value`.

    Raises:
        TypeError, ValueError: for an empty `runs` or an invalid frame.
    """
    named = _check_runs(runs)
    validation = checks.flag("validation", validation)
    if log_y is not None:
        log_y = checks.flag("log_y", log_y)
    if not isinstance(name, str):
        raise ValueError(f"`name` must be a metric's name, such as 'loss', got {name!r}.")
    figure = style.new_figure()
    pieces = []
    every_name = set()
    broken = []  # (label, steps, values) of the lines with NaN/Inf points
    for (run, metrics), color in zip(named, style.line_colors(len(named)), strict=True):
        try:
            lines.check_metrics(metrics)
        except (TypeError, ValueError) as error:
            raise type(error)(f"Run {run!r}: {error}") from error
        recorded = set(metrics["name"].unique())
        every_name |= recorded
        for metric, dash in ((name, "solid"), (f"val_{name}", "dash")):
            if metric not in recorded or (dash == "dash" and not validation):
                continue
            steps, values, _ = lines.metric_series(metrics, metric, max_points)
            pieces.append(
                pd.DataFrame({"run": run, "step": steps, "name": metric, "value": values})
            )
            label = style.escape_label(run) + (" (validation)" if dash == "dash" else "")
            if not np.isfinite(values).all():
                broken.append((label, steps, values))
            figure.add_trace(
                go.Scatter(
                    x=steps,
                    y=values,
                    # Validation comes once an epoch: its few points, marked,
                    # stay visible on the training line of the same colour.
                    # A run of one recorded step has no line to draw: its point is marked.
                    mode="lines" if dash == "solid" and len(steps) > 1 else "lines+markers",
                    marker=dict(symbol="diamond", size=8),
                    name=label,
                    line=dict(color=color, dash=dash, width=2),
                    hovertemplate=f"{label}<br>step %{{x}}<br>%{{y:.4g}}<extra></extra>",
                )
            )
    # The runs are in the legend (a title with them was cut on a half-width chart).
    plain_title = title or f"{name} over training"
    description = f"{name} per step of each run (validation dashed when recorded)."
    data = (
        pd.concat(pieces, ignore_index=True)
        if pieces
        else pd.DataFrame(columns=["run", "step", "name", "value"])
    )
    if data.empty and every_name:
        raise ValueError(
            f"`name` must be a metric the runs recorded, got {name!r}; they recorded "
            f"{sorted(every_name)}."
        )
    if data.empty:
        return Chart(
            style.no_data_figure(f"No {name} recorded yet.", presentation),
            data,
            plain_title,
            description,
        )
    values = data["value"].to_numpy(dtype=np.float64)
    values = values[np.isfinite(values)]
    if log_y is None:
        log_y = bool(len(values) and values.min() > 0 and values.max() > 1000 * values.min())
    # A line stops at a NaN: its steps marked at the top of the data, as on
    # the Live page (a run's NaN loss drew nothing here).
    top = float(values.max()) if len(values) else 1.0
    for label, steps, run_values in broken:
        bad = ~np.isfinite(run_values)
        for trace in heatmap_lib.nonfinite_markers(
            steps[bad],
            np.full(int(bad.sum()), top),
            run_values[bad],
            np.full(int(bad.sum()), label, dtype=object),
            name_prefix=f"{label}: ",
        ):
            figure.add_trace(trace)
    figure.update_layout(
        title=style.escape_label(plain_title),
        xaxis_title="step",
        yaxis_title=style.escape_label(name) + (" (log scale)" if log_y else ""),
    )
    if log_y:
        figure.update_yaxes(type="log")
    style.apply_style(figure, presentation)
    style.legend_below(figure, columns=1)  # run names are long: one a row
    return Chart(figure, data, plain_title, description)
