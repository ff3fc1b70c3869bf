"""Exports: real PNG/SVG/PDF from Chromium, offline HTML, safe CSV, lesson pack."""

import io
import json
import os
import re
import xml.etree.ElementTree as ElementTree
import zipfile

import numpy as np
import pandas as pd
import PIL.Image
import pytest

from gradflow import export, figures, schema

EVIL = "<script>alert(1)</script>"
needs_browser = pytest.mark.skipif(
    export.find_browser() is None, reason="no Chromium/Chrome installed"
)


def make_layer_stats(steps=8, layers=("dense", EVIL, "a&b")):
    rng = np.random.default_rng(0)
    rows = []
    for step in range(1, steps + 1):
        for index, layer in enumerate(layers):
            for tensor in ("kernel", "bias"):
                rows.append(
                    dict(
                        step=step,
                        layer=layer,
                        layer_index=index,
                        tensor=tensor,
                        variable=f"seq/{layer}/{tensor}",
                        max_abs=10.0 ** (-index) * rng.uniform(0.5, 2),
                        l2_norm=10.0 ** (-index) * rng.uniform(2, 5),
                        mean_abs=10.0 ** (-index) * rng.uniform(0.05, 0.4),
                    )
                )
    frame = pd.DataFrame(rows)
    frame.loc[(frame["step"] == 5) & (frame["layer_index"] == 1), "max_abs"] = np.nan
    frame.loc[(frame["step"] == 6) & (frame["layer_index"] == 2), "max_abs"] = np.inf
    return frame


def make_metrics(steps=8):
    rows = []
    for step in range(1, steps + 1):
        rows += [
            dict(step=step, name="loss", value=1.0 / step),
            dict(step=step, name="accuracy", value=step / 10),
        ]
    rows.append(dict(step=steps, name="val_loss", value=np.nan))
    return pd.DataFrame(rows)


class FakeStore:
    """The RunStore methods export_run uses, over fixed frames (no events, no histograms)."""

    def __init__(self, name):
        self.name = name

    def run_info(self, run_id):
        return {
            "run_id": run_id,
            "name": self.name,
            "config": {"depth": 3, "learning_rate": float("nan")},
        }

    def layer_stats(self, run_id):
        return make_layer_stats()

    def metrics(self, run_id):
        return make_metrics()

    def events(self, run_id):
        return pd.DataFrame(columns=["step", "layer", "kind", "message"])

    def histograms(self, run_id):
        return pd.DataFrame()


@needs_browser
def test_png_batch_renders_real_images(artifacts_dir):
    frame = make_layer_stats()
    charts = {
        "heatmap": figures.heatmap(frame, "max_abs"),
        "profile": figures.profile(frame, presentation=True),
        "lines": figures.layer_lines(frame, "l2_norm", figures.ALL_WEIGHTS),
    }
    images = export.to_images(list(charts.values()), "png")
    assert len(images) == 3
    for (name, chart), png in zip(charts.items(), images, strict=True):
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        image = PIL.Image.open(io.BytesIO(png))
        image.load()
        # Default width 1100 px at scale 2; height is the figure's own.
        assert image.size == (2200, 2 * (chart.figure.layout.height or 600))
        assert len(set(image.convert("L").getdata())) > 10  # not a blank page
        (artifacts_dir / f"export_{name}.png").write_bytes(png)


@needs_browser
def test_svg_is_xml_with_escaped_layer_names_and_pdf_is_pdf():
    chart = figures.heatmap(make_layer_stats(), "max_abs")
    svg = export.to_image(chart, "svg", width=800, height=500)
    root = ElementTree.fromstring(svg)
    assert root.tag.endswith("svg")
    assert not [e for e in root.iter() if e.tag.rsplit("}", 1)[-1] == "script"]
    texts = ["".join(e.itertext()) for e in root.iter() if e.tag.endswith("text")]
    assert EVIL in texts and "a&b" in texts  # drawn literally, as text
    pdf = export.to_image(chart, "pdf")
    assert pdf.startswith(b"%PDF") and len(pdf) > 1000


def _svg_texts(svg, css_class):
    root = ElementTree.fromstring(svg)
    groups = [e for e in root.iter() if css_class in e.get("class", "").split()]
    return ["".join(t.itertext()) for g in groups for t in g.iter() if t.tag.endswith("text")]


@needs_browser
def test_a_long_runs_step_axis_reads_in_thousands_not_powers_of_ten():
    """A 20,000-step run's heatmap was ticked "0.5e+4, 1e+4, 1.5e+4" on a slide."""
    steps = np.arange(1, 20_001)
    frame = pd.DataFrame(
        {"step": steps, "layer": "dense", "layer_index": 0, "tensor": "kernel"}
        | {"variable": "dense/kernel", "max_abs": np.exp(-steps / 1e4), "l2_norm": 1.0}
    )
    for chart in (figures.heatmap(frame), figures.layer_lines(frame, "max_abs", "kernel")):
        svg = export.to_image(chart, "svg", width=800, height=400)
        ticks = _svg_texts(svg, "xtick")
        assert "10,000" in ticks and not [t for t in ticks if "e+" in t], ticks
    # The values' log axis keeps its powers of ten.
    assert "1e-1" in _svg_texts(svg, "ytick")


def test_missing_browser_raises_export_error_naming_chromium(monkeypatch, tmp_path):
    monkeypatch.delenv("GRADFLOW_CHROMIUM", raising=False)
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert export.find_browser() is None
    with pytest.raises(export.ExportError, match="(?i)install.*chromium"):
        export.to_image(figures.heatmap(make_layer_stats()), "png")


def test_gradflow_chromium_variable_wins(monkeypatch, tmp_path):
    fake = tmp_path / "my-chrome"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("GRADFLOW_CHROMIUM", str(fake))
    assert export.find_browser() == str(fake)
    monkeypatch.setenv("GRADFLOW_CHROMIUM", str(tmp_path / "missing"))
    assert export.find_browser() != str(tmp_path / "missing")


@pytest.mark.parametrize(
    "call, error, words",
    [
        (
            lambda c: export.to_image(c, "jpeg"),
            ValueError,
            "`format` must be one of ['png', 'svg', 'pdf']",
        ),
        (lambda c: export.to_html("chart"), TypeError, "plotly Figure or a gradflow.figures.Chart"),
        (lambda c: export.to_csv([1, 2]), TypeError, "`data` must be a pandas DataFrame"),
        (
            lambda c: export.export_run(FakeStore("x"), "r", "gif", "/tmp"),
            ValueError,
            "`fmt` must be one of",
        ),
        (lambda c: export.lesson_pack({}), ValueError, "at least one chart"),
        (lambda c: export.to_image(None), TypeError, "`figure` must be a plotly Figure"),
        (lambda c: export.to_image(c, width=0), ValueError, "`width` must be a positive integer"),
        (lambda c: export.to_image(c, height=-5), ValueError, "`height` must be a positive"),
        (lambda c: export.to_image(c, scale=float("nan")), ValueError, "`scale` must be"),
        # scale=100 gave 3 bytes of garbage and no error.
        (lambda c: export.to_image(c, scale=100), ValueError, "more than a browser can draw"),
        (lambda c: export.export_run(None, "r", "csv", "/tmp"), ValueError, "`store` must be"),
        (
            lambda c: export.export_run("/nonexistent/runs.db", "r", "csv", "/tmp"),
            ValueError,
            "no such file",
        ),
    ],
)
def test_errors_name_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call(figures.heatmap(make_layer_stats()))
    assert words in str(info.value)


def parse_new_plot_arguments(page):
    """The JSON arguments of the Plotly.newPlot call, parsed strictly (no NaN)."""

    def no_constants(name):
        raise ValueError(f"bare {name} in the page's JSON")

    decoder = json.JSONDecoder(parse_constant=no_constants)
    position = page.rindex("Plotly.newPlot(") + len(
        "Plotly.newPlot("
    )  # the library mentions it too
    arguments = []
    for _ in range(4):  # div id, data, layout, config
        while page[position] in " \n\r\t,":
            position += 1
        value, position = decoder.raw_decode(page, position)
        arguments.append(value)
    return arguments


def test_html_is_standalone_valid_and_escaped():
    chart = figures.heatmap(make_layer_stats(), "max_abs", title=f"run {EVIL}")
    page = export.to_html(chart)
    # Booleans first: pytest would spend minutes diffing a 4 MB string.
    # Plotly 7 puts `<!doctype html>` first (standards mode); Plotly 6 did not.
    starts_as_html = re.match(r"(<!doctype html>\s*)?<html[\s>]", page.lstrip(), re.I) is not None
    external_scripts = re.findall(r"<script[^>]*\bsrc=", page)
    has_raw_evil = EVIL in page
    has_title = "<title>run &lt;script&gt;alert(1)&lt;/script&gt;</title>" in page
    assert starts_as_html and has_title
    assert external_scripts == []  # plotly.js inline: works offline
    assert len(page) > 3_000_000  # the inline library
    assert not has_raw_evil
    _, data, layout, config = parse_new_plot_arguments(page)
    assert data[0]["type"] == "heatmap"
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in data[0]["y"]
    assert {t.get("name") for t in data} >= {"NaN", "Inf"}
    assert config["toImageButtonOptions"] == {"format": "svg", "scale": 2, "filename": "gradflow"}


@pytest.mark.browser
def test_an_exported_page_offers_no_upload_to_plotly_cloud(chromium):
    """Plotly 7's pages (Plotly.js 4) showed a "Share chart..." button that uploads the
    chart to Plotly Cloud: a student's handout must send nothing anywhere."""
    page = chromium.new_page()
    try:
        page.set_content(export.to_html(figures.heatmap(make_layer_stats(), "max_abs")))
        page.wait_for_selector(".modebar-btn", state="attached")
        buttons = page.eval_on_selector_all(
            ".modebar-btn", "buttons => buttons.map(b => b.getAttribute('data-title'))"
        )
    finally:
        page.close()
    assert "Download plot" in buttons  # the toolbar was drawn
    assert not [title for title in buttons if "share" in str(title).lower()]


@pytest.mark.parametrize(
    "cell, written",
    [
        ("=1+1", "'=1+1"),
        ("+1", "'+1"),
        ("-1", "'-1"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("\tcmd", "'\tcmd"),
        ("\rcmd", "'\rcmd"),
        ("dense", "dense"),
        ("a=b", "a=b"),
        ("two\nlines", "two\nlines"),
    ],
)
def test_csv_neutralises_formula_text_but_not_numbers(cell, written):
    frame = pd.DataFrame({"layer": [cell], "value": [-2.5], "count": [-3]})
    back = pd.read_csv(io.StringIO(export.to_csv(frame)), keep_default_na=False)
    assert back["layer"].iloc[0] == written
    assert back["value"].iloc[0] == -2.5 and back["count"].iloc[0] == -3


def test_csv_round_trips_the_plotted_data_with_nan_and_inf():
    chart = figures.heatmap(make_layer_stats(), "max_abs")
    text = export.to_csv(chart)
    assert ",nan" in text and ",inf" in text
    back = pd.read_csv(io.StringIO(text))
    pd.testing.assert_frame_equal(back, chart.data, check_dtype=False)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("../../etc/passwd", "etc_passwd"),
        ("run 1", "run_1"),
        ("", "figure"),
        ("..", "figure"),
        (EVIL, "script_alert_1_script"),
        ("a/b\\c", "a_b_c"),
        ("relu-vs.sigmoid", "relu-vs.sigmoid"),
    ],
)
def test_safe_filename(name, expected):
    assert export.safe_filename(name) == expected


@needs_browser
def test_lesson_pack_holds_figures_data_config_and_readme(artifacts_dir):
    frame = make_layer_stats()
    charts = {"heatmap": figures.heatmap(frame), "../loss": figures.metrics_chart(make_metrics())}
    blob = export.lesson_pack(charts, config={"depth": 3, "clip_value": float("inf")})
    (artifacts_dir / "export_lesson_pack.zip").write_bytes(blob)
    archive = zipfile.ZipFile(io.BytesIO(blob))
    names = set(archive.namelist())
    assert names == {
        "README.txt",
        "config.json",
        "figures/heatmap.png",
        "figures/heatmap.html",
        "data/heatmap.csv",
        "figures/loss.png",
        "figures/loss.html",
        "data/loss.csv",
    }
    assert archive.read("figures/loss.png")[:4] == b"\x89PNG"
    assert json.loads(archive.read("config.json")) == {"depth": 3, "clip_value": None}
    readme = archive.read("README.txt").decode()
    assert charts["heatmap"].title in readme and charts["../loss"].description in readme
    back = pd.read_csv(io.BytesIO(archive.read("data/heatmap.csv")))
    pd.testing.assert_frame_equal(back, charts["heatmap"].data, check_dtype=False)


@pytest.mark.parametrize("fmt", ["csv", "html"])
def test_export_run_writes_only_inside_out_dir(tmp_path, fmt):
    out_dir = tmp_path / "out"
    paths = export.export_run(FakeStore(f"../../evil {EVIL}"), "abc123", fmt, out_dir)
    names = sorted(p.name for p in paths)
    assert names == sorted(
        f"evil_script_alert_1_script_abc123_{chart}.{fmt}"
        for chart in ("max_abs_heatmap", "l2_norm_heatmap", "max_abs_lines", "profile", "metrics")
    )
    assert all(p.parent == out_dir.resolve() and p.stat().st_size > 0 for p in paths)
    assert sorted(os.listdir(tmp_path)) == ["out"]


@needs_browser
def test_export_run_png_and_zip(tmp_path):
    paths = export.export_run(FakeStore("relu run"), "abc123", "png", tmp_path)
    assert len(paths) == 5
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    (zip_path,) = export.export_run(FakeStore("relu run"), "abc123", "zip", tmp_path)
    assert zip_path.name == "relu_run_abc123_lesson.zip"
    assert "data/metrics.csv" in zipfile.ZipFile(zip_path).namelist()


def test_export_run_from_a_real_run_store(store_path, tmp_path):
    store_module = pytest.importorskip("gradflow.store")
    store = store_module.RunStore(store_path)
    run_id = store.create_run({"depth": 3}, name="tiny")
    writer = store.writer(run_id, background_flush=False)
    writer.add_layer_stats(make_layer_stats())
    for step in range(1, 9):
        writer.add_metrics(step, {"loss": 1.0 / step})
    writer.close(status="completed")
    (csv_path, *_) = export.export_run(store, run_id, "csv", tmp_path)
    assert csv_path.name == f"tiny_{run_id}_max_abs_heatmap.csv"
    # The store's path works too, as GradientMonitor(store=...) takes it.
    for path in (store_path, str(store_path)):
        assert export.export_run(path, run_id, "csv", tmp_path / "again")[0].name == csv_path.name
    back = pd.read_csv(csv_path)
    # Exactly the values drawn, after a column that says which run they are.
    expected = figures.heatmap(make_layer_stats(), "max_abs").data
    assert (back.pop("run") == "tiny").all()
    pd.testing.assert_frame_equal(back, expected, check_dtype=False)


def vanishing_run(store):
    """A stored run whose input layer's gradients vanish, with histograms and one stored event."""
    stats = make_layer_stats(steps=12, layers=("dense", "mid", "=top"))
    stats.loc[stats["layer_index"] == 0, ["max_abs", "l2_norm", "mean_abs"]] *= 1e-9
    run_id = store.create_run({"depth": 3}, name="sigmoid deep")
    writer = store.writer(run_id, background_flush=False)
    writer.add_layer_stats(stats)
    for step in range(1, 13):
        writer.add_metrics(step, {"loss": 1.0 / step})
        counts = np.eye(len(figures.BIN_COLUMNS))[step % 5] * 10
        writer.add_histograms(
            step,
            [
                (layer, index, "kernel", counts)
                for index, layer in enumerate(("dense", "mid", "=top"))
            ],
        )
    writer.add_event(3, "", "info", "=HYPERLINK(1) the optimizer was rebuilt")
    writer.close(status="completed")
    return run_id, stats


@needs_browser
def test_a_lesson_pack_says_what_the_rules_found_and_shows_the_ends_histograms(
    store_path, tmp_path
):
    from gradflow import diagnose
    from gradflow.store import RunStore

    store = RunStore(store_path)
    run_id, stats = vanishing_run(store)
    (zip_path,) = export.export_run(store, run_id, "zip", tmp_path)
    archive = zipfile.ZipFile(zip_path)
    names = set(archive.namelist())
    assert {"figures/histogram_first_layer.png", "figures/histogram_last_layer.png"} <= names
    readme = archive.read("README.txt").decode()
    assert "Distribution of |gradient| over training: dense (kernels)" in readme
    assert "Distribution of |gradient| over training: =top (kernels)" in readme
    alerts = pd.read_csv(io.BytesIO(archive.read("data/alerts.csv")), keep_default_na=False)
    found = diagnose(store.layer_stats(run_id))
    assert len(alerts) == len(found) + 1
    assert set(found["message"]) < set(alerts["message"])
    # The gravest first, then by step; a message that would run in a spreadsheet does not.
    assert alerts["kind"].iloc[0] == "nonfinite"
    assert alerts["step"].iloc[1:].is_monotonic_increasing
    assert "'=HYPERLINK(1) the optimizer was rebuilt" in set(alerts["message"])
    # "The first:" read as the run's earliest alerts; they are its gravest.
    # An `info` event is a note, not an alert.
    notes = int((alerts["kind"] == "info").sum())
    assert notes == 1
    assert (
        f"what the diagnosis rules found ({len(alerts) - 1} alerts and 1 note). The most "
        "serious first (NaN/Inf), then by step:"
    ) in readme
    assert "[vanishing]: Layer dense: gradient norm" in readme


def test_an_rnns_cell_kernels_are_its_kernels_and_one_nan_origin_is_told_once():
    """The LSTM's `lstm_cell/kernel` was left out: the "first layer" histogram was the output's."""
    counts = {c: 1.0 for c in figures.BIN_COLUMNS}
    histograms = pd.DataFrame(
        [
            dict(step=s, layer=layer, layer_index=i, tensor=tensor, **counts)
            for s in (1, 2)
            for i, (layer, tensor) in enumerate(
                [
                    ("lstm", "lstm_cell/kernel"),
                    ("lstm", "lstm_cell/recurrent_kernel"),
                    ("output", "kernel"),
                ]
            )
        ]
    )
    stats = make_layer_stats(layers=("lstm", "mid", "output"))
    charts = export.run_charts(stats, make_metrics(), histograms=histograms)
    assert charts["histogram_first_layer"].title.endswith(": lstm (lstm_cell/kernel)")
    assert charts["histogram_last_layer"].title.endswith(": output (kernels)")
    # The gradient through time has a heatmap of its own (the Live page offers it too).
    recurrent = stats.assign(tensor=stats["tensor"].replace({"bias": "lstm_cell/recurrent_kernel"}))
    chart = export.run_charts(recurrent, make_metrics())["recurrent_kernel_heatmap"]
    assert chart.title == "gradient L2 norm per layer (recurrent kernels)"
    origin = export.run_alerts(stats, pd.DataFrame()).query("kind == 'nonfinite'")
    stored = origin.assign(message="Non-finite gradient first at step 6, layer 'a&b'.")
    both = export.run_alerts(stats, stored)
    assert both.query("kind == 'nonfinite'")["message"].tolist() == stored["message"].tolist()


def test_a_lesson_pack_of_a_calm_run_says_the_rules_found_nothing(monkeypatch):
    # No browser needed to read the README: the PNGs are stubbed.
    monkeypatch.setattr(export, "to_images", lambda charts, fmt: [b"png"] * len(charts))
    blob = export.lesson_pack({"loss": figures.metrics_chart(make_metrics())}, alerts=[])
    archive = zipfile.ZipFile(io.BytesIO(blob))
    assert "found no vanishing, exploding, dead or" in archive.read("README.txt").decode()
    assert archive.read("data/alerts.csv").decode().strip() == "step,layer,kind,message"
    without = zipfile.ZipFile(
        io.BytesIO(export.lesson_pack({"loss": figures.metrics_chart(make_metrics())}))
    )
    assert "data/alerts.csv" not in without.namelist()


@pytest.mark.parametrize(
    ("title", "run", "expected"),
    [
        ("max |gradient| per layer", None, "max_gradient_per_layer"),
        ("max |gradient| per layer", "relu · depth 20", "relu_depth_20_max_gradient_per_layer"),
        ("loss", "../../" + "x" * 100, "x" * 48 + "_loss"),
        ("loss", "···", "run_loss"),
    ],
)
def test_file_stem_puts_the_run_first(title, run, expected):
    assert export.file_stem(title, run) == expected


def test_exported_figures_say_their_run_escaped(tmp_path):
    # A figure on a slide is no longer under its run's name on the page.
    paths = export.export_run(FakeStore(f"sigmoid {EVIL}"), "abc123", "html", tmp_path)
    for path in paths:
        page = path.read_text()
        assert "sigmoid &lt;script&gt;alert(1)&lt;/script&gt;" in page, path.name
        assert EVIL not in page, path.name


@pytest.mark.parametrize(
    "count, heading",
    [
        (1, "found (1 alert):"),
        (3, "found (3 alerts). The most serious first (NaN/Inf), then by step:"),
        (12, "found (12 alerts). The 10 most serious, NaN/Inf first, then by step:"),
    ],
)
def test_the_lesson_packs_readme_says_which_alerts_it_quotes(count, heading):
    """It said "The first:" above the gravest alerts, not the run's first ones."""
    alerts = pd.DataFrame(
        {"step": range(count), "layer": "dense", "kind": "vanishing", "message": "m"}
    )
    lines = export._alerts_readme(alerts)
    assert lines[0].endswith(heading)
    assert len([line for line in lines if line.startswith("  - step")]) == min(count, 10)


def test_a_clipped_or_constrained_runs_exports_show_what_was_applied():
    """The exports of a clipping run had only the norms before clipping (0.4 where 0.01 was
    applied), and a max-norm run's weight norms were in no file."""
    stats = make_layer_stats()
    plain = export.run_charts(stats, make_metrics())
    assert not {"l2_norm_clipped_heatmap", "weight_norm_lines"} & set(plain)
    stats["l2_norm_clipped"] = np.minimum(stats["l2_norm"], 0.01)
    stats["weight_norm"] = 0.5
    stats["weight_norm_unconstrained"] = stats["l2_norm"] * 3
    charts = export.run_charts(stats, make_metrics(), run="clipped run")
    clipped = charts["l2_norm_clipped_heatmap"]
    assert clipped.data["l2_norm_clipped"].max() <= 0.01
    # One colour scale for the norms before and after clipping: on their own
    # scales the same yellow meant 1000 above and 1 below.
    before = charts["l2_norm_heatmap"].figure.data[0]
    after = clipped.figure.data[0]
    assert (before.zmin, before.zmax) == (after.zmin, after.zmax)
    assert after.zmin <= np.log10(0.01) and before.zmax >= np.log10(stats["l2_norm"].max())
    assert charts["weight_norm_lines"].data["weight_norm"].eq(0.5).all()
    assert charts["weight_norm_unconstrained_lines"].data["weight_norm_unconstrained"].max() > 0.5


def test_a_lesson_packs_readme_says_how_its_run_ended(monkeypatch):
    """A pack of a run stopped at step 52 of 300, or still training, read as a finished one."""
    monkeypatch.setattr(export, "to_images", lambda charts, fmt: [b"png"] * len(charts))
    charts = {"loss": figures.metrics_chart(make_metrics())}
    info = {
        "status": "stopped",
        "progress_step": 52,
        "total_steps": 300,
        "message": "Stopped: a new run was started from its page.",
    }
    blob = export.lesson_pack(charts, {"record_every": 5}, "pack", run_info=info)
    readme = zipfile.ZipFile(io.BytesIO(blob)).read("README.txt").decode().splitlines()
    assert readme[3:6] == [
        "Stopped at step 52 of 300.",
        "Stopped: a new run was started from its page.",
        "Statistics were recorded every 5 steps.",
    ]
    running = export.lesson_pack(
        charts, {}, "pack", run_info={"status": "running", "progress_step": 9}
    )
    readme = zipfile.ZipFile(io.BytesIO(running)).read("README.txt").decode().splitlines()
    assert readme[3] == "Still training when this pack was made, at step 9."
    script = {"model": "tuned", "optimizer": "Adam", "optimizer_settings": {"learning_rate": 0.1}}
    blob = export.lesson_pack(
        charts,
        script,
        "pack",
        run_info={"status": "completed", "progress_step": 9, "source": "monitor", "config": script},
    )
    readme = zipfile.ZipFile(io.BytesIO(blob)).read("README.txt").decode().splitlines()
    assert readme[4] == "Recorded from a script: model tuned · Adam: learning_rate 0.1."


def test_exporting_an_ended_run_with_nothing_recorded_does_not_say_yet(tmp_path):
    from gradflow.store import RunStore

    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({}, name="broke at once", status="failed")
    with pytest.raises(
        export.ExportError, match=r"\(failed\) has no recorded statistics or metrics to export\.$"
    ):
        export.export_run(store, run_id, "csv", tmp_path / "out")


def test_an_alert_through_time_names_no_layer_in_the_lesson_pack():
    """The pack's README said "layer t=01" of a time step, and counted a note as an alert."""
    alerts = pd.DataFrame(
        {
            "step": [13, 425],
            "layer": ["t=01", "t=01"],
            "kind": ["vanishing", "info"],
            "message": ["Through time (training step 13): ...", "Through time (... 425): ..."],
        }
    )
    lines = export._alerts_readme(alerts)
    assert lines[0].startswith(
        "data/alerts.csv: what the diagnosis rules found (1 alert and 1 note)."
    )
    assert lines[1] == "  - step 13 [vanishing]: Through time (training step 13): ..."
    assert "layer" not in " ".join(lines[1:])
    layers = alerts.assign(layer=["dense_1", "t=001–003x"], kind=["vanishing", "vanishing"])
    assert ", layer dense_1 [vanishing]" in export._alerts_readme(layers)[1]
    assert ", layer t=001–003x [vanishing]" in export._alerts_readme(layers)[2]


def test_an_alert_about_the_whole_model_names_no_layer_in_the_lesson_pack(monkeypatch):
    """A monitor's loss-alone NaN has no layer (None); pandas 3 reads it as NaN, and the
    pack's README said "layer nan"."""
    monkeypatch.setattr(export, "to_images", lambda charts, fmt: [b"png"] * len(charts))
    # As `GradientMonitor.events` makes them: rows of tuples, None for no layer.
    events = pd.DataFrame(
        [
            (3, None, "nonfinite", "The loss itself was NaN at step 3."),
            (2, "dense", "exploding", "m"),
        ],
        columns=list(schema.EVENTS_COLUMNS),
    )
    charts = {"loss": figures.metrics_chart(make_metrics())}
    blob = export.lesson_pack(charts, {}, "pack", alerts=events)
    readme = zipfile.ZipFile(io.BytesIO(blob)).read("README.txt").decode()
    assert "  - step 3 [nonfinite]: The loss itself was NaN at step 3.\n" in readme
    assert "  - step 2, layer dense [exploding]: m\n" in readme


def test_a_scripts_run_says_what_it_trained_in_one_line():
    """A KerasTuner search stored runs named alike: the page and the pack now tell them apart."""
    from gradflow.run_settings import script_settings

    config = {
        "model": "tuned",
        "optimizer": "SGD",
        "optimizer_settings": {
            "learning_rate": 0.01,
            "momentum": 0.0,  # no momentum: nothing to say
            "clipnorm": 1.0,  # clipping at 1 is a setting
            "nesterov": False,
            "gradient_accumulation_steps": 1,
        },
        "parameters": 1234,
        "every": 1,
    }
    info = {"source": "monitor", "config": config}
    assert script_settings(info) == (
        "model `tuned`, 1,234 parameters · SGD: learning_rate 0.01, clipnorm 1 · every step"
    )
    config["optimizer_settings"] = {"learning_rate": "ExponentialDecay"}
    config["every"] = 5
    assert script_settings(info).endswith("SGD: learning_rate ExponentialDecay · every 5 steps")
    # A run stored before these settings were: what there is.
    assert script_settings(
        {"source": "monitor", "config": {"model": "m", "optimizer": "Adam"}}
    ) == ("model `m` · Adam")
    assert script_settings({"source": "lab", "config": {"model": "m"}}) == ""


def test_a_run_list_says_what_a_run_trained_where_its_name_does_not():
    """The Runs page listed 30 KerasTuner trials as "sequential", and a lab run renamed
    "Alice" with nothing of its settings."""
    from gradflow.lab.config import RunConfig, run_name
    from gradflow.run_settings import run_settings

    trial = {
        "model": "sequential",
        "optimizer": "Adam",
        "optimizer_settings": {"learning_rate": 0.01},
    }
    assert run_settings("monitor", trial, "sequential") == (
        "model `sequential` · Adam: learning_rate 0.01"
    )
    lab = RunConfig(depth=3, activation="sigmoid")
    assert run_settings("lab", lab.to_dict(), "Alice") == "sigmoid · depth 3 · sgd lr=0.05"
    # A lab run that keeps its own name says its settings already.
    assert run_settings("cli", lab.to_dict(), run_name(lab)) == ""
    named = RunConfig(depth=3, name="Alice")  # `gradflow train --name Alice`
    assert run_settings("cli", named.to_dict(), "Alice") == "relu · depth 3 · sgd lr=0.05"
    # A config of another gradflow, or none: nothing to say rather than an error.
    assert run_settings("lab", {"depth": 3, "from_the_future": 1}, "x") == ""
    assert run_settings("lab", None, "x") == ""
    assert run_settings("monitor", None, "x") == ""
