"""Show a gradflow `Chart` with its export buttons (PNG, SVG, PDF, HTML, CSV).

Exports are generated only when a button is clicked (Streamlit's deferred
download data), so a live page does not render images it will never send.
"""

import functools
import re

import streamlit as st

from gradflow import export, figures, schema
from gradflow.ui.controls import keep_across_pages

_MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>$~:&])")
# What a message keeps as it is (its words, numbers, "Layer dense_1: ... (NaN/Inf)")
# and what it escapes: what could start a link, an image, HTML, a formula, a
# colour, emphasis, a heading or a list. `_` only where it could emphasise
# (not inside a word), `:` only before a letter (`:red[`, `:material/...:`).
# Backticks stay: a code span shows its text as typed, links and all, and a
# failure message's `gradflow train --data-path` or a chart description's
# `block` column stays code.
_MESSAGE_SPECIALS = re.compile(r"([\\*\[\]#|<>$~!&]|(?<![^\W_])_|_(?![^\W_])|:(?=[^\W\d_]))")
# A list item or a heading's underline at the start of a line ("- ", "1. ", "===").
_LINE_STARTS = re.compile(r"^([ \t]*(?:\d+)?)([-+=.)])", re.MULTILINE)
# GitHub's markdown (remark-gfm in Streamlit) makes these into links even as
# plain text, after the backslashes are read: `http://`, `https://`, `www.`,
# `mailto:`, `xmpp:` and `name@host.tld`. An invisible word joiner (U+2060)
# after the scheme's colon, inside `www.` and after `@` stops it; the text
# still reads as typed.
_AUTOLINKS = re.compile(
    r"(?i)(?<=https:)(?=//)|(?<=http:)(?=//)|(?<=mailto:)|(?<=xmpp:)|(?<=www)(?=\.)|(?<=@)"
)
_WORD_JOINER = "\u2060"


def _unlinked(text):
    # A right-to-left override in a name reversed the rest of the line it was in.
    return _AUTOLINKS.sub(_WORD_JOINER, schema.BIDI_CONTROLS.sub("\ufffd", str(text)))


def plain_markdown(text):
    """`text` escaped so that Streamlit's markdown shows it as typed.

    Run names come from students: `# heading`, `:red[...]` or `$x^2$` in a
    name must not turn into a heading, colour or formula in a status line,
    nor `[Log in](https://...)`, `![](http://...)` or a bare
    `https://...` into a link or an image.
    """
    return _MARKDOWN_SPECIALS.sub(r"\\\1", _unlinked(text))


def plain_message(text):
    """A stored message (an alert, a failure, a layer name in one) safe in Streamlit's markdown.

    Lighter than `plain_markdown`, so that the message's own text stays
    readable where it is compared and copied ("Layer dense_1: gradient norm
    1.0e-09 at step 1"): it escapes every character that could start a link,
    an image, HTML, a formula, a colour, emphasis, a heading or a list, and
    stops bare URLs becoming links. Shown, it reads as typed (text between
    backticks as code).
    """
    # Markdown shows a code span's text as typed, backslashes too: escaped there,
    # `gradients[0]` read `gradients\[0\]`. Split as CommonMark pairs backtick
    # strings (equal lengths, neither next to another backtick); the rest is escaped.
    parts, start = [], 0
    text = schema.BIDI_CONTROLS.sub("\ufffd", str(text))  # in code spans too
    for span in _CODE_SPAN.finditer(text):
        parts += [_escaped_message(text[start : span.start()]), span.group(0)]
        start = span.end()
    parts.append(_escaped_message(text[start:]))
    return "".join(parts)


# On one line only: markdown reads the blocks (paragraphs, headings, quotes,
# lists) before the spans, so a span across lines may never form, and what
# it held would be read as markdown.
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)[^\r\n]+?(?<!`)\1(?!`)")


def _escaped_message(text):
    # Backticks outside the spans too: markdown must not pair them otherwise.
    text = _MESSAGE_SPECIALS.sub(r"\\\1", _unlinked(text)).replace("`", "\\`")
    return _LINE_STARTS.sub(r"\1\\\2", text)


@functools.cache
def image_export_available():
    """Whether a Chromium for kaleido is on this server (checked once)."""
    return export.find_browser() is not None


# At slide size the charts' fonts grow, and an alert's text and a chart's
# caption beside them stayed at 16 and 12 px, unreadable from the back row.
_PRESENTATION_CSS = """<style>
[data-testid^="stAlertContent"] p { font-size: 1.3rem; line-height: 1.5; }
[data-testid="stCaptionContainer"] { font-size: 1.05rem; }
</style>"""


def presentation_style():
    """The sidebar switch for slide-ready figures (large fonts, white background).

    On, it also enlarges the page's alert boxes and captions.
    """
    keep_across_pages("ui.presentation", False)
    on = st.sidebar.toggle(
        "Presentation style",
        key="ui.presentation",
        help="Large fonts and a colour-blind-safe palette, for projectors and handouts.",
    )
    if on:
        st.html(_PRESENTATION_CSS)
    return on


def show_chart(chart, key, exports=True, run=None):
    """Draw a chart; below it, its export buttons.

    Args:
        chart: A `gradflow.figures.Chart`.
        key: A key unique on the page (widget identity).
        exports: Whether to offer downloads. Defaults to `True`.
        run: The name of the run the chart shows, or None (default): the
            exported files then say it (`export_buttons`).
    """
    st.plotly_chart(
        chart.figure, config=plotly_config(chart, key, run), key=f"{key}.plot", width="stretch"
    )
    if chart.description:
        # It can name a user's metric or layer.
        st.caption(plain_message(chart.description))
    if exports:
        export_buttons(chart, key, run)


def plotly_config(chart, key, run=None, base=None):
    """`base` (default `figures.PLOTLY_CONFIG`) with the chart's toolbar download named as its exports.

    The toolbar's camera saved every chart as `gradflow.svg`.
    """
    base = figures.PLOTLY_CONFIG if base is None else base
    image = {
        **base.get("toImageButtonOptions", {}),
        "filename": export.file_stem(chart.title or key, run),
    }
    return {**base, "toImageButtonOptions": image}


def export_buttons(chart, key, run=None):
    """The Export popover of a chart: PNG, SVG, PDF (with Chromium), HTML and CSV.

    Args:
        chart: A `gradflow.figures.Chart`; files are made from it on click.
        key: The chart's key on the page (the buttons' keys start with it).
        run: The name of the run the chart shows, or None (default). A file
            leaves the page that says which run it is: the name starts the
            file's name and goes into the figure and the CSV
            (`Chart.for_run`), so a teacher's relu and sigmoid heatmaps do
            not arrive as `Max_gradient_per_layer.png` and its `(1)`.
    """
    name = export.file_stem(chart.title or key, run)
    with st.popover("Export", icon=":material/download:"):
        if image_export_available():
            for fmt, mime in (
                ("png", "image/png"),
                ("svg", "image/svg+xml"),
                ("pdf", "application/pdf"),
            ):
                st.download_button(
                    fmt.upper(),
                    data=functools.partial(_file, export.to_image, chart, run, fmt),
                    file_name=f"{name}.{fmt}",
                    mime=mime,
                    key=f"{key}.{fmt}",
                    on_click="ignore",
                )
        else:
            st.caption(
                "PNG, SVG and PDF need Chromium on the server (see the README). HTML and CSV work."
            )
        st.download_button(
            "HTML",
            data=functools.partial(_file, export.to_html, chart, run),
            file_name=f"{name}.html",
            mime="text/html",
            key=f"{key}.html",
            on_click="ignore",
        )
        st.download_button(
            "CSV",
            data=functools.partial(_file, export.to_csv, chart, run),
            file_name=f"{name}.csv",
            mime="text/csv",
            key=f"{key}.csv",
            on_click="ignore",
        )


def _file(make, chart, run, *args):
    # Copied for its run only when a button asks for the file: a live page
    # draws its charts every second, and in a full classroom a copy of each
    # figure for a download that rarely comes would cost the server.
    return make(chart if run is None else chart.for_run(run), *args)
