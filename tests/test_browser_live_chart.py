"""Live charts in a real browser: the JavaScript applies updates exactly, and a tick is small.

The first test runs `gradflow/ui/live_chart.js` alone in Chromium (Plotly
replaced by a stub that keeps what it is asked to draw) on the updates the
server makes for a growing run. The second opens the dashboard on a run that
keeps growing and reads the WebSocket frames: each tick sends the heatmaps'
new columns, not their history. The third checks how the server sends
Plotly.js: gzipped once on disk, not compressed again for every page, and a
partial bundle that still holds every trace type the live charts draw.
"""

import contextlib
import gzip
import json
import math
import pathlib
import threading
import time
import urllib.request

import numpy as np
import pandas as pd
import pytest

from gradflow.store import RunStore
from gradflow.ui import live_chart
from gradflow.ui.figure_delta import figure_update
from tests.browser import new_elements, streamlit_server
from tests.test_figure_delta import live_heatmap, plotly_array, run_rows

pytestmark = pytest.mark.browser

MODULE = pathlib.Path(__file__).resolve().parent.parent / "gradflow" / "ui" / "live_chart.js"
# Keeps what it is asked to draw on the div, as Plotly does (`gd.data`, `gd.layout`).
PLOTLY_STUB = (
    "data:text/javascript,window.Plotly={react:(gd,data,layout,config)=>{gd.data=data;"
    "gd.layout=layout;gd.config=config;gd.draws=(gd.draws||0)+1;return Promise.resolve(gd)},"
    "purge:(gd)=>{gd.purged=true}}"
)
SETUP = """async (source) => {
  const url = URL.createObjectURL(new Blob([source], {type: "text/javascript"}));
  window.liveChart = await import(url);
  window.asked = [];
}"""
# Renders one update in the host element `host` and waits for its draw.
RENDER = """async ([update, host, plotly]) => {
  let element = document.getElementById(host);
  if (!element) {
    element = document.createElement("div");
    element.id = host;
    document.body.appendChild(element);
  }
  window.liveChart.render(
    {data: update, parentElement: element, setStateValue: (name, value) => window.asked.push([name, value])},
    plotly);
  const div = element.querySelector(".gradflow-live-chart");
  await div.gradflowDrawn;
  return div.data ? {draws: div.draws, revision: div.layout.datarevision} : null;
}"""
DRAWN = """(host) => document.querySelector(`#${host} .gradflow-live-chart`).data.map(t => ({
  x: t.x, y: t.y, z: t.z, customdata: t.customdata, type: t.type, name: t.name ?? null}))"""


def assert_drawn(page, host, chart):
    drawn = page.evaluate(DRAWN, host)
    expected = json.loads(chart.figure.to_json())["data"]
    assert len(drawn) == len(expected)
    for got, trace in zip(drawn, expected, strict=True):
        assert got["type"] == trace["type"] and got["name"] == trace.get("name")
        for attribute in ("x", "y", "z", "customdata"):
            if attribute not in trace:
                assert got.get(attribute) is None, attribute
                continue
            want = plotly_array(trace[attribute])
            if want.dtype.kind == "O":
                assert got[attribute] == want.tolist(), attribute
            else:
                np.testing.assert_array_equal(
                    np.asarray(got[attribute], dtype=float), want.astype(float)
                )


def test_the_javascript_applies_updates_exactly_and_asks_again_when_it_holds_another_base(chromium):
    page = chromium.new_page()
    try:
        page.set_content("<html><body></body></html>")
        page.evaluate(SETUP, MODULE.read_text())
        sent = None
        stats = run_rows(1, 5)
        for more in (1, 3, 20, 1, 90, 2, 300):  # NaN, Inf and zeros; blocks 1 -> 32
            last = int(stats["step"].max())
            stats = pd.concat([stats, run_rows(last + 1, last + more)], ignore_index=True)
            chart = live_heatmap(stats)
            update, sent = figure_update(chart.figure, sent)
            update["key"] = "live.max"
            drawn = page.evaluate(RENDER, [update, "first", PLOTLY_STUB])
            assert drawn["revision"] == update["revision"]
            assert_drawn(page, "first", chart)
        assert page.evaluate("window.asked") == []

        # Mounted again elsewhere (another view and back): the page still holds the chart.
        chart = live_heatmap(pd.concat([stats, run_rows(432, 433)], ignore_index=True))
        update, sent = figure_update(chart.figure, sent)
        update["key"] = "live.max"
        page.evaluate(RENDER, [update, "second", PLOTLY_STUB])
        assert_drawn(page, "second", chart)

        # An update for a revision the page does not hold is not applied; it asks for the figure.
        held = update["revision"]
        lost, sent = figure_update(live_heatmap(run_rows(1, 500)).figure, sent)
        newer_chart = live_heatmap(run_rows(1, 501))
        newer, _ = figure_update(newer_chart.figure, sent)
        newer["key"] = "live.max"
        drawn = page.evaluate(RENDER, [newer, "second", PLOTLY_STUB])
        assert drawn["revision"] == held
        assert_drawn(page, "second", chart)
        assert [name for name, _ in page.evaluate("window.asked")] == ["resend"]
        assert page.evaluate("window.asked")[0][1]["held"] == held
        whole, _ = figure_update(newer_chart.figure)
        whole["key"] = "live.max"
        page.evaluate(RENDER, [whole, "second", PLOTLY_STUB])
        assert_drawn(page, "second", newer_chart)
    finally:
        page.close()


@pytest.mark.parametrize("touch", [True, False])
def test_on_a_touch_screen_a_swipe_does_not_zoom_a_live_chart(chromium, touch):
    """A swipe meant to scroll a phone's page zoomed the heatmap to a few layers,
    and the zoom stayed through the live updates."""
    context = chromium.new_context(has_touch=touch, is_mobile=touch)
    page = context.new_page()
    try:
        page.set_content("<html><body></body></html>")
        assert page.evaluate("matchMedia('(pointer: coarse)').matches") == touch
        page.evaluate(SETUP, MODULE.read_text())
        update, _ = figure_update(live_heatmap(run_rows(1, 5)).figure)
        update["key"] = "live.max"
        page.evaluate(RENDER, [update, "phone", PLOTLY_STUB])
        dragmode, toolbar = page.evaluate(
            "() => { const d = document.querySelector('#phone .gradflow-live-chart');"
            " return [d.layout.dragmode, d.config.displayModeBar]; }"
        )
        assert dragmode is (False if touch else None)
        assert toolbar is (False if touch else None)  # it covered the titles
    finally:
        context.close()


def test_compared_heatmaps_stand_one_per_row_on_a_phone(chromium):
    """On a 412 px phone the Compare page's two heatmaps got about 60 px each,
    and the runs' titles were printed over each other."""
    from gradflow import figures

    chart = figures.compare_heatmaps({"relu": run_rows(1, 30), "sigmoid": run_rows(1, 30, seed=3)})
    update, _ = figure_update(chart.figure)
    update["key"] = "compare.heatmaps"
    page = chromium.new_page(viewport={"width": 1300, "height": 900})
    try:
        page.set_content(
            "<html><body><div id='phone' style='width:380px'></div>"
            "<div id='desk' style='width:1200px'></div></body></html>"
        )
        page.evaluate(SETUP, MODULE.read_text())
        drawn = {}
        for host in ("phone", "desk"):
            page.evaluate(RENDER, [update, host, PLOTLY_STUB])
            drawn[host] = page.evaluate(
                """(host) => { const l = document.querySelector(`#${host} .gradflow-live-chart`).layout;
                  return {x2: l.xaxis2.domain, y: l.yaxis.domain, y2: l.yaxis2.domain, height: l.height,
                          titles: l.annotations.map(a => [a.text, a.x, a.y])}; }""",
                host,
            )
        desk, phone = drawn["desk"], drawn["phone"]
        assert desk["x2"] == [0.525, 1.0] and desk["y2"] == [0.0, 1.0]
        assert phone["x2"] == [0.0, 1.0] and phone["y"][0] > phone["y2"][1]  # relu above sigmoid
        # Two panels' height, and room between them for the step axis and the title below.
        assert phone["height"] > 2 * desk["height"]
        assert [t[0] for t in phone["titles"]] == ["relu", "sigmoid"]
        assert phone["titles"][0][2] > phone["titles"][1][2]  # the titles no longer meet
    finally:
        page.close()


def test_a_screen_reader_hears_a_charts_title_not_its_tick_labels(chromium):
    """Plotly's SVG was an unnamed image whose text a screen reader read as a
    jumble ("100 200 300 dense_1 ... 1e-8 1e-6 ..."); the chart had no name."""
    chart = live_heatmap(run_rows(1, 30))
    chart.figure.update_layout(
        title="max |gradient| per layer<br><sup>kernels & <b>biases</b></sup>"
    )
    update, _ = figure_update(chart.figure)
    update["key"] = "live.max"
    page = chromium.new_page()
    try:
        page.set_content("<html><body style='width:800px'></body></html>")
        page.add_script_tag(path=str(MODULE.parent / "vendor" / "plotly-cartesian.min.js"))
        page.evaluate(SETUP, MODULE.read_text())
        page.evaluate(RENDER, [update, "sr", "data:text/javascript,void 0"])
        named = page.evaluate(
            """() => { const d = document.querySelector('#sr .gradflow-live-chart');
              return {role: d.getAttribute('role'), label: d.getAttribute('aria-label'),
                      svgs: d.querySelectorAll('svg').length,
                      hidden: [...d.querySelectorAll('svg')].every(s => s.getAttribute('aria-hidden') === 'true')}; }"""
        )
        assert named["role"] == "figure"
        assert (
            named["label"]
            == "max |gradient| per layer. kernels & biases. Its numbers: Export, CSV."
        )
        assert named["svgs"] > 0 and named["hidden"]
        tree = page.locator("#sr").aria_snapshot()
        assert "dense" not in tree and "max |gradient| per layer" in tree
    finally:
        page.close()


@contextlib.contextmanager
def drawn_with_plotly(chromium, chart, key, host, body, viewport):
    """A page that drew `chart` with the real Plotly (cartesian bundle) in element `host`."""
    update, _ = figure_update(chart.figure)
    update["key"] = key
    plotly = MODULE.parent / "vendor" / "plotly-cartesian.min.js"
    page = chromium.new_page(viewport={"width": viewport[0], "height": viewport[1]})
    try:
        page.set_content(f"<html>{body}</html>")
        page.add_script_tag(path=str(plotly))  # window.Plotly; the module's own load then finds it
        page.evaluate(SETUP, MODULE.read_text())
        page.evaluate(RENDER, [update, host, "data:text/javascript,void 0"])
        yield page
    finally:
        page.close()


def test_a_heatmap_wider_than_its_plot_keeps_a_one_step_spike(chromium):
    """Plotly skips the heatmap columns narrower than a pixel, which ones
    depending on the width: a one-step spike the server's max per block kept
    vanished from the live heatmaps at common window widths (an audit: a
    40,000-step run at 1280 px). The page merges columns to the plot's width."""
    from gradflow import figures

    steps = np.arange(1, 2001)
    rows = []
    for index, layer in enumerate(["dense", "dense_1", "dense_2"]):
        values = np.full(len(steps), 1e-3)
        if index == 1:
            values[steps == 1237] = 5e3  # the spike
        rows.append(
            pd.DataFrame(
                {
                    "step": steps,
                    "layer": layer,
                    "layer_index": index,
                    "tensor": "kernel",
                    "max_abs": values,
                    "nonfinite": 0,
                }
            )
        )
    chart = figures.heatmap(pd.concat(rows), "max_abs", max_columns=1000)
    assert len(chart.figure.data[0].x) > 600  # more columns than the plot has pixels
    body = "<body style='width:600px'></body>"
    with drawn_with_plotly(chromium, chart, "live.spike", "spike", body, (700, 600)) as page:
        drawn = page.evaluate(
            """(host) => {
              const div = document.querySelector(`#${host} .gradflow-live-chart`);
              const trace = div.data[0];
              return {columns: trace.x.length, width: div._fullLayout.xaxis._length,
                      row: trace.z[1], raw: trace.customdata[1], x: trace.x,
                      title: div.layout.xaxis.title.text};
            }""",
            "spike",
        )
        assert drawn["columns"] <= drawn["width"] < 600
        at = int(np.argmax(drawn["row"]))
        assert drawn["raw"][at] == pytest.approx(5e3)
        assert drawn["x"][at] <= 1237 < drawn["x"][at + 1]
        assert drawn["title"].startswith("step (each column: max over up to")


@pytest.mark.parametrize("max_columns", [1000, 400], ids=["whole", "server_blocks"])
def test_compared_heatmaps_merged_to_their_width_say_it_once_above_the_panels(
    chromium, max_columns
):
    """At 1280 px the Compare page's two 288 px panels each got the axis title "step (each
    column: max over up to 2 steps)", which ran into each other, and counted only the
    browser's merging: the server's blocks of 2 were said in the subtitle, not read."""
    from gradflow import figures

    runs = {"relu": run_rows(1, 800), "sigmoid": run_rows(1, 800, seed=3)}
    chart = figures.compare_heatmaps(runs, max_columns=max_columns)
    served = 1 if max_columns >= 800 else 2
    body = "<body><div id='pair' style='width:760px'></div></body>"
    with drawn_with_plotly(chromium, chart, "compare.heatmaps", "pair", body, (900, 700)) as page:
        drawn = page.evaluate(
            """(host) => {
              const div = document.querySelector(`#${host} .gradflow-live-chart`);
              const l = div.layout;
              return {columns: div.data.filter(t => t.type === "heatmap").map(t => t.x.length),
                      widths: [div._fullLayout.xaxis._length, div._fullLayout.xaxis2._length],
                      axes: [l.xaxis.title.text ?? l.xaxis.title, l.xaxis2.title.text ?? l.xaxis2.title],
                      title: l.title.text ?? l.title, top: l.margin.t};
            }""",
            "pair",
        )
        served_columns = 800 // served
        assert max(drawn["columns"]) <= max(drawn["widths"]) < served_columns  # merged here
        factor = math.ceil(served_columns / max(drawn["widths"]))
        assert drawn["axes"] == ["step", "step"]  # nothing to run into the next panel
        said = f"each column: max over up to {served * factor} steps"
        assert drawn["title"].count("max over up to") == 1 and said in drawn["title"], drawn
        assert drawn["top"] >= chart.figure.layout.margin.t + (25 if served == 1 else 0)


def test_a_page_whose_request_for_the_whole_figure_went_unanswered_asks_again(chromium):
    """The rerun that answers a resend can be lost too (a later tick's run drops its unsent
    messages on a loaded server), and Streamlit calls `render` only when the update changes:
    the page must ask again by itself. Seen as a blank live page in two CI runs (session 12)."""
    page = chromium.new_page()
    try:
        page.set_content("<html><body></body></html>")
        page.evaluate(SETUP, MODULE.read_text())
        chart = live_heatmap(run_rows(1, 40))
        whole, sent = figure_update(chart.figure)
        unchanged, _ = figure_update(chart.figure, sent)  # what every later tick sends
        assert unchanged == {"revision": whole["revision"], "base": whole["revision"]}
        unchanged["key"] = whole["key"] = "live.max"

        # The whole figure was lost: the page holds nothing and asks for it, once.
        started = time.monotonic()
        assert page.evaluate(RENDER, [unchanged, "lost", PLOTLY_STUB]) is None
        page.evaluate(RENDER, [unchanged, "lost", PLOTLY_STUB])
        assert [value["held"] for _, value in page.evaluate("window.asked")] == [None]
        # No render comes; the page asks again after 3 s, then after 6 s more.
        page.wait_for_function("window.asked.length === 2", timeout=10_000, polling=100)
        assert 2.5 < time.monotonic() - started < 8
        page.wait_for_function("window.asked.length === 3", timeout=15_000, polling=100)
        assert 8.5 < time.monotonic() - started < 20
        # The whole figure arrives: it is drawn, and the page stops asking.
        drawn = page.evaluate(RENDER, [whole, "lost", PLOTLY_STUB])
        assert drawn["revision"] == whole["revision"]
        assert_drawn(page, "lost", chart)
        page.wait_for_timeout(13_000)
        assert len(page.evaluate("window.asked")) == 3
    finally:
        page.close()


LAYERS = 9


def synthetic_steps(first, last, seed=0):
    """Tidy rows of a depth-8 MLP (9 layers, kernel and bias) for steps first..last."""
    rng = np.random.default_rng(seed + first)
    steps = np.arange(first, last + 1)
    index = np.tile(np.repeat(np.arange(LAYERS), 2), len(steps))
    n = len(index)
    return pd.DataFrame(
        {
            "step": np.repeat(steps, LAYERS * 2),
            "layer": [f"dense_{i}" for i in index],
            "layer_index": index,
            "tensor": np.tile(["kernel", "bias"], len(steps) * LAYERS),
            "max_abs": rng.lognormal(-5, 2, n),
            "l2_norm": rng.lognormal(-3, 2, n),
        }
    )


TRACE_TYPES = """() => [...document.querySelectorAll('.js-plotly-plot')]
  .flatMap(p => ((p.gradflowWhole || p).data || []).map(t => t.type))"""
HEATMAP_WIDTHS = """() => [...document.querySelectorAll('.js-plotly-plot')]
  .flatMap(p => (p.gradflowWhole || p).data || []).filter(t => t.type === 'heatmap').map(t => t.z[0].length)"""
FONT_SIZE_20 = """() => [...document.querySelectorAll('.js-plotly-plot')]
  .some(p => p.layout && p.layout.font && p.layout.font.size === 20)"""


def chart_updates(frames):
    """(time, frame bytes, update) of each live-chart update among WebSocket frames."""
    return [
        (when, size, json.loads(element.bidi_component.json))
        for when, size, element in new_elements(frames)
        if element.WhichOneof("type") == "bidi_component"
        and element.bidi_component.component_name.endswith("gradflow.live_chart")
    ]


def test_a_live_tick_sends_the_new_columns_not_the_history(chromium, tmp_path, artifacts_dir):
    from gradflow.store import RunStore
    from gradflow.ui.live import LIVE_MAX_COLUMNS

    steps, window_s = 3000, 6.0
    with streamlit_server(
        tmp_path / "runs.db",
        extra_env={"GRADFLOW_PREWARM": "0"},
        log_path=artifacts_dir / "live-chart-server.log",
    ) as (url, _):
        store = RunStore(tmp_path / "runs.db")
        run_id = store.create_run({"depth": 8}, name="growing", status="running")
        with store.writer(run_id) as writer:
            writer.add_layer_stats(synthetic_steps(1, steps))
            writer.progress(steps)
        stop = threading.Event()

        def train_on():  # two steps a second, as a slow training run
            step = steps
            with store.writer(run_id) as writer:
                while not stop.wait(0.5):
                    step += 1
                    writer.add_layer_stats(synthetic_steps(step, step))
                    writer.progress(step)

        threading.Thread(target=train_on, daemon=True).start()
        frames = []
        page = chromium.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.on(
                "websocket",
                lambda ws: ws.on(
                    "framereceived",
                    lambda payload: frames.append(
                        (
                            time.monotonic(),
                            payload if isinstance(payload, bytes) else payload.encode(),
                        )
                    ),
                ),
            )
            page.goto(f"{url}/?run={run_id}")
            page.wait_for_function(
                "() => [...document.querySelectorAll('.js-plotly-plot')].some(p => ((p.gradflowWhole || p).data || [])"
                ".some(t => t.type === 'heatmap' && t.z && t.z[0] && t.z[0].length > 0))",
                timeout=120_000,
                polling=200,
            )
            page.wait_for_timeout(2000)  # past the first full page
            start = time.monotonic()
            page.wait_for_timeout(window_s * 1000)
            end = time.monotonic()
            page.screenshot(path=str(artifacts_dir / "live-chart-growing.png"), full_page=True)

            # The other live chart, and back: the page still holds the heatmaps.
            page.get_by_text("Lines", exact=True).click()
            page.wait_for_function(f"({TRACE_TYPES})().includes('scatter')", timeout=60_000)
            # The profile view goes through the same component (one step's values per layer).
            page.get_by_text("Profile", exact=True).click()
            page.wait_for_function(f"({PROFILE_STEP})() > 0", timeout=60_000)
            # It follows the run (it once stayed at the step it was opened at).
            shown = page.evaluate(PROFILE_STEP)
            page.wait_for_function(f"({PROFILE_STEP})() > {shown}", timeout=30_000)
            page.get_by_text("Heatmaps", exact=True).click()
            page.wait_for_function(f"({TRACE_TYPES})().includes('heatmap')", timeout=60_000)
            # Slide fonts (a whole-page rerun): the layout changes, the columns stay.
            page.get_by_text("Presentation style").click()
            page.wait_for_function(FONT_SIZE_20, timeout=60_000)
            assert page.locator("[data-testid='stException']").count() == 0
            assert page.evaluate(HEATMAP_WIDTHS) >= [math.ceil(steps / 8)] * 2
        finally:
            stop.set()
            page.close()

    in_window = [u for u in chart_updates(frames) if start <= u[0] < end]
    heatmaps = [(size, u) for _, size, u in in_window if u["key"] in ("live.max", "live.norm")]
    assert len(heatmaps) >= 4, "the run grew by a step every half second: the heatmaps must update"
    for _, update in heatmaps:
        assert update["base"] is not None, "a tick re-sent a whole figure"
        for name, change in update.get("arrays", {}).items():
            assert change["shape"][-1] <= 3, (name, change["from"], change["shape"])
    # What st.plotly_chart sent per tick before: both whole figures. At 3,000 steps
    # (blocks of 8, 375 columns) each has z and customdata of 9 x 375 float64, in base64.
    columns = math.ceil(steps / 8)
    assert columns <= LIVE_MAX_COLUMNS
    whole_figures = 2 * 2 * LAYERS * columns * 8 * 4 / 3
    sent_per_tick = sum(size for size, _ in heatmaps) / (len(heatmaps) / 2)
    # A slow tick carries up to 3 new columns and the message's own framing: 3.0 kB
    # a tick (1/48 of the whole figures) in a CI run on a loaded machine.
    assert sent_per_tick < whole_figures / 30, (sent_per_tick, whole_figures)
    received_per_s = sum(len(p) for when, p in frames if start <= when < end) / window_s
    assert received_per_s < whole_figures / 5, (received_per_s, whole_figures)


# The step in the Profile view's title ("Gradient flow at step 12 ..."), 0 if none.
PROFILE_STEP = """() => Math.max(0, ...[...document.querySelectorAll('.js-plotly-plot')].map(p => {
  const m = String(p.layout && p.layout.title && p.layout.title.text).match(/^Gradient flow at step (\\d+)/);
  return m ? Number(m[1]) : 0; }))"""
STATIC = "/app/static/gradflow/"
# The live page of a run handed to a worker draws its empty heatmap panels ("... per layer").
PLOTLY_DRAWN = """() => window.Plotly !== undefined && [...document.querySelectorAll('.js-plotly-plot')]
  .some(p => p._fullLayout && String(p.layout.title && p.layout.title.text).includes('per layer'))"""


def test_plotly_js_is_served_as_gzipped_on_disk_and_still_draws(chromium, tmp_path, artifacts_dir):
    """Streamlit 1.67 gzips app static files anew per request (0.12 s of server CPU for
    plotly.min.js, issue #7) but leaves `application/gzip` alone: the page fetches
    `plotly.min.js.gz` as it is on disk and unpacks it. If Streamlit or Starlette starts
    compressing it again (or stops serving .gz files as application/gzip), this fails."""
    static = pathlib.Path(__file__).resolve().parent.parent / "static" / "gradflow"
    with streamlit_server(
        tmp_path / "runs.db",
        extra_env={"GRADFLOW_PREWARM": "0"},
        log_path=artifacts_dir / "live-chart-static-server.log",
    ) as (url, _):
        # The live page of a run draws its (empty) heatmaps with the Plotly it unpacked.
        # (Its first script run publishes the files: read them only after it.)
        run_id = RunStore(tmp_path / "runs.db").create_run(
            {"depth": 2}, name="first step soon", status="running"
        )
        context, page, fetched = _open_drawn_page(
            chromium, f"{url}/?run={run_id}", artifacts=artifacts_dir / "live-chart-static-gz"
        )
        try:
            on_disk = (static / "plotly.min.js.gz").read_bytes()
            assert gzip.decompress(on_disk) == (static / "plotly.min.js").read_bytes()
            assert (static / "plotly.min.js").read_bytes() == live_chart._PLOTLY_JS.read_bytes()
            # As a browser asks: the server must send the file's bytes, not compress them again.
            request = urllib.request.Request(
                f"{url}{STATIC}plotly.min.js.gz",
                headers={"Accept-Encoding": "gzip, deflate, br, zstd"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.headers.get("Content-Type") == "application/gzip"
                assert response.headers.get("Content-Encoding") is None
                assert response.read() == on_disk

            plotly_responses = [r for r in fetched if "/plotly.min.js" in r.url]
            assert [r.url.split("?")[0].rsplit("/", 1)[1] for r in plotly_responses] == [
                "plotly.min.js.gz"
            ]
            gz = plotly_responses[0]
            assert gz.status == 200
            assert gz.all_headers().get("content-encoding") is None
            assert gz.request.sizes()["responseBodySize"] == len(on_disk)
            assert page.locator("[data-testid='stException']").count() == 0
            # The partial bundle holds every trace type the live charts draw.
            registered = page.evaluate("() => Object.keys(Plotly.PlotSchema.get().traces)")
            assert set(live_chart.TRACE_TYPES) <= set(registered), registered
        finally:
            context.close()

        # A browser without DecompressionStream loads plotly.min.js instead, and draws.
        context, page, fetched = _open_drawn_page(
            chromium,
            f"{url}/?run={run_id}",
            init_script="delete window.DecompressionStream;",
            artifacts=artifacts_dir / "live-chart-static-fallback",
        )
        try:
            names = [
                r.url.split("?")[0].rsplit("/", 1)[1] for r in fetched if "/plotly.min.js" in r.url
            ]
            assert names == ["plotly.min.js"]
        finally:
            context.close()


def _open_drawn_page(chromium, url, init_script=None, artifacts=None):
    """Open the live page in a new context; return it once Plotly has drawn, with its static responses.

    If it never draws, `artifacts` gets a screenshot and a log of the page's
    console and static responses (`<artifacts>.png`, `<artifacts>.log`): this
    wait timed out once in a full CI run (eleventh session) and passed alone.
    """
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    if init_script:
        context.add_init_script(init_script)
    page = context.new_page()
    fetched, console = [], []
    page.on("response", lambda r: fetched.append(r) if STATIC in r.url else None)
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    try:
        page.goto(url)
        page.wait_for_function(PLOTLY_DRAWN, timeout=120_000, polling=200)
    except BaseException:
        if artifacts is not None:
            with contextlib.suppress(Exception):
                page.screenshot(path=f"{artifacts}.png", full_page=True)
            with contextlib.suppress(Exception):
                state = page.evaluate(
                    "() => ({plotly: window.Plotly !== undefined,"
                    " plots: document.querySelectorAll('.js-plotly-plot').length,"
                    " text: document.body.innerText.slice(0, 2000)})"
                )
                lines = [f"{r.status} {r.url}" for r in fetched] + console + [repr(state)]
                pathlib.Path(f"{artifacts}.log").write_text("\n".join(lines))
        context.close()
        raise
    return context, page, fetched


def completed_run(db, name, steps=40):
    """A completed depth-8 run of `steps` synthetic steps in the store at `db`; its id."""
    store = RunStore(db)
    run_id = store.create_run({"depth": 8}, name=name, status="running")
    with store.writer(run_id) as writer:
        writer.add_layer_stats(synthetic_steps(1, steps))
        writer.progress(steps)
    store.set_status(run_id, "completed")
    return run_id


def test_behind_a_proxy_that_strips_its_prefix_the_live_charts_draw(
    chromium, tmp_path, artifacts_dir
):
    """nginx's `location /school/ { proxy_pass http://127.0.0.1:8501/; }`: the
    server cannot know the prefix, and the page asked for
    /app/static/gradflow/live_chart.js outside it (404): every live chart showed
    "Failed to fetch dynamically imported module" instead of a heatmap."""
    import subprocess
    import sys

    from tests.browser import free_port, wait_healthy

    run_id = completed_run(tmp_path / "runs.db", "behind a proxy")
    with streamlit_server(
        tmp_path / "runs.db",
        extra_env={"GRADFLOW_PREWARM": "0"},
        log_path=artifacts_dir / "live-chart-proxy-server.log",
    ) as (url, _):
        port, upstream = free_port(), url.rsplit(":", 1)[1]
        proxy = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).with_name("proxy.py")), str(port), upstream]
            + ["school"],
            start_new_session=True,
        )
        try:
            school = f"http://127.0.0.1:{port}/school"
            wait_healthy(school, process=proxy)
            context, page, fetched = _open_drawn_page(
                chromium, f"{school}/?run={run_id}", artifacts=artifacts_dir / "live-chart-proxy"
            )
            try:
                page.wait_for_function(f"() => ({HEATMAP_WIDTHS})().length >= 2", timeout=60_000)
                assert page.evaluate(HEATMAP_WIDTHS) == [40, 40]
                assert fetched and all(r.status == 200 for r in fetched)
                assert all(r.url.startswith(f"{school}{STATIC}") for r in fetched)
                assert page.locator("[data-testid='stException']").count() == 0
            finally:
                context.close()
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)


@pytest.mark.parametrize("width, stacked", [(664, True), (1400, False)])
def test_on_a_phone_held_sideways_the_live_heatmaps_stand_one_above_the_other(
    chromium, tmp_path, artifacts_dir, width, stacked
):
    """At 664 px (a phone in landscape) each heatmap had about 70 px of plot."""
    run_id = completed_run(tmp_path / "runs.db", "sideways")
    with streamlit_server(
        tmp_path / "runs.db",
        extra_env={"GRADFLOW_PREWARM": "0"},
        log_path=artifacts_dir / f"live-chart-{width}px-server.log",
    ) as (url, _):
        context = chromium.new_context(viewport={"width": width, "height": 900})
        page = context.new_page()
        try:
            page.goto(f"{url}/?run={run_id}")
            page.wait_for_function(f"() => ({HEATMAP_WIDTHS})().length >= 2", timeout=120_000)
            boxes = [page.locator(".gradflow-live-chart").nth(i).bounding_box() for i in range(2)]
            if stacked:
                assert boxes[1]["y"] >= boxes[0]["y"] + boxes[0]["height"] - 1
                assert min(b["width"] for b in boxes) > 0.8 * width - 100
            else:
                assert boxes[1]["y"] == boxes[0]["y"] and boxes[1]["x"] > boxes[0]["x"]
        finally:
            context.close()


ALERT_COLUMNS = """() => [...document.querySelectorAll('.st-key-compare-alerts [data-testid="stColumn"]')]
  .filter(c => c.innerText.trim()).map(c => { const b = c.getBoundingClientRect();
    return {x: Math.round(b.x), y: Math.round(b.y), width: Math.round(b.width)}; })"""


@pytest.mark.parametrize("width", [800, 1400])
def test_three_compared_runs_alerts_stay_wide_enough_to_read(
    chromium, tmp_path, artifacts_dir, width
):
    """At 800 px, beside the sidebar, three alert columns were about 145 px
    each: a few words a line. A column narrower than 220 px now goes to the
    next line; at 1400 px the three stay side by side."""
    db = tmp_path / "runs.db"
    runs = [completed_run(db, name) for name in ("relu", "sigmoid", "tanh")]
    with streamlit_server(
        db,
        extra_env={"GRADFLOW_PREWARM": "0"},
        log_path=artifacts_dir / f"compare-alerts-{width}px-server.log",
    ) as (url, _):
        page = chromium.new_page(viewport={"width": width, "height": 900})
        try:
            page.goto(f"{url}/compare?runs={','.join(runs)}")
            page.wait_for_function(f"() => ({ALERT_COLUMNS})().length === 3", timeout=120_000)
            page.locator(".st-key-compare-alerts").scroll_into_view_if_needed()
            page.screenshot(path=str(artifacts_dir / f"compare-alerts-{width}px.png"))
            columns = page.evaluate(ALERT_COLUMNS)
            assert min(c["width"] for c in columns) >= 220, columns
            rows = len({c["y"] for c in columns})
            assert rows == (1 if width == 1400 else 2), columns
        finally:
            page.close()


def test_a_comparison_link_opened_first_on_a_fresh_server_runs_through_the_app(
    chromium, tmp_path, artifacts_dir
):
    """Before any session had run app.py, Streamlit ran pages/compare.py by itself:
    its list of files (with "app") in the sidebar, a narrow page, no warm worker."""
    db = tmp_path / "runs.db"
    runs = [completed_run(db, "relu"), completed_run(db, "sigmoid")]
    with streamlit_server(
        db,
        extra_env={"GRADFLOW_PREWARM": "0"},
        log_path=artifacts_dir / "fresh-server-deep-link.log",
    ) as (url, _):
        page = chromium.new_page(viewport={"width": 1400, "height": 900})
        try:
            page.goto(f"{url}/compare?runs={runs[0]},{runs[1]}")
            page.wait_for_function(f"() => ({HEATMAP_WIDTHS})().length >= 2", timeout=120_000)
            links = page.locator('[data-testid="stSidebarNav"] a').all_inner_texts()
            assert [link.split("\n")[-1] for link in links] == [
                "Live training",
                "Compare",
                "Inspect your model",
                "Split backprop",
                "Runs",
            ]
            assert page.url.endswith(f"/compare?runs={runs[0]}%2C{runs[1]}")
            assert page.evaluate(HEATMAP_WIDTHS) == [40, 40]  # both runs, from the link
        finally:
            page.close()


def test_the_end_of_a_followed_run_is_said_to_a_screen_reader_and_its_name_stays_text(
    chromium, tmp_path, artifacts_dir
):
    """The line that says a run completed is plain text rewritten every second:
    a blind student never heard that training had ended. The line that says it
    now allows HTML, so a student's run name must still show as typed."""
    db = tmp_path / "runs.db"
    store = RunStore(db)
    name = '<img src=x onerror="window.pwned = 1">'
    run_id = store.create_run({"depth": 8}, name=name, status="running", total_steps=40)
    with store.writer(run_id) as writer:
        writer.add_layer_stats(synthetic_steps(1, 20))
        writer.progress(20)
    with streamlit_server(
        db, extra_env={"GRADFLOW_PREWARM": "0"}, log_path=artifacts_dir / "run-end-said.log"
    ) as (url, _):
        page = chromium.new_page(viewport={"width": 1400, "height": 900})
        try:
            page.goto(f"{url}/?run={run_id}")
            page.wait_for_function(f"() => ({HEATMAP_WIDTHS})().length >= 2", timeout=120_000)
            with store.writer(run_id) as writer:
                writer.add_layer_stats(synthetic_steps(21, 40))
                writer.progress(40)
            store.set_status(run_id, "completed")
            said = page.get_by_role("alert").filter(has_text="Training completed")
            said.wait_for(state="attached", timeout=60_000)
            assert said.inner_text() == "Training completed at step 40 of 40."
            assert said.bounding_box()["width"] <= 1  # heard, not seen
            assert page.evaluate("window.pwned") is None
            assert page.get_by_text(name).count() >= 1  # the name, as typed
        finally:
            page.close()
