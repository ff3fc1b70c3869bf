"""Every dashboard page runs without an exception and shows its widgets (Streamlit AppTest)."""

import dataclasses
import json
import pathlib
import sqlite3

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
LIVE_LABELS = {
    "slider": ["Depth"],
    "select_slider": ["Width", "Learning rate", "Batch size"],
    "selectbox": [
        "Activation",
        "Initializer",
        "Optimizer",
        "Dataset",
        "Gradient clipping",
        "Normalization",
    ],
    "toggle": ["Residual connections"],
    "number_input": ["Seed"],
    "button": ["Start training", "Pause", "Stop"],
}


# Pages share st.cache_resource singletons in this process: one store for the module (conftest.py).
pytestmark = pytest.mark.usefixtures("page_environment")


@pytest.fixture(autouse=True)
def without_run_board(monkeypatch):
    # These pages poll with fragment ticks, as a server without static files
    # does; tests/test_board.py covers the pages that watch the run board.
    from gradflow.ui import resources

    monkeypatch.setattr(resources, "run_board", lambda: None)


def run_page(name, /, **query):
    from streamlit.testing.v1 import AppTest

    app = AppTest.from_file(str(REPO / "pages" / name), default_timeout=120)
    for key, value in query.items():
        app.query_params[key] = value
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    return app


def labels(app, kind):
    return {widget.label for widget in getattr(app, kind)}


def test_live_training_has_the_contract_widgets():
    app = run_page("live_training.py")
    for kind, expected in LIVE_LABELS.items():
        missing = set(expected) - labels(app, kind)
        assert not missing, f"{kind} widgets missing: {missing}"
    start = next(b for b in app.button if b.label == "Start training")
    assert not start.disabled
    assert any("Start training" in info.value for info in app.info)


def test_a_shared_link_restores_its_settings():
    app = run_page("live_training.py", depth="8", activation="sigmoid")
    assert next(s for s in app.slider if s.label == "Depth").value == 8
    assert next(s for s in app.selectbox if s.label == "Activation").value == "sigmoid"


def test_a_broken_link_falls_back_to_defaults_with_a_message():
    app = run_page("live_training.py", depth="5000")
    assert any("not valid" in w.value for w in app.warning)
    assert next(s for s in app.slider if s.label == "Depth").value != 5000


def test_invalid_settings_show_a_message_and_disable_start():
    app = run_page("live_training.py")
    next(s for s in app.selectbox if s.label == "Architecture").set_value("cnn")
    next(s for s in app.selectbox if s.label == "Dataset").set_value("spirals")
    app.run()
    assert not app.exception
    assert app.error, "a student must see why the settings do not work"
    assert "cnn" in app.error[0].value.lower() or "image" in app.error[0].value.lower()
    assert next(b for b in app.button if b.label == "Start training").disabled


def test_compare_page_offers_an_ab_launch():
    app = run_page("compare.py")
    assert {"Vary", "A: Activation", "B: Activation"} <= labels(app, "selectbox")
    assert "Start comparison" in labels(app, "button")


def test_the_compare_page_starts_a_presets_pair_and_varies_residual(page_environment, monkeypatch):
    """Each preset names its partner, but nothing read it: a teacher ran both presets one by
    one and picked them here. Residual connections could not be A/B'd."""
    import types

    from gradflow.lab.presets import PRESETS
    from gradflow.store import RunStore
    from gradflow.ui import resources

    store = RunStore(page_environment)
    started = []

    def start(config, name=None):
        started.append((config, name))
        return store.create_run(config, name=name, status="completed")

    manager = types.SimpleNamespace(
        prewarm=False, start=start, queued=lambda: [], running=lambda: {}
    )
    monkeypatch.setattr(resources, "run_manager", lambda: manager)
    app = run_page("compare.py")
    next(s for s in app.selectbox if s.label == "Pair").set_value(("deep_sigmoid", "relu_he"))
    next(b for b in app.button if b.label == "Start the pair").click().run()
    assert not app.exception, [e.value for e in app.exception]
    pair = [PRESETS["deep_sigmoid"], PRESETS["relu_he"]]
    assert started == [(p.config, p.title) for p in pair]
    assert [store.run_info(r)["name"] for r in app.session_state["compare.picker"]] == [
        p.title for p in pair
    ]

    next(s for s in app.selectbox if s.label == "Vary").set_value("residual").run()
    a = next(s for s in app.selectbox if s.label == "A: Residual connections")
    b = next(s for s in app.selectbox if s.label == "B: Residual connections")
    assert (a.value, b.value) == (False, True)
    next(b for b in app.button if b.label == "Start comparison").click().run()
    assert [config.residual for config, _ in started[2:]] == [False, True]
    assert started[3][1].startswith("Residual connections: on · ")


def test_a_run_from_a_users_own_model_says_the_form_is_not_its_settings(page_environment):
    """Beside a ResNet50's charts the sidebar read mlp, depth 4, sgd, as if those were its."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    mine = store.create_run({"model": "resnet50"}, name="my resnet", source="monitor")
    app = run_page("live_training.py", run=mine)
    said = "recorded from a model of your own"
    assert any(said in c.value for c in app.sidebar.caption)
    lab = store.create_run({"depth": 3}, name="lab run", source="lab")
    app = run_page("live_training.py", run=lab)
    assert not any(said in c.value for c in app.sidebar.caption)
    # Nor a page with no run (a teacher's first look said it, beside nothing).
    for page in ("live_training.py", "compare.py"):
        assert not any(said in c.value for c in run_page(page).sidebar.caption), page


def test_the_lesson_pack_of_a_run_deleted_elsewhere_is_made_of_what_the_page_shows(
    page_environment, monkeypatch
):
    """ "Download lesson pack" gave no file and no word once another page had deleted the
    run: the pack asked the store for the run's events (UnknownRunError in the log)."""
    import io
    import types
    import zipfile

    from gradflow import export
    from gradflow.store import RunStore
    from gradflow.ui import live

    monkeypatch.setattr(export, "to_images", lambda charts, fmt: [b"png"] * len(charts))
    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="deleted by a colleague", status="completed")
    write_vanishing_steps(store, run_id, 1, 5)
    info = store.run_info(run_id)
    cache = types.SimpleNamespace(
        layer_stats=store.layer_stats(run_id), metrics=store.metrics(run_id), histograms=None
    )
    store.delete(run_id)
    pack = zipfile.ZipFile(io.BytesIO(live.lesson_pack_of(info, cache)))
    assert any(name.endswith(".csv") for name in pack.namelist())


def test_a_shared_compare_link_restores_its_settings():
    """The Compare page read no link: a teacher's "/compare?depth=20" opened at depth 5."""
    app = run_page("compare.py", depth="20", activation="tanh")
    assert next(s for s in app.slider if s.label == "Depth").value == 20
    assert next(s for s in app.selectbox if s.label == "A: Activation").value == "tanh"
    next(s for s in app.slider if s.label == "Depth").set_value(12)
    app.run()
    assert app.query_params["depth"] == "12" and app.query_params["activation"] == "tanh"


def test_runs_page_lists_runs_from_the_store(page_environment):
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 3}, name="from my script", source="monitor")
    app = run_page("runs.py")
    assert any(f"`{page_environment}`" in c.value for c in app.caption)  # which store it is
    assert "from my script" in app.dataframe[0].value["name"].tolist()
    assert run_id in app.dataframe[0].value["run_id"].tolist()


def test_the_runs_page_says_what_runs_named_alike_trained(page_environment):
    """Thirty KerasTuner trials were thirty rows of "sequential"; a lab run renamed "Alice" said
    nothing of its settings."""
    from gradflow.lab.config import RunConfig, run_name
    from gradflow.store import RunStore

    store = RunStore(page_environment)  # the module's store: other tests' runs are in it too
    lab = RunConfig(depth=3)
    named = store.create_run(lab.to_dict(), name=run_name(lab))
    trials = [
        store.create_run(
            {"model": "sequential", "optimizer": "SGD", "optimizer_settings": {"momentum": m}},
            name="sequential",
            source="monitor",
        )
        for m in (0.5, 0.9)
    ]
    alice = store.create_run(RunConfig(activation="tanh").to_dict(), name="Alice")
    table = run_page("runs.py").dataframe[0].value
    assert list(table.columns[:2]) == ["name", "settings"]
    settings = table.set_index("run_id")["settings"]
    assert settings[trials[0]] == "model `sequential` · SGD: momentum 0.5"
    assert settings[trials[1]] == "model `sequential` · SGD: momentum 0.9"
    assert settings[alice] == "tanh · depth 4 · sgd lr=0.05"
    assert settings[named] == ""  # its name says it all (`gradflow runs` leaves the column out)


def test_runs_brought_from_other_machines_say_whose_they_are(page_environment):
    """A teacher imports the class's stores: every run read "run 1" from "cli"."""
    import sqlite3

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    mine = store.create_run({}, name="run 1")
    assert "host" not in run_page("runs.py").dataframe[0].value.columns  # one machine: no column
    theirs = store.create_run({}, name="run 1")
    with sqlite3.connect(page_environment) as conn:
        conn.execute("UPDATE runs SET host = 'alice-laptop' WHERE run_id = ?", (theirs,))
    table = run_page("runs.py").dataframe[0].value.set_index("run_id")
    assert table.loc[theirs, "host"] == "alice-laptop"
    assert table.loc[mine, "host"] not in ("alice-laptop", None)


def test_the_runs_page_deletes_a_finished_run_and_stops_a_training_one(page_environment):
    """ "Yes, delete" called a `RunManager.stop` that does not exist: every delete failed."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    done = store.create_run({"depth": 3}, name="finished run", status="completed")
    training = store.create_run({"depth": 3}, name="training run", status="running")
    app = run_page("runs.py")
    next(s for s in app.selectbox if s.label == "Run").set_value(done).run()
    next(b for b in app.button if b.label == "Delete").click().run()
    next(b for b in app.button if b.label == "Yes, delete").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert done not in store.runs()["run_id"].tolist()

    next(s for s in app.selectbox if s.label == "Run").set_value(training).run()
    assert "Delete" not in labels(app, "button")
    next(b for b in app.button if b.label == "Stop").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert store.pending_request(training) == "stop"
    assert training in store.runs()["run_id"].tolist()


def test_the_runs_page_deletes_every_failed_run_at_once_and_no_training_one(page_environment):
    """A term's store held 293 runs, and the page deleted one at a time, with a question each."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    [store.create_run({}, name=f"broken {i}", status="failed") for i in range(3)]
    kept = store.create_run({}, name="the good one", status="completed")
    training = store.create_run({}, name="still training", status="running")
    runs = store.runs()  # (this module's pages share one store)
    failed = sorted(runs.loc[runs["status"] == "failed", "run_id"])
    app = run_page("runs.py")
    status = next(m for m in app.multiselect if m.label == "Only runs that are")
    assert "failed" in status.options and "running" not in status.options
    status.set_value(["failed"]).run()
    next(b for b in app.button if b.label == f"Pick all {len(failed)} shown").click().run()
    picker = next(m for m in app.multiselect if m.label == "Runs to delete")
    assert sorted(picker.value) == failed and training not in picker.options
    next(b for b in app.button if b.label == f"Delete {len(failed)} runs").click().run()
    assert set(failed) <= set(store.runs()["run_id"])  # asked first
    from gradflow.ui.runs_table import DELETION_REMEMBERED

    assert DELETION_REMEMBERED in [c.value for c in app.caption]
    next(b for b in app.button if b.label == "Yes, delete them").click().run()
    assert not app.exception, [e.value for e in app.exception]
    left = set(store.runs()["run_id"])
    assert not left & set(failed) and {kept, training} <= left
    assert next(m for m in app.multiselect if m.label == "Runs to delete").value == []


def test_a_renamed_run_stays_the_one_picked(page_environment):
    """After Rename the picker jumped to the first run, and the next Delete asked to delete it."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    picked = store.create_run({"depth": 3}, name="CNN demo", status="completed")
    store.create_run({"depth": 3}, name="newer run", status="completed")
    app = run_page("runs.py")
    assert next(s for s in app.selectbox if s.label == "Run").value != picked  # not the first
    next(s for s in app.selectbox if s.label == "Run").set_value(picked).run()
    # A name with markdown in it is asked about as typed, not as red text.
    typed = "CNN demo :red[renamed]"
    next(t for t in app.text_input if t.label == "New name").input(typed)
    next(b for b in app.button if b.label == "Rename").click().run()
    assert store.run_info(picked)["name"] == typed
    assert next(s for s in app.selectbox if s.label == "Run").value == picked
    next(b for b in app.button if b.label == "Delete").click().run()
    [question] = [w.value for w in app.warning if w.value.startswith("Delete")]
    assert "CNN demo \\:red\\[renamed\\]" in question
    assert question.replace("\\", "") == f"Delete {typed} · completed · {picked} and all its data?"
    from gradflow.ui.runs_table import DELETION_REMEMBERED

    assert DELETION_REMEMBERED in [c.value for c in app.caption]


def test_a_run_opened_from_the_runs_page_brings_its_settings(page_environment):
    """ "Open in Live training" once left the form on other settings and the link bare."""
    from gradflow.lab.config import RunConfig
    from gradflow.store import RunStore
    from gradflow.ui.controls import lab_config_of

    store = RunStore(page_environment)
    config = RunConfig(depth=20, activation="sigmoid", learning_rate=0.05)
    lab = store.create_run(config, name="deep sigmoid", source="lab")
    script = store.create_run({"model": "mine"}, name="from my script", source="monitor")
    assert lab_config_of(store.run_info(lab)) == config
    assert lab_config_of(store.run_info(script)) is None
    # What the Live page reads back from the link that `show_on_live_page` builds.
    app = run_page("live_training.py", run=lab, **config.to_query())
    assert next(s for s in app.slider if s.label == "Depth").value == 20
    assert next(s for s in app.selectbox if s.label == "Activation").value == "sigmoid"
    table = run_page("runs.py")
    assert "Started (UTC)" in str(table.dataframe[0].proto)
    # A link to the run alone: the form shows its settings, not the defaults beside its charts.
    bare = run_page("live_training.py", run=lab)
    assert next(s for s in bare.slider if s.label == "Depth").value == 20
    assert bare.query_params["activation"] == "sigmoid"


def test_run_names_show_as_typed_and_twins_can_be_told_apart(page_environment):
    from gradflow.store import RunStore
    from gradflow.ui.charts import plain_markdown

    assert plain_markdown("# Big **bold** :red[red] $x^2$") == (
        r"\# Big \*\*bold\*\* \:red\[red\] \$x^2\$"
    )
    store = RunStore(page_environment)
    first = store.create_run({"depth": 3}, name="sigmoid · depth 20", status="completed")
    second = store.create_run({"depth": 3}, name="sigmoid · depth 20", status="completed")
    app = run_page("compare.py")
    picker = next(m for m in app.multiselect if m.label == "Runs to compare")
    labels = [option for option in picker.options]
    assert len(set(labels)) == len(labels)
    assert any(first in label for label in labels) and any(second in label for label in labels)

    # Picked runs go into the link, and the link opens the comparison (it opened empty).
    picker.set_value([first, second]).run()
    assert app.query_params["runs"] == f"{first},{second}"
    linked = run_page("compare.py", runs=f"{first},{second}")
    assert next(m for m in linked.multiselect if m.label == "Runs to compare").value == [
        first,
        second,
    ]
    assert not any("Pick two or more runs" in i.value for i in linked.info)
    assert not linked.warning
    # A link whose runs are gone says so: it showed "Pick two or more runs" alone.
    stale = run_page("compare.py", runs=f"{first},0123456789ab,zz<b>")
    assert [w.value for w in stale.warning] == [
        "2 of the 3 runs in this link no longer exist (deleted, or the link is wrong)."
    ]
    gone = run_page("compare.py", runs="0123456789ab")
    assert [w.value for w in gone.warning] == [
        "The runs in this link no longer exist (deleted, or the link is wrong)."
    ]


def test_inspect_shows_a_snapshot_only_beside_what_it_was_taken_of():
    """The example's results once stayed under the empty upload form, unlabelled."""
    app = run_page("inspect_model.py")
    next(b for b in app.button if b.label == "Take snapshot").click()
    app.run()
    assert [m.label for m in app.metric] == ["Loss on this batch"]
    app.radio[0].set_value("Upload my own")
    app.run()
    assert not app.exception and list(app.metric) == []
    app.radio[0].set_value("Built-in example")
    app.run()
    assert [m.label for m in app.metric] == ["Loss on this batch"]
    example = next(s for s in app.selectbox if s.label == "Example")
    example.set_value(next(o for o in example.options if o != example.value))
    app.run()
    assert list(app.metric) == [], "another example: not its snapshot"


def test_inspect_page_snapshots_a_built_in_subclassed_rnn():
    app = run_page("inspect_model.py")
    example = next(s for s in app.selectbox if s.label == "Example")
    example.set_value(next(o for o in example.options if "Subclassed" in o))
    next(b for b in app.button if b.label == "Take snapshot").click()
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert app.metric and app.metric[0].label == "Loss on this batch"
    tables = [frame.value for frame in app.dataframe]
    activations = tables[1]
    assert {"rnn", "head/dense"} <= set(activations["layer"])


def test_inspect_warns_of_a_layer_no_gradient_reaches(monkeypatch):
    """An uploaded model with a dropped branch: its rows would have read as zeros."""
    import keras
    import numpy as np

    import gradflow
    from gradflow.ui import inspect
    from tests.test_monitor_edges import UnusedBranch

    model = UnusedBranch()
    model.build((None, 5))
    x = np.ones((4, 5), "float32")
    shot = gradflow.snapshot(model, x, x[:, :1], loss=keras.losses.MeanSquaredError())
    monkeypatch.setattr(inspect, "snapshot_of_example", lambda name: (shot, None))
    app = run_page("inspect_model.py")
    next(b for b in app.button if b.label == "Take snapshot").click()
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    warnings = [w.value for w in app.warning]
    assert len(warnings) == 1
    assert warnings[0].startswith("No gradient reaches layer 'unused' (kernel, bias, output)")


def upload_and_snapshot(model_path, data, loss=None):
    """The Inspect page with a model file and an .npz batch uploaded, after Take snapshot."""
    import io

    import numpy as np

    app = run_page("inspect_model.py")
    app.radio[0].set_value("Upload my own")
    app.run()
    batch = io.BytesIO()
    np.savez(batch, **data)
    app.file_uploader[0].set_value(("m.keras", model_path.read_bytes(), "application/zip"))
    app.file_uploader[1].set_value(("batch.npz", batch.getvalue(), "application/zip"))
    app.run()
    if loss is not None:
        next(s for s in app.selectbox if s.label == "Loss").set_value(loss)
        app.run()
    next(b for b in app.button if b.label == "Take snapshot").click()
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    return app


def logits_model(tmp_path, loss=None):
    import keras

    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(5, name="scores")(inputs), name="logits")
    if loss is not None:
        model.compile(optimizer="adam", loss=loss)
    model.save(tmp_path / "m.keras")
    return model, tmp_path / "m.keras"


def test_uploads_beyond_the_servers_slots_wait_for_one(tmp_path, monkeypatch):
    """Each upload's child starts TensorFlow: thirty clicks at once started thirty."""
    import threading
    import time

    import numpy as np
    import streamlit as st

    from gradflow.ui import resources

    monkeypatch.setenv("GRADFLOW_MAX_UPLOADS", "1")
    st.cache_resource.clear()
    _, path = logits_model(tmp_path, loss="mse")
    slots, count = resources.upload_slots()
    assert count == 1
    slots.acquire()  # another student's upload
    threading.Timer(3.0, slots.release).start()
    started = time.monotonic()
    app = upload_and_snapshot(path, {"x": np.ones((4, 4), "float32"), "y": np.zeros((4, 5))})
    assert time.monotonic() - started >= 3.0
    assert not app.error, [e.value for e in app.error]
    assert len(app.metric) and len(app.dataframe)  # the snapshot is shown
    # The slot is free again for the next upload.
    assert slots.acquire(blocking=False)
    slots.release()
    st.cache_resource.clear()


def test_an_uploaded_logits_model_is_read_with_its_own_saved_loss(tmp_path):
    """Read as probabilities its loss was 7.6 against 1.7, its gradients 3-5x too large."""
    import keras
    import numpy as np
    import tensorflow as tf

    model, path = logits_model(
        tmp_path, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    y = np.arange(8) % 5
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x))
    expected = np.linalg.norm(tape.gradient(loss, model.trainable_variables[0]))
    app = upload_and_snapshot(path, {"x": x, "y": y})
    assert [e.value for e in app.error] == [] and [w.value for w in app.warning] == []
    assert float(app.metric[0].value) == pytest.approx(float(loss), rel=1e-3)
    kernel = app.dataframe[0].value.query("tensor == 'kernel'")
    assert kernel["l2_norm"].iloc[0] == pytest.approx(expected, rel=1e-5)


def test_the_inspect_page_says_what_is_wrong_without_a_traceback(tmp_path):
    import numpy as np

    _, path = logits_model(tmp_path)
    x = np.ones((6, 4), "float32")
    # Saved without a loss: the page asks for one.
    app = upload_and_snapshot(path, {"x": x, "y": np.arange(6) % 5})
    assert "choose the loss in the **Loss** box" in app.error[0].value
    # Labels numbered from 1.
    app = upload_and_snapshot(
        path, {"x": x, "y": np.arange(6) % 5 + 1}, loss="sparse_categorical_crossentropy"
    )
    assert "They look numbered from 1" in app.error[0].value
    # Raw scores read as probabilities: a snapshot, with a warning beside it.
    app = upload_and_snapshot(
        path, {"x": x, "y": np.arange(6) % 5}, loss="sparse_categorical_crossentropy"
    )
    assert app.metric and "(from logits)" in app.warning[0].value
    # Unnamed arrays (`np.savez(f, x, y)`) with a NaN among the inputs.
    app = upload_and_snapshot(
        path,
        {"arr_0": np.where(np.eye(6, 4) > 0, np.nan, x), "arr_1": np.arange(6) % 5},
        loss="sparse_categorical_crossentropy (from logits)",
    )
    assert "The inputs hold 4 NaN or infinite value(s)" in app.error[0].value


def test_a_refusal_on_the_page_gives_no_advice_a_student_cannot_follow():
    """ "Upload a smaller file or raise `max_bytes`": the browser has no `max_bytes` to raise."""
    import gradflow
    from gradflow.probe import uploads

    error = gradflow.UnsafeInputError(
        "The model file is 60,000,000 bytes, over the limit of `max_bytes`=52,428,800. "
        "Upload a smaller file or raise `max_bytes`."
    )
    assert uploads.for_the_page(error) == (
        "The model file is 60,000,000 bytes, over the limit of 52,428,800. Upload a smaller file."
    )


def test_a_model_with_two_outputs_gets_a_message(tmp_path):
    import keras
    import numpy as np

    inputs = keras.Input((4,))
    model = keras.Model(
        inputs, [keras.layers.Dense(2, name="a")(inputs), keras.layers.Dense(1, name="b")(inputs)]
    )
    model.save(tmp_path / "two.keras")
    app = upload_and_snapshot(
        tmp_path / "two.keras", {"x": np.ones((4, 4), "float32"), "y": np.zeros(4)}, loss="mse"
    )
    assert (
        "gradflow probes models with one output; this model has 2 ('a', 'b')" in app.error[0].value
    )


def test_an_rnns_recurrent_kernels_are_a_choice_of_their_own():
    """The gradient through time, where an RNN's gradients vanish, had no view of its own."""
    import pandas as pd

    from gradflow.ui.live import _tensor_choices

    stats = pd.DataFrame(
        {"tensor": ["lstm_cell/kernel", "lstm_cell/recurrent_kernel", "lstm_cell/bias", "kernel"]}
    )
    assert _tensor_choices(stats) == ["kernel", "recurrent_kernel", "bias", "all_weights"]


def test_normalization_scales_and_shifts_are_choices_of_their_own(page_environment):
    """ResNet50's 52 BatchNorm gammas and betas were only inside "All weights", one row
    per BatchNorm between the convolutions' rows, found only by hovering."""
    import pandas as pd

    from gradflow.store import RunStore
    from gradflow.ui.live import _tensor_choices

    names = ["kernel", "bias", "gamma", "beta", "depthwise_kernel", "activation"]
    assert _tensor_choices(pd.DataFrame({"tensor": names})) == [
        "kernel",
        "bias",
        "gamma",
        "beta",
        "depthwise_kernel",
        "all_weights",
        "activation",
    ]
    _, run_id = one_layer_run(page_environment, {}, "completed")
    store = RunStore(page_environment)
    row = {"step": [1], "layer": ["batch_norm"], "layer_index": [1], "tensor": "gamma"}
    with store.writer(run_id) as writer:
        writer.add_layer_stats(pd.DataFrame(row | {"max_abs": [0.3], "l2_norm": [0.4]}))
    app = live_view(run_id, "Heatmaps")
    [radio] = [r for r in app.radio if r.label == "Gradients of"]
    assert "gamma" in radio.options or "Norm. scales (gamma)" in radio.options
    radio.set_value("gamma").run()
    assert not app.exception, [e.value for e in app.exception]


def test_a_bad_or_empty_number_box_turns_start_off_and_says_why_beside_it():
    """A box with a range kept an out-of-range number on show while Start trained the
    value before; an emptied box took its minimum (a clip threshold of 1e-6), silently;
    the message was only at the top of the sidebar, far above the box."""
    app = run_page("live_training.py")
    boxes = {box.label: box for box in app.number_input}
    boxes["Record every N steps"].set_value(0).run()
    start = next(b for b in app.button if b.label == "Start training")
    said = "**Record every N steps** must be an integer from 1 to 1000000, got 0."
    assert start.disabled
    assert any(said in e.value for e in app.sidebar.error)
    assert any(said in w.value and "Start training is off" in w.value for w in app.main.warning)
    boxes = {box.label: box for box in app.number_input}
    boxes["Record every N steps"].set_value(1).run()
    boxes = {box.label: box for box in app.number_input}
    boxes["Clip threshold"].set_value(None).run()
    # With clipping off the threshold is not read: it must not turn Start off.
    assert not next(b for b in app.button if b.label == "Start training").disabled
    assert not app.sidebar.error
    next(s for s in app.selectbox if s.label == "Gradient clipping").set_value("norm").run()
    assert next(b for b in app.button if b.label == "Start training").disabled
    assert any(
        "**Clip threshold** is empty: enter a number greater than 0 and at most 1e+06." in e.value
        for e in app.sidebar.error
    )
    assert app.session_state["cfg._config"].clip_value == 1.0  # the last valid settings
    from gradflow.ui.controls import _in_words

    assert _in_words("`record_every` must be an integer from 1 to 1000000, got 0.") == (
        "**Record every N steps** must be an integer from 1 to 1000000, got 0."
    )
    # A setting with its value, in backticks or not (it read "`architecture='cnn'` needs ...").
    from gradflow.lab.config import RunConfig

    with pytest.raises(ValueError) as caught:
        RunConfig(architecture="cnn", dataset="spirals")
    assert _in_words(str(caught.value)).startswith("**Architecture** cnn needs an image data set (")
    assert _in_words(str(caught.value)).endswith("got **Dataset** spirals.")
    with pytest.raises(ValueError) as caught:
        RunConfig(max_norm=-1.0)
    assert _in_words(str(caught.value)).startswith(
        "**Max-norm constraint (0 = off)** must be 0 (off) or a number greater than 0"
    )


@pytest.mark.parametrize(
    "module",
    sorted(p.stem for p in (REPO / "gradflow" / "ui").glob("*.py") if p.stem != "__init__"),
)
def test_every_ui_module_imports_on_its_own(module):
    """An import cycle (controls -> resources -> charts -> controls) failed only when
    a module was the first one imported."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", f"import gradflow.ui.{module}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-1500:]


def test_split_backprop_page_runs_the_lesson():
    app = run_page("split_backprop.py")
    app.multiselect[0].set_value([6, 8])
    next(b for b in app.button if b.label == "Run the lesson").click()
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("Largest difference" in s.value for s in app.success)


def test_split_backprop_page_takes_a_size_too_large_for_jacobians():
    """At 16x16 the largest Jacobian is over the 20-million-entry limit: once a crash."""
    app = run_page("split_backprop.py")
    app.multiselect[0].set_value([16])
    next(b for b in app.button if b.label == "Run the lesson").click()
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("too large to form" in s.value for s in app.success)
    # Nothing claims the way that was not run agreed, or a size of "nan MB".
    assert not any("(Jacobians)" in s.value for s in app.success)
    assert not any("nan MB" in c.value for c in app.caption)
    # Other sizes picked: the results on show say which sizes they are for.
    app.multiselect[0].set_value([6, 16]).run()
    assert any("These results are for the sizes 16" in i.value for i in app.info)


def live_view(run_id, view):
    """The Live training page of `run_id`, opened on `view` (Alerts, Lines, ...)."""
    from streamlit.testing.v1 import AppTest

    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = run_id
    app.session_state["live.view"] = view
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    return app


def live_chart_updates(app):
    """What the page's live charts send (`gradflow/ui/figure_delta.py` has the format)."""
    import json

    return [
        json.loads(element.proto.json)
        for element in app.get("bidi_component")
        if element.proto.component_name.endswith("gradflow.live_chart")
    ]


def test_every_training_setting_says_what_it_does():
    """A lecturer found one "?" in the sidebar: Initializer, Gradient clipping,
    Normalization and Max-norm were left unexplained to first-year students."""
    from gradflow.ui.controls import WIDGETS

    app = run_page("live_training.py")
    labels = {label for _, label, *_ in WIDGETS}
    kinds = ("selectbox", "select_slider", "slider", "toggle", "number_input")
    shown = {w.label: w.help for kind in kinds for w in app.get(kind) if w.label in labels}
    assert set(shown) == labels
    assert all(help_text and len(help_text) > 20 for help_text in shown.values()), shown
    assert "he" in shown["Initializer"] and "global_norm" in shown["Gradient clipping"]


def test_a_charts_toolbar_download_is_named_after_its_run(page_environment):
    """The toolbar's camera saved every chart as gradflow.svg."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="relu depth 2", status="running")
    write_vanishing_steps(store, run_id, 1, 5)
    store.set_status(run_id, "completed")
    app = run_page("live_training.py", run=run_id)
    names = [u["config"]["toImageButtonOptions"]["filename"] for u in live_chart_updates(app)]
    assert len(names) == 2 and all(n.startswith("relu_depth_2_") for n in names), names
    assert len(set(names)) == 2  # the max and the norm heatmap


def decoded(change):
    """The numpy array of an update's array change ({from, shape, dtype, bdata} or values)."""
    import base64

    import numpy as np

    if "bdata" not in change:
        return np.array(change["values"], dtype=object).reshape(change["shape"])
    flat = np.frombuffer(base64.b64decode(change["bdata"]), dtype=change["dtype"])
    return flat.reshape(change["shape"])


def annotations(layout):
    return " ".join(a.get("text", "") for a in layout.get("annotations", []))


def test_the_live_panel_is_drawn_empty_before_a_run():
    # Nothing moves when the first step arrives, and the browser loads Plotly early.
    app = run_page("live_training.py")
    updates = live_chart_updates(app)
    assert len(updates) == 2 and all("appear here" in annotations(u["layout"]) for u in updates)
    assert all(u["base"] is None and not u["traces"] for u in updates)
    assert not app.get("plotly_chart")


def test_with_more_pages_than_cores_plotly_waits_until_a_worker_has_the_run(
    page_environment, monkeypatch
):
    # Issue #7: a class opening the page at once loaded 30 copies of Plotly at
    # once (1.1 s of each page's main thread), and its pages stalled for 30-40 s.
    import types

    from gradflow.store import RunStore
    from gradflow.ui import resources

    monkeypatch.setattr(resources, "open_sessions", lambda: 31)
    app = run_page("live_training.py")
    assert live_chart_updates(app) == [] and not app.get("plotly_chart")
    captions = [c.value for c in app.caption]
    assert sum("appear here" in c for c in captions) == 2 and any(
        "per layer" in c for c in captions
    )

    store = RunStore(page_environment)
    queued = store.create_run({"depth": 3}, name="in a class", status="queued")
    monkeypatch.setattr(
        resources,
        "run_manager",
        lambda: types.SimpleNamespace(prewarm=False, queued=lambda: [queued], running=lambda: {}),
    )
    app = run_page("live_training.py", run=queued)
    assert live_chart_updates(app) == []
    assert sum("Waiting for the first training step" in c.value for c in app.caption) == 2

    store.set_status(queued, "running")  # a worker has it: Plotly now, before the first step
    app = run_page("live_training.py", run=queued)
    updates = live_chart_updates(app)
    assert len(updates) == 2 and all(
        "Waiting for the first training step" in annotations(u["layout"]) for u in updates
    )


def test_a_run_without_its_first_step_shows_empty_heatmaps(page_environment):
    from gradflow.store import RunStore

    run_id = RunStore(page_environment).create_run(
        {"depth": 3}, name="just started", status="running"
    )
    app = run_page("live_training.py", run=run_id)
    updates = live_chart_updates(app)
    assert len(updates) == 2
    assert all("Waiting for the first training step" in annotations(u["layout"]) for u in updates)
    assert any("just started" in m.value for m in app.markdown)


def write_steps(store, run_id, first, last):
    import numpy as np
    import pandas as pd

    steps = np.arange(first, last + 1)
    with store.writer(run_id) as writer:
        writer.add_layer_stats(
            pd.DataFrame(
                {
                    "step": steps,
                    "layer": "dense_1",
                    "layer_index": 0,
                    "tensor": "kernel",
                    "max_abs": np.linspace(1e-3, 1.0, len(steps)) * steps,
                    "l2_norm": 1.0,
                }
            )
        )
        writer.progress(last)


def test_alerts_come_in_network_order_and_none_is_hidden(page_environment):
    """12 vanishing layers: dense_2 before dense_10, and the seven past the first five listed."""
    import numpy as np
    import pandas as pd

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 12}, name="deep sigmoid", status="completed")
    layers = [f"dense_{i}" for i in range(1, 13)]
    with store.writer(run_id) as writer:
        writer.add_layer_stats(
            pd.DataFrame(
                {
                    "step": 5,
                    "layer": layers,
                    "layer_index": np.arange(12),
                    "tensor": "kernel",
                    "max_abs": 1e-9,
                    "l2_norm": 1e-9,
                    "nonfinite": 0,
                }
            )
        )
        writer.progress(5)
    app = live_view(run_id, "Alerts")
    shown = [w.value.split(":")[0] for w in app.warning if w.value.startswith("Layer dense_")]
    assert shown == [f"Layer dense_{i}" for i in range(1, 6)]
    [more] = [e for e in app.expander if "more alerts about" in e.label]
    assert more.label == "7 more alerts about vanishing gradients"
    table = more.dataframe[0].value
    assert table["layer"].tolist() == [f"dense_{i}" for i in range(6, 13)]


def write_vanishing_steps(store, run_id, first, last, vanishing=(30, 50), loss=True):
    """Steps first..last of two dense layers whose gradients vanish from the steps in `vanishing`."""
    import numpy as np
    import pandas as pd

    steps = np.arange(first, last + 1)
    with store.writer(run_id) as writer:
        for index, layer in enumerate(["dense_1", "dense_2"]):
            norm = np.where(steps >= vanishing[index], 1e-9, 1.0)
            writer.add_layer_stats(
                pd.DataFrame(
                    {
                        "step": steps,
                        "layer": layer,
                        "layer_index": index,
                        "tensor": "kernel",
                        "max_abs": norm,
                        "l2_norm": norm,
                        "nonfinite": 0,
                    }
                )
            )
        for step in steps if loss else ():
            writer.add_metrics(step, {"loss": 1.0 / step})
        writer.progress(last)


def test_the_alerts_of_a_running_run_read_only_its_new_steps(page_environment, monkeypatch):
    """The Alerts view redraws every second: the rules once read the whole run each time."""
    from streamlit.testing.v1 import AppTest

    from gradflow import diagnosis
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="growing", status="running")

    read = []
    diagnose = diagnosis.diagnose

    def counted(table, thresholds=None, layer_inputs=None):
        read.append(sorted(table["step"].unique()))
        return diagnose(table, thresholds, layer_inputs)

    monkeypatch.setattr(diagnosis, "diagnose", counted)
    # dense_1's gradients vanish from step 1 on, dense_2's from step 110.
    write_vanishing_steps(store, run_id, 1, 100, vanishing=(1, 110), loss=False)
    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = run_id
    app.session_state["live.view"] = "Alerts"
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert [w.value.split(":")[0] for w in app.warning if "vanishing" in w.value] == [
        "Layer dense_1"
    ]
    assert read == [list(range(1, 101))]

    write_vanishing_steps(store, run_id, 101, 120, vanishing=(1, 110), loss=False)
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    # The alert of step 1 stays; step 110's joins it. The rules read the 20
    # new steps and those before them they compare with: `repeat_after`
    # steps back from step 100, then `growth_window` steps more (a run
    # without rows through time needs no `time_window` more).
    shown = [w.value for w in app.warning if "vanishing" in w.value]
    assert [m.split(":")[0] for m in shown] == ["Layer dense_1", "Layer dense_2"]
    assert "step 1 " in shown[0] and "step 110 " in shown[1]
    rules = diagnosis.Thresholds()
    assert read[1] == list(range(100 - rules.repeat_after - rules.growth_window, 121))
    # Nothing new: nothing read again.
    app.run()
    assert len(read) == 2 and len([w for w in app.warning if "vanishing" in w.value]) == 2


def test_tabs_showing_one_run_share_its_rows_and_read_each_new_step_once(
    page_environment, monkeypatch
):
    """Each tab kept its own copy of the rows: about 165 MB per tab of a
    40,000-step run, and every tick read the same new rows again per tab."""
    import gc

    from streamlit.testing.v1 import AppTest

    from gradflow import diagnosis
    from gradflow.store import RunStore
    from gradflow.ui import run_rows

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="the teacher's", status="running")
    write_vanishing_steps(store, run_id, 1, 40)
    reads, diagnosed = [], []
    layer_stats, diagnose = RunStore.layer_stats, diagnosis.diagnose

    def counted_read(self, run, *args, **kwargs):
        reads.append(kwargs.get("after_step"))
        return layer_stats(self, run, *args, **kwargs)

    def counted_rules(table, thresholds=None, layer_inputs=None):
        diagnosed.append(int(table["step"].max()))
        return diagnose(table, thresholds, layer_inputs)

    monkeypatch.setattr(RunStore, "layer_stats", counted_read)
    monkeypatch.setattr(diagnosis, "diagnose", counted_rules)

    def tab():
        app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
        app.query_params["run"] = run_id
        app.session_state["live.view"] = "Alerts"
        return app

    tabs = [tab() for _ in range(3)]

    def tick():
        for app in tabs:
            app.run()
            assert not app.exception, [e.value for e in app.exception]
            # Each tab shows what the rules found, not only the first one.
            assert any("Layer dense_1" in w.value for w in app.warning)

    tick()
    assert reads == [None] and diagnosed == [40]
    key = f"live.cache.{run_id}"
    rows = tabs[0].session_state[key]
    assert all(app.session_state[key] is rows for app in tabs)
    assert rows.last_step == 40 and len(rows.layer_stats) == 80

    write_vanishing_steps(store, run_id, 41, 60)
    tick()
    assert reads == [None, 40] and diagnosed == [40, 60]
    assert rows.last_step == 60 and len(rows.layer_stats) == 120
    assert sorted(rows.metrics["step"]) == list(range(1, 61))
    assert all(any("Layer dense_2" in w.value for w in app.warning) for app in tabs)

    # A tab that moves to another run lets go of this one; the rows go
    # with the last tab that showed it.
    other = store.create_run({"depth": 2}, name="a student's", status="running")
    write_vanishing_steps(store, other, 1, 5)
    for app in tabs:
        app.session_state["live.run_id"] = other
        app.run()
        assert key not in app.session_state
    del rows
    gc.collect()
    held = [run for _, run in run_rows.runs_held()]
    assert run_id not in held and other in held


def test_the_alerts_view_and_lesson_pack_use_the_thresholds_the_monitor_was_given(
    page_environment,
):
    """The page and the exports ran the rules again with the defaults: an alert
    the user had turned off came back, and one they asked for was missing."""
    import io
    import zipfile

    import keras
    from streamlit.testing.v1 import AppTest

    from gradflow import GradientMonitor, diagnosis, export
    from gradflow.store import RunStore

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="hidden"), keras.layers.Dense(1, name="out")]
    )
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    # Every gradient is "exploding" under this ceiling; none is by default.
    rules = diagnosis.Thresholds(exploding_norm=1e-12)
    monitor = GradientMonitor(store=page_environment, rules=rules, run_name="strict")
    model.fit(x, x[:, :1], batch_size=8, verbose=0, callbacks=[monitor])
    assert set(monitor.events["kind"]) == {"exploding"}
    store = RunStore(page_environment)
    assert diagnosis.run_thresholds(store.run_info(monitor.run_id)["config"]) == rules
    assert diagnosis.diagnose(store.layer_stats(monitor.run_id)).empty

    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = monitor.run_id
    app.session_state["live.view"] = "Alerts"
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    shown = [e.value for e in [*app.error, *app.warning] if "exploding" in e.value]
    assert {m.split(":")[0] for m in shown} == {"Layer hidden", "Layer out"}
    (path,) = export.export_run(store, monitor.run_id, "zip", page_environment.parent / "out")
    with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as pack:
        alerts = pack.read("data/alerts.csv").decode()
    assert "Layer hidden" in alerts and "Layer out" in alerts


def test_live_heatmaps_are_capped_and_a_tick_sends_only_the_new_columns(page_environment):
    from gradflow.store import RunStore
    from gradflow.ui.live import LIVE_MAX_COLUMNS

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 1}, name="long run", status="running")
    last = 3 * LIVE_MAX_COLUMNS + 1
    write_steps(store, run_id, 1, last)
    app = run_page("live_training.py", run=run_id)
    first = [
        u for u in live_chart_updates(app) if u.get("traces", [{}])[0].get("type") == "heatmap"
    ]
    assert len(first) == 2 and all(u["base"] is None for u in first)
    widths = [decoded(u["arrays"]["0.z"]).shape[1] for u in first]
    assert all(LIVE_MAX_COLUMNS // 2 <= w <= LIVE_MAX_COLUMNS for w in widths)

    # The next tick of this session: three more steps, in the same (partial) last column
    # or the next one; the browser holds the rest.
    write_steps(store, run_id, last + 1, last + 3)
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    second = live_chart_updates(app)
    max_update = next(u for u in second if u["key"] == first[0]["key"])
    assert max_update["base"] == first[0]["revision"]
    change = max_update["arrays"]["0.z"]
    assert change["from"] >= widths[0] - 1 and 1 <= change["shape"][1] <= 2
    assert "traces" not in max_update and set(max_update.get("layout", {})) <= {"xaxis"}


def full_run_messages(monkeypatch):
    """Record the ForwardMsgs of every AppTest run (the element tree drops delta paths)."""
    from streamlit.testing.v1 import local_script_runner

    recorded = []
    parse = local_script_runner.parse_tree_from_messages

    def recording(messages):
        recorded[:] = list(messages)
        return parse(messages)

    monkeypatch.setattr(local_script_runner, "parse_tree_from_messages", recording)
    return recorded


def fragments_sharing_or_not_last_in_their_block(messages):
    """Fragments a queued fragment run could re-add past the end of their block.

    When a fragment run starts before the full run's messages went out,
    Streamlit drops that run's deltas of the fragment and the browser removes
    its container as stale (gradflow/ui/fragments.py). Re-adding it is safe
    only if it is the last element of its block and the only fragment there.
    """
    deltas = [
        (tuple(m.metadata.delta_path), m.delta.fragment_id)
        for m in messages
        if m.WhichOneof("type") == "delta"
    ]
    containers = {}
    for path, fragment_id in deltas:
        if fragment_id and (
            fragment_id not in containers or len(path) < len(containers[fragment_id])
        ):
            containers[fragment_id] = path
    problems = []
    for fragment_id, path in containers.items():
        parent = path[:-1]
        siblings = {
            p[len(parent)] for p, _ in deltas if len(p) > len(parent) and p[: len(parent)] == parent
        }
        others = [f for f, p in containers.items() if f != fragment_id and p[:-1] == parent]
        if path[-1] != max(siblings) or others:
            problems.append(
                {
                    "fragment": fragment_id[:8],
                    "path": path,
                    "block_children": sorted(siblings),
                    "other_fragments_in_block": others,
                }
            )
    return problems


def warming_trainer(monkeypatch):
    """The pages' run manager: its spare worker is still warming up, nothing is queued."""
    import types

    from gradflow.ui import resources

    warming = types.SimpleNamespace(
        prewarm=True,
        wait_warm=lambda timeout=None: False,
        warming=lambda: True,
        queued=lambda: [],
        running=lambda: [],
    )
    monkeypatch.setattr(resources, "run_manager", lambda: warming)


def tickers(messages):
    """The data of each ticker (`fragments.tick_after`) drawn, with the fragment that drew it."""
    return [
        (m.delta.fragment_id, json.loads(m.delta.new_element.bidi_component.json))
        for m in messages
        if m.WhichOneof("type") == "delta"
        and m.delta.new_element.bidi_component.component_name.endswith("gradflow.ticker")
    ]


def paces(messages):
    """Seconds between a redraw and the next tick, for each ticker drawn that ticks."""
    return [
        data["every_ms"] / 1000 for _, data in tickers(messages) if data["every_ms"] is not None
    ]


def test_the_live_page_is_one_fragment_last_and_alone_in_its_block(page_environment, monkeypatch):
    # Issue #7: two fragments (the trainer-readiness line while the spare
    # worker warms up, and the live panel of a run) in the page's main block
    # froze pages under load. tests/test_fragment_race.py shows the race.
    from gradflow.store import RunStore

    warming_trainer(monkeypatch)
    messages = full_run_messages(monkeypatch)
    run_id = RunStore(page_environment).create_run({"depth": 3}, name="polled", status="completed")
    app = run_page("live_training.py", run=run_id)
    assert any("Warming up the trainer for the next run" in c.value for c in app.caption), (
        "under a finished run the spare is the next start's"
    )
    fragment_ids = {m.delta.fragment_id for m in messages if m.WhichOneof("type") == "delta"} - {""}
    assert len(fragment_ids) == 1, "buttons, readiness line and panel are one fragment"
    from gradflow.ui import live

    assert paces(messages) == [live.WARMING_POLL_SECONDS], (
        "the readiness line ticks (no run board here)"
    )
    assert fragments_sharing_or_not_last_in_their_block(messages) == []
    buttons = [
        m
        for m in messages
        if m.WhichOneof("type") == "delta" and m.delta.new_element.WhichOneof("type") == "button"
    ]
    assert {b.delta.new_element.button.label for b in buttons} >= {
        "Start training",
        "Pause",
        "Stop",
    }
    assert all(
        b.delta.fragment_id in fragment_ids
        for b in buttons
        if b.delta.new_element.button.label in ("Start training", "Pause", "Stop", "Step once")
    ), "the buttons follow the run too"


def test_the_page_ticks_from_the_browser_at_the_pace_of_its_run(page_environment, monkeypatch):
    # Issue #7: Streamlit's `run_every` can only be changed by a full rerun of
    # the page, and a class's pages queued such reruns behind each other. The
    # fragment draws a ticker instead, with the pace it needs now: no
    # `auto_rerun` message at all, one ticker, none once the run has ended.
    import types

    from gradflow.store import RunStore
    from gradflow.ui import live, resources
    from gradflow.ui.fragments import STALL_AFTER_S

    warming_trainer(monkeypatch)
    messages = full_run_messages(monkeypatch)
    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 3}, name="watched", status="running")
    run_page("live_training.py", run=run_id)
    assert not any(m.WhichOneof("type") == "auto_rerun" for m in messages)
    [(fragment, data)] = tickers(messages)
    assert fragment, "the ticker reruns its fragment, not the page"
    # Just started, no step yet: four ticks a second until the first is drawn.
    assert data["every_ms"] == 1000 * live.FIRST_POLL_SECONDS
    assert data["stall_ms"] >= 1000 * STALL_AFTER_S
    assert not any(
        "Warming up the trainer" in m.delta.new_element.markdown.body
        for m in messages
        if m.WhichOneof("type") == "delta"
    ), "the spare warming beside a training run is the next start's: not this run's line"
    store.set_status(run_id, "queued")
    run_page("live_training.py", run=run_id)
    assert any(
        "Warming up the trainer" in m.delta.new_element.markdown.body
        for m in messages
        if m.WhichOneof("type") == "delta"
    ), "a queued run waits for it: drawn again at the run's ticks, without a poller of its own"
    store.set_status(run_id, "running")

    write_steps(store, run_id, 1, 3)
    run_page("live_training.py", run=run_id)
    assert paces(messages) == [live.POLL_SECONDS], "the first step is drawn: one tick a second"
    store.set_status(run_id, "paused")
    run_page("live_training.py", run=run_id)
    assert paces(messages) == [live.POLL_SECONDS]

    # An ended run with a warm trainer: nothing else on the page ticks.
    monkeypatch.setattr(
        resources,
        "run_manager",
        lambda: types.SimpleNamespace(
            prewarm=True,
            wait_warm=lambda timeout=None: True,
            warming=lambda: False,
            queued=lambda: [],
            running=lambda: {},
        ),
    )
    store.set_status(run_id, "running")
    app = run_page("live_training.py", run=run_id)  # this session follows the run
    store.set_status(run_id, "completed")
    app.run()
    assert paces(messages) == [live.POLL_SECONDS], (
        "once more after the end: a redraw a race may have dropped"
    )
    app.run()
    assert paces(messages) == [], "then an ended run is not polled"
    [(_, idle)] = tickers(messages)
    assert idle["every_ms"] is None, "the ticker stays mounted, idle, for the next run"
    app = run_page("live_training.py", run=run_id)
    assert paces(messages) == [], "a page opened on an ended run does not tick at all"
    assert next(b for b in app.button if b.label == "Stop").disabled
    assert not any(m.WhichOneof("type") == "auto_rerun" for m in messages)


def test_a_queued_run_polls_slower_and_its_page_speeds_up_when_it_starts(
    page_environment, monkeypatch
):
    # Issue #7: in a class most runs wait in the queue at first, and each of
    # their ticks costs the shared server a script run; a page whose run was
    # queued by another process (no run board knows it) ticks every
    # QUEUED_POLL_SECONDS, fast once a worker has the run.
    import types

    from gradflow.store import RunStore
    from gradflow.ui import live, resources

    store = RunStore(page_environment)
    queued = store.create_run({"depth": 3}, name="in line", status="queued")
    running = store.create_run({"depth": 3}, name="on its way", status="running")
    write_steps(store, running, 1, 3)
    workers = {}
    manager = types.SimpleNamespace(
        prewarm=False, queued=lambda: [queued], running=lambda: dict(workers)
    )
    monkeypatch.setattr(resources, "run_manager", lambda: manager)
    messages = full_run_messages(monkeypatch)

    app = run_page("live_training.py", run=queued)
    assert paces(messages) == [live.QUEUED_POLL_SECONDS]
    assert any("this run starts when a slot frees (0 ahead of it)" in i.value for i in app.info)
    assert len(live_chart_updates(app)) == 2
    run_page("live_training.py", run=running)
    assert paces(messages) == [live.POLL_SECONDS]

    # Handed to a worker, not yet marked running by it: fast ticks, and
    # still fast once running, although the run waited long in the queue.
    manager.queued = lambda: []
    workers[queued] = 1234
    run_page("live_training.py", run=queued)
    assert paces(messages) == [live.FIRST_POLL_SECONDS]
    with sqlite3.connect(page_environment) as db:  # it waited a minute in the queue
        db.execute("UPDATE runs SET created_at = created_at - 60 WHERE run_id = ?", (queued,))
    store.set_status(queued, "running")
    run_page("live_training.py", run=queued)
    assert paces(messages) == [live.FIRST_POLL_SECONDS]
    write_steps(store, queued, 1, 1)
    run_page("live_training.py", run=queued)
    assert paces(messages) == [live.POLL_SECONDS]


def test_server_settings_from_the_environment_name_a_bad_value(monkeypatch):
    from gradflow.ui.resources import DEFAULT_WORKER_NICENESS, _setting

    monkeypatch.delenv("GRADFLOW_WORKER_NICENESS", raising=False)
    assert _setting("GRADFLOW_WORKER_NICENESS", DEFAULT_WORKER_NICENESS) == 10
    monkeypatch.setenv("GRADFLOW_WORKER_NICENESS", " 0 ")
    assert _setting("GRADFLOW_WORKER_NICENESS", DEFAULT_WORKER_NICENESS) == 0
    monkeypatch.setenv("GRADFLOW_MAX_RUNNING", "two")
    with pytest.raises(ValueError, match=r"GRADFLOW_MAX_RUNNING must be a whole number, got 'two'"):
        _setting("GRADFLOW_MAX_RUNNING", 0)


def heatmap_parents(app):
    """For each live heatmap of the page: whether it sits in a column."""

    def walk(node, in_column):
        kind = getattr(node, "type", None)
        if getattr(node, "proto", None) is not None and kind == "bidi_component":
            if node.proto.component_name.endswith("gradflow.live_chart"):
                yield in_column
        for child in getattr(node, "children", {}).values():
            yield from walk(child, in_column or kind == "column")

    return list(walk(app._tree, False))


@pytest.mark.parametrize("presentation, in_columns", [(False, True), (True, False)])
def test_presentation_style_stacks_the_heatmaps(page_environment, presentation, in_columns):
    """Side by side, Presentation style's large fonts left each heatmap about 65 px at 1024 px."""
    from streamlit.testing.v1 import AppTest

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 1}, name="for the slides", status="completed")
    write_steps(store, run_id, 1, 20)
    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = run_id
    app.session_state["ui.presentation"] = presentation
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert heatmap_parents(app) == [in_columns, in_columns]
    # The alert boxes and captions grow with the charts' fonts at slide size.
    styles = [getattr(h.proto, "body", "") for h in app.get("html")]
    assert any("stAlertContent" in body for body in styles) == presentation, styles


def test_a_screen_reader_hears_once_that_the_run_it_followed_completed(page_environment):
    """The status line is plain text rewritten every second: a blind student
    never learned that training had ended (a divergence's error box was heard)."""
    from streamlit.testing.v1 import AppTest

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="<b>mine</b> *", status="running", total_steps=40)
    write_vanishing_steps(store, run_id, 1, 20)
    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = run_id

    def alerts():
        return [m.value for m in app.markdown if 'role="alert"' in m.value]

    app.run()
    assert not app.exception and alerts() == []
    write_vanishing_steps(store, run_id, 21, 40)
    store.set_status(run_id, "completed")
    app.run()
    (line,) = alerts()
    assert line.endswith('">Training completed at step 40 of 40.</span>')
    assert line.startswith("**\\<b\\>mine\\</b\\> \\*** — ")  # as typed: no tag, no bold
    app.run()
    assert alerts() == []  # said once


def test_a_watched_run_shows_the_validation_written_after_its_last_step(page_environment):
    """A page that followed a run to its end never read the validation results
    `fit` writes at an epoch's last step, after that step's statistics."""
    import pandas as pd
    from streamlit.testing.v1 import AppTest

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="validated", status="running")

    def write(steps):
        with store.writer(run_id) as writer:
            writer.add_layer_stats(
                pd.DataFrame(
                    {
                        "step": steps,
                        "layer": "dense",
                        "layer_index": 0,
                        "tensor": "kernel",
                        "max_abs": 1.0,
                        "l2_norm": 1.0,
                        "nonfinite": 0,
                    }
                )
            )
            for step in steps:
                writer.add_metrics(step, {"loss": 1.0 / step})
            writer.progress(steps[-1])

    write([1, 2, 3])
    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = run_id
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    with store.writer(run_id) as writer:
        writer.add_metrics(3, {"val_loss": 0.5})  # the first epoch's end
    write([4, 5, 6])
    app.run()
    with store.writer(run_id) as writer:
        writer.add_metrics(6, {"val_loss": 0.25})  # the second epoch's end
    store.set_status(run_id, "completed")
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    metrics = app.session_state[f"live.cache.{run_id}"].metrics
    validation = metrics[metrics["name"] == "val_loss"].sort_values("step")
    assert validation[["step", "value"]].values.tolist() == [[3, 0.5], [6, 0.25]]
    assert sorted(metrics.query("name == 'loss'")["step"]) == [1, 2, 3, 4, 5, 6]


def two_layer_kernels(step, max_abs, l2_norm, nonfinite):
    """One step's kernel rows of a two-layer run: "dense", then "output"."""
    import pandas as pd

    return pd.DataFrame(
        {
            "step": step,
            "layer": ["dense", "output"],
            "layer_index": [0, 1],
            "tensor": "kernel",
            "max_abs": max_abs,
            "l2_norm": l2_norm,
            "nonfinite": nonfinite,
        }
    )


@pytest.mark.parametrize("loss_at_nan", [float("nan"), 0.7], ids=["NaN loss", "finite loss"])
def test_a_diverged_run_says_whether_the_loss_itself_blew_up(page_environment, loss_at_nan):
    """When the loss is NaN every gradient is, and the banner named the output
    layer as the origin: students blamed the output layer."""
    import numpy as np

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="exploding", status="running")
    with store.writer(run_id) as writer:
        for step, broken in ((1, 0), (2, 5)):
            writer.add_layer_stats(
                two_layer_kernels(step, [1.0, np.nan if broken else 2.0], 1.0, [broken, broken])
            )
        writer.add_metrics(1, {"loss": 5.9243e9})
        writer.add_metrics(2, {"loss": loss_at_nan})
        writer.progress(2)
    store.set_status(run_id, "diverged")
    app = run_page("live_training.py", run=run_id)
    banner = next(e.value for e in app.error if "NaN or infinite" in e.value)
    if np.isnan(loss_at_nan):
        assert "the loss itself was NaN (its last finite value, at step 1, was 5.92e+09)" in banner
    else:
        assert "It started at step 2 in layer **output**." in banner


def test_a_run_nan_from_its_first_step_that_trained_on_is_told_so(page_environment):
    """A monitor's run (no `stop_on_nonfinite`) NaN from step 1 to its end read "so
    training stopped ... Try a smaller learning rate": it had not stopped, and at
    step 1 no update had come before (the odd-runs audit). Its Histograms view sent
    the script's user to the lab's sidebar."""
    import numpy as np

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run(
        {"model": "mine"}, name="nan inputs", status="running", source="monitor", total_steps=3
    )
    with store.writer(run_id) as writer:
        for step in (1, 2, 3):
            writer.add_layer_stats(two_layer_kernels(step, np.nan, np.nan, 4))
            writer.add_metrics(step, {"loss": np.nan})
        writer.progress(3)
    store.set_status(run_id, "diverged")
    app = run_page("live_training.py", run=run_id)
    banner = next(e.value for e in app.error if "NaN or infinite" in e.value)
    assert banner.startswith(
        "The gradients became NaN or infinite (training went on to its end: "
        "`stop_on_nonfinite` was off)."
    )
    assert "check the inputs and labels for NaN or Inf" in banner
    assert "smaller learning rate" not in banner
    app.session_state["live.view"] = "Histograms"
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("GradientMonitor(histograms=True)" in i.value for i in app.info)


def test_a_loss_that_overflowed_before_the_gradients_did_is_told_first(page_environment):
    """The loss infinite at step 3 with finite gradients, the gradients NaN at step 5: the
    banner began with the gradients, and called step 2's loss "the step before" step 5's."""
    import numpy as np

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run(
        {"model": "mine"}, name="overflow", status="running", source="monitor", total_steps=6
    )
    losses = {1: 1.7e6, 2: 2.2e27, 3: np.inf, 4: np.inf, 5: np.nan, 6: np.nan}
    with store.writer(run_id) as writer:
        for step, loss in losses.items():
            broken = int(step >= 5)
            writer.add_layer_stats(
                two_layer_kernels(step, np.nan if broken else 1e20, 1.0, [broken, broken])
            )
            writer.add_metrics(step, {"loss": loss})
        writer.progress(6)
    store.set_status(run_id, "diverged")
    app = run_page("live_training.py", run=run_id)
    errors = [e.value for e in app.error]
    assert any(
        e.startswith(
            "The loss became infinite at step 3 while every gradient was still finite: the "
            "loss overflowed first. The gradients followed at step 5."
        )
        for e in errors
    ), errors


def test_a_run_whose_loss_alone_overflowed_is_not_said_to_have_nan_gradients(page_environment):
    """A squared error overflowed while every gradient was finite (TerminateOnNaN stopped
    it): the banner said "The gradients became NaN or infinite"."""
    import numpy as np

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run(
        {"model": "mine"}, name="huge inputs", status="running", source="monitor", total_steps=9
    )
    with store.writer(run_id) as writer:
        for step, loss in ((1, 3.0), (2, 4e37), (3, np.inf)):
            writer.add_layer_stats(two_layer_kernels(step, 1e18 * step, 2e18 * step, 0))
            writer.add_metrics(step, {"loss": loss})
        writer.progress(3)
    store.set_status(run_id, "diverged")
    app = run_page("live_training.py", run=run_id)
    assert not app.exception, [e.value for e in app.exception]
    errors = [e.value for e in app.error]
    assert any(
        e.startswith("The loss became infinite at step 3 while every gradient was still finite")
        for e in errors
    ), errors
    assert not any("gradients became NaN" in e for e in errors), errors


def test_runs_are_named_by_what_sets_them_apart():
    """The exploding run and a healthy relu run were both "relu · depth 10 · sgd lr=0.05",
    and a loaded preset's runs lost its title."""
    from gradflow.lab.config import RunConfig
    from gradflow.lab.presets import PRESETS
    from gradflow.ui.live import run_name

    assert run_name(RunConfig(activation="relu", depth=10)) == "relu · depth 10 · sgd lr=0.05"
    exploding = RunConfig(activation="relu", depth=10, initializer="random_normal", init_stddev=2)
    assert run_name(exploding) == "relu · depth 10 · random_normal σ=2 · sgd lr=0.05"
    tamed = RunConfig(normalization="batch", clipping="norm")
    assert "batch norm · clip norm" in run_name(tamed)
    # A SimpleRNN and an LSTM on the adding problem, and a CNN and an MLP, had one name.
    rnn = RunConfig(architecture="rnn", dataset="adding", depth=1, activation="tanh")
    assert run_name(rnn).startswith("SimpleRNN · tanh · depth 1")
    assert run_name(rnn).endswith("· on adding")
    assert run_name(dataclasses.replace(rnn, rnn_cell="lstm")).startswith("LSTM · tanh")
    assert run_name(RunConfig(architecture="cnn")).startswith("CNN · relu")
    # A residual network and the same without, and dropout or max-norm, had one name too.
    assert "· residual ·" in run_name(RunConfig(residual=True))
    assert "dropout 0.5 · max-norm 2" in run_name(RunConfig(dropout=0.5, max_norm=2.0))

    app = run_page("live_training.py")
    next(s for s in app.selectbox if s.label == "Preset").set_value("large_init").run()
    next(b for b in app.button if b.label == "Load preset").click().run()
    assert app.session_state["cfg._config"].name == PRESETS["large_init"].title
    next(s for s in app.slider if s.label == "Depth").set_value(3).run()
    assert app.session_state["cfg._config"].name is None  # no longer the preset


def test_a_data_set_this_server_has_not_downloaded_is_said_before_start(
    page_environment, monkeypatch, tmp_path
):
    """An offline class server offered MNIST; its runs failed with a developer's error,
    above "The first statistics appear after the first recorded step" (they never would)."""
    from gradflow.store import RunStore

    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    app = run_page("live_training.py", dataset="mnist", architecture="cnn")
    assert any("not on this server yet" in i.value for i in app.sidebar.info)
    assert not any("not on this server" in i.value for i in run_page("live_training.py").info)

    store = RunStore(page_environment)
    failed = store.create_run({"dataset": "mnist"}, name="mnist", status="running")
    store.set_status(failed, "failed", "The mnist data set needs a one-time download of ...")
    app = run_page("live_training.py", run=failed)
    captions = [c.value for c in app.caption]
    assert "This run recorded no statistics." in captions
    assert not any("first statistics appear" in c for c in captions)


def write_a_nan_at_step_2(store, run_id, message):
    """Two layers' steps 1 (finite) and 2 (NaN), and the monitor's `nonfinite` event `message`."""
    import pandas as pd

    stats = pd.DataFrame(
        {
            "step": [1, 1, 2, 2],
            "layer": ["dense", "output"] * 2,
            "layer_index": [0, 1] * 2,
            "tensor": "kernel",
            "max_abs": [0.5, 0.5, np.nan, np.nan],
            "l2_norm": [0.5, 0.5, np.nan, np.nan],
            "nonfinite": [0, 0, 8, 4],
        }
    )
    with store.writer(run_id) as writer:
        writer.add_layer_stats(stats)
        writer.add_event(2, "output", "nonfinite", message)
        writer.progress(2)


def test_the_nan_origin_is_one_alert_not_two(page_environment):
    """The monitor's stored event and the rules' finding of the same step both showed."""
    from gradflow.store import RunStore
    from gradflow.ui.live import _run_events
    from gradflow.ui.run_rows import RunRows

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="diverged", status="running")
    write_a_nan_at_step_2(store, run_id, "First non-finite gradient at step 2: ...")
    cache = RunRows(store.layer_stats(run_id), store.metrics(run_id), store.histograms(run_id))
    cache.last_step = 2
    events = _run_events(store, run_id, cache)
    assert events.query("kind == 'nonfinite'")["message"].tolist() == [
        "First non-finite gradient at step 2: ..."
    ]


def test_a_clipped_run_shows_what_the_optimizer_applied(page_environment):
    """The norms after clipping were stored but no view drew them: a student saw the
    output layer's norm above the threshold and concluded clipping did nothing."""
    import pandas as pd

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    rows = pd.DataFrame(
        {
            "step": [1, 1],
            "layer": ["dense", "output"],
            "layer_index": [0, 1],
            "tensor": "kernel",
            "max_abs": [0.5, 0.9],
            "l2_norm": [0.8, 1.147],
            "l2_norm_clipped": [0.8, 1.0],
            "nonfinite": 0,
        }
    )
    for clipping, clipped in (("none", None), ("norm", rows)):
        run_id = store.create_run({"clipping": clipping}, name=clipping, status="completed")
        with store.writer(run_id) as writer:
            writer.add_layer_stats(rows.assign(l2_norm_clipped=np.nan) if clipped is None else rows)
            writer.progress(1)
        app = run_page("live_training.py", run=run_id)
        said = any("Gradient clipping is on" in c.value for c in app.caption)
        assert said == (clipped is not None)
    # The norms before and after clipping share a colour scale; the max keeps its own.
    scales = [
        (u["traces"][0]["zmin"], u["traces"][0]["zmax"])
        for u in live_chart_updates(app)
        if u.get("traces", [{}])[0].get("type") == "heatmap"
    ]
    assert len(scales) == 3 and scales[1] == scales[2] != scales[0], scales


def test_a_run_this_page_did_not_start_is_watched_until_taken_over(page_environment):
    """A student who opened the teacher's link could pause the demo for the whole class."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="teacher's demo", status="running")
    app = run_page("live_training.py", run=run_id)
    buttons = {b.label: b for b in app.button}
    assert buttons["Pause"].disabled and buttons["Stop"].disabled
    assert any("watching it here does not pause or stop it" in c.value for c in app.caption)
    buttons["Take control"].click().run()
    buttons = {b.label: b for b in app.button}
    assert not buttons["Pause"].disabled and not buttons["Stop"].disabled
    assert "Take control" not in buttons
    store.set_status(run_id, "completed")


def one_layer_run(db, config, status, step=1, progress=None, loss=None, **columns):
    """A stored run with one kernel row at `step` (extra statistic `columns`) and its id."""
    import pandas as pd

    from gradflow.store import RunStore

    store = RunStore(db)
    run_id = store.create_run(config, name="stored", status=status)
    row = {"step": [step], "layer": ["dense"], "layer_index": [0], "tensor": "kernel"}
    row.update({"max_abs": [0.5], "l2_norm": [0.8], "nonfinite": 0}, **columns)
    with store.writer(run_id) as writer:
        writer.add_layer_stats(pd.DataFrame(row))
        if loss is not None:
            writer.add_metrics(step, {"loss": loss})
        writer.progress(step if progress is None else progress)
    return store, run_id


def test_a_run_recorded_every_few_steps_says_so_and_whose_loss_it_shows(page_environment):
    """Step once changed no chart, and the status line put step 45's loss beside step 47."""
    store, run_id = one_layer_run(
        page_environment, {"record_every": 5}, "paused", step=45, progress=47, loss=2.212
    )
    app = run_page("live_training.py", run=run_id)
    assert any("loss 2.212 (at step 45)" in m.value for m in app.markdown)
    assert any("recorded every 5 steps" in c.value for c in app.caption)
    store.set_status(run_id, "stopped")


def test_a_max_norm_run_points_to_its_weight_norms(page_environment):
    """The weight norms before and after the constraint were stored but never drawn."""
    _, run_id = one_layer_run(
        page_environment,
        {"max_norm": 0.5},
        "completed",
        weight_norm=[2.83],
        weight_norm_unconstrained=[6.48],
    )
    app = run_page("live_training.py", run=run_id)
    [caption] = [c.value for c in app.caption if "max-norm constraint is on" in c.value]
    # Not "scales down a kernel whose norm passes the limit": a teacher read 5.6
    # above a limit of 1 as the constraint failing.
    assert "each unit's incoming weights" in caption and "√units × the limit" in caption


def test_a_preset_or_link_trains_its_settings_that_have_no_widget():
    """The LSTM preset trained sequences of 50 from 1,000 examples, not its 30 from 2,000,
    under another name; a link's sequence length, loss and name were dropped."""
    from gradflow.lab.config import RunConfig
    from gradflow.lab.presets import PRESETS

    app = run_page("live_training.py")
    next(s for s in app.selectbox if s.label == "Preset").set_value("rnn_lstm").run()
    next(b for b in app.button if b.label == "Load preset").click().run()
    assert app.session_state["cfg._config"] == PRESETS["rnn_lstm"].config
    assert app.query_params["sequence_length"] == "30"  # the link says it too
    next(s for s in app.select_slider if s.label == "Learning rate").set_value(0.1).run()
    changed = app.session_state["cfg._config"]
    assert (changed.sequence_length, changed.n_samples, changed.rnn_cell) == (30, 2000, "lstm")
    assert changed.name is None  # no longer the preset's experiment

    link = {
        "architecture": "rnn",
        "dataset": "adding",
        "depth": "1",
        "sequence_length": "30",
        "loss": "mae",
        "name": "My LSTM demo",
        "epochs": "2",
    }
    linked = run_page("live_training.py", **link)
    config = linked.session_state["cfg._config"]
    assert (config.sequence_length, config.loss, config.name, config.epochs) == (
        30,
        "mae",
        "My LSTM demo",
        2,
    )
    next(s for s in linked.select_slider if s.label == "Steps").set_value(100).run()
    assert linked.session_state["cfg._config"].epochs is None  # a length in steps now

    # Whoever sends a link must not choose a file on the server for the run to read.
    hostile = run_page("live_training.py", dataset="file", data_path="/etc/passwd")
    assert hostile.session_state["cfg._config"] == RunConfig()
    assert any("cannot choose a data file" in w.value for w in hostile.warning)


def test_an_ended_runs_alerts_are_pointed_to_from_every_view(page_environment):
    """A finished vanishing run showed nothing about it outside the Alerts view."""
    import pandas as pd

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="vanishing", status="running")
    with store.writer(run_id) as writer:
        writer.add_layer_stats(
            pd.DataFrame(
                {
                    "step": [1, 1],
                    "layer": ["dense", "output"],
                    "layer_index": [0, 1],
                    "tensor": "kernel",
                    "max_abs": [1e-9, 0.5],
                    "l2_norm": [1e-9, 0.5],
                    "nonfinite": 0,
                }
            )
        )
        writer.progress(1)
    app = run_page("live_training.py", run=run_id)
    assert not any("diagnosis rules found" in c.value for c in app.caption)  # still training
    store.set_status(run_id, "completed")
    app = run_page("live_training.py", run=run_id)
    hint = [c.value for c in app.caption if "diagnosis rules found" in c.value]
    assert hint and "vanishing gradients" in hint[0] and "**Alerts**" in hint[0]


def alerts_in_page_order(app):
    """`(message, "warning" or "info" or ...)` of the page's alert boxes, top to bottom."""

    def walk(node):
        if getattr(node, "type", None) in ("error", "warning", "info", "success"):
            yield node.value, node.type
        for child in getattr(node, "children", {}).values():
            yield from walk(child)

    return list(walk(app._tree))


def test_the_alerts_tell_the_gradient_through_time_in_step_order(page_environment):
    """The SimpleRNN preset's Alerts said "No alerts" while its lesson was vanishing through
    time; an LSTM's gradient fades too, until it learns to carry it back."""
    import pandas as pd

    from gradflow.store import RunStore

    store = RunStore(page_environment)

    def recurrent_run(name, shares):
        run_id = store.create_run({"architecture": "rnn"}, name=name, status="running")
        frames = []
        for step, share in enumerate(shares, start=1):
            frames.append(
                pd.DataFrame(
                    {
                        "step": step,
                        "layer": [f"t={t:02d}" for t in range(1, 11)] + ["lstm", "output"],
                        "layer_index": list(range(10)) + [0, 1],
                        "tensor": ["time_step"] * 10 + ["kernel", "kernel"],
                        "l2_norm": [share] + [1.0] * 9 + [0.5, 0.5],
                        "max_abs": [share] + [1.0] * 9 + [0.5, 0.5],
                        "nonfinite": 0,
                    }
                )
            )
        with store.writer(run_id) as writer:
            writer.add_layer_stats(pd.concat(frames, ignore_index=True))
            writer.progress(len(shares))
        store.set_status(run_id, "completed")
        return run_id

    # Fades, comes back at step 73 (said at 122), fades again from step 150.
    lstm = recurrent_run("learns", [1e-3] * 60 + [0.5] * 90 + [1e-3] * 50)
    app = live_view(lstm, "Alerts")
    said = alerts_in_page_order(app)
    assert [kind for _, kind in said] == ["warning", "info", "warning"], said
    assert said[1][0].startswith("Through time (training step 122): since training step 73,")
    assert not [s for s in app.success if "No alerts" in s.value]
    app = live_view(lstm, "Heatmaps")
    [hint] = [c.value for c in app.caption if "diagnosis rules found" in c.value]
    assert "a gradient vanishing through time" in hint and "vanishing gradients" not in hint
    assert hint.startswith(":material/warning:")

    learnt = recurrent_run("learnt", [1e-3] * 60 + [0.5] * 140)
    app = live_view(learnt, "Heatmaps")
    [hint] = [c.value for c in app.caption if "diagnosis rules found" in c.value]
    assert "a gradient that vanished through time and came back" in hint
    assert hint.startswith(":material/info:")  # good news is no warning


def test_the_speed_limit_is_a_setting_a_link_keeps():
    app = run_page("live_training.py")
    speed = next(s for s in app.select_slider if s.label == "Speed limit (steps a second)")
    assert speed.value == 0 and app.session_state["cfg._config"].pace is None  # full speed
    speed.set_value(5).run()
    assert app.session_state["cfg._config"].pace == 5
    linked = run_page("live_training.py", pace="10")
    assert next(s for s in linked.select_slider if s.label.startswith("Speed limit")).value == 10


def test_a_bad_number_in_a_box_the_run_does_not_read_leaves_start_on():
    """An Init stddev of -1 blocked Start with the Glorot initializer, which never reads it."""
    app = run_page("live_training.py")
    boxes = {box.label: box for box in app.number_input}
    boxes["Init stddev (random_normal)"].set_value(-1.0).run()
    assert not next(b for b in app.button if b.label == "Start training").disabled
    assert app.session_state["cfg._config"].init_stddev == 0.05  # the run keeps a good value
    next(s for s in app.selectbox if s.label == "Initializer").set_value("random_normal").run()
    assert next(b for b in app.button if b.label == "Start training").disabled
    assert any("**Init stddev (random_normal)** must be" in e.value for e in app.sidebar.error)


def test_inspect_charts_say_one_batch_not_a_training_step():
    """A snapshot's charts read "Gradient flow at step 0", as if a run had trained."""
    app = run_page("inspect_model.py")
    next(b for b in app.button if b.label == "Take snapshot").click()
    app.run()
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in app.get("plotly_chart")]
    assert titles[:2] == [
        "Gradient flow on one batch (kernels)",
        "Gradient flow on one batch (layer outputs)",
    ]
    assert not any("step" in title for title in titles)


def test_histograms_of_all_weights_say_they_show_the_kernels(page_environment):
    """'All weights' drew the kernels' histograms under a choice that promised every weight."""
    import pandas as pd
    from streamlit.testing.v1 import AppTest

    from gradflow import schema

    store, run_id = one_layer_run(page_environment, {"histograms": True}, "completed")
    with store.writer(run_id) as writer:
        writer.add_layer_stats(
            pd.DataFrame(
                {"step": [1], "layer": ["dense"], "layer_index": [0], "tensor": ["bias"]}
                | {"max_abs": [0.1], "l2_norm": [0.1], "nonfinite": [0]}
            )
        )
        counts = np.zeros(schema.HISTOGRAM_BINS, dtype=np.int64)
        writer.add_histograms(1, [("dense", 0, "kernel", counts), ("dense", 0, "bias", counts)])
    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = run_id
    app.session_state["live.view"] = "Histograms"
    app.session_state["live.tensor"] = "all_weights"
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("**All weights** chosen, this shows the kernels'" in c.value for c in app.caption)
    app.session_state["live.tensor"] = "bias"
    app.run()
    assert not any("**All weights**" in c.value for c in app.caption)


def test_the_update_ratio_is_a_lines_statistic_with_its_rule_of_thumb(page_environment):
    """It was recorded at every step and shown nowhere; a lecturer's best signal of
    where a sigmoid network stops learning (3e-9 at its first layer, 1e-2 at its last)."""
    _, run_id = one_layer_run(page_environment, {}, "completed", update_ratio=[3e-9])
    app = live_view(run_id, "Lines")
    [radio] = [r for r in app.radio if r.label == "Statistic"]
    assert "update_ratio" in radio.options or "update / weight norm" in radio.options
    radio.set_value("update_ratio").run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("about 1e-3 is healthy" in c.value for c in app.caption)


@pytest.mark.parametrize("started_here", [True, False])
def test_a_speed_limit_moved_during_the_pages_run_goes_to_that_run(page_environment, started_here):
    """A teacher slowing a demo down mid-run changed nothing until the next Start, silently."""
    from streamlit.testing.v1 import AppTest

    from gradflow.store import RunStore, tables

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="demo", status="running")
    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = run_id
    if started_here:
        app.session_state["live.started"] = {run_id}
    app.run()
    assert store.pending_request(run_id) is None  # opening the page asks nothing
    speed = next(s for s in app.select_slider if s.label.startswith("Speed limit"))
    speed.set_value(2).run()
    assert not app.exception, [e.value for e in app.exception]
    toasts = [t.value for t in app.toast]
    if started_here:
        assert store.pending_request(run_id) == tables.pace_request(2.0)
        assert toasts == ["This run now trains at most 2 steps a second."]
    else:
        assert store.pending_request(run_id) is None
        assert "is for the runs you start" in toasts[0]
    store.set_status(run_id, "completed")


def test_a_run_that_ended_early_says_why_beside_its_step_count(page_environment):
    """A run EarlyStopping ended showed 'Completed · step 8 / 8' with no word of why."""
    store, run_id = one_layer_run(page_environment, {}, "running", step=8)
    said = (
        "Training ended at step 8 of the 40 planned: a callback stopped it (such as EarlyStopping)."
    )
    store.set_status(run_id, "completed", said)
    app = run_page("live_training.py", run=run_id)
    shown = [c.value.replace("\\", "") for c in app.caption]  # as escaped markdown shows it
    assert any(said in c for c in shown), shown


def test_inspect_exports_name_the_model_they_show(monkeypatch):
    """Two models' exports were all "Gradient_flow_on_one_batch_kernels.png", saying no model."""
    from gradflow.ui import charts

    exported = []
    monkeypatch.setattr(
        charts, "export_buttons", lambda chart, key, run=None: exported.append((key, run))
    )
    app = run_page("inspect_model.py")
    example = next(s for s in app.selectbox if s.label == "Example").value
    next(b for b in app.button if b.label == "Take snapshot").click()
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert exported and {run for _, run in exported} == {example}


def test_a_model_of_two_inputs_is_inspected_from_arrays_named_after_them(tmp_path):
    """Its upload could not be given: "expects 2 named input(s)" for `x`, "needs arrays named
    `x` and `y`" for arrays named after the inputs."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(2)
    a, b = keras.Input((3,), name="in_a"), keras.Input((2,), name="in_b")
    out = keras.layers.Dense(1, name="out")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], out)
    model.compile(loss="mse")
    model.save(tmp_path / "m.keras")
    rng = np.random.default_rng(0)
    data = {"in_a": rng.normal(size=(8, 3)), "in_b": rng.normal(size=(8, 2))}
    data = {k: v.astype("float32") for k, v in data.items()} | {"y": rng.normal(size=(8, 1))}
    app = upload_and_snapshot(tmp_path / "m.keras", data)
    assert not app.error, [e.value for e in app.error]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(data["y"] - model([data["in_a"], data["in_b"]])))
    kernel = tape.gradient(loss, model.get_layer("out").kernel)
    weights = app.dataframe[0].value
    row = weights[weights["variable"].str.endswith("out/kernel")].iloc[0]
    np.testing.assert_allclose(row["l2_norm"], np.linalg.norm(kernel), rtol=1e-5)
    # Without them, the page says what to name the arrays.
    app = upload_and_snapshot(tmp_path / "m.keras", {"x": data["in_a"], "y": data["y"]})
    assert "needs an array for each, named after the input" in app.error[0].value


def test_pause_and_resume_are_one_button_that_keeps_the_keyboards_focus(page_environment):
    """Pause pressed from the keyboard became a new Resume element: the focus
    fell to the page, and Space no longer resumed (48 Tabs back to it)."""
    from streamlit.testing.v1 import AppTest

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="demo", status="running")
    app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
    app.query_params["run"] = run_id
    app.session_state["live.started"] = {run_id}
    app.run()
    running = app.button(key="live.pause")
    assert running.label == "Pause" and not running.disabled
    running.click().run()
    assert store.pending_request(run_id) == "pause"
    store.set_status(run_id, "paused")
    app.run()
    paused = app.button(key="live.pause")
    assert paused.label == "Resume" and paused.id == running.id
    store.set_status(run_id, "completed")


def test_a_store_file_deleted_under_the_server_is_said_in_words(tmp_path):
    """Every page showed Streamlit's "This app has encountered an error" once the store
    file was moved or deleted, and the next connection made a new empty one."""
    import threading

    from streamlit.testing.v1 import AppTest

    from gradflow.ui import resources
    from tests.conftest import pages_on

    with pages_on(tmp_path / "runs.db") as db:
        from gradflow.store import RunStore

        run_id = RunStore(db).create_run({"depth": 2}, name="last lesson", status="completed")
        app = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        app.query_params["run"] = run_id
        app.run()
        assert not app.exception, [e.value for e in app.exception]
        for leftover in db.parent.glob("runs.db*"):
            leftover.unlink()
        # The server runs each rerun in a new thread, with a new connection: here
        # the test's thread keeps its own, so it is dropped as a new thread would lack it.
        resources.run_store()._local = threading.local()
        app.run()
        assert not app.exception, [e.value for e in app.exception]
        assert any("is gone: it was moved or deleted" in e.value for e in app.error)
        assert not db.exists()


@pytest.mark.parametrize("kept", [True, False])
def test_the_alerts_view_pairs_each_layer_with_the_layer_it_reads(page_environment, kept):
    """A Transformer's linear value projection was "probably saturated" in the Alerts
    view: its input gradient was taken from the key projection, called before it."""
    import pandas as pd

    from gradflow.store import RunStore

    reads = {"embed": None, "mha/key": "embed", "mha/value": "embed", "head": "mha/value"}
    store = RunStore(page_environment)
    config = {"model": "transformer"} | ({"layer_inputs": reads} if kept else {})
    run_id = store.create_run(config, name="my transformer", source="monitor", status="completed")
    sizes = {"embed": 1e-3, "mha/key": 4e-6, "mha/value": 2e-2, "head": 1e-3}
    frame = pd.DataFrame(
        {
            "step": 1,
            "layer": list(sizes),
            "layer_index": range(4),
            "tensor": "activation",
            "max_abs": 1.0,
            "l2_norm": 1.0,
            "mean_abs": list(sizes.values()),
            "nonfinite": 0,
        }
    )
    with store.writer(run_id) as writer:
        writer.add_layer_stats(frame)
        writer.progress(1)
    app = live_view(run_id, "Alerts")
    said = any("Layer mha/value" in w.value and "saturated" in w.value for w in app.warning)
    assert said == (not kept)


def test_the_server_marks_runs_whose_process_died_again_and_again(monkeypatch):
    """A second dashboard on the store that was killed left its queued run "queued" on
    this one until it started again: `recover()` ran only when a server started."""
    import threading

    from gradflow.ui import sessions

    monkeypatch.setattr(sessions, "CHECK_SECONDS", 0.01)
    monkeypatch.setattr(sessions, "RECOVER_SECONDS", 0.02)
    called = threading.Event()

    class Store:
        def recover(self, **kwargs):
            assert kwargs == {"other_hosts": False}  # another host's slow step is no death
            called.set()
            return []

    sessions.SessionOwnership(Store())
    assert called.wait(10)


def test_a_recurrent_run_shows_its_gradient_through_time(page_environment):
    """The SimpleRNN lesson's heatmaps summed each layer over the 30 time steps: the
    gradient fading through time, what the lesson is about, had no picture."""
    import pandas as pd

    from gradflow import train
    from gradflow.lab.config import RunConfig
    from gradflow.ui.live import _tensor_choices

    names = ["kernel", "recurrent_kernel", "activation", "time_step"]
    assert _tensor_choices(pd.DataFrame({"tensor": names})) == [
        "kernel",
        "recurrent_kernel",
        "all_weights",
        "activation",
        "time_step",
    ]
    config = RunConfig(
        architecture="rnn", dataset="adding", sequence_length=10, n_samples=40, steps=3, width=4
    )
    run = train(config, store=page_environment)
    app = live_view(run.run_id, "Heatmaps")
    [radio] = [r for r in app.radio if r.label == "Gradients of"]
    assert radio.value == "time_step"  # opened on the lesson, as Compare is
    radio.set_value("kernel").run()
    assert not app.exception, [e.value for e in app.exception]
    [radio] = [r for r in app.radio if r.label == "Gradients of"]
    assert radio.value == "kernel"  # and a choice stays
    radio.set_value("time_step").run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("vanishes through time" in c.value for c in app.caption)
    drawn = json.dumps(live_chart_updates(app))
    assert "time step (first at the bottom)" in drawn and "t=10" in drawn

    # The Compare page puts two recurrent runs' time steps side by side.
    lstm = train(dataclasses.replace(config, rnn_cell="lstm"), store=page_environment)
    app = run_page("compare.py", runs=f"{run.run_id},{lstm.run_id}")
    [radio] = [r for r in app.radio if r.label == "Gradients of"]
    assert radio.value == "time_step"  # the view the kernels cannot give comes first
    drawn = json.dumps(live_chart_updates(app))
    assert "max |gradient| reaching each time step" in drawn
    assert "by time step" in drawn and "time step (1 = the first)" in drawn
    assert "time step (first at the bottom)" in drawn
    # Runs without time steps get no such choice.
    mlp = train(RunConfig(dataset="circles", steps=2), store=page_environment)
    app = run_page("compare.py", runs=f"{run.run_id},{mlp.run_id}")
    assert not [r for r in app.radio if r.label == "Gradients of"]
