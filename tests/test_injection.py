"""Strings from the run store and from links are shown as typed, never acted on.

Run names, failure and alert messages, layer and metric names are anyone's:
a student renames a run on the Runs page, a script names its layers and
metrics. In the dashboard's markdown they must not become links, images,
colours or formulas (a red-team audit showed a "Re-login" link and an image
from another host); in a terminal their escape sequences must not clear the
screen; in an exported SVG a control character must not make invalid XML.
"""

import os
import pathlib
import re
import sqlite3
import subprocess
import sys
import xml.dom.minidom

import numpy as np
import pandas as pd
import pytest

from tests.test_pages import run_page

REPO = pathlib.Path(__file__).resolve().parent.parent
# Markdown a hostile name or message holds: an image that would load from
# another host, links (one bare, as GitHub's markdown links it), HTML, a
# colour, a formula and bold.
HOSTILE = (
    "![q](http://127.0.0.1:8799/beacon.png) [Re-login](https://evil.example/l) "
    "https://evil.example/login www.evil.example <img src=x> :red[R] $x^2$ **B**"
)

# Pages share st.cache_resource singletons in this process: one store for the module (conftest.py).
pytestmark = pytest.mark.usefixtures("page_environment")


@pytest.fixture(autouse=True)
def without_run_board(monkeypatch):
    # The pages poll with fragment ticks, as a server without static files does.
    from gradflow.ui import resources

    monkeypatch.setattr(resources, "run_board", lambda: None)


def shown(body):
    """The text markdown shows for `body`: its backslash escapes read (word joiners kept)."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", body)


def typed_of(body):
    """What a reader sees of `body`, as they would type it (without the invisible word joiners)."""
    return shown(body).replace("\u2060", "")


# GitHub's autolinks (remark-gfm's, in Streamlit) on the text markdown shows.
_AUTOLINK = re.compile(r"(?i)https?://|www\.|(?:mailto|xmpp):\w|[\w.+-]@[\w-]+\.")


def assert_inert(body, typed):
    """`body` (a markdown string Streamlit got) shows `typed` as typed, with nothing live in it."""
    assert typed in typed_of(body), body
    syntax = re.sub(r"\\.", "", body)  # what markdown reads as syntax: the unescaped rest
    for start in ("[", "<", "$", ":red", "*B*"):
        assert start not in syntax, (start, body)
    assert not _AUTOLINK.search(shown(body)), body


def test_the_escapers_leave_nothing_live():
    from gradflow.ui.charts import plain_markdown, plain_message

    for escape in (plain_markdown, plain_message):
        body = escape(HOSTILE)
        assert_inert(body, HOSTILE)
        for bare in ("mail me@evil.example", "MAILTO:x@evil.example", "HTTP://EVIL.example"):
            assert not _AUTOLINK.search(shown(escape(bare))) and typed_of(escape(bare)) == bare
    # A message's own words stay as the rules wrote them.
    said = "Layer dense_1: gradient norm 1.0e-09 at step 1 (NaN/Inf) is below 1e-07 — vanishing."
    assert plain_message(said) == said
    assert plain_message("- one\n2. two") == "\\- one\n2\\. two"  # no list
    # Code spans show their text as typed, backslashes too: they are left as they are,
    # the text around them escaped, paired as CommonMark pairs backtick strings.
    error = "`gradients[0]` has shape (1,): run `pip install x@1`; see [docs](https://evil.example)"
    body = plain_message(error)
    assert body.startswith("`gradients[0]` has shape (1,): run `pip install x@1`; see \\[docs\\]")
    assert_inert(body.split("`; see ")[1], "")
    assert plain_message("``a`b`` [x](y) `c") == "``a`b`` \\[x\\](y) \\`c"
    # A span across lines never forms (markdown reads the blocks first): what it
    # held was read as markdown, links and images live on the Live page.
    for crafted in (
        "`a\n\n[x](https://evil.example/a) ![i](https://evil.example/i.png)`",
        "`a\r\r# [h](https://evil.example/h)`",
        "`a\n> [q](https://evil.example/q)\n- [l](https://evil.example/l)`",
        "`a\n===\n[s](https://evil.example/s)`",
    ):
        assert_inert(plain_message(crafted), "")
    # The backtick left alone is escaped, so markdown pairs the others as this does: code.
    crafted = "`a\n`[x](https://evil.example/u)`"
    assert plain_message(crafted) == "\\`a\n`[x](https://evil.example/u)`"


def test_a_crafted_link_is_refused_without_its_markdown():
    """`?activation=![q](http://...) [Re-login](https://...)`: the warning quoted it as markdown."""
    app = run_page("live_training.py", activation=HOSTILE)
    [warning] = [w.value for w in app.sidebar.warning if "not valid" in w.value]
    assert_inert(warning, HOSTILE)


def test_a_link_cannot_name_a_run_with_a_control_character():
    """The name would be refused when the run starts, with a traceback; the link says so now."""
    app = run_page("live_training.py", name="slides\x07")
    assert any("not valid" in w.value and "control characters" in w.value for w in app.warning)


def test_compare_shows_run_names_and_alerts_as_typed(page_environment):
    """The status line under the picker and the alert boxes drew names and messages as markdown."""
    from gradflow.store import RunStore
    from tests.test_pages import write_a_nan_at_step_2

    store = RunStore(page_environment)
    named = store.create_run({"depth": 2}, name=HOSTILE, status="running")
    other = store.create_run({"depth": 2}, name="plain", status="running")
    for run_id in (named, other):
        write_a_nan_at_step_2(store, run_id, f"Layer output: NaN. {HOSTILE}")
        store.set_status(run_id, "diverged")
    app = run_page("compare.py", runs=f"{named},{other}")
    [line] = [c.value for c in app.caption if "diverged" in c.value]
    assert_inert(line, f"{HOSTILE}: diverged · plain: diverged")
    boxes = [e.value for e in app.error if "Layer output" in e.value]
    assert len(boxes) == 2
    for box in boxes:
        assert_inert(box, f"Layer output: NaN. {HOSTILE}")
    # The column's bold name was escaped before; it still is.
    assert any(typed_of(m.value) == f"**{HOSTILE}**" for m in app.markdown)


def test_live_shows_failures_alerts_and_layer_names_as_typed(page_environment):
    """A failure's message, an alert's message and the NaN origin's layer name came from a
    user's script (an exception's text, `Dense(name=...)`) and were drawn as markdown."""
    from gradflow.store import RunStore
    from tests.test_pages import live_view

    store = RunStore(page_environment)
    failed = store.create_run({"model": "mine"}, name="failing", source="monitor")
    store.set_status(failed, "failed", f"RuntimeError: {HOSTILE}")
    app = run_page("live_training.py", run=failed)
    [error] = [e.value for e in app.error if "RuntimeError" in e.value]
    assert_inert(error, f"RuntimeError: {HOSTILE}")

    layer = "![o](http://127.0.0.1:8799/layer.png)"
    diverged = store.create_run({"model": "mine"}, name="nan", source="monitor")
    with store.writer(diverged) as writer:
        for step, value in ((1, 0.5), (2, np.nan)):
            writer.add_layer_stats(
                pd.DataFrame(
                    {
                        "step": step,
                        "layer": ["dense", layer],
                        "layer_index": [0, 1],
                        "tensor": "kernel",
                        "max_abs": [0.5, value],
                        "l2_norm": [0.5, value],
                        "nonfinite": [0, int(np.isnan(value))],
                    }
                )
            )
            writer.add_metrics(step, {"loss": 0.5})
        writer.add_event(2, layer, "nonfinite", f"Layer {layer}: first NaN. {HOSTILE}")
        writer.progress(2)
    store.set_status(diverged, "diverged")
    app = live_view(diverged, "Alerts")
    [banner] = [e.value for e in app.error if "became NaN" in e.value]
    assert_inert(banner, f"in layer **{layer}**.")  # bold, its name escaped inside
    [alert] = [e.value for e in app.error if "first NaN" in e.value]
    assert_inert(alert, f"Layer {layer}: first NaN. {HOSTILE}")


def test_the_store_refuses_control_characters_in_names(store_path):
    from gradflow.store import RunStore

    store = RunStore(store_path)
    for name in (
        "slides\x07",
        "title\x1b]0;x\x07",
        "two\nlines",
        "tab\there",
        "c1\x9b2J",
        "relu\u202egnp.exe",  # turned the rest of a caption listing runs around
        "isolate\u2066",
    ):
        with pytest.raises(
            ValueError, match="`name` must not contain control characters"
        ) as caught:
            store.create_run({}, name=name)
        assert repr(name) in str(caught.value)
    run_id = store.create_run({}, name="café · relu — 4 layers ✓")
    with pytest.raises(ValueError, match=re.escape(repr("slides\x1b[2J"))):
        store.rename(run_id, "slides\x1b[2J")
    assert store.run_info(run_id)["name"] == "café · relu — 4 layers ✓"


def test_the_runs_page_says_why_a_name_with_a_control_character_is_refused(page_environment):
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 3}, name="kept", status="completed")
    app = run_page("runs.py")
    next(s for s in app.selectbox if s.label == "Run").set_value(run_id).run()
    next(t for t in app.text_input if t.label == "New name").input("slides\x1b[2J")
    next(b for b in app.button if b.label == "Rename").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("not renamed" in e.value and "control characters" in e.value for e in app.error)
    assert store.run_info(run_id)["name"] == "kept"


def cli(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "gradflow", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


def test_gradflow_train_refuses_a_control_character_in_its_name(store_path):
    done = cli("train", "--name", "slides\x07", "--steps", "2", "--db", str(store_path))
    assert done.returncode == 2, done.stderr
    assert "--name must not contain control characters" in done.stderr
    assert "Traceback" not in done.stderr


def stored_under(store_path, run_id, name):
    """Names a run as a store from before the check could (SQL, as another program would)."""
    with sqlite3.connect(store_path) as conn:
        conn.execute("UPDATE runs SET name = ? WHERE run_id = ?", (name, run_id))
    conn.close()


def test_gradflow_runs_prints_no_escape_sequences(store_path):
    """`gradflow runs` printed names raw: `\\x1b]0;...\\x07` set the terminal's title,
    `\\x1b[2J` cleared it, U+202E turned the rest of the line around."""
    from gradflow.store import RunStore

    run_id = RunStore(store_path).create_run({}, name="placeholder", status="completed")
    stored_under(store_path, run_id, "slides\x1b]0;OWNED\x07\x1b[2J\u202egnp.exe\x9b1m")
    done = cli("runs", "--db", str(store_path))
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if run_id in line)
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", done.stdout)
    assert "slides\\x1b]0;OWNED\\x07\\x1b[2J\\u202egnp.exe\\x9b1m" in line


def test_an_old_runs_control_character_leaves_its_svg_valid_xml(store_path, tmp_path):
    """A run named `slides\\x07` before names were checked: each of its SVGs was invalid XML
    (and its PNG and PDF exports failed in Plotly.js)."""
    from gradflow import export
    from gradflow.store import RunStore

    store = RunStore(store_path)
    run_id = store.create_run({"depth": 2}, name="placeholder", status="running")
    with store.writer(run_id) as writer:
        for step in (1, 2, 3):
            writer.add_layer_stats(
                pd.DataFrame(
                    {
                        "step": step,
                        "layer": ["dense\x1b", "output"],
                        "layer_index": [0, 1],
                        "tensor": "kernel",
                        "max_abs": [0.5, 0.25],
                        "l2_norm": [0.5, 0.25],
                        "nonfinite": 0,
                    }
                )
            )
            writer.add_metrics(step, {"loss": 1.0 / step, "acc\x07": 0.5})
        writer.progress(3)
    store.set_status(run_id, "completed")
    stored_under(store_path, run_id, "slides\x07")
    # Without a browser the figures themselves are checked: no control character reaches Plotly.
    charts = export.run_charts(store.layer_stats(run_id), store.metrics(run_id), run="slides\x07")
    for chart in charts.values():
        figure = chart.for_run("slides\x07").figure.to_json()
        assert not re.search(r"\\u00[01][0-9a-f]|\\u007f|\\u00[89][0-9a-f]", figure), figure
    if export.find_browser() is None:
        pytest.skip("no Chromium for the SVG export")
    paths = export.export_run(store, run_id, "svg", tmp_path / "out")
    assert paths
    for path in paths:
        xml.dom.minidom.parse(str(path))  # raises on a control character


def test_compare_shows_no_link_or_image_in_chromium(chromium, page_environment, monkeypatch):
    """The real browser: a hostile name on the Compare page draws no link and loads no image."""
    from gradflow.store import RunStore
    from tests import browser

    if os.environ.get("GRADFLOW_TEST_PORT"):
        monkeypatch.setattr(browser, "free_port", lambda: int(os.environ["GRADFLOW_TEST_PORT"]))
    store = RunStore(page_environment)
    runs = [
        store.create_run({"depth": 2}, name=name, status="completed")
        for name in (HOSTILE, "mail x@evil.example www.evil.example/y")
    ]
    with browser.streamlit_server(page_environment) as (url, _):
        page = chromium.new_page()
        asked = []
        page.on("request", lambda r: asked.append(r.url) if "8799" in r.url else None)
        try:
            page.goto(f"{url}/compare?runs={','.join(runs)}")
            caption = page.get_by_text("Waiting for the first recorded steps")
            caption.wait_for(timeout=90_000)
            said = page.locator('[data-testid="stCaptionContainer"]', has_text="completed")
            text = said.first.inner_text().replace("\u2060", "")
            links = page.locator('[data-testid="stMarkdownContainer"] a').all()
            hrefs = [a.get_attribute("href") for a in links]
            images = page.locator('[data-testid="stMarkdownContainer"] img').count()
        finally:
            page.close()
    assert HOSTILE in text and "x@evil.example www.evil.example/y" in text, text
    assert not [h for h in hrefs if "evil" in (h or "") or "8799" in (h or "")], hrefs
    assert images == 0 and asked == [], asked


def test_right_to_left_overrides_are_shown_inert_on_pages_and_in_figures():
    """An uploaded model's layer named with U+202E reversed the rest of a figure's title,
    and a run's name the rest of the Compare caption listing the other runs."""
    from gradflow.figures.style import escape_label
    from gradflow.ui.charts import plain_markdown, plain_message

    for shown in (
        escape_label("dense\u202e_1"),
        plain_markdown("dense\u202e_1"),
        plain_message("Layer `dense\u202e_1`: first NaN"),
        plain_message("Layer dense\u2067_1: first NaN"),
    ):
        assert not re.search("[\u202a-\u202e\u2066-\u2069]", shown)
        assert "\ufffd" in shown
