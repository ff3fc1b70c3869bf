"""Live-chart updates: applied in order to an empty browser, they give exactly the full figure.

`Browser` below is what `gradflow/ui/live_chart.js` does with an update,
written out here on its own (base64 decoded with numpy, columns spliced with
`np.concatenate`), and the reference is the figure's own Plotly JSON. The
browser test (`test_browser_e2e.py`) checks the JavaScript itself against
the CSV export.
"""

import base64
import copy
import json

import numpy as np
import pandas as pd
import plotly.io as pio

from gradflow import figures
from gradflow.ui.figure_delta import figure_update

LAYERS = ("dense", "dense_1", "dense_2", "output")


def plotly_array(value):
    """A numpy array from Plotly JSON: a list, or {dtype, bdata, shape} (base64)."""
    if not isinstance(value, dict):
        array = np.asarray(value)
        return array.astype(object) if array.dtype.kind in "USO" else array
    array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
    shape = value.get("shape")
    return array.reshape([int(n) for n in str(shape).split(",")]) if shape else array


class Browser:
    """A browser's copy of one chart, updated as live_chart.js updates it."""

    def __init__(self):
        self.state = None

    def receive(self, update):
        """Apply `update`; False when it does not apply to what is held (a resend is asked)."""
        json.dumps(update, allow_nan=False)  # what Streamlit sends must be strict JSON
        if update["base"] is None:
            state = {"config": update["config"], "layout": {}, "traces": [], "arrays": {}}
        elif self.state is not None and update["base"] == self.state["revision"]:
            state = copy.deepcopy(self.state)
        else:
            return self.state is not None and update["revision"] == self.state["revision"]
        state["revision"] = update["revision"]
        state["layout"].update(update.get("layout", {}))
        for key in update.get("layout_drop", []):
            del state["layout"][key]
        if "traces" in update:
            state["traces"] = update["traces"]
        for name, change in update.get("arrays", {}).items():
            if "bdata" in change:
                tail = np.frombuffer(base64.b64decode(change["bdata"]), dtype=change["dtype"])
            else:
                tail = np.array(change["values"], dtype=object)
            tail = tail.reshape(change["shape"])
            old = state["arrays"].get(name)
            start = change["from"]
            state["arrays"][name] = (
                tail if start == 0 else np.concatenate([old[..., :start], tail], axis=-1)
            )
        for name in update.get("drop", []):
            del state["arrays"][name]
        self.state = state
        return True

    def figure(self):
        """The figure as Plotly JSON-like dicts, arrays as numpy."""
        traces = [dict(trace) for trace in self.state["traces"]]
        for name, values in self.state["arrays"].items():
            index, attribute = name.split(".", 1)
            traces[int(index)][attribute] = values
        return traces, self.state["layout"]


def assert_browser_shows(browser, chart):
    expected = json.loads(pio.to_json(chart.figure, validate=False))
    traces, layout = browser.figure()
    assert layout == expected["layout"]
    assert len(traces) == len(expected["data"])
    for drawn, trace in zip(traces, expected["data"], strict=True):
        assert drawn.keys() == trace.keys()
        for attribute, value in trace.items():
            if attribute in ("x", "y", "z", "customdata"):
                want = plotly_array(value)
                got = np.asarray(drawn[attribute])
                assert got.shape == want.shape, attribute
                if want.dtype.kind == "O":
                    assert got.tolist() == want.tolist(), attribute
                else:
                    np.testing.assert_array_equal(got.astype(float), want.astype(float), attribute)
            else:
                assert drawn[attribute] == value, attribute


def run_rows(first, last, layers=LAYERS, tensors=("kernel", "bias"), seed=0):
    """Tidy rows of steps first..last, with zeros, NaN and Inf here and there."""
    rng = np.random.default_rng(seed + first)
    steps = np.arange(first, last + 1)
    rows = []
    for index, layer in enumerate(layers):
        for tensor in tensors:
            values = rng.lognormal(-4 + index, 1.5, len(steps))
            values[steps % 37 == 0] = 0.0
            if index == 1:
                values[steps % 53 == 0] = np.nan
            if index == 2:
                values[steps % 71 == 0] = np.inf
            rows.append(
                pd.DataFrame(
                    {
                        "step": steps,
                        "layer": layer,
                        "layer_index": index,
                        "tensor": tensor,
                        "max_abs": values,
                        "l2_norm": values * 3,
                    }
                )
            )
    return pd.concat(rows, ignore_index=True)


def live_heatmap(stats, tensor="kernel", max_columns=16):
    return figures.heatmap(
        stats, "max_abs", tensor, max_columns=max_columns, power_of_two_blocks=True
    )


def columns_sent(update, name="0.z"):
    change = update.get("arrays", {}).get(name)
    return 0 if change is None else change["shape"][-1]


def test_deltas_over_a_growing_run_rebuild_the_full_figure_with_nan_inf_and_block_changes():
    browser, sent = Browser(), None
    stats = run_rows(1, 3)
    growth = [1, 2, 1, 5, 3, 1, 7, 1, 1, 40, 2, 1, 90, 3, 1, 200, 1, 1, 1]
    blocks, resent = [], []
    for more in growth:
        last = int(stats["step"].max())
        stats = pd.concat([stats, run_rows(last + 1, last + more)], ignore_index=True)
        chart = live_heatmap(stats)
        update, sent = figure_update(chart.figure, sent)
        assert browser.receive(update)
        assert_browser_shows(browser, chart)
        # Every step is recorded here, so a column is a block of `block` steps.
        block = int(np.max(chart.data["step_last"] - chart.data["step"])) + 1
        if blocks and block == blocks[-1]:
            # Same block: the last (partial) column and the new ones, never the history.
            assert columns_sent(update) <= more + 1
            assert columns_sent(update, "0.customdata") <= more + 1
        else:
            resent.append(update["arrays"]["0.z"]["from"] == 0)
        blocks.append(block)
    # A new block re-buckets every column; 3 -> 365 steps in 16 columns: blocks 1, 2, 8, 16, 32.
    assert sorted(set(blocks)) == [1, 2, 8, 16, 32] and all(resent) and len(resent) == 5


def test_a_delta_after_k_new_steps_carries_k_columns_not_the_history():
    layers = [f"dense_{i}" for i in range(9)]
    stats = run_rows(1, 6005, layers=layers, tensors=("kernel",))
    full = live_heatmap(stats, max_columns=500)
    # 6005 steps in at most 500 columns: 13 steps a column, rounded up to 16;
    # 375 full columns and a partial one of 5 steps.
    assert full.data["step"].nunique() == 376
    whole, sent = figure_update(full.figure)
    for k in (1, 8, 64):
        bigger = pd.concat(
            [stats, run_rows(6006, 6005 + 16 * k, layers=layers, tensors=("kernel",))],
            ignore_index=True,
        )
        update, _ = figure_update(live_heatmap(bigger, max_columns=500).figure, sent)
        start = update["arrays"]["0.z"]["from"]
        assert start in (375, 376)  # the partial column, unless its max stayed the same
        assert start + columns_sent(update) == 376 + k
        assert update["arrays"]["0.x"]["from"] == 376
        assert len(json.dumps(update)) < 0.02 * len(json.dumps(whole)) + 250 * k


def test_switching_tensor_statistic_or_layers_and_nothing_new():
    browser, sent = Browser(), None
    stats = run_rows(1, 40)
    kernels = live_heatmap(stats)
    for chart in (
        kernels,
        live_heatmap(stats, tensor="bias"),
        figures.heatmap(stats, "l2_norm", "bias", max_columns=16, power_of_two_blocks=True),
        live_heatmap(run_rows(1, 40, layers=LAYERS[:2])),  # another run, fewer layers
        kernels,
    ):
        update, sent = figure_update(chart.figure, sent)
        assert browser.receive(update)
        assert_browser_shows(browser, chart)
    # Nothing new: the update names the revision the browser holds and changes nothing.
    same, unchanged = figure_update(kernels.figure, sent)
    assert same == {"revision": sent.revision, "base": sent.revision} and unchanged is sent
    assert browser.receive(same)
    assert_browser_shows(browser, kernels)


def test_an_update_for_another_base_is_refused_and_a_whole_figure_repairs_it():
    stats = run_rows(1, 30)
    first, sent = figure_update(live_heatmap(stats).figure)
    second, sent = figure_update(live_heatmap(run_rows(1, 31)).figure, sent)
    third_chart = live_heatmap(run_rows(1, 33))
    third, _ = figure_update(third_chart.figure, sent)
    browser = Browser()
    assert browser.receive(first)
    # The second update was lost (an interrupted rerun): the third does not apply.
    assert not browser.receive(third)
    assert browser.state["revision"] == first["revision"]
    # A fresh page (nothing held) refuses a delta too.
    assert not Browser().receive(third)
    # The server forgets what it sent and sends the whole figure.
    whole, _ = figure_update(third_chart.figure, None)
    assert whole["base"] is None and browser.receive(whole)
    assert_browser_shows(browser, third_chart)
    assert len({first["revision"], second["revision"], third["revision"], whole["revision"]}) == 4


def test_lines_and_the_empty_figure_take_the_same_path():
    browser, sent = Browser(), None
    empty = figures.heatmap(run_rows(1, 1).iloc[:0], "max_abs")
    update, sent = figure_update(empty.figure, sent)
    assert browser.receive(update) and not browser.state["arrays"]
    assert_browser_shows(browser, empty)
    stats = run_rows(1, 20)
    for last in (20, 21, 25, 600):
        stats = (
            pd.concat([stats, run_rows(int(stats["step"].max()) + 1, last)], ignore_index=True)
            if last > stats["step"].max()
            else stats
        )
        chart = figures.layer_lines(
            stats, "l2_norm", "kernel", max_points=64, power_of_two_blocks=True
        )
        update, sent = figure_update(chart.figure, sent)
        assert browser.receive(update)
        assert_browser_shows(browser, chart)
