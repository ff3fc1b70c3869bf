"""The Compare page overlays any metric the compared runs recorded, not the loss alone.

"Which of relu and sigmoid reached the higher accuracy?" and a GAN's `d_loss`
could not be compared: the page drew the loss and nothing else (AppTest).
"""

import pytest

from gradflow.ui.compare import metric_choices
from tests.test_compare_alerts import compare, write_steps
from tests.test_pages import live_chart_updates

pytestmark = pytest.mark.usefixtures("page_environment")


@pytest.fixture(autouse=True)
def without_run_board(monkeypatch):
    from gradflow.ui import resources

    monkeypatch.setattr(resources, "run_board", lambda: None)


def stored_run(store, name, metrics):
    """A completed run of 3 steps whose metric `name` at step s is `metrics[name](s)`."""
    run_id = store.create_run({"depth": 2}, name=name, status="completed")
    write_steps(store, run_id, 1, 3, ["dense", "dense_1"], lambda layer, step: 1.0)
    with store.writer(run_id) as writer:
        for step in (1, 2, 3):
            writer.add_metrics(step, {metric: value(step) for metric, value in metrics.items()})
    return run_id


def drawn(app):
    """`{trace name: y values}` of the metric chart, as the browser holds it after this run."""
    import json

    (update,) = [u for u in live_chart_updates(app) if u["key"] == "compare.loss"]
    assert update  # the page sent the chart in this run
    sent = app.session_state["live_chart.sent.compare.loss"]
    traces = json.loads(sent.traces)
    return {t["name"]: sent.arrays[f"{i}.y"].tolist() for i, t in enumerate(traces)}


def test_the_metric_picker_draws_accuracy_for_each_run_and_its_validation(page_environment):
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    relu = stored_run(
        store,
        "relu",
        {
            "loss": lambda s: 1 / s,
            "accuracy": lambda s: 0.5 + s / 10,
            "val_accuracy": lambda s: 0.4,
        },
    )
    sigmoid = stored_run(store, "sigmoid", {"loss": lambda s: 2.0, "accuracy": lambda s: 0.5})
    app = compare(relu, sigmoid)
    (picker,) = [s for s in app.selectbox if s.label == "Metric"]
    assert picker.options == ["loss", "accuracy"] and picker.value == "loss"
    assert drawn(app) == {"relu": [1.0, 0.5, 1 / 3], "sigmoid": [2.0, 2.0, 2.0]}
    picker.set_value("accuracy").run()
    assert not app.exception
    lines = drawn(app)
    assert lines["relu"] == pytest.approx([0.6, 0.7, 0.8])
    assert lines["sigmoid"] == [0.5, 0.5, 0.5]
    assert lines["relu (validation)"] == [0.4, 0.4, 0.4]


def test_a_loops_metric_is_drawn_for_the_runs_that_recorded_it(page_environment):
    from gradflow.store import RunStore

    store = RunStore(page_environment)
    gan = stored_run(store, "gan", {"loss": lambda s: 1.0, "d_loss": lambda s: -s})
    other = stored_run(store, "plain", {"loss": lambda s: 3.0})
    app = compare(gan, other)
    next(s for s in app.selectbox if s.label == "Metric").set_value("d_loss").run()
    assert drawn(app) == {"gan": [-1.0, -2.0, -3.0]}


def test_metric_choices_put_the_loss_first_and_fold_validation_in():
    import pandas as pd

    frames = [
        pd.DataFrame({"step": [1, 1], "name": ["val_accuracy", "accuracy"], "value": [0, 0]}),
        pd.DataFrame({"step": [1, 1], "name": ["d_loss", "loss"], "value": [0, 0]}),
        pd.DataFrame({"step": [], "name": [], "value": []}),
        pd.DataFrame({"step": [1], "name": ["val_"], "value": [0]}),  # a loop's own name
    ]
    assert metric_choices(frames) == ["loss", "accuracy", "d_loss", "val_"]
