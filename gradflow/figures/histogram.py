"""Histogram of log10|gradient| over time for one layer."""

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from gradflow import schema
from gradflow.checks import positive_int
from gradflow.figures import decimate, logscale, style
from gradflow.figures.chart import Chart

# Wide layout of histogram frames: one count column per fixed bin.
BIN_COLUMNS = tuple(f"b{i}" for i in range(schema.HISTOGRAM_BINS))


def histogram_counts(histograms, layer, tensor):
    """Counts of one layer and tensor as `(steps, counts[steps, bins])`.

    Accepts the wide layout (`step, layer, layer_index, tensor, b0..b33`),
    the long one (`step, layer, layer_index, tensor, bin, count`) or
    `GradientMonitor.histogram_rows` (an array of `counts` per row). Rows of
    the same step (several variables of one kind) are added.

    Raises:
        TypeError: if `histograms` is not a DataFrame.
        ValueError: if columns are missing, or `layer`/`tensor` have no rows.
    """
    if not isinstance(histograms, pd.DataFrame):
        raise TypeError(
            f"`histograms` must be a pandas DataFrame, got {type(histograms).__name__}."
        )
    long_layout = {"bin", "count"} <= set(histograms.columns)
    # `GradientMonitor.histogram_rows`: one array of counts per row.
    array_layout = "counts" in histograms.columns and BIN_COLUMNS[0] not in histograms.columns
    needed = ["step", "layer", "tensor"]
    needed += [] if long_layout or array_layout else list(BIN_COLUMNS)
    missing = [c for c in needed if c not in histograms.columns]
    if missing:
        raise ValueError(
            f"`histograms` is missing the columns {missing[:5]}; expected step, layer, tensor and "
            f"either b0..b{schema.HISTOGRAM_BINS - 1}, bin and count, or counts."
        )
    if histograms.empty:
        return np.array([], dtype=np.int64), np.zeros((0, schema.HISTOGRAM_BINS))
    # An RNN's `lstm_cell/kernel` is its kernel (`schema.is_tensor`), as in every other figure.
    names = pd.Series(histograms["tensor"].unique())
    kinds = set(names[[schema.is_tensor(str(name), tensor) for name in names]])
    rows = histograms[(histograms["layer"] == layer) & histograms["tensor"].isin(kinds)]
    if rows.empty:
        pairs = histograms[["layer", "tensor"]].drop_duplicates().head(20)
        raise ValueError(
            f"`layer`={layer!r} with `tensor`={tensor!r} has no histogram rows; available (layer, tensor): "
            f"{list(pairs.itertuples(index=False, name=None))}."
        )
    if long_layout:
        wide = rows.pivot_table(
            index="step", columns="bin", values="count", aggfunc="sum", fill_value=0
        )
        wide = wide.reindex(columns=range(schema.HISTOGRAM_BINS), fill_value=0)
    elif array_layout:
        counts = np.stack([np.asarray(c, dtype=np.float64) for c in rows["counts"]])
        wide = pd.DataFrame(counts, index=rows["step"].to_numpy()).groupby(level=0).sum()
    else:
        wide = rows.groupby("step")[list(BIN_COLUMNS)].sum()
    return wide.index.to_numpy(dtype=np.int64), wide.to_numpy(dtype=np.float64)


def histogram_heatmap(
    histograms,
    layer,
    tensor="kernel",
    *,
    max_columns=decimate.DEFAULT_MAX_COLUMNS,
    title=None,
    presentation=False,
):
    """How the distribution of |gradient| of one layer moves over training.

    x is the step, y the fixed log10|g| bins of `gradflow.schema` (bin
    centres from `histogram_bin_centers`), colour the share of the tensor's
    entries in the bin (log scale; empty bins blank). Long runs keep the
    largest share of each bin per block of steps, so rare outliers stay.

    Example:

    ```python
    chart = histogram_heatmap(store.histograms(run_id), layer="dense_2")
    ```

    Args:
        histograms: DataFrame, wide (`step, layer, layer_index, tensor,
            b0..b33`) or long (`..., bin, count`).
        layer: the layer name (path) to show.
        tensor: tensor kind. Default `"kernel"`.
        max_columns: most step columns drawn. Default 1000.
        title: figure title, or None (default).
        presentation: large fonts for slides. Default False.

    Returns:
        A `Chart`; `.data` has columns `step, step_last, bin, log10_center,
        share` (one row per non-empty drawn cell).

    Raises:
        TypeError, ValueError: see `histogram_counts`.
    """
    steps, counts = histogram_counts(histograms, layer, tensor)
    plain_title = (
        title or f"Distribution of |gradient| over training: {layer} ({style.tensor_label(tensor)})"
    )
    description = (
        f"Histogram of log10 |gradient| of {layer} ({style.tensor_label(tensor)}) at each step: colour is the share "
        "of entries per bin (log scale); the bottom row holds exact zeros and values below 1e-12."
    )
    columns = ["step", "step_last", "bin", "log10_center", "share"]
    if steps.size == 0:
        return Chart(
            style.no_data_figure("No histograms recorded yet.", presentation),
            pd.DataFrame(columns=columns),
            plain_title,
            description,
        )

    totals = counts.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = np.where(totals > 0, counts / totals, 0.0).T  # [bins, steps]
    present = np.ones_like(shares, dtype=bool)
    max_columns = positive_int("max_columns", max_columns)
    block = -(-steps.size // max_columns)
    step_first, step_last = steps, steps
    if block > 1:
        shares, present = decimate.block_max(shares, present, block)
        step_first = steps[::block]
        step_last = np.pad(steps, (0, (-steps.size) % block), mode="edge")[block - 1 :: block]

    centers = np.asarray(schema.histogram_bin_centers())
    share_floor = -8.0
    z = np.where(shares > 0, np.log10(np.where(shares > 0, shares, 1.0)), np.nan)
    tickvals, ticktext = logscale.decade_ticks(share_floor, 0.0, max_ticks=5)
    figure = style.new_figure(
        go.Heatmap(
            z=z,
            x=step_first,
            y=centers,
            zmin=share_floor,
            zmax=0.0,
            colorscale=style.HEATMAP_COLORSCALE,
            colorbar=dict(
                title=dict(text="share of entries", side="right"),
                tickvals=tickvals,
                ticktext=ticktext,
            ),
            hovertemplate="step %{x}<br>log10 |g| %{y:.2f}<br>log10 share %{z:.2f}<extra></extra>",
            hoverongaps=False,
        )
    )
    ytickvals, yticktext = logscale.decade_ticks(
        schema.HISTOGRAM_LOW, schema.HISTOGRAM_HIGH, max_ticks=9
    )
    # The two open-ended bins sit half a bin past the range's ends: a decade
    # tick at an end would be drawn over their labels.
    inner = [
        (v, t)
        for v, t in zip(ytickvals, yticktext, strict=True)
        if schema.HISTOGRAM_LOW < v < schema.HISTOGRAM_HIGH
    ]
    ytickvals = [centers[0], *(v for v, _ in inner), centers[-1]]
    yticktext = [
        f"<1e{int(schema.HISTOGRAM_LOW)}",
        *(t for _, t in inner),
        f">=1e{int(schema.HISTOGRAM_HIGH)}",
    ]
    figure.update_layout(
        title=style.escape_label(plain_title),
        xaxis_title="step"
        if block == 1
        else f"step (each column: max share over up to {block} steps)",
        yaxis_title="|gradient| (log scale)",
    )
    figure.update_yaxes(
        tickvals=ytickvals, ticktext=[style.escape_label(t) for t in yticktext], showgrid=False
    )
    figure.update_xaxes(showgrid=False)
    style.apply_style(figure, presentation)

    rows, cols = np.nonzero(shares > 0)
    data = pd.DataFrame(
        {
            "step": step_first[cols],
            "step_last": step_last[cols],
            "bin": rows,
            "log10_center": centers[rows],
            "share": shares[rows, cols],
        }
    ).sort_values(["step", "bin"], ignore_index=True)
    return Chart(figure, data, plain_title, description)
