"""Export figures and their data: PNG, SVG, PDF, HTML, CSV and a lesson pack.

Static images are rendered by kaleido 1.x in a headless Chromium. gradflow
never lets kaleido download a browser: it uses `$GRADFLOW_CHROMIUM`,
`$BROWSER_PATH` or a Chromium/Chrome found on the PATH, and otherwise raises
`ExportError` saying what to install. The browser stays open between
exports and closes when idle (`gradflow.image_renderer`). HTML pages embed plotly.js, so they
open offline; CSV holds exactly the values drawn, safe to open in a
spreadsheet.

Example:

```python
from gradflow import export, figures
chart = figures.heatmap(run.layer_stats)
open("heatmap.png", "wb").write(export.to_image(chart, "png"))
export.export_run(store, run_id, "zip", "out/")
```
"""

import io
import json
import math
import os
import pathlib
import re
import shutil
import zipfile

import numpy as np
import pandas as pd
import plotly.io

from gradflow import checks, figures, schema
from gradflow.diagnosis import diagnose, run_layer_inputs, run_thresholds
from gradflow.figures import style
from gradflow.image_renderer import ImageRenderer
from gradflow.run_settings import script_settings

IMAGE_FORMATS = ("png", "svg", "pdf")
EXPORT_FORMATS = (*IMAGE_FORMATS, "html", "csv", "zip")

# Searched in this order after $GRADFLOW_CHROMIUM and $BROWSER_PATH.
_BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_DEFAULT_WIDTH = 1100
_DEFAULT_HEIGHT = 600
# Spreadsheets run a cell starting with these as a formula (CSV injection).
_FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


# One browser for the process's image exports, kept open between them
# (`gradflow.image_renderer`: starting it is most of an export's time).
RENDERER = ImageRenderer()


class ExportError(RuntimeError):
    """An export could not be produced (no browser, rendering failed, no data)."""


def find_browser():
    """The Chromium/Chrome executable kaleido should use, or None.

    Looks at `$GRADFLOW_CHROMIUM`, then `$BROWSER_PATH` (the variable
    choreographer itself reads), then `chromium`, `chromium-browser` and
    `google-chrome` on the PATH.

    Returns:
        An absolute path string, or None when no browser is installed.
    """
    for variable in ("GRADFLOW_CHROMIUM", "BROWSER_PATH"):
        candidate = os.environ.get(variable)
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    for name in _BROWSER_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _figure_of(figure_or_chart, argument="figure"):
    if isinstance(figure_or_chart, figures.Chart):
        return figure_or_chart.figure
    if hasattr(figure_or_chart, "to_dict") and hasattr(figure_or_chart, "layout"):
        return figure_or_chart
    raise TypeError(
        f"`{argument}` must be a plotly Figure or a gradflow.figures.Chart, got {type(figure_or_chart).__name__}."
    )


def _store_of(store):
    """A `RunStore` for a path (as `GradientMonitor(store=...)` takes); a store as is."""
    if isinstance(store, (str, os.PathLike)):
        if not os.path.isfile(store):
            raise ValueError(
                f"`store` must be a run store or its file, got {store!r}: no such file."
            )
        from gradflow.store import RunStore  # Here: the store is not needed to draw.

        return RunStore(store)
    if not all(hasattr(store, name) for name in ("run_info", "layer_stats", "metrics")):
        raise ValueError(
            f"`store` must be a gradflow.RunStore or the path of its file, got "
            f"{type(store).__name__}."
        )
    return store


def _check_format(format, allowed, argument="format"):
    if format not in allowed:
        raise ValueError(f"`{argument}` must be one of {list(allowed)}, got {format!r}.")


def to_images(figure_list, format="png", *, width=None, height=None, scale=None):
    """Render several figures to image bytes in the process's one browser.

    Example:

    ```python
    png_a, png_b = to_images([chart_a, chart_b], "png")
    ```

    Args:
        figure_list: plotly Figures or `Chart`s.
        format: `"png"` (default), `"svg"` or `"pdf"`.
        width: pixels; None (default) for the figure's own width or 1100.
        height: pixels; None (default) for the figure's own height or 600.
        scale: resolution multiplier; None (default) for 2 for PNG (sharp
            on slides) and 1 for the vector formats.

    Returns:
        A list of `bytes`, one per figure.

    Raises:
        ValueError: if `format` is not an image format, or `width`, `height`
            or `scale` is not positive or makes an image larger than a
            browser can draw.
        TypeError: if an item is not a Figure or Chart.
        ExportError: if no Chromium is installed or rendering fails.
    """
    _check_format(format, IMAGE_FORMATS)
    plotly_figures = [_figure_of(f, "figure_list") for f in figure_list]
    width = checks.positive_int("width", width, allow_none=True)
    height = checks.positive_int("height", height, allow_none=True)
    if scale is not None:
        scale = checks.positive_number("scale", scale)
    if not plotly_figures:
        return []
    scale = scale if scale is not None else (2 if format == "png" else 1)
    specs = []
    for figure in plotly_figures:
        size = dict(
            width=width or figure.layout.width or _DEFAULT_WIDTH,
            height=height or figure.layout.height or _DEFAULT_HEIGHT,
        )
        _check_drawable(size, scale)
        specs.append((figure.to_dict(), dict(format=format, scale=scale, **size)))
    browser = find_browser()
    if browser is None:
        raise ExportError(
            "PNG/SVG/PDF export needs Chromium or Chrome, and none was found. Install it "
            "(Debian/Ubuntu: `apt-get install chromium`) or set GRADFLOW_CHROMIUM to the "
            "browser's path. HTML and CSV export work without a browser."
        )

    try:
        return RENDERER.render(browser, specs)
    except Exception as error:
        raise ExportError(f"Rendering {format.upper()} with {browser} failed: {error}") from error


def to_image(figure, format="png", *, width=None, height=None, scale=None):
    """Render one figure to PNG, SVG or PDF bytes (see `to_images`)."""
    _figure_of(figure)
    return to_images([figure], format, width=width, height=height, scale=scale)[0]


# What Chromium's canvas draws: 32,767 px a side and 268 million pixels
# (2**28). Beyond them `scale=100` gave 3 bytes of garbage and no error.
_LARGEST_SIDE = 32_767
_LARGEST_AREA = 2**28


def _check_drawable(size, scale):
    width, height = size["width"] * scale, size["height"] * scale
    if max(width, height) > _LARGEST_SIDE or width * height > _LARGEST_AREA:
        raise ValueError(
            f"An image of {size['width']}x{size['height']} px at `scale` {scale:g} would be "
            f"{width:,.0f}x{height:,.0f} px, more than a browser can draw (32,767 px a side, "
            "268 million pixels): give a smaller `scale`, `width` or `height`."
        )


def to_html(figure, *, title=None):
    """A standalone interactive HTML page with plotly.js inline (works offline).

    Args:
        figure: a plotly Figure or `Chart`.
        title: the page title (escaped), or None (default) for the chart's
            title or "gradflow figure".

    Returns:
        The HTML page as a string. Non-finite values are encoded by Plotly as
        typed arrays or `null`, never as bare `NaN`, so the embedded JSON is
        valid; user text is escaped.
    """
    plotly_figure = _figure_of(figure)
    if title is None:
        title = (
            figure.title
            if isinstance(figure, figures.Chart) and figure.title
            else "gradflow figure"
        )
    page = plotly.io.to_html(
        plotly_figure,
        include_plotlyjs=True,
        full_html=True,
        config=style.PLOTLY_CONFIG,
        validate=False,
    )
    return page.replace("</head>", f"<title>{style.escape_label(title)}</title></head>", 1)


def _neutralize(value):
    if isinstance(value, str) and value.startswith(_FORMULA_PREFIXES):
        return "'" + value
    return value


def neutralize_csv_cells(data):
    """A copy of `data` where text cells cannot run as spreadsheet formulas.

    Text starting with `=`, `+`, `-`, `@`, tab or carriage return gets a
    leading `'`. Numbers (negative ones included) are left alone.

    Args:
        data: a DataFrame.

    Returns:
        A new DataFrame.
    """
    safe = data.copy()
    for column in safe.columns:
        if safe[column].dtype == object or isinstance(
            safe[column].dtype, (pd.CategoricalDtype, pd.StringDtype)
        ):
            safe[column] = safe[column].astype(object).map(_neutralize)
    safe.columns = [_neutralize(str(c)) for c in safe.columns]
    return safe


def to_csv(data):
    """CSV text of exactly the data a chart draws, safe for spreadsheets.

    Example:

    ```python
    text = to_csv(chart)          # or to_csv(chart.data)
    pandas.read_csv(io.StringIO(text))
    ```

    Args:
        data: a `Chart` (its `.data` is written) or a DataFrame.

    Returns:
        CSV text; NaN is written `nan` and infinities `inf`/`-inf`, which
        pandas reads back as floats.

    Raises:
        TypeError: if `data` is neither.
    """
    if isinstance(data, figures.Chart):
        data = data.data
    if not isinstance(data, pd.DataFrame):
        raise TypeError(
            f"`data` must be a pandas DataFrame or a gradflow.figures.Chart, got {type(data).__name__}."
        )
    # CRLF line ends (RFC 4180) also make the csv module quote fields holding
    # a lone "\r" or "\n", which would otherwise split a row in two.
    return neutralize_csv_cells(data).to_csv(index=False, na_rep="nan", lineterminator="\r\n")


def safe_filename(name, default="figure"):
    """A file name made from user text that cannot leave its folder.

    Keeps letters, digits, `.`, `_` and `-`; anything else (slashes, `..`,
    spaces, `<>`) becomes `_`; at most 80 characters.

    Args:
        name: the text (a run name, a layer name).
        default: used when nothing printable is left. Default `"figure"`.

    Returns:
        The file name, never empty, never starting with a dot.
    """
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._-")[:80]
    return cleaned or default


def file_stem(title, run=None):
    """The name of a chart's file, before its extension: the run's name first, if any.

    Example:

    ```python
    file_stem("Max |gradient| per layer", "relu · depth 20")
    # 'relu_depth_20_Max_gradient_per_layer'
    ```

    Args:
        title: the chart's title.
        run: the run's name, or None (default).

    Returns:
        A `safe_filename`: the run's part at most 48 characters, so that
        the title still tells a run's figures apart.
    """
    stem = safe_filename(title)
    if run is None:
        return stem
    return f"{safe_filename(run, 'run')[:48].rstrip('._-')}_{stem}"


def _json_safe(value):
    """Recursively replace NaN/Inf with None so `json.dumps` stays strict JSON."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def lesson_pack(
    charts, config=None, title="gradflow lesson pack", alerts=None, run_info=None, metrics=None
):
    """A zip for a lesson: figures (PNG + HTML), data CSVs, config and README.

    Layout: `README.txt`, `config.json`, `figures/<name>.png`,
    `figures/<name>.html`, `data/<name>.csv`, with `alerts`
    `data/alerts.csv`, whose first messages the README quotes (what the
    dashboard's Alerts view said: a handout says what went wrong too), and
    with `metrics` `data/all_metrics.csv`.

    Example:

    ```python
    blob = lesson_pack({"heatmap": heatmap(stats), "loss": metrics_chart(m)}, config=info["config"])
    ```

    Args:
        charts: mapping of name -> `Chart` (names are sanitised for files).
        config: the run configuration dict written to `config.json`, or None
            (default) for `{}`.
        title: first line of the README. Default `"gradflow lesson pack"`.
        alerts: the run's events (`step, layer, kind, message`, as
            `run_alerts` gives them; empty: the README says the rules found
            nothing), or None (default) to leave them out.
        run_info: the run's record (`RunStore.run_info`), or None (default):
            the README then says how the run ended (completed, stopped or
            diverged, at which step of how many) and how often it recorded,
            so a pack of a stopped run does not read as a finished one.
        metrics: every metric value of the run (`every_metric`: `run, step,
            name, value, block`), or None (default) to leave it out: a
            chart draws some metrics, decimated on a long run.

    Returns:
        The zip file as bytes.

    Raises:
        ValueError: if `charts` is empty.
        ExportError: if the PNGs cannot be rendered (no Chromium).
    """
    if not charts:
        raise ValueError("`charts` must hold at least one chart, got an empty mapping.")
    named = []
    used = set()
    for name, chart in charts.items():
        if not isinstance(chart, figures.Chart):
            raise TypeError(
                f"`charts` values must be gradflow.figures.Chart, got {type(chart).__name__} for {name!r}."
            )
        stem = safe_filename(name)
        while stem in used:
            stem += "_"
        used.add(stem)
        named.append((stem, chart))
    pngs = to_images([chart for _, chart in named], "png")

    readme = [title, "=" * len(title), "", *_ending_readme(run_info, config)]
    readme += ["Made with gradflow. Contents:", ""]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for (stem, chart), png in zip(named, pngs, strict=True):
            archive.writestr(f"figures/{stem}.png", png)
            archive.writestr(f"figures/{stem}.html", to_html(chart))
            archive.writestr(f"data/{stem}.csv", to_csv(chart))
            readme += [
                f"figures/{stem}.png, figures/{stem}.html, data/{stem}.csv",
                f"  {chart.title}",
                f"  {chart.description}",
                "",
            ]
        if alerts is not None:
            alerts = alerts_in_order(alerts)
            archive.writestr("data/alerts.csv", to_csv(alerts))
            readme += _alerts_readme(alerts)
        if metrics is not None:
            archive.writestr("data/all_metrics.csv", to_csv(metrics))
            readme += [_ALL_METRICS_README, ""]
        readme += [
            "config.json: the settings of the run.",
            "The HTML files are interactive (zoom, hover) and work offline.",
            "The CSV files hold exactly the values drawn. In a long run a heatmap shows",
            "the maximum over blocks of steps, and a loss curve each block's lowest and",
            "highest value (its `block` column numbers the blocks), so no spike, dip, NaN or",
            "Inf is hidden.",
            "Text cells starting with = + - @, a tab or a carriage return are prefixed with ' "
            "for spreadsheet safety.",
        ]
        archive.writestr(
            "config.json",
            json.dumps(_json_safe(config or {}), indent=2, sort_keys=True, allow_nan=False),
        )
        archive.writestr("README.txt", "\n".join(readme) + "\n")
    return buffer.getvalue()


_ENDINGS = {
    "completed": "Completed",
    "stopped": "Stopped",
    "diverged": "Diverged (the loss or a gradient became NaN or infinite)",
    "interrupted": "Interrupted",
    "failed": "Failed",
    "running": "Still training when this pack was made",
    "paused": "Paused when this pack was made",
    "queued": "Not started when this pack was made",
}


def _ending_readme(info, config):
    """How the run ended and how often it recorded: the README's first lines."""
    if not info:
        return []
    step, total = info.get("progress_step"), info.get("total_steps")
    where = ""
    if step is not None:
        where = f" at step {step}" + (f" of {total}" if total else "")
        if info.get("status") in ("running", "paused", "queued"):
            where = "," + where
    lines = [f"{_ENDINGS.get(info.get('status'), info.get('status'))}{where}."]
    if info.get("message"):
        lines.append(str(info["message"]))
    every = (config or {}).get("record_every")
    if isinstance(every, int) and every > 1:
        lines.append(f"Statistics were recorded every {every} steps.")
    settings = script_settings(info)
    if settings:
        lines.append(f"Recorded from a script: {settings.replace('`', '')}.")
    return [*lines, ""]


# The README quotes this many alerts; data/alerts.csv holds them all.
_ALERTS_QUOTED = 10


# The README quotes the gravest alerts first: a diverged run's NaN origin came
# after sixteen vanishing-gradient lines of the step before.
_GRAVITY = {"nonfinite": 0, "exploding": 1, "no_gradient": 2}


def gravity(kind):
    """How serious an alert of `kind` is: 0 for NaN/Inf, then exploding, no gradient, the rest."""
    return _GRAVITY.get(kind, len(_GRAVITY))


def alerts_in_order(alerts):
    """Alerts told once each, the most serious first (NaN/Inf, exploding, ...), then by step.

    Args:
        alerts: An events DataFrame (`step, layer, kind, message`) or a list
            of such rows.

    Returns:
        An events DataFrame, possibly empty.
    """
    columns = list(schema.EVENTS_COLUMNS)
    frame = pd.DataFrame(alerts, columns=columns) if len(alerts) else pd.DataFrame(columns=columns)
    frame = frame.drop_duplicates(subset=["kind", "layer", "message"])
    gravity = frame["kind"].map(_GRAVITY).fillna(len(_GRAVITY))
    order = np.lexsort((frame["step"].to_numpy(), gravity.to_numpy()))
    return frame.iloc[order].reset_index(drop=True)[columns]


def _alerts_readme(alerts):
    if alerts.empty:
        return [
            "data/alerts.csv: empty. The diagnosis rules found no vanishing, exploding, dead or",
            "  non-finite gradients in this run.",
            "",
        ]
    # In order of gravity (a NaN first), then of step: not the run's first alerts.
    # An `info` event (the gradient through time came back, ...) is a note.
    notes = int((alerts["kind"] == "info").sum())
    warned = len(alerts) - notes
    found = f"{warned} alert{'' if warned == 1 else 's'}" + (
        f" and {notes} note{'' if notes == 1 else 's'}" if notes else ""
    )
    lines = [
        f"data/alerts.csv: what the diagnosis rules found ({found}):"
        if len(alerts) == 1
        else f"data/alerts.csv: what the diagnosis rules found ({found}). "
        + (
            f"The {_ALERTS_QUOTED} most serious, NaN/Inf first, then by step:"
            if len(alerts) > _ALERTS_QUOTED
            else "The most serious first (NaN/Inf), then by step:"
        )
    ]
    for row in alerts.head(_ALERTS_QUOTED).itertuples():
        # A row through time ("t=01") is no layer; its message says where. A
        # monitor's event about the whole model has none: None, or NaN where
        # pandas 3 reads the column as strings.
        layer = "" if pd.isna(row.layer) else str(row.layer)
        where = f", layer {layer}" if layer and not schema.is_time_label(layer) else ""
        lines.append(f"  - step {row.step}{where} [{row.kind}]: {row.message}")
    return [*lines, ""]


def run_alerts(layer_stats, events, thresholds=None, layer_inputs=None):
    """A run's stored events and what the diagnosis rules find in its statistics.

    Example:

    ```python
    info = store.run_info(run_id)
    alerts = run_alerts(
        store.layer_stats(run_id), store.events(run_id), run_thresholds(info["config"])
    )
    ```

    Args:
        layer_stats: tidy layer-statistics DataFrame.
        events: the run's stored events (`RunStore.events`).
        thresholds: the rules' `Thresholds` (the run's own:
            `gradflow.diagnosis.run_thresholds`), or None (default) for the
            defaults.
        layer_inputs: which layer reads which (the run's own:
            `gradflow.diagnosis.run_layer_inputs`), or None (default): a chain.

    Returns:
        One events DataFrame (`step, layer, kind, message`), possibly empty.
    """
    found = diagnose(layer_stats, thresholds, layer_inputs)
    return alerts_in_order(merge_alerts(events, found))


def merge_alerts(stored, found):
    """A run's stored events and what the diagnosis rules found, each alert told once.

    A finding of a kind, step and layer the run stored already is left out:
    the monitor's NaN-origin event and the rules' say the same thing in other
    words, and the Alerts view and the lesson pack said it twice.

    Args:
        stored: the run's stored events (`RunStore.events`).
        found: events from `gradflow.diagnose`.

    Returns:
        One events DataFrame (`step, layer, kind, message`), the stored
        events first, possibly empty.
    """
    if len(stored) and len(found):
        told = set(zip(stored["kind"], stored["step"], stored["layer"], strict=True))
        found = found[
            [
                key not in told
                for key in zip(found["kind"], found["step"], found["layer"], strict=True)
            ]
        ]
    parts = [frame for frame in (stored, found) if len(frame)]
    if not parts:
        return pd.DataFrame(columns=list(schema.EVENTS_COLUMNS))
    return pd.concat(parts, ignore_index=True)


def run_charts(layer_stats, metrics, presentation=False, run=None, histograms=None, per_step=False):
    """The standard figures of one run, keyed by file-friendly name.

    Heatmaps of `max_abs` and `l2_norm` (kernels, or all weights when the
    model has no kernels), with clipping the norms applied after it, with a
    max-norm constraint the weight norms before and after it, activation
    gradients when recorded, per-layer lines, the profile at the last step,
    the gradient through time when recorded (a heatmap and a profile), and
    the loss/accuracy curves. Figures without data are left out.

    Args:
        layer_stats: tidy layer-statistics DataFrame.
        metrics: long metrics DataFrame.
        presentation: slide-sized fonts. Default False.
        run: the run's name, or None (default). Given, every figure and CSV
            says it (`Chart.for_run`): these charts go into files.
        histograms: the run's gradient histograms (`RunStore.histograms`),
            or None (default). With some, the kernel histograms of the
            layers nearest the input and the output are added: side by side
            they show gradients shrinking (or growing) with depth.
        per_step: True for a training loop's run (`loop_run`): its metrics
            are drawn as the loop passed them, the loss and its own
            (`figures.metrics_chart(per_step=True)`). Default False.

    Returns:
        A dict name -> `Chart`, possibly empty.
    """
    charts = {}
    kinds = set(layer_stats["tensor"].unique()) if len(layer_stats) else set()
    weights = "kernel" if "kernel" in kinds else figures.ALL_WEIGHTS
    # With clipping, what the optimizer applied, on the colour scale of the
    # norms before it: a class saw norms of 0.4 where 0.01 was applied.
    norms = ["l2_norm", "l2_norm_clipped"] if recorded(layer_stats, "l2_norm_clipped") else []
    if any(schema.is_weight(k) for k in kinds):
        charts["max_abs_heatmap"] = figures.heatmap(
            layer_stats, "max_abs", weights, presentation=presentation
        )
        norm_heatmaps = figures.heatmaps_on_one_scale(
            layer_stats, norms or ["l2_norm"], weights, presentation=presentation
        )
        charts["l2_norm_heatmap"] = norm_heatmaps[0]
        charts["max_abs_lines"] = figures.layer_lines(
            layer_stats, "max_abs", weights, presentation=presentation
        )
        charts["profile"] = figures.profile(layer_stats, tensor=weights, presentation=presentation)
        if norms:
            charts["l2_norm_clipped_heatmap"] = norm_heatmaps[1]
    if recorded(layer_stats, "weight_norm_unconstrained"):
        # The max-norm constraint: each layer's weight norm before and after it.
        for statistic in ("weight_norm_unconstrained", "weight_norm"):
            charts[f"{statistic}_lines"] = figures.layer_lines(
                layer_stats, statistic, weights, presentation=presentation
            )
    if any(schema.tensor_kind(k) == "recurrent_kernel" for k in kinds):
        # A recurrent net's gradient through time: its recurrent kernels.
        charts["recurrent_kernel_heatmap"] = figures.heatmap(
            layer_stats, "l2_norm", "recurrent_kernel", presentation=presentation
        )
    if "activation" in kinds:
        charts["activation_heatmap"] = figures.heatmap(
            layer_stats, "max_abs", "activation", presentation=presentation
        )
    if schema.TIME_STEP in kinds:
        # How far back in the sequence the gradient still reaches the output.
        charts["through_time_heatmap"] = figures.heatmap(
            layer_stats, "l2_norm", schema.TIME_STEP, presentation=presentation
        )
        # One picture for a slide: the pack's profile was the kernels' alone.
        charts["through_time_profile"] = figures.profile(
            layer_stats, tensor=schema.TIME_STEP, presentation=presentation
        )
    if len(metrics):
        chart = figures.metrics_chart(metrics, per_step=per_step, presentation=presentation)
        if len(chart.data):
            charts["metrics"] = chart
    charts.update(_histogram_charts(histograms, presentation))
    if run is not None:
        charts = {name: chart.for_run(run) for name, chart in charts.items()}
    return charts


def loop_run(info):
    """Whether a run (`RunStore.run_info`) was recorded by a training loop's `GradientLog`.

    Its metrics are each recorded step's own numbers, as the loop passed
    them, with names of its own (a GAN's `d_loss`, `g_loss`); a `model.fit`
    run's compiled metrics are Keras's running means over an epoch.
    """
    config = (info or {}).get("config")
    return (
        (info or {}).get("source") == "monitor"
        and isinstance(config, dict)
        and config.get("recorded_by") == "GradientLog"
    )


_ALL_METRICS_README = (
    "data/all_metrics.csv: every metric the run recorded, at every recorded step "
    "(data/metrics.csv holds what its chart draws)."
)


def every_metric(metrics, chart=None, run=None):
    """Every metric value of a run, long, in the columns of the metrics chart's CSV.

    A run's metrics chart draws some of them (the loss and accuracy, or a
    loop's loss and first few), each block's lowest and highest on a long
    run: its CSV alone lost the rest (the learning rate, a GAN's third
    metric, most of a long run's steps).

    Args:
        metrics: the run's long metrics (`step, name, value`).
        chart: the run's metrics `Chart`, or None. Given, and its CSV already
            holds every value, None is returned (nothing more to write).
        run: the run's name for a leading `run` column, or None (default).

    Returns:
        A DataFrame `[run,] step, name, value, block` (`block` 1: each row
        is one recorded value), or None.
    """
    if metrics is None or not len(metrics):
        return None
    every = metrics.loc[:, list(schema.METRICS_COLUMNS)].reset_index(drop=True)
    if chart is not None and len(chart.data):
        drawn = chart.data
        if set(every["name"]) <= set(drawn["name"]) and (drawn["block"] == 1).all():
            return None
    every["block"] = 1
    if run is not None:
        every.insert(0, "run", str(run))
    return every


def recorded(layer_stats, column):
    """Whether a run recorded `column` (`l2_norm_clipped` with clipping on, ...)."""
    return column in layer_stats.columns and bool(layer_stats[column].notna().any())


def _histogram_charts(histograms, presentation):
    if histograms is None or not len(histograms):
        return {}
    # An RNN's input kernels are `lstm_cell/kernel`: kernels too (`schema.tensor_kind`).
    kernels = histograms[histograms["tensor"].map(schema.tensor_kind) == "kernel"]
    if kernels.empty:
        return {}
    layers = kernels.sort_values("layer_index", kind="stable").drop_duplicates("layer")["layer"]
    ends = {"histogram_first_layer": layers.iloc[0], "histogram_last_layer": layers.iloc[-1]}
    if len(layers) == 1:
        ends.pop("histogram_last_layer")
    return {
        name: figures.histogram_heatmap(
            kernels,
            layer,
            kernels.loc[kernels["layer"] == layer, "tensor"].iloc[0],
            presentation=presentation,
        )
        for name, layer in ends.items()
    }


def _write(out_dir, filename, payload):
    path = (out_dir / filename).resolve()
    if path.parent != out_dir:
        raise ExportError(f"Refusing to write {filename!r} outside {out_dir}.")
    path.write_bytes(payload if isinstance(payload, bytes) else payload.encode("utf-8"))
    return path


def export_run(store, run_id, fmt, out_dir, *, presentation=True):
    """Export the standard figures of a stored run (used by `gradflow export`).

    Example:

    ```python
    paths = export_run(RunStore(), run_id, "png", "slides/")
    ```

    Args:
        store: a `gradflow.store.RunStore` (anything with `layer_stats`,
            `metrics`, `histograms`, `events` and `run_info` methods), or
            the path of a run store's file.
        run_id: the run to export.
        fmt: one of `"png"`, `"svg"`, `"pdf"`, `"html"`, `"csv"`, `"zip"`
            (a lesson pack).
        out_dir: folder to write into (created if needed); nothing is
            written anywhere else.
        presentation: slide-sized fonts. Default True.

    Returns:
        A list of the `pathlib.Path`s written, named
        `<run name>_<run id>_<figure>.<fmt>` (or `<run name>_<run id>_lesson.zip`).
        CSV adds `<run name>_<run id>_all_metrics.csv`, and a lesson pack
        `data/all_metrics.csv`, when the metrics chart's CSV is not every
        metric value recorded (`every_metric`): a loop's own metrics beyond
        the chart's panels, the learning rate, a long run's every step.

    Raises:
        ValueError: if `fmt` is not an export format, or `store` is a path
            with no file.
        ExportError: if the run has no data to draw, or images cannot be
            rendered.
    """
    _check_format(fmt, EXPORT_FORMATS, "fmt")
    presentation = checks.flag("presentation", presentation)
    store = _store_of(store)
    info = store.run_info(run_id) or {}
    layer_stats = store.layer_stats(run_id)
    metrics = store.metrics(run_id)
    charts = run_charts(
        layer_stats,
        metrics,
        presentation=presentation,
        run=info.get("name") or run_id,
        histograms=store.histograms(run_id),
        per_step=loop_run(info),
    )
    if not charts:
        still = " yet" if info.get("status") in ("queued", "running", "paused") else ""
        raise ExportError(
            f"Run {run_id!r} ({info.get('status')}) has no recorded statistics or metrics to "
            f"export{still}."
        )
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir.resolve()
    # The run's id after its name: two runs of one name (a repeat with another
    # seed) exported to one folder overwrote each other's files.
    base = file_stem(run_id, info.get("name") or "run")
    # What the metrics chart's CSV does not hold: every metric, every step.
    all_metrics = every_metric(metrics, charts.get("metrics"), info.get("name") or run_id)

    if fmt == "zip":
        title = f"gradflow lesson pack: {info.get('name') or run_id}"
        return [
            _write(
                out_dir,
                f"{base}_lesson.zip",
                lesson_pack(
                    charts,
                    info.get("config"),
                    title,
                    alerts=run_alerts(
                        layer_stats,
                        store.events(run_id),
                        run_thresholds(info.get("config")),
                        run_layer_inputs(info.get("config")),
                    ),
                    run_info=info,
                    metrics=all_metrics,
                ),
            )
        ]
    if fmt in IMAGE_FORMATS:
        payloads = to_images(list(charts.values()), fmt)
    elif fmt == "html":
        payloads = [to_html(chart) for chart in charts.values()]
    else:
        payloads = [to_csv(chart) for chart in charts.values()]
    written = [
        _write(out_dir, f"{base}_{name}.{fmt}", payload)
        for name, payload in zip(charts, payloads, strict=True)
    ]
    if fmt == "csv" and all_metrics is not None:
        written.append(_write(out_dir, f"{base}_all_metrics.csv", to_csv(all_metrics)))
    return written
