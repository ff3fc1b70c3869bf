"""A run that blows up: SGD at learning rate 1e3 on a deep ReLU network.

The run must end `diverged` with the NaN origin recorded, and everything
downstream of the store (reading back, figures, CSV/HTML/zip/PNG exports, the
live dashboard page) must cope with NaN and Inf in the data: no exception, and
no bare `NaN`/`Infinity` in any JSON a browser or a script will parse.
"""

import io
import json
import math
import pathlib
import zipfile

import numpy as np
import pandas as pd
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG = dict(
    depth=8, activation="relu", learning_rate=1e3, steps=50, optimizer="sgd", batch_size=16
)


def strict_json(text):
    """`json.loads` that refuses NaN, Infinity and -Infinity."""

    def refuse(name):
        raise ValueError(f"bare {name} in JSON")

    return json.loads(text, parse_constant=refuse)


def new_plot_arguments(page):
    """The JSON arguments of the page's Plotly.newPlot call, parsed strictly."""

    def refuse(name):
        raise ValueError(f"bare {name} in the page's JSON")

    decoder = json.JSONDecoder(parse_constant=refuse)
    # plotly.js itself mentions Plotly.newPlot; the call is the last one.
    position = page.rindex("Plotly.newPlot(") + len("Plotly.newPlot(")
    arguments = []
    for _ in range(3):  # div id, data, layout
        while page[position] in " \n\r\t,":
            position += 1
        value, position = decoder.raw_decode(page, position)
        arguments.append(value)
    return arguments


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """One diverged run in a fresh store, trained in this process."""
    import gradflow
    from gradflow.store import RunStore

    path = tmp_path_factory.mktemp("diverged") / "runs.db"
    store = RunStore(path)
    run = gradflow.train(gradflow.RunConfig(**CONFIG), store=store)
    return run, store, path


def test_the_run_ends_diverged_with_a_reason(diverged):
    run, _, _ = diverged
    assert run.status == "diverged"
    assert run.message and "non-finite" in run.message.lower()
    # It stopped at the blow-up, well before the 50 steps it was given.
    assert run.layer_stats["step"].max() < CONFIG["steps"]


def test_the_nan_origin_is_an_event_that_matches_the_stored_statistics(diverged):
    run, _, _ = diverged
    events = run.events
    origin = events[events["kind"] == "nonfinite"]
    assert len(origin) == 1, events
    step, layer = int(origin["step"].iloc[0]), origin["layer"].iloc[0]
    assert f"step {step}" in origin["message"].iloc[0] and layer in origin["message"].iloc[0]

    # Checked against the raw rows, not against gradflow.diagnosis: the first
    # step with a non-finite gradient, and at that step the broken layer
    # nearest the loss (backprop reaches it first).
    stats = run.layer_stats
    broken = stats[(stats["nonfinite"] > 0) | ~np.isfinite(stats["l2_norm"])]
    assert int(broken["step"].min()) == step
    at_step = broken[broken["step"] == step]
    assert layer == at_step.loc[at_step["layer_index"].idxmax(), "layer"]
    # Before that step every gradient was finite, and so was the loss.
    before = stats[stats["step"] < step]
    assert len(before) and (before["nonfinite"] == 0).all() and np.isfinite(before["l2_norm"]).all()
    metrics = run.metrics
    losses = metrics[metrics["name"] == "loss"].set_index("step")["value"]
    assert np.isfinite(losses[losses.index < step]).all()


def test_the_stored_run_reads_back_in_a_new_store_object(diverged):
    from gradflow.lab.training import Run
    from gradflow.store import RunStore

    run, _, path = diverged
    again = Run(run.run_id, RunStore(path))
    assert again.status == "diverged"
    pd.testing.assert_frame_equal(again.layer_stats, run.layer_stats)
    assert again.config.learning_rate == CONFIG["learning_rate"]
    listed = RunStore(path).runs().set_index("run_id")
    assert listed.loc[run.run_id, "status"] == "diverged"


@pytest.mark.parametrize("tensor", ["kernel", "bias"])
def test_the_figures_build_on_nan_data_with_strict_json(diverged, tensor):
    from gradflow import figures

    run, _, _ = diverged
    stats = run.layer_stats
    last = int(stats["step"].max())
    charts = [
        figures.heatmap(stats, "max_abs", tensor),
        figures.heatmap(stats, "l2_norm", tensor, presentation=True),
        figures.layer_lines(stats, "l2_norm", tensor),
        figures.profile(stats, step=last, tensor=tensor),
        figures.metrics_chart(run.metrics),
    ]
    for chart in charts:
        assert len(chart.figure.data) > 0
        strict_json(chart.figure.to_json())
    # The heatmap's data keep NaN/Inf cells exactly where the run had them:
    # hidden data would hide the lesson. (The kernel gradients break here; the
    # bias gradients may stay finite, as the NaN comes from inf * 0 in a^T delta.)
    raw = stats.loc[stats["tensor"] == tensor, "max_abs"]
    drawn = charts[0].data["max_abs"]
    assert np.isfinite(drawn).all() == np.isfinite(raw).all()
    if tensor == "kernel":
        assert not np.isfinite(drawn).all()


def test_csv_export_reads_back(diverged, tmp_path):
    from gradflow.export import export_run

    run, store, _ = diverged
    paths = export_run(store, run.run_id, "csv", tmp_path)
    assert paths
    for path in paths:
        table = pd.read_csv(path)
        assert len(table) > 0, path.name
        if "step" in table.columns:
            assert table["step"].max() == run.layer_stats["step"].max()


def test_html_export_has_strict_plotly_json(diverged, tmp_path):
    from gradflow.export import export_run

    run, store, _ = diverged
    paths = export_run(store, run.run_id, "html", tmp_path)
    assert paths
    for path in paths:
        _, data, layout = new_plot_arguments(path.read_text(encoding="utf-8"))
        assert data and isinstance(layout, dict), path.name


def _needs_chromium():
    from gradflow.export import find_browser

    if find_browser() is None:
        pytest.skip("PNG export and lesson packs need Chromium (scripts/ensure_chromium.sh)")


def test_png_export(diverged, tmp_path):
    from gradflow.export import export_run

    _needs_chromium()
    run, store, _ = diverged
    paths = export_run(store, run.run_id, "png", tmp_path)
    assert paths
    for path in paths:
        assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), path.name


def test_lesson_pack_has_strict_json_everywhere(diverged, tmp_path):
    from gradflow.export import export_run

    _needs_chromium()
    run, store, _ = diverged
    (path,) = export_run(store, run.run_id, "zip", tmp_path)
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        config = strict_json(archive.read("config.json").decode("utf-8"))
        assert math.isclose(config["learning_rate"], CONFIG["learning_rate"])
        pages = [name for name in names if name.endswith(".html")]
        assert pages
        for name in pages:
            new_plot_arguments(archive.read(name).decode("utf-8"))
        for name in (n for n in names if n.endswith(".json")):
            strict_json(archive.read(name).decode("utf-8"))
        for name in (n for n in names if n.endswith(".csv")):
            assert len(pd.read_csv(io.BytesIO(archive.read(name)))) > 0, name
        # The handout says the run diverged, and where.
        alerts = pd.read_csv(io.BytesIO(archive.read("data/alerts.csv")))
        assert "nonfinite" in set(alerts["kind"])


def test_the_live_page_shows_the_diverged_run_and_its_origin(diverged):
    from streamlit.testing.v1 import AppTest

    from tests.conftest import pages_on

    run, _, path = diverged
    origin = run.events[run.events["kind"] == "nonfinite"].iloc[0]
    with pages_on(path):
        app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
        app.session_state["live.run_id"] = run.run_id
        app.run()
        assert not app.exception, [e.value for e in app.exception]
        errors = [e.value for e in app.error]
        assert any(
            f"step {int(origin['step'])}" in text and origin["layer"] in text for text in errors
        ), errors
        assert any("Diverged" in m.value for m in app.markdown), [m.value for m in app.markdown]
