"""Look of every gradflow figure: palette, fonts, label escaping, Plotly config.

Figures are built for two audiences: a dashboard on a laptop screen and a
slide projected in a lecture hall. `apply_style(figure, presentation=True)`
switches to large fonts and thick lines; both looks use a white background and
colour-blind-safe colours (Okabe-Ito for lines, viridis for heatmaps).
"""

import html
import textwrap

import numpy as np
import plotly.colors
import plotly.graph_objects as go
import plotly.io

from gradflow import checks, schema

# Okabe & Ito (2008), "Color Universal Design": distinguishable under the
# common forms of colour blindness. Black is left out: it marks NaN/Inf.
OKABE_ITO = (
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#009E73",  # bluish green
    "#D55E00",  # vermillion
    "#CC79A7",  # reddish purple
    "#56B4E9",  # sky blue
    "#F0E442",  # yellow
    "#999999",  # grey
)

HEATMAP_COLORSCALE = "Viridis"

# Markers for non-finite values. Viridis never reaches white or black, and
# non-finite heatmap cells are left blank (white), so a black marker on them
# is visible to everybody; the two kinds differ by shape, not colour.
NONFINITE_COLOR = "#000000"
NAN_SYMBOL = "x"
INF_SYMBOL = "triangle-up"

# For `st.plotly_chart(..., config=PLOTLY_CONFIG)` and HTML export: the camera
# button saves a 2x SVG, which stays sharp on slides and in handouts. Plotly.js 4
# (the one Plotly 7 puts in an exported page) adds a "Share chart" button that
# uploads the chart to Plotly Cloud unless told not to: a handout sends nothing.
PLOTLY_CONFIG = {
    "displaylogo": False,
    "showSendToCloud": False,
    "toImageButtonOptions": {"format": "svg", "scale": 2, "filename": "gradflow"},
}

_FONT = "Arial, Helvetica, sans-serif"

# A small template in the spirit of plotly_white. Plotly's own templates carry
# styles for ~40 trace types and are deep-copied into every figure (~50 ms),
# which alone would eat a sixth of the 300 ms budget of a live heatmap.
_AXIS = dict(
    gridcolor="#EBEBEB",
    linecolor="#444444",
    showline=True,
    ticks="outside",
    zeroline=False,
    automargin=True,
    title=dict(standoff=12),
    # One notation for powers of ten everywhere: "5.9e9" and "1e-5", where
    # Plotly's default wrote "5.9B" and "10µ" beside the log axes' "1e-5".
    # In the template, which every axis reads: no cost per figure.
    exponentformat="e",
)
TEMPLATE = go.layout.Template(
    layout=dict(
        colorway=OKABE_ITO,
        paper_bgcolor="white",
        plot_bgcolor="white",
        font=dict(family=_FONT, color="#222222"),
        # x is the step almost everywhere: "15,000", not "1.5e+4" (nor "15k").
        xaxis=dict(_AXIS, exponentformat="none", separatethousands=True),
        yaxis=_AXIS,
        hovermode="closest",
        title=dict(x=0.02, xanchor="left"),
    )
)


def new_figure(data=None):
    """A `go.Figure` with the gradflow template (skips Plotly's default one)."""
    return go.Figure(data=data, layout={"template": TEMPLATE})


def wrap_label(text, width):
    """`escape_label(text)` on lines of at most `width` characters (Plotly's `<br>`).

    Words longer than `width` stay whole.
    """
    lines = textwrap.wrap(str(text), width, break_long_words=False) or [""]
    return "<br>".join(escape_label(line) for line in lines)


def escape_label(text):
    """Escape a user-provided name so Plotly shows it literally.

    Plotly interprets a small set of HTML tags (`<b>`, `<br>`, `<a href>`) and
    entities in every text it draws. Layer and run names come from users'
    models, so they are escaped: `<b>` stays the four characters `<b>` and
    `&` stays `&` in the dashboard, in HTML and in SVG exports.

    Control characters (a run named `"slides\\x07"` before the store refused
    them) are replaced too: in an SVG they are not XML, and Plotly.js could
    not draw a PNG or PDF of the figure. Tabs and line breaks become spaces,
    the others U+FFFD (�).

    Args:
        text: the name; anything else is converted with `str()`.

    Returns:
        The escaped string.
    """
    text = schema.CONTROL_CHARACTERS.sub(_visible, str(text))
    text = schema.BIDI_CONTROLS.sub("\ufffd", text)  # an uploaded model's layer names too
    return html.escape(text, quote=False)


def _visible(match):
    # A control character (`schema.CONTROL_CHARACTERS`) a label can show.
    return " " if match[0] in "\t\n\r" else "\ufffd"


def line_colors(count):
    """`count` colours for lines: Okabe-Ito up to 8, else viridis by depth.

    Args:
        count: number of lines.

    Returns:
        A list of `count` CSS colour strings.
    """
    if count <= len(OKABE_ITO):
        # Okabe-Ito's yellow is a line hard to see on white (a projector's
        # "output" line): its black takes the place.
        return ["#000000" if c == "#F0E442" else c for c in OKABE_ITO[:count]]
    # Many layers: a sequential scale reads as "depth" (input dark, output
    # green), which a cycling palette cannot; it stops before viridis's pale
    # yellow end for the same reason.
    positions = [0.85 * i / (count - 1) for i in range(count)]
    return plotly.colors.sample_colorscale(HEATMAP_COLORSCALE, positions)


def apply_style(figure, presentation=False):
    """Apply the gradflow look to a figure, in place.

    Example:

    ```python
    chart = gradflow.figures.profile(layer_stats)
    gradflow.figures.apply_style(chart.figure, presentation=True)
    ```

    Args:
        figure: a `plotly.graph_objects.Figure`.
        presentation: `False` (default) for screen size; `True` for slides:
            larger fonts, thicker lines and markers, wider margins.

    Returns:
        The same figure, for chaining.
    """
    # Every figure builder comes here: `presentation="no"` meant slides.
    presentation = checks.flag("presentation", presentation)
    font_size = font_size_of(presentation)
    if figure.layout.template is not TEMPLATE:
        figure.update_layout(template=TEMPLATE)
    figure.update_layout(
        font=dict(family=_FONT, size=font_size, color="#222222"),
        title=dict(font=dict(size=font_size + 6 if presentation else font_size + 3)),
        legend=dict(font=dict(size=font_size - 1 if presentation else font_size - 2)),
        margin=dict(l=90, r=40, t=80, b=70) if presentation else dict(l=70, r=20, t=60, b=50),
        hoverlabel=dict(font_size=font_size),
    )
    _whole_step_ticks(figure)
    if presentation:
        figure.update_traces(line_width=4, selector=dict(type="scatter", mode="lines"))
        figure.update_traces(marker_size=14, selector=dict(mode="markers"))
        figure.update_annotations(font_size=font_size)
        _wrap_axis_titles(figure)
    return figure


# A step axis spanning fewer steps than this ticks every step.
_FEW_STEPS = 10


def _whole_step_ticks(figure):
    """Tick step axes at whole steps: a run of two steps was ticked 1, 1.2, 1.4, ..."""
    spans = {}
    for trace in figure.data:
        try:
            x = np.asarray(getattr(trace, "x", None), dtype=np.float64)
        except (TypeError, ValueError):
            continue  # categories, or no x at all
        x = x[np.isfinite(x)] if x.ndim == 1 else x[:0]
        if x.size:
            name = "xaxis" + (trace.xaxis or "x")[1:]
            low, high = spans.get(name, (x.min(), x.max()))
            spans[name] = (min(low, x.min()), max(high, x.max()))
    for name, (low, high) in spans.items():
        axis = figure.layout[name]
        if (axis.title.text or "").startswith("step") and high - low < _FEW_STEPS:
            axis.update(tick0=0, dtick=1)


# At slide font size, a projector's 1366 px shows two charts side by side of
# about this many characters across: longer axis titles were cut at both ends.
_AXIS_TITLE_CHARACTERS = 26


def _wrap_axis_titles(figure):
    """Break long axis titles into lines (Plotly draws a title on one line, and cuts it)."""

    def wrap(axis):
        text = axis.title.text
        if text and len(text) > _AXIS_TITLE_CHARACTERS and "<br>" not in text:
            lines = textwrap.wrap(text, _AXIS_TITLE_CHARACTERS, break_long_words=False)
            axis.title.text = "<br>".join(lines)

    figure.for_each_xaxis(wrap)
    figure.for_each_yaxis(wrap)


# Tensor kinds as a title says them ("all_weights" is `grid.ALL_WEIGHTS`).
_TENSOR_WORDS = {
    "kernel": "kernels",
    "recurrent_kernel": "recurrent kernels",
    "bias": "biases",
    "activation": "layer outputs",
    "all_weights": "all weights",
    "time_step": "output w.r.t. each time step",
}


def row_noun(tensor):
    """What one row of `tensor`'s heatmap is: `"time step"` for rows through time, else `"layer"`."""
    return "time step" if tensor == "time_step" else "layer"


def font_size_of(presentation):
    """The figures' font size in px: 20 at slide size, 13 on screen (`apply_style`)."""
    return 20 if presentation else 13


def chart_heading(statistic, tensor, over_training=False):
    """A chart's title: `"max |gradient| per layer (kernels)"`, or for rows
    through time `"max |gradient| reaching each time step"`.

    The through-time title said "per time step (output w.r.t. each time
    step)": cut at 1280 px with two heatmaps side by side.
    """
    name = STATISTIC_LABELS.get(statistic, statistic)
    if tensor == "time_step":
        return f"{name} reaching each time step" + (", over training" if over_training else "")
    during = " over training" if over_training else ""
    return f"{name} per {row_noun(tensor)}{during} ({tensor_label(tensor)})"


def tensor_label(tensor):
    """A tensor kind in a title's words: `"all_weights"` -> `"all weights"`."""
    return _TENSOR_WORDS.get(tensor, tensor)


# Words for axis titles and colour bars; unknown columns show their own name.
STATISTIC_LABELS = {
    "max_abs": "max |gradient|",
    "l2_norm": "gradient L2 norm",
    "mean_abs": "mean |gradient|",
    "std": "gradient std",
    "zero_fraction": "share of zero entries",
    "nonfinite": "non-finite entries",
    "weight_norm": "weight L2 norm",
    "weight_norm_unconstrained": "weight L2 norm before constraint",
    "update_ratio": "update / weight norm",
    "l2_norm_clipped": "clipped gradient L2 norm",
    "max_abs_clipped": "clipped max |gradient|",
}


def statistic_label(statistic):
    """Human words for a statistic column, e.g. `"max |gradient|"`."""
    return STATISTIC_LABELS.get(statistic, escape_label(statistic))


def layer_labels(names, indices):
    """Escaped axis labels for layers, made unique with the index if needed.

    The layers of a model nested in another share their path's first part
    (`mobilenetv2_1.00_224/block_16_project`): where `nested_in` finds one,
    those labels write it as "…/" (the axis title says it once,
    `layer_axis_title`). Written whole, it took 150 of a half-width
    heatmap's 450 px, and the cells were a narrow strip. A label longer than
    32 characters keeps its start and end around a "…".
    """
    outer = nested_in(names)
    cut = len(outer) + 1
    shown = [
        f"…/{name[cut:]}" if outer and name.startswith(f"{outer}/") else name for name in names
    ]
    labels = [escape_label(_shortened(str(name))) for name in shown]
    if len(set(labels)) < len(labels):
        labels = [f"{label} [{index}]" for label, index in zip(labels, indices, strict=True)]
    return labels


# Longer labels keep their start and end around a "…": one name of 80
# characters took a heatmap's width and, on the Compare page, ran over the
# panel beside it (the odd-runs audit).
_LONGEST_LABEL = 32


def _shortened(name):
    if len(name) <= _LONGEST_LABEL:
        return name
    head = (_LONGEST_LABEL - 1) // 2
    return f"{name[:head]}…{name[-(_LONGEST_LABEL - 1 - head) :]}"


# A shared outer name shorter than this is kept in every label: `mha/query`
# says more than `…/query` and costs little room.
_SHORTEST_NESTED = 12


def nested_in(names):
    """The outer model's name that `layer_labels` writes as "…", or "" for none.

    The first part of the layer paths (`outer` of `outer/dense`) that at
    least half of `names`, and at least three, share, when it is
    `_SHORTEST_NESTED` characters or longer.
    """
    counts = {}
    for name in names:
        outer, nested, _ = str(name).partition("/")
        if nested:
            counts[outer] = counts.get(outer, 0) + 1
    if not counts:
        return ""
    outer = max(counts, key=counts.get)
    shared = counts[outer] >= max(3, len(names) / 2)
    return outer if shared and len(outer) >= _SHORTEST_NESTED else ""


def layer_axis_title(title, names):
    """`title` of a layer axis, saying what "…/" stands for in `layer_labels`.

    In the title's closing bracket, if it has one: "layer (input at the
    bottom; …/ = mobilenetv2_1.00_224/)".
    """
    outer = nested_in(names)
    if not outer:
        return title
    said = f"…/ = {escape_label(outer)}/"
    return f"{title[:-1]}; {said})" if title.endswith(")") else f"{title}; {said}"


def no_data_figure(message, presentation=False):
    """An empty figure that says why it is empty (e.g. before step 1)."""
    figure = new_figure()
    figure.add_annotation(
        text=escape_label(message), x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False
    )
    figure.update_xaxes(visible=False)
    figure.update_yaxes(visible=False)
    return apply_style(figure, presentation)


def legend_below(figure, columns=2):
    """Put `figure`'s legend in its bottom margin, with room for it (after `apply_style`).

    Beside the plot, run names took most of a half-width chart; placed at a
    share of the plot's height below it, the legend covered the axis title
    at slide size.

    Args:
        figure: A `go.Figure`, styled.
        columns: About how many entries fit in a row. Default 2.
    """
    figure.update_layout(
        legend=dict(orientation="h", yref="container", y=0.0, yanchor="bottom"),
    )
    entries = sum(1 for trace in figure.data if trace.showlegend is not False)
    rows = -(-entries // columns)
    font = figure.layout.legend.font.size
    figure.update_layout(margin_b=figure.layout.margin.b + rows * (font + 10))
