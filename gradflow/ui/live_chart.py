"""Charts that a rerun updates with what changed, not with the whole figure.

`st.plotly_chart` puts the whole figure into the page on every rerun, so a
live heatmap re-sends its whole history once a second (streamlit/streamlit
#12980). `show_live_chart` draws the same `Chart` through a small Streamlit
component (Custom Components v2: no iframe, in the page's DOM) that keeps
the figure in the browser between reruns; each rerun sends an update from
`gradflow.ui.figure_delta`: the new and changed columns of the arrays, and
the layout entries and trace attributes that changed.

How the server knows what the browser holds: this session's state keeps,
per chart key, the `SentFigure` of the last update sent. The browser keeps
its figure per chart key in the page (`live_chart.js`), so a chart mounted
again (another view, another page and back) still holds it; a reloaded page
is a new session, which holds nothing and gets the whole figure. Every
update names the revision it applies to. If the browser holds another one
(an update lost when a rerun was interrupted), it does not apply it and sets
the component's `resend` state instead; the callback forgets the
`SentFigure`, and the rerun that follows sends the whole figure. That answer
can be lost too (on a loaded server a tick's run drops the unsent messages
of the run before it), and an unchanged figure sends the same update on
every tick, which Streamlit does not pass to the page again: the page asks
again by itself, after 3 s, then at doubling intervals up to 12 s, until a
figure applies. Without that, the live page of a run stayed blank on a
loaded machine (two CI runs, session 12).

Plotly.js and the component's module are served as app static files
(`server.enableStaticServing`): `publish_assets` copies them from this
package into `static/gradflow/` beside `app.py` when the server starts,
with Plotly.js also gzipped once there (`plotly.min.js.gz`). Where static serving
is off or the copy failed, `show_live_chart` falls back to
`st.plotly_chart`, which works, at the old cost. The files' URLs are
resolved in the browser against the app's root as the page was reached
(`APP_ROOT_JS`): under `server.baseUrlPath`, and behind a reverse proxy that
serves the dashboard under a path prefix and strips it (nginx's
`location /gradflow/ { proxy_pass http://127.0.0.1:8501/; }`), where the
server cannot know the prefix.

Why the `.gz` (issue #7): Streamlit 1.67 (Starlette) gzips every app static
response anew, in the event loop, 64 KiB at a time; `plotly.min.js` cost the
server 0.12 s of CPU per page load, 30 times when a class opens the page.
Its middleware leaves `application/gzip` responses alone (the type Streamlit
gives a `.gz` file), so the browser fetches `plotly.min.js.gz` as it is on
disk and unpacks it itself (`DecompressionStream`, `live_chart.js`); a
browser without it loads `plotly.min.js` as before.
`tests/test_browser_live_chart.py` checks the headers, so a Streamlit or
Starlette that starts compressing it again fails a test.

Why a partial Plotly.js (issue #7): every live page loads Plotly.js, when
it opens or once a worker takes its run (`gradflow/ui/live.py`), and the
full bundle was about half of what a browser spends opening the page. Live
charts draw only the trace types in `TRACE_TYPES`, so `vendor/` holds
Plotly's official cartesian bundle (`plotly.js-cartesian-dist-min`, 1.4 MB,
those types and a few more) instead of the installed plotly package's full
one (4.8 MB, every trace type). Opening the dashboard then costs a browser
1.5 s of main-thread CPU instead of 2.3 s, which a class on one two-core
machine pays 30 times (`python3 bench/bench_static_assets.py
--against-full-plotly`). Figures exported as HTML still embed the full Plotly.js (see
`gradflow.export`): a handout works on its own, offline.
`tests/test_browser_live_chart.py` checks that the served bundle registers
every type in `TRACE_TYPES`, `tests/test_figures.py` that the live charts
use no other.
"""

import functools
import gzip
import hashlib
import logging
import os
import pathlib
import tempfile
import zlib

import streamlit as st

from gradflow import figures
from gradflow.ui.charts import export_buttons, plain_message, plotly_config, show_chart
from gradflow.ui.figure_delta import figure_update

# App static files live in <app folder>/static/ and are served at
# <baseUrlPath>/app/static/ (Streamlit's convention); ours in a folder of their own.
STATIC_FOLDER = pathlib.Path("static") / "gradflow"
# Plotly's cartesian bundle, vendored (see `vendor/README.md`).
_PLOTLY_JS = pathlib.Path(__file__).with_name("vendor") / "plotly-cartesian.min.js"
# The trace types of the figures drawn through `show_live_chart`; the served
# bundle must register each of them.
TRACE_TYPES = ("bar", "heatmap", "scatter")


@functools.cache
def _plotly_js():
    return _PLOTLY_JS.read_bytes()


def _plotly_gz(published):
    """Plotly.js gzipped; the copy already published when it unpacks to this Plotly.

    Unpacking it (~0.01 s) spares gzipping it again (~0.06 s) at every start.
    """
    if published is not None:
        try:
            if gzip.decompress(published) == _plotly_js():
                return published
        except (OSError, EOFError, zlib.error):
            pass  # a truncated or corrupt copy: write it anew
    # Fixed header time, so the same Plotly gives the same bytes.
    return gzip.compress(_plotly_js(), compresslevel=9, mtime=0)


# File name -> a function of the published file's content (or None) that returns the content to publish.
_ASSETS = {
    "plotly.min.js": lambda published: _plotly_js(),
    "plotly.min.js.gz": _plotly_gz,
    "live_chart.js": lambda published: pathlib.Path(__file__)
    .with_name("live_chart.js")
    .read_bytes(),
}
# As `st.plotly_chart(..., width="stretch")`: the chart follows its column's width.
_CONFIG = {**figures.PLOTLY_CONFIG, "responsive": True}
_SENT = "live_chart.sent."
_LOG = logging.getLogger(__name__)

# The app's root as the browser reaches it: Streamlit loads its own bundle
# relative to it ("./static/js/..."), so the bundle's address carries every
# path prefix in front of the app, also one a reverse proxy strips before the
# server (which then cannot know it: `server.baseUrlPath` is empty there).
APP_ROOT_JS = """() => {
  const s = document.querySelector('script[src*="/static/js/index."]')?.src ?? `${location.origin}/static/js/`;
  return s.slice(0, s.lastIndexOf("static/js/"));
}"""

# Kept tiny: Streamlit sends a component's inline JavaScript with every
# update (a tick's two heatmap updates are about 1.5 KB each).
_LOADER = """export default function (c) {
  const r = (%(root)s)();
  const u = (n) => r + %(folder)s + n;
  return import(u(%(module)s)).then((m) => m.render(c, u(%(plotly)s), u(%(plotly_gz)s)));
}"""


class _Assets:
    """What `publish_assets` did in this server process."""

    versions = None  # file name -> short content hash, once published
    folder = None  # where they were published
    failed = False


@functools.cache
def publish_assets(app_dir):
    """Copy Plotly.js (also gzipped) and the live-chart module into `app_dir`/static/gradflow/.

    Called by `app.py` when the server starts (once per process; Plotly.js
    is gzipped here, when the published copy is missing or stale, instead
    of by the server for every page). Files are
    copied, not linked: Streamlit refuses a static path whose real location
    is outside `static/`. A file already there with the same content is left
    alone; a changed one is replaced atomically, so a browser never reads
    half a file.

    Args:
        app_dir: the folder of the app's main script (`app.py`).

    Returns:
        True when all files are in place, False (and a logged warning) when
        they could not be written; live charts then use `st.plotly_chart`.
    """
    target = pathlib.Path(app_dir) / STATIC_FOLDER
    versions = {}
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name, read in _ASSETS.items():
            path = target / name
            published = path.read_bytes() if path.is_file() else None
            content = read(published)
            versions[name] = hashlib.sha256(content).hexdigest()[:12]
            if published != content:
                replace_file(path, content)
    except OSError as error:
        _LOG.warning(
            "gradflow: live charts fall back to st.plotly_chart: cannot write %s (%s).",
            target,
            error,
        )
        _Assets.failed = True
        return False
    _Assets.versions = versions
    _Assets.folder = target
    return True


def replace_file(path, content):
    """Write `content` to `path` atomically: a reader sees the old file or the new one, whole."""
    path = pathlib.Path(path)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        try:
            tmp.write(content)
            tmp.close()
            os.chmod(tmp.name, 0o644)
            os.replace(tmp.name, path)
        finally:
            if os.path.exists(tmp.name):
                os.unlink(tmp.name)


def published_folder():
    """The static folder `publish_assets` filled in this process, or None."""
    return _Assets.folder if available() else None


def static_url(name=""):
    """The URL of `name` in the published static folder, relative to the app's root (no version).

    The browser resolves it against `APP_ROOT_JS`: `server.baseUrlPath`, and
    any prefix a proxy strips, are already in the page's own address.
    """
    return "/".join(p for p in ("app", STATIC_FOLDER.as_posix(), name) if p)


def available():
    """Whether live charts can use the component (else `st.plotly_chart`)."""
    return bool(st.get_option("server.enableStaticServing")) and not _Assets.failed


def _served_versions():
    """This server's published file versions, as the hashable key `_component` is cached by."""
    return tuple(sorted((_Assets.versions or {}).items()))


def _assets(versions):
    """Where the module and Plotly.js are served: `folder` (relative to the app's root) and the
    `module`, `plotly` and `plotly_gz` file names in it, with their versions."""

    def name_of(name):
        # Without a publish_assets call (a page run on its own, as in AppTest)
        # the URL has no version; nothing is fetched there anyway.
        version = dict(versions).get(name)
        return name + (f"?v={version}" if version else "")

    return {
        "folder": static_url() + "/",
        "module": name_of("live_chart.js"),
        "plotly": name_of("plotly.min.js"),
        "plotly_gz": name_of("plotly.min.js.gz"),
    }


def preload_assets():
    """Where a page finds this module and Plotly.js to load Plotly before its first chart.

    For `gradflow.ui.board`: a queued page near the front of the queue
    loads Plotly.js through `preloadPlotly` of the same module (one copy per
    page: the browser imports a module URL once), so that evaluating it is
    not what stands between its run's first or last step and the page
    showing it.

    Returns:
        `_assets` of this server, or None where live charts are not available.
    """
    return _assets(_served_versions()) if available() else None


@functools.cache
def _component(versions):
    quoted = {name: repr(value) for name, value in _assets(versions).items()}
    return st.components.v2.component(
        "gradflow.live_chart",
        js=_LOADER % {"root": APP_ROOT_JS, **quoted},
        # In the page's DOM, not a shadow root: Plotly puts its CSS in the
        # document's head, and tests find the chart as `.js-plotly-plot`.
        isolate_styles=False,
    )


def show_live_chart(chart, key, exports=True, run=None):
    """Draw a chart that later reruns update with only what changed.

    A drop-in for `charts.show_chart` on pages that redraw a growing figure
    every second. Give a chart the same `key` on every rerun; its figure may
    change in any way (another run or tensor, a new decimation block): what
    did not change is not sent again.

    Example:

    ```python
    chart = figures.heatmap(stats, "max_abs", max_columns=500, power_of_two_blocks=True)
    show_live_chart(chart, "live.max")
    ```

    Args:
        chart: A `gradflow.figures.Chart`.
        key: A key unique on the page (widget identity; also names what the
            browser holds).
        exports: Whether to offer downloads. Defaults to `True`.
        run: The name of the run the chart shows, for its files, or None
            (default; `charts.export_buttons`).
    """
    if not available():
        show_chart(chart, key, exports, run)
        return
    sent_key = _SENT + key
    config = plotly_config(chart, key, run, base=_CONFIG)
    update, sent = figure_update(chart.figure, st.session_state.get(sent_key), config=config)
    update["key"] = key
    _component(_served_versions())(
        key=f"{key}.plot",
        data=update,
        on_resend_change=functools.partial(forget, key),
    )
    # After the call: a rerun that stops inside it leaves the old record, and
    # the browser then asks for the whole figure.
    st.session_state[sent_key] = sent
    if chart.description:
        # It can name a user's metric or layer.
        st.caption(plain_message(chart.description))
    if exports:
        export_buttons(chart, key, run)


def forget(key):
    """Forget what the browser holds of chart `key`: the next rerun sends it whole."""
    st.session_state.pop(_SENT + key, None)
