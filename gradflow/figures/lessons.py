"""Figures for the teaching pages: input sensitivity bars and the Jacobian's cost."""

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from gradflow.figures.chart import Chart
from gradflow.figures.style import apply_style, escape_label, line_colors


def sensitivity_bars(inputs, *, presentation=False):
    """Bars of max |d(sum of layer output)/d(input)| per layer (a snapshot's `.inputs`).

    Args:
        inputs: DataFrame with `layer`, `layer_index` and `max_abs`.
        presentation: Slide-sized fonts. Defaults to `False`.

    Returns:
        A `Chart`.
    """
    data = inputs[["layer", "layer_index", "max_abs"]].reset_index(drop=True)
    figure = go.Figure(
        go.Bar(
            x=[escape_label(name) for name in data["layer"]],
            y=data["max_abs"],
            marker_color=line_colors(1)[0],
        )
    )
    figure.update_yaxes(type="log", title="max |d(sum of output) / d(input)|")
    figure.update_xaxes(title="layer (input side first)")
    figure.update_layout(title="Input sensitivity per layer")
    description = "How strongly each layer's output reacts to the input. It usually shrinks or grows with depth."
    if "note" in inputs and inputs["note"].str.contains("softmax").any():
        description += (
            " A softmax output sums to 1 whatever the input, so its bar is 0 by construction"
            " (missing on the log scale; see the table's note), not a sign that it ignores the input."
        )
    if "note" in inputs and inputs["note"].str.contains("Normalization").any():
        description += (
            " A normalization's output sums to about a constant whatever the input, so its bar"
            " is about 0 by construction (see the table's note), not a sign that it ignores the"
            " input."
        )
    return Chart(apply_style(figure, presentation), data, "input_sensitivity", description)


def jacobian_cost(cost, *, presentation=False):
    """Time of the chained backward pass against the size of the largest Jacobian, per method.

    Args:
        cost: `SplitLesson.cost`: `jacobian_entries`, `method`, `milliseconds`.
        presentation: Slide-sized fonts. Defaults to `False`.

    Returns:
        A `Chart` (log-log axes).
    """
    data = cost[["input_size", "jacobian_entries", "method", "milliseconds", "jacobian_megabytes"]]
    figure = go.Figure()
    labels = {
        "vjp": "vector-Jacobian products (one tape per part)",
        "jacobian": "full Jacobians multiplied",
    }
    for color, (method, group) in zip(
        line_colors(2), data.groupby("method", sort=False), strict=False
    ):
        figure.add_trace(
            go.Scatter(
                x=group["jacobian_entries"],
                y=group["milliseconds"],
                mode="lines+markers",
                name=labels.get(method, method),
                line_color=color,
                text=[f"{int(s)}×{int(s)} input" for s in group["input_size"]],
                hovertemplate="%{text}<br>%{x:.3s} Jacobian entries<br>%{y:.1f} ms<extra></extra>",
            )
        )
    figure.update_xaxes(type="log", title="entries in the largest Jacobian", exponentformat="e")
    figure.update_yaxes(type="log", title="milliseconds per backward pass")
    figure.update_layout(title="The Jacobian way grows with size; chained VJPs barely notice")
    formed = cost["formed"] if "formed" in cost.columns else pd.Series(True, index=cost.index)
    jacobians = data[data["method"] == "jacobian"]
    built = jacobians[formed.loc[jacobians.index].astype(bool)]
    biggest = built["jacobian_megabytes"].max() if len(built) else np.nan
    description = (
        f"The largest Jacobian here takes {biggest:.1f} MB; vector-Jacobian products never form it."
        if np.isfinite(biggest)
        else "No Jacobian was formed at these sizes; vector-Jacobian products never form one."
    )
    skipped = jacobians[~formed.loc[jacobians.index].astype(bool)]
    if len(skipped):
        first = skipped.iloc[0]
        size = int(first["input_size"])
        description += (
            f" From {size}×{size} on, the largest Jacobian would take "
            f"{first['jacobian_megabytes']:.0f} MB ({first['jacobian_entries'] / 1e6:.1f} million "
            "entries), too many to form: that way stops there, the chained VJPs go on."
        )
    return Chart(
        apply_style(figure, presentation),
        data.reset_index(drop=True),
        "jacobian_cost",
        description,
    )
