"""The Compare page says what the diagnosis rules found in each compared run (AppTest).

A teacher comparing "deep sigmoid" with "ReLU + He" saw the heatmaps and the
loss, but not the lesson's sentence: the rules flagged vanishing gradients in
one run and nothing in the other. These tests train real small runs and run
the real rules.
"""

import pathlib

import numpy as np
import pandas as pd
import pytest

from tests.test_pages import run_page

REPO = pathlib.Path(__file__).resolve().parent.parent
SECTION = "What the diagnosis rules found"

# Pages share st.cache_resource singletons in this process: one store for the module (conftest.py).
pytestmark = pytest.mark.usefixtures("page_environment")


@pytest.fixture(autouse=True)
def without_run_board(monkeypatch):
    # The pages poll with fragment ticks, as a server without static files
    # does (as in tests/test_pages.py).
    from gradflow.ui import resources

    monkeypatch.setattr(resources, "run_board", lambda: None)


@pytest.fixture(scope="module")
def lesson_pair(page_environment):
    """`(deep sigmoid run, shallow ReLU + He run)`: real runs of 3 steps, a few seconds each.

    Six sigmoid layers of 8 units drawn with stddev 0.01 shrink the gradient
    about 100-fold per layer on its way back: at step 1 dense_1's norm is
    about 1e-14, far below the vanishing rule's 1e-7. One He-initialized ReLU
    layer passes it back whole.
    """
    from gradflow import train
    from gradflow.lab.config import RunConfig

    small = dict(dataset="circles", n_samples=64, steps=3, width=8)
    sigmoid = RunConfig(
        depth=6, activation="sigmoid", initializer="random_normal", init_stddev=0.01, **small
    )
    relu = RunConfig(depth=1, activation="relu", initializer="he_normal", **small)
    return (
        train(sigmoid, store=page_environment, name="deep sigmoid").run_id,
        train(relu, store=page_environment, name="relu he").run_id,
    )


def compare(*run_ids):
    return run_page("compare.py", runs=",".join(run_ids))


def boxes(node):
    """`(kind, message)` of the alert boxes under `node`, top to bottom."""
    if getattr(node, "type", None) in ("error", "warning", "info", "success"):
        yield node.type, node.value
    for child in getattr(node, "children", {}).values():
        yield from boxes(child)


def run_columns(app):
    """`{run name: its column}` of the diagnosis section: a column that opens with a bold name."""
    assert SECTION in [s.value for s in app.subheader]
    columns = {}
    for column in app.columns:
        opening = [m.value for m in column.markdown][:1]
        if opening and opening[0].startswith("**") and opening[0].endswith("**"):
            columns[opening[0].strip("*")] = column
    return columns


def more_alerts(column):
    """The column's "…and N more alerts about ..." lines, without the pointer to the Live page."""
    return [c.value.split(" (")[0] for c in column.caption if "more alert" in c.value]


def write_steps(store, run_id, first, last, layers, norm_of):
    """Steps first..last of `layers`, whose kernel norm at `step` is `norm_of(layer, step)`."""
    steps = np.arange(first, last + 1)
    with store.writer(run_id) as writer:
        for index, layer in enumerate(layers):
            norm = np.array([norm_of(layer, step) for step in steps], dtype=float)
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
        writer.progress(last)


def test_each_run_gets_a_column_saying_what_the_rules_found(lesson_pair):
    sigmoid, relu = lesson_pair
    columns = run_columns(compare(sigmoid, relu))
    assert set(columns) == {"deep sigmoid", "relu he"}

    flagged = list(boxes(columns["deep sigmoid"]))
    # One box for the kind, the first alert in network order; the rest counted.
    assert [kind for kind, _ in flagged] == ["warning"], flagged
    assert flagged[0][1].startswith("Layer dense_1: gradient norm")
    assert "gradients are vanishing" in flagged[0][1]
    [more] = more_alerts(columns["deep sigmoid"])
    assert more.startswith("…and ") and more.endswith(" more alerts about vanishing gradients")
    assert not columns["deep sigmoid"].success

    quiet = list(boxes(columns["relu he"]))
    assert [kind for kind, _ in quiet] == ["success"], quiet
    assert quiet[0][1].startswith("No alerts:")


def test_the_live_alerts_view_tells_the_same_first_alert(lesson_pair):
    """Both pages tell the rules' findings through one entry point (`live.run_alerts`)."""
    from streamlit.testing.v1 import AppTest

    sigmoid, relu = lesson_pair
    first = list(boxes(run_columns(compare(sigmoid, relu))["deep sigmoid"]))[0][1]
    said = {}
    for run_id in lesson_pair:
        app = AppTest.from_file(str(REPO / "pages" / "live_training.py"), default_timeout=120)
        app.query_params["run"] = run_id
        app.session_state["live.view"] = "Alerts"
        app.run()
        assert not app.exception, [e.value for e in app.exception]
        said[run_id] = [box for box in boxes(app._tree) if box[0] != "info"]
    # The Live view lists the first five vanishing layers, dense_1 first.
    assert said[sigmoid][0] == ("warning", first)
    assert len([kind for kind, _ in said[sigmoid] if kind == "warning"]) == 5
    assert [kind for kind, _ in said[relu]] == ["success"]
    assert said[relu][0][1].startswith("No alerts:")


def test_a_runs_nan_is_an_error_box(page_environment, lesson_pair):
    """The monitor's stored NaN event is told as an error, not as a warning."""
    from gradflow.store import RunStore
    from tests.test_pages import write_a_nan_at_step_2

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="blew up", status="running")
    message = "Layer output: first non-finite (NaN/Inf) gradient at step 2 (stored)."
    write_a_nan_at_step_2(store, run_id, message)
    store.set_status(run_id, "diverged")
    columns = run_columns(compare(run_id, lesson_pair[1]))
    said = list(boxes(columns["blew up"]))
    # The stored event and the rules' finding of the same step are one alert.
    assert said == [("error", message)], said
    assert [kind for kind, _ in boxes(columns["relu he"])] == ["success"]


def test_a_training_runs_alerts_read_only_its_new_steps(page_environment, lesson_pair, monkeypatch):
    """The page redraws every second while a run trains: the rules must not read the whole
    run at each tick. An ended run is diagnosed once."""
    from gradflow import diagnosis
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="growing", status="running")
    layers = ["hidden_1", "hidden_2"]
    # hidden_1's gradients vanish from step 1 on, hidden_2's from step 110.
    vanish_from = {"hidden_1": 1, "hidden_2": 110}

    def norm_of(layer, step):
        return 1e-9 if step >= vanish_from[layer] else 1.0

    write_steps(store, run_id, 1, 100, layers, norm_of)
    read = {"growing": [], "ended": []}
    diagnose = diagnosis.diagnose

    def counted(table, thresholds=None, layer_inputs=None):
        # The real rules, counted: the steps each look reads, per run.
        if len(table):
            run = "growing" if "hidden_1" in set(table["layer"]) else "ended"
            read[run].append(sorted(table["step"].unique()))
        return diagnose(table, thresholds, layer_inputs)

    monkeypatch.setattr(diagnosis, "diagnose", counted)
    app = compare(run_id, lesson_pair[1])
    rows = app.session_state["compare.rows"][run_id]
    assert read["growing"] == [list(range(1, 101))]
    assert rows.diagnosed_step == 100
    column = run_columns(app)["growing"]
    [(kind, first)] = boxes(column)
    assert kind == "warning" and first.startswith(
        "Layer hidden_1: gradient norm 1.0e-09 at step 1 "
    )
    # hidden_1's second alert: its norm beside the last layer's.
    assert more_alerts(column) == ["…and 1 more alert about vanishing gradients"]

    write_steps(store, run_id, 101, 120, layers, norm_of)
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    # The 20 new steps and those before them the rules compare with.
    rules = diagnosis.Thresholds()
    assert read["growing"][1] == list(range(100 - rules.repeat_after - rules.growth_window, 121))
    assert rows.diagnosed_step == 120
    column = run_columns(app)["growing"]
    assert [box for _, box in boxes(column)] == [first]
    assert more_alerts(column) == ["…and 2 more alerts about vanishing gradients"]  # hidden_2's

    app.run()  # nothing new: the rules read nothing
    assert not app.exception, [e.value for e in app.exception]
    assert len(read["growing"]) == 2
    assert len(read["ended"]) <= 1  # read once (or not at all: another page read it first)


def test_a_run_compared_before_its_first_step_then_shows_its_steps(page_environment, lesson_pair):
    """A lesson pair's second run starts later: the page read it with no step, and at its
    first step every read of its shared rows raised (`after_step` -1), on Compare and on
    the run's Live page, for every session, until the rows were let go."""
    from gradflow.store import RunStore
    from tests.test_pages import live_view

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="second of the pair", status="running")
    app = compare(lesson_pair[0], run_id)
    column = run_columns(app)["second of the pair"]
    assert [text for _, text in boxes(column)] == []  # nothing recorded yet
    write_steps(store, run_id, 1, 30, ["hidden_1", "hidden_2"], lambda layer, step: 1.0)
    with store.writer(run_id) as writer:
        for step in range(1, 31):
            writer.add_metrics(step, {"loss": 1.0 / step})
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    rows = app.session_state["compare.rows"][run_id]
    assert rows.layer_stats["step"].max() == 30
    assert sorted(rows.metrics.query("name == 'loss'")["step"]) == list(range(1, 31))
    [(kind, text)] = boxes(run_columns(app)["second of the pair"])
    assert kind == "success" and text.startswith("No alerts so far:")
    live = live_view(run_id, "Alerts")  # the same shared rows, on the Live page
    assert any(s.value.startswith("No alerts:") for s in live.success)


def test_a_run_deleted_while_the_charts_tick_is_left_out(page_environment, lesson_pair):
    """A fragment's tick keeps the run ids it was drawn with: a run deleted on the Runs page
    meanwhile raised `UnknownRunError` at every tick."""
    from streamlit.testing.v1 import AppTest

    from gradflow.store import RunStore

    store = RunStore(page_environment)
    gone = store.create_run({"depth": 1}, name="gone", status="completed")
    store.delete(gone)

    def tick(run_ids):
        # What a tick of the comparison's fragment runs, with the ids it was drawn with.
        from gradflow.ui import compare

        compare._draw_charts(run_ids, False)

    for run_ids, says in (
        (lesson_pair + (gone,), None),
        ((lesson_pair[0], gone), "A compared run was deleted: pick two or more runs."),
    ):
        app = AppTest.from_function(tick, args=(run_ids,), default_timeout=120)
        app.run()
        assert not app.exception, [e.value for e in app.exception]
        if says:
            assert [i.value for i in app.info] == [says]
        else:
            assert set(run_columns(app)) == {"deep sigmoid", "relu he"}


def test_the_charts_read_only_new_steps_at_each_tick(page_environment, lesson_pair, monkeypatch):
    """The charts read every compared run whole at each tick: 0.3-0.6 s for a 40,000-step
    run's kernel rows, per run, every second while one trains (forty-first session)."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"depth": 2}, name="ticking", status="running")
    layers = ["hidden_1", "hidden_2"]
    write_steps(store, run_id, 1, 50, layers, lambda layer, step: 1.0)
    reads = []
    original = RunStore.layer_stats

    def spied(self, run, *args, **kwargs):
        reads.append((run, kwargs.get("after_step")))
        return original(self, run, *args, **kwargs)

    monkeypatch.setattr(RunStore, "layer_stats", spied)
    app = compare(run_id, lesson_pair[1])
    assert (run_id, None) in reads  # the first look reads the run
    write_steps(store, run_id, 51, 60, layers, lambda layer, step: 1.0)
    reads.clear()
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert reads == [(run_id, 50)]  # only the new steps; the ended run not at all
    rows = app.session_state["compare.rows"][run_id]
    assert rows.layer_stats["step"].max() == 60
    assert "ticking: running" in " ".join(c.value for c in app.caption)


def test_the_gradient_through_time_is_told_in_step_order(page_environment, lesson_pair):
    """An LSTM's gradient fades through time, comes back, fades again: one story, in order."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    run_id = store.create_run({"architecture": "rnn"}, name="learns", status="running")
    shares = [1e-3] * 60 + [0.5] * 90 + [1e-3] * 50
    frames = [
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
        for step, share in enumerate(shares, start=1)
    ]
    with store.writer(run_id) as writer:
        writer.add_layer_stats(pd.concat(frames, ignore_index=True))
        writer.progress(len(shares))
    store.set_status(run_id, "completed")
    said = list(boxes(run_columns(compare(run_id, lesson_pair[1]))["learns"]))
    assert [kind for kind, _ in said] == ["warning", "info", "warning"], said
    assert said[1][1].startswith("Through time (training step 122): since training step 73,")


def test_four_runs_are_two_rows_of_two(lesson_pair, page_environment):
    """A teacher may compare four runs: four columns side by side were too narrow to read."""
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    extra = []
    for name in ("third", "fourth"):
        run_id = store.create_run({"depth": 2}, name=name, status="running")
        write_steps(store, run_id, 1, 3, ["dense", "output"], lambda layer, step: 0.5)
        store.set_status(run_id, "completed")
        extra.append(run_id)
    app = compare(*lesson_pair, *extra)
    columns = run_columns(app)
    assert set(columns) == {"deep sigmoid", "relu he", "third", "fourth"}

    def rows_of_columns(node):
        # A block whose children are the section's columns: one row of them.
        children = list(getattr(node, "children", {}).values())
        named = [c for c in children if any(c is column for column in columns.values())]
        if named:
            yield [next(k for k, v in columns.items() if v is c) for c in named]
        for child in children:
            yield from rows_of_columns(child)

    assert list(rows_of_columns(app._tree)) == [["deep sigmoid", "relu he"], ["third", "fourth"]]
    assert [kind for kind, _ in boxes(columns["fourth"])] == ["success"]


def test_the_most_serious_kind_comes_first():
    """A diverged run's column opened with the explosion two steps before its NaN, and a
    long dead-ReLU box; the NaN came third (the teacher's audit)."""
    from gradflow.ui.live import THROUGH_TIME, alert_groups

    events = pd.DataFrame(
        [
            (2, "dense_1", "exploding", "Layer dense_1: gradient norm 1.7e+10 ..."),
            (2, "dense_2", "dead_relu", "Layer dense_2: 90% of units ..."),
            (2, "t=01", "vanishing", "Through time (training step 2): ..."),
            (3, "dense_9", "nonfinite", "The loss itself was NaN at step 3 ..."),
            (3, "dense_1", "exploding", "Layer dense_1: again ..."),
        ],
        columns=["step", "layer", "kind", "message"],
    )
    stats = pd.DataFrame({"layer": [f"dense_{i}" for i in range(10)], "layer_index": range(10)})
    groups = alert_groups(events, stats)
    assert [kind for kind, _ in groups] == ["nonfinite", "exploding", "dead_relu", THROUGH_TIME]
    assert groups[1][1]["step"].tolist() == [2, 3]
