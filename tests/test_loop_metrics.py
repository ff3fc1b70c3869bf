"""A training loop's own metrics (`GradientLog.record(loss=..., d_loss=..., g_loss=...)`).

They are each recorded step's numbers as the loop passed them, with names of
the loop's own: the Live page's Loss view, the figures and the exports must
draw and write them all, and not call them Keras's running means.
"""

import io
import pathlib
import zipfile

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import gradflow
from gradflow import cli, export, figures
from gradflow.store import RunStore

STEPS = 4


def gan_run(store_path, name="tiny gan"):
    """A real GAN loop of `STEPS` steps logged to `store_path`: `(run_id, {metric: [values]})`.

    One log of both networks' gradients (`variables=` the ones differentiated),
    `d_loss` and `g_loss` passed as keywords, `loss` as their sum.
    """
    keras.utils.set_random_seed(0)
    generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="g")], name="gen")
    critic = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="c")], name="critic")
    gan = keras.Sequential([generator, critic], name="gan")
    d_opt, g_opt = keras.optimizers.SGD(0.01), keras.optimizers.SGD(0.01)
    variables = critic.trainable_variables + generator.trainable_variables
    real = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    passed = {"loss": [], "d_loss": [], "g_loss": []}
    with gradflow.GradientLog(
        gan, variables=variables, optimizer=d_opt, store=store_path, run_name=name
    ) as log:
        for step in range(STEPS):
            z = tf.random.normal((8, 2), seed=step)
            with tf.GradientTape() as tape:
                d_loss = tf.reduce_mean(critic(generator(z))) - tf.reduce_mean(critic(real))
            d_grads = tape.gradient(d_loss, critic.trainable_variables)
            d_opt.apply(d_grads, critic.trainable_variables)
            with tf.GradientTape() as tape:
                g_loss = -tf.reduce_mean(critic(generator(z)))
            g_grads = tape.gradient(g_loss, generator.trainable_variables)
            g_opt.apply(g_grads, generator.trainable_variables)
            log.record(d_grads + g_grads, loss=d_loss + g_loss, d_loss=d_loss, g_loss=g_loss)
            for key, value in (("loss", d_loss + g_loss), ("d_loss", d_loss), ("g_loss", g_loss)):
                passed[key].append(float(np.float32(value)))
    return log.run_id, passed


def subplot_titles(layout):
    return [a["text"] for a in layout.get("annotations", [])]


@pytest.fixture(scope="module")
def gan(tmp_path_factory):
    path = tmp_path_factory.mktemp("gan") / "runs.db"
    run_id, passed = gan_run(path)
    return path, run_id, passed


def test_a_loops_own_metrics_get_a_panel_each_titled_plainly(gan):
    path, run_id, passed = gan
    store = RunStore(path)
    info = store.run_info(run_id)
    assert export.loop_run(info)
    metrics = store.metrics(run_id)
    assert {"d_loss", "g_loss", "learning_rate", "global_norm"} <= set(metrics["name"])
    chart = figures.metrics_chart(metrics, per_step=True)
    titles = [a.text for a in chart.figure.layout.annotations]
    assert titles == ["loss", "d_loss", "g_loss"]
    assert [t.name for t in chart.figure.data] == [
        "training loss",
        "training d_loss",
        "training g_loss",
    ]
    for trace, name in zip(chart.figure.data, ["loss", "d_loss", "g_loss"], strict=True):
        assert list(trace.x) == list(range(1, STEPS + 1))
        np.testing.assert_allclose(np.asarray(trace.y), passed[name], rtol=1e-6)
    assert chart.title == "loss, d_loss and g_loss over training"
    assert "per recorded step, as your loop passed it" in chart.description
    assert "epoch" not in chart.description and "running mean" not in chart.description
    # The lesson pack and the image exports draw the same panels.
    charts = export.run_charts(store.layer_stats(run_id), metrics, per_step=True)
    assert [a.text for a in charts["metrics"].figure.layout.annotations] == titles
    # A model.fit run's compiled metrics stay Keras's running means.
    fit = pd.DataFrame(
        [dict(step=s, name=n, value=v) for s in (1, 2) for n, v in (("loss", 1.0), ("d_loss", 2.0))]
    )
    keras_chart = figures.metrics_chart(fit, ["loss", "d_loss"])
    assert [a.text for a in keras_chart.figure.layout.annotations] == [
        "loss",
        "d_loss (running mean over each epoch)",
    ]


def test_at_most_four_panels_and_the_caption_names_the_rest():
    rows = [
        dict(step=s, name=n, value=float(s + i))
        for s in (1, 2, 3)
        for i, n in enumerate(
            [
                "loss",
                "learning_rate",
                "global_norm",
                "d_loss",
                "<b>gp</b>",
                "g_loss",
                "reward",
                "r2",
            ]
        )
    ]
    rows.append(dict(step=3, name="val_d_loss", value=0.5))
    metrics = pd.DataFrame(rows)
    assert figures.lines.loop_metric_names(metrics) == [
        "loss",
        "d_loss",
        "<b>gp</b>",
        "g_loss",
        "reward",
        "r2",
    ]
    chart = figures.metrics_chart(metrics, per_step=True)
    titles = [a.text for a in chart.figure.layout.annotations]
    assert titles == ["loss", "d_loss", figures.escape_label("<b>gp</b>"), "g_loss"]
    assert "<b>" not in "".join(titles)
    # The validation the loop passed is drawn dashed in its metric's panel.
    dashed = [t for t in chart.figure.data if t.line.dash == "dash"]
    assert [t.name for t in dashed] == ["validation d_loss"]
    assert "Not drawn (4 panels at most): reward, r2" in chart.description
    assert set(chart.data["name"]) == {"loss", "d_loss", "val_d_loss", "<b>gp</b>", "g_loss"}


def test_the_live_pages_loss_view_draws_a_loops_metrics(page_environment):
    from gradflow.ui.charts import plain_message
    from tests.test_pages import decoded, live_chart_updates, live_view, write_steps

    run_id, passed = gan_run(page_environment, name="live gan")
    app = live_view(run_id, "Loss")
    (update,) = [
        u for u in live_chart_updates(app) if "loss" in " ".join(subplot_titles(u["layout"]))
    ]
    assert subplot_titles(update["layout"]) == ["loss", "d_loss", "g_loss"]
    names = [trace["name"] for trace in update["traces"]]
    assert names == ["training loss", "training d_loss", "training g_loss"]
    for index, name in enumerate(["loss", "d_loss", "g_loss"]):
        y = decoded(update["arrays"][f"{index}.y"])
        np.testing.assert_allclose(y.astype(float), passed[name], rtol=1e-6)
    captions = [c.value for c in app.caption]
    assert any(
        plain_message("loss, d_loss and g_loss per recorded step, as your loop passed it") in c
        for c in captions
    ), captions
    assert not any("running mean" in c for c in captions)

    # A GradientMonitor run (model.fit) looks as before: compiled metrics are running means.
    store = RunStore(page_environment)
    fit_id = store.create_run({}, name="fit", source="monitor", status="completed")
    write_steps(store, fit_id, 1, 3)
    with store.writer(fit_id) as writer:
        for step in (1, 2, 3):
            writer.add_metrics(step, {"loss": 1.0 / step, "accuracy": step / 4, "d_loss": 0.5})
    app = live_view(fit_id, "Loss")
    (update,) = [u for u in live_chart_updates(app) if "loss" in subplot_titles(u["layout"])]
    assert subplot_titles(update["layout"]) == ["loss", "accuracy (running mean over each epoch)"]
    assert any("Keras's running mean" in c.value for c in app.caption)


def test_the_csv_export_writes_every_metric_the_loop_recorded(gan, tmp_path, capsys):
    path, run_id, passed = gan
    out = tmp_path / "out"
    code = cli.main(["export", run_id, "--format", "csv", "--out", str(out), "--db", str(path)])
    assert code == 0
    written = {p.name: p for p in map(pathlib.Path, capsys.readouterr().out.split())}
    (every,) = [p for name, p in written.items() if name.endswith("_all_metrics.csv")]
    back = pd.read_csv(every)
    assert list(back.columns) == ["run", "step", "name", "value", "block"]
    assert (back["run"] == "tiny gan").all() and (back["block"] == 1).all()
    stored = RunStore(path).metrics(run_id)
    assert set(back["name"]) == set(stored["name"]) >= {"loss", "d_loss", "g_loss"}
    assert len(back) == len(stored)
    for name, values in passed.items():
        rows = back[back["name"] == name].sort_values("step")
        assert list(rows["step"]) == list(range(1, STEPS + 1))
        np.testing.assert_allclose(rows["value"], values, rtol=1e-6)
    # The metrics chart's own CSV holds the loop's metrics it draws.
    (drawn,) = [p for name, p in written.items() if name.endswith("_metrics.csv") and p != every]
    assert set(pd.read_csv(drawn)["name"]) == {"loss", "d_loss", "g_loss"}


@pytest.mark.skipif(export.find_browser() is None, reason="no Chromium/Chrome installed")
def test_the_lesson_pack_holds_every_metric_and_says_so(gan, tmp_path):
    path, run_id, passed = gan
    (pack,) = export.export_run(RunStore(path), run_id, "zip", tmp_path)
    archive = zipfile.ZipFile(pack)
    every = pd.read_csv(io.BytesIO(archive.read("data/all_metrics.csv")))
    assert {"d_loss", "g_loss", "learning_rate", "global_norm"} <= set(every["name"])
    rows = every[every["name"] == "g_loss"].sort_values("step")
    np.testing.assert_allclose(rows["value"], passed["g_loss"], rtol=1e-6)
    readme = archive.read("README.txt").decode()
    assert "loss, d_loss and g_loss per recorded step, as your loop passed it" in readme
    assert "data/all_metrics.csv: every metric the run recorded" in readme


def test_the_live_pages_lesson_pack_draws_and_holds_a_loops_metrics(gan, monkeypatch):
    """The pack made from the Live page's button, from the rows the page holds."""
    import types

    from gradflow.ui import live

    monkeypatch.setattr(export, "to_images", lambda charts, fmt: [b"png"] * len(charts))
    path, run_id, passed = gan
    store = RunStore(path)
    cache = types.SimpleNamespace(
        layer_stats=store.layer_stats(run_id), metrics=store.metrics(run_id), histograms=None
    )
    pack = zipfile.ZipFile(io.BytesIO(live.lesson_pack_of(store.run_info(run_id), cache)))
    every = pd.read_csv(io.BytesIO(pack.read("data/all_metrics.csv")))
    assert {"d_loss", "g_loss", "learning_rate"} <= set(every["name"])
    (drawn,) = [n for n in pack.namelist() if n.endswith("metrics.csv") and "all_" not in n]
    assert set(pd.read_csv(io.BytesIO(pack.read(drawn)))["name"]) == {"loss", "d_loss", "g_loss"}
