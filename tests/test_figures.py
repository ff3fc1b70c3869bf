"""Figure builders on small synthetic tidy frames.

References are computed here with plain pandas/numpy loops, never with
gradflow code, and compared with the arrays inside the Plotly traces.
"""

import dataclasses
import json
import math
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from gradflow import figures, schema
from gradflow.figures import decimate, style
from gradflow.figures import grid as grid_lib

EVIL = "<script>alert(1)</script>"
LAYERS = ("dense", "dense_1", "dense_2")


def make_layer_stats(steps=6, layers=LAYERS, tensors=("kernel", "bias"), seed=0):
    """Tidy rows in a shuffled order, so no test relies on the input order."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(1, steps + 1):
        for index, layer in enumerate(layers):
            for tensor in tensors:
                scale = 10.0 ** (-index)
                rows.append(
                    dict(
                        step=step,
                        layer=layer,
                        layer_index=index,
                        tensor=tensor,
                        variable="" if tensor == "activation" else f"seq/{layer}/{tensor}",
                        max_abs=scale * rng.uniform(0.5, 2.0),
                        l2_norm=scale * rng.uniform(2.0, 5.0),
                        mean_abs=scale * rng.uniform(0.05, 0.4),
                    )
                )
    frame = pd.DataFrame(rows)
    return frame.sample(frac=1.0, random_state=seed).reset_index(drop=True)


def set_value(frame, step, layer_index, tensor, column, value):
    where = (
        (frame["step"] == step)
        & (frame["layer_index"] == layer_index)
        & (frame["tensor"] == tensor)
    )
    assert where.sum() == 1
    frame.loc[where, column] = value


def heat_trace(chart):
    traces = [t for t in chart.figure.data if t.type == "heatmap"]
    assert len(traces) == 1
    return traces[0]


def marker_traces(chart):
    return {t.name: t for t in chart.figure.data if t.type == "scatter" and t.mode == "markers"}


def test_figures_and_export_import_neither_tensorflow_nor_streamlit():
    code = (
        "import sys, gradflow.figures, gradflow.export\n"
        "bad = [m for m in ('tensorflow', 'streamlit', 'keras') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_heatmap_values_are_log10_of_the_statistic_in_layer_index_order():
    frame = make_layer_stats()
    chart = figures.heatmap(frame, "max_abs", "kernel")
    trace = heat_trace(chart)
    # Reference: plain pandas pivot, rows by layer_index (input first = bottom).
    reference = frame[frame["tensor"] == "kernel"].pivot(
        index="layer_index", columns="step", values="max_abs"
    )
    np.testing.assert_allclose(np.asarray(trace.z), np.log10(reference.to_numpy()))
    np.testing.assert_array_equal(np.asarray(trace.x), reference.columns.to_numpy())
    assert list(trace.y) == list(LAYERS)  # first row is drawn at the bottom
    # The axes end at the cell edges (no padded empty band around the cells).
    assert list(chart.figure.layout.yaxis.range) == [-0.5, 2.5]
    assert list(chart.figure.layout.xaxis.range) == [0.5, 6.5]
    assert chart.figure.layout.yaxis.type == "category"
    # The data is exactly what is drawn, in real units.
    data = chart.data.pivot(index="layer_index", columns="step", values="max_abs")
    np.testing.assert_allclose(data.to_numpy(), reference.to_numpy())


def test_heatmap_colorbar_is_labelled_in_real_units():
    frame = make_layer_stats()
    trace = heat_trace(figures.heatmap(frame, "max_abs", "kernel"))
    lowest = frame.loc[frame["tensor"] == "kernel", "max_abs"].min()
    highest = frame.loc[frame["tensor"] == "kernel", "max_abs"].max()
    assert trace.zmin == math.floor(math.log10(lowest))
    assert trace.zmax == math.ceil(math.log10(highest))
    expected = {-3: "1e-3", -2: "1e-2", -1: "1e-1", 0: "1", 1: "10"}
    for value, text in zip(trace.colorbar.tickvals, trace.colorbar.ticktext, strict=True):
        assert expected[int(value)] == text
    assert "log" in trace.colorbar.title.text


@pytest.mark.parametrize(
    "value, expect_z, marker",
    [
        (0.0, "floor", None),  # exact zero -> bottom of the scale, no marker
        (np.nan, "gap", "NaN"),
        (np.inf, "gap", "Inf"),
    ],
)
def test_heatmap_zero_nan_and_inf_cells(value, expect_z, marker):
    frame = make_layer_stats()
    set_value(frame, 3, 1, "kernel", "max_abs", value)
    chart = figures.heatmap(frame, "max_abs", "kernel")
    trace = heat_trace(chart)
    z = np.asarray(trace.z)
    cell = z[1, 2]  # layer_index 1, step 3
    if expect_z == "floor":
        assert cell == trace.zmin
    else:
        assert np.isnan(cell)
    markers = marker_traces(chart)
    if marker is None:
        assert not markers
    else:
        assert set(markers) == {marker}
        assert list(markers[marker].x) == [3]
        assert list(markers[marker].y) == ["dense_1"]
    # The exported data keeps the recorded value, not the drawn floor.
    row = chart.data[(chart.data["step"] == 3) & (chart.data["layer_index"] == 1)]
    recorded = row["max_abs"].iloc[0]
    assert (np.isnan(recorded) and np.isnan(value)) or recorded == value
    chart.figure.to_json()  # renders without error


def test_exact_zeros_sit_below_the_smallest_value_at_a_tick_that_reads_0():
    """A dead layer took the bottom colour, which the colour bar labelled "1e-4":
    a student read it as a small gradient."""
    frame = make_layer_stats()
    dead = frame["layer_index"] == 1
    frame.loc[dead, "max_abs"] = 0.0
    smallest = frame.loc[~dead, "max_abs"].min()
    trace = heat_trace(figures.heatmap(frame, "max_abs", "kernel"))
    z = np.asarray(trace.z, dtype=float)
    assert trace.colorbar.ticktext[0] == "0" and trace.colorbar.tickvals[0] == trace.zmin
    assert (z[1] == trace.zmin).all()
    assert np.nanmin(np.delete(z, 1, axis=0)) >= trace.zmin + 1 == np.floor(np.log10(smallest))
    lines = figures.layer_lines(frame, "max_abs", "kernel").figure
    [dead_line] = [t for t in lines.data if t.name == "dense_1"]
    assert lines.layout.yaxis.ticktext[0] == "0"
    assert list(dead_line.y) == [lines.layout.yaxis.tickvals[0]] * len(dead_line.y)
    assert min(min(t.y) for t in lines.data if t.name != "dense_1") >= 10 * dead_line.y[0]
    both = figures.compare_heatmaps({"a": frame, "b": make_layer_stats()}, "max_abs")
    assert both.figure.layout.coloraxis.colorbar.ticktext[0] == "0"
    profiles = figures.compare_profiles({"a": frame, "b": make_layer_stats()}, statistic="max_abs")
    assert profiles.figure.layout.yaxis.ticktext[0] == "0"
    # Without a zero the scale starts at the data's decade, as before.
    alive = heat_trace(figures.heatmap(make_layer_stats(), "max_abs", "kernel"))
    assert "0" not in alive.colorbar.ticktext


def test_heatmap_missing_cells_are_blank_without_markers():
    frame = make_layer_stats()
    frame = frame[~((frame["step"] == 2) & (frame["layer_index"] == 0))]
    chart = figures.heatmap(frame, "max_abs", "kernel")
    assert np.isnan(np.asarray(heat_trace(chart).z)[0, 1])
    assert not marker_traces(chart)
    assert len(chart.data) == 6 * 3 - 1


@pytest.mark.parametrize(
    "statistic, combine",
    [
        ("max_abs", lambda v: v.max()),
        ("l2_norm", lambda v: math.sqrt((v**2).sum())),
    ],
)
def test_all_weights_combines_every_variable_of_a_layer(statistic, combine):
    frame = make_layer_stats(tensors=("kernel", "bias", "activation"))
    chart = figures.heatmap(frame, statistic, figures.ALL_WEIGHTS)
    z = np.asarray(heat_trace(chart).z)
    for (step, index), group in frame[frame["tensor"] != "activation"].groupby(
        ["step", "layer_index"]
    ):
        assert z[index, step - 1] == pytest.approx(math.log10(combine(group[statistic].to_numpy())))


@pytest.mark.parametrize("categorical", [False, True])
def test_a_recurrent_layer_s_cell_kernel_is_a_kernel(categorical):
    """An RNN keeps its weights in a cell: `simple_rnn_cell/kernel` once fell out of "Kernels"."""
    frame = pd.DataFrame(
        {
            "step": [1, 1, 1, 1],
            "layer": ["simple_rnn", "simple_rnn", "simple_rnn", "output"],
            "layer_index": [0, 0, 0, 1],
            "tensor": [
                "simple_rnn_cell/kernel",
                "simple_rnn_cell/recurrent_kernel",
                "simple_rnn_cell/bias",
                "kernel",
            ],
            "max_abs": [0.1, 10.0, 0.3, 0.2],
        }
    )
    if categorical:
        frame = frame.astype({"tensor": "category", "layer": "category"})
    grid = figures.layer_grid(frame, "max_abs", "kernel")
    assert grid.layer == ["simple_rnn", "output"]
    np.testing.assert_array_equal(grid.values[:, 0], [0.1, 0.2])  # not the recurrent kernel
    recurrent = figures.layer_grid(frame, "max_abs", "recurrent_kernel")
    assert recurrent.layer == ["simple_rnn"] and recurrent.values[0, 0] == 10.0
    exact = figures.layer_grid(frame, "max_abs", "simple_rnn_cell/bias")
    assert exact.values[0, 0] == 0.3


def test_categorical_columns_from_the_store_give_the_same_heatmap():
    frame = make_layer_stats(tensors=("kernel", "bias", "activation"))
    categorical = frame.astype({"layer": "category", "tensor": "category", "variable": "category"})
    for tensor in ("bias", figures.ALL_WEIGHTS):
        plain = heat_trace(figures.heatmap(frame, "l2_norm", tensor))
        cat = heat_trace(figures.heatmap(categorical, "l2_norm", tensor))
        np.testing.assert_array_equal(np.asarray(plain.z), np.asarray(cat.z))
        assert list(plain.y) == list(cat.y)


def test_zmin_zmax_set_the_scale_and_compare_shares_one_scale():
    quiet = make_layer_stats(seed=1)
    loud = make_layer_stats(seed=2)
    loud["max_abs"] *= 1e4
    fixed = heat_trace(figures.heatmap(quiet, "max_abs", zmin=1e-8, zmax=1e2))
    assert (fixed.zmin, fixed.zmax) == (-8.0, 2.0)

    chart = figures.compare_heatmaps({"quiet": quiet, "loud": loud}, "max_abs")
    heatmaps = [t for t in chart.figure.data if t.type == "heatmap"]
    assert len(heatmaps) == 2
    assert all(t.coloraxis == "coloraxis" for t in heatmaps)
    axis = chart.figure.layout.coloraxis
    everything = pd.concat([quiet, loud])
    kernels = everything.loc[everything["tensor"] == "kernel", "max_abs"]
    assert axis.cmin == math.floor(math.log10(kernels.min()))
    assert axis.cmax == math.ceil(math.log10(kernels.max()))
    assert set(chart.data["run"]) == {"quiet", "loud"}
    titles = [a.text for a in chart.figure.layout.annotations]
    assert titles == ["quiet", "loud"]


@pytest.mark.parametrize("runs", [7, 12])
def test_a_comparison_of_many_runs_is_drawn(runs):
    """Seven runs (one to a row on phones) failed inside Plotly: "Vertical spacing cannot
    be greater than (1/(rows-1))"; the Compare page lets a teacher pick that many."""
    named = {f"run {n}": make_layer_stats(seed=n) for n in range(runs)}
    for columns in (None, 1):
        chart = figures.compare_heatmaps(named, "max_abs", columns=columns)
        assert len([t for t in chart.figure.data if t.type == "heatmap"]) == runs
        assert [a.text for a in chart.figure.layout.annotations][:runs] == list(named)


def test_a_diverged_run_is_compared_at_its_last_step_with_a_value_and_on_a_log_loss_axis():
    """Beside its fix, a diverged run had no profile line (its last step all NaN), and
    its loss of 1e7 flattened the other run's loss to a line at 0 ("clipping made the
    loss zero")."""
    diverged = make_layer_stats()
    diverged.loc[diverged["step"] == 6, "max_abs"] = np.nan
    fixed = make_layer_stats(seed=1)
    chart = figures.compare_profiles({"diverged": diverged, "fixed": fixed})
    shown = chart.data.groupby("run")["step"].max()
    assert shown.to_dict() == {"diverged": 5, "fixed": 6}
    assert np.isfinite(chart.data["max_abs"]).all()
    assert chart.title.endswith("at each run's last step")
    names = [trace.name for trace in chart.figure.data]
    assert names == ["diverged (step 5, its last with a value)", "fixed (step 6)"]
    # One broken layer in a run whose loss stayed finite: its last step is drawn,
    # the layer marked NaN; going back to step 5 hid it (the odd-runs audit).
    one_layer = make_layer_stats()
    last = one_layer["step"] == 6
    one_layer.loc[last & (one_layer["layer_index"] == 1), "max_abs"] = np.nan
    chart = figures.compare_profiles({"one NaN layer": one_layer, "fixed": fixed})
    assert chart.data.groupby("run")["step"].max().to_dict() == {"one NaN layer": 6, "fixed": 6}
    marker = next(t for t in chart.figure.data if t.name == "one NaN layer: NaN")
    assert list(marker.x) == [1] and marker.marker.symbol == style.NAN_SYMBOL
    assert chart.figure.layout.xaxis.dtick == 1  # whole depths, not 0.5
    assert "max_abs" not in chart.description
    assert figures.compare_profiles({"diverged": diverged}, step=6).data["step"].max() == 6

    steps = np.arange(1, 11)
    loss = lambda values: pd.DataFrame({"step": steps, "name": "loss", "value": values})  # noqa: E731
    blown = {"large init": loss(np.geomspace(300, 2e7, 10)), "clipped": loss(np.linspace(3, 2, 10))}
    assert figures.compare_metrics(blown).figure.layout.yaxis.type == "log"
    calm = {"a": loss(np.linspace(3, 2, 10)), "b": loss(np.linspace(2.5, 1, 10))}
    assert figures.compare_metrics(calm).figure.layout.yaxis.type in (None, "linear", "-")
    assert figures.compare_metrics(blown, log_y=False).figure.layout.yaxis.type != "log"
    # A run of one recorded step: a line of one point is not drawn at all.
    one = {"one step": loss(np.full(10, 0.88))[:1], "ten": calm["a"]}
    modes = [trace.mode for trace in figures.compare_metrics(one).figure.data]
    assert modes == ["lines+markers", "lines"]
    # A loss that turned NaN: its steps marked at the top of the data (nothing was drawn).
    nan_tail = {"diverged": loss(np.r_[np.linspace(3, 2, 7), [np.nan] * 3]), "calm": calm["a"]}
    marked = figures.compare_metrics(nan_tail).figure.data[-1]
    assert marked.name == "diverged: NaN" and list(marked.x) == [8, 9, 10]
    assert list(marked.y) == [3.0] * 3 and marked.marker.symbol == style.NAN_SYMBOL


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda s, m: figures.layer_lines(s, layers=object()), "`layers` must be a layer's name"),
        (lambda s, m: figures.layer_lines(s, max_points=0), "`max_points` must be a positive"),
        (lambda s, m: figures.metrics_chart(m, names=["Loss"]), "it recorded ['accuracy', 'loss']"),
        (lambda s, m: figures.metrics_chart(m, names=None), "`names` must be a metric's name"),
        (lambda s, m: figures.compare_metrics({"a": m}, "Loss"), "they recorded ['accuracy'"),
        (lambda s, m: figures.compare_metrics({"a": m}, None), "`name` must be a metric's name"),
        (lambda s, m: figures.compare_metrics({"a": m}, validation="no"), "`validation` must be"),
        (lambda s, m: figures.heatmap(s, presentation="yes"), "`presentation` must be True or"),
        (lambda s, m: figures.metrics_chart(m, log_loss="yes"), "`log_loss` must be True or"),
        (
            lambda s, m: figures.heatmap(s, power_of_two_blocks="yes"),
            "`power_of_two_blocks` must be True or",
        ),
    ],
)
def test_a_wrong_layer_or_metric_name_is_said_not_drawn_blank(call, words):
    """Wrong metric names gave a blank chart with no title or hint; `layers="dense_1"`
    was read as the layers "d", "e", ...; `max_points=0` was called `max_columns`."""
    metrics = pd.DataFrame(
        {"step": [1, 2, 1, 2], "name": ["loss"] * 2 + ["accuracy"] * 2, "value": [2, 1, 0.1, 0.5]}
    )
    with pytest.raises(ValueError) as info:
        call(make_layer_stats(), metrics)
    assert words in str(info.value)


def test_one_layer_is_named_by_a_string_or_an_index():
    stats = make_layer_stats()
    by_name = figures.layer_lines(stats, layers="dense_1")
    by_index = figures.layer_lines(stats, layers=np.int64(1))
    assert set(by_name.data["layer"]) == set(by_index.data["layer"]) == {"dense_1"}
    # NumPy numbers, as read from an array, are numbers.
    panels = figures.compare_heatmaps({"a": stats, "b": stats}, columns=np.int64(1))
    assert len([t for t in panels.figure.data if t.type == "heatmap"]) == 2


def test_a_softmax_outputs_activation_gradient_does_not_set_the_colour_scale():
    """The output row (about 1/p, up to 4e5) stretched a ResNet50's Activations scale to
    1e-3..1e6 and left the other 175 rows one dark blue."""
    frame = make_layer_stats(tensors=("activation",))
    top = frame["layer_index"] == frame["layer_index"].max()
    frame.loc[top, "max_abs"] = 4e5
    chart = figures.heatmap(frame, "max_abs", "activation")
    trace = heat_trace(chart)
    assert trace.zmax == math.ceil(math.log10(frame.loc[~top, "max_abs"].max()))
    assert "left out of the colour scale" in chart.description
    assert chart.data["max_abs"].max() == 4e5  # its values are kept, as recorded
    # A given top, other tensors and an output row near the rest are as before.
    assert heat_trace(figures.heatmap(frame, "max_abs", "activation", zmax=1e6)).zmax == 6
    frame.loc[top, "max_abs"] = 3.0
    near = figures.heatmap(frame, "max_abs", "activation")
    assert "left out" not in near.description


def brute_force_block_max(values, present, block):
    """Reference: a Python loop over blocks."""
    rows, cols = values.shape
    out = np.full((rows, math.ceil(cols / block)), np.nan)
    for r in range(rows):
        for b in range(out.shape[1]):
            cells = [
                values[r, c] for c in range(b * block, min(cols, (b + 1) * block)) if present[r, c]
            ]
            if not cells:
                continue
            if any(np.isnan(cells)):
                out[r, b] = np.nan
            else:
                out[r, b] = max(cells)
    return out


def random_grid(cols, seed=None):
    rng = np.random.default_rng(cols if seed is None else seed)
    values = rng.lognormal(size=(4, cols))
    values[rng.random((4, cols)) < 0.05] = np.nan
    values[rng.random((4, cols)) < 0.05] = np.inf
    present = rng.random((4, cols)) > 0.1
    return grid_lib.LayerGrid(
        values=np.where(present, values, np.nan),
        present=present,
        step_first=np.arange(1, cols + 1),
        step_last=np.arange(1, cols + 1),
        layer_index=np.arange(4),
        layer=["a", "b", "c", "d"],
        statistic="max_abs",
        tensor="kernel",
    )


def first_columns(grid, cols):
    return dataclasses.replace(
        grid,
        values=grid.values[:, :cols],
        present=grid.present[:, :cols],
        step_first=grid.step_first[:cols],
        step_last=grid.step_last[:cols],
    )


@pytest.mark.parametrize("cols, max_columns", [(10, 3), (12, 4), (7, 7), (1000, 10), (999, 100)])
def test_decimation_keeps_the_max_of_every_block(cols, max_columns):
    grid = random_grid(cols)
    small = decimate.decimate_max(grid, max_columns)
    block = math.ceil(cols / max_columns)
    assert small.values.shape[1] <= max_columns
    np.testing.assert_array_equal(
        small.values, brute_force_block_max(grid.values, grid.present, block)
    )
    assert small.step_first[0] == 1 and small.step_last[-1] == cols


@pytest.mark.parametrize(
    "cols, max_columns", [(10, 3), (12, 4), (7, 7), (38, 1), (1000, 10), (999, 100), (1500, 500)]
)
def test_power_of_two_blocks_keep_earlier_columns_as_a_run_grows(cols, max_columns):
    grid = random_grid(cols)
    small = decimate.decimate_max(grid, max_columns, power_of_two_blocks=True)
    block = 1
    while math.ceil(cols / block) > max_columns:
        block *= 2
    assert small.values.shape[1] == math.ceil(cols / block)
    np.testing.assert_array_equal(
        small.values, brute_force_block_max(grid.values, grid.present, block)
    )
    np.testing.assert_array_equal(small.step_first, np.arange(1, cols + 1, block))
    # The same run, shorter: while the block is the same, every column but
    # the last (partial) one is already the one drawn at the end.
    for shorter in range(1, cols):
        earlier = decimate.decimate_max(
            first_columns(grid, shorter), max_columns, power_of_two_blocks=True
        )
        if decimate.block_size(shorter, max_columns, power_of_two=True) != block:
            continue
        full = earlier.values.shape[1] - 1
        np.testing.assert_array_equal(earlier.values[:, :full], small.values[:, :full])
    # The default is unchanged: the fewest steps per column.
    assert decimate.decimate_max(grid, max_columns).values.shape[1] == min(
        cols, math.ceil(cols / math.ceil(cols / max_columns))
    )


@pytest.mark.parametrize("spike", [1.0e3, np.nan, np.inf])
def test_decimated_heatmap_keeps_a_single_step_spike(spike):
    steps = 5000
    rows = []
    for index, layer in enumerate(("in", "out")):
        rows.append(
            pd.DataFrame(
                {
                    "step": np.arange(1, steps + 1),
                    "layer": layer,
                    "layer_index": index,
                    "tensor": "kernel",
                    "variable": "",
                    "max_abs": np.full(steps, 1e-3),
                }
            )
        )
    frame = pd.concat(rows, ignore_index=True)
    frame.loc[(frame["step"] == 3217) & (frame["layer_index"] == 1), "max_abs"] = spike
    chart = figures.heatmap(frame, "max_abs", max_columns=100)
    drawn = chart.data[chart.data["layer_index"] == 1]
    assert len(drawn) == 100
    hit = drawn[(drawn["step"] <= 3217) & (drawn["step_last"] >= 3217)]["max_abs"].iloc[0]
    assert (np.isnan(hit) and np.isnan(spike)) or hit == spike
    others = drawn[~((drawn["step"] <= 3217) & (drawn["step_last"] >= 3217))]["max_abs"]
    assert (others == 1e-3).all()
    if not np.isfinite(spike):
        assert len(marker_traces(chart)) == 1
    assert "max over up to 50 steps" in chart.figure.layout.xaxis.title.text


def test_decimate_envelope_keeps_dips_spikes_and_nan():
    steps = np.arange(1, 10_001)
    values = np.ones(steps.size)
    values[1234] = 50.0
    values[5678] = -7.0
    values[9000] = np.nan
    kept_steps, kept = decimate.decimate_envelope(steps, values, max_points=200)
    assert len(kept) <= 200
    assert 50.0 in kept and -7.0 in kept and np.isnan(kept).sum() == 1
    assert kept_steps[np.nanargmax(kept)] == 1235 and kept_steps[np.nanargmin(kept)] == 5679
    assert np.all(np.diff(kept_steps) > 0)


def test_layer_names_are_escaped_in_figures_but_raw_in_data():
    frame = make_layer_stats(layers=("dense", EVIL, "a&b <b>x</b>"))
    for chart in (
        figures.heatmap(frame),
        figures.profile(frame),
        figures.layer_lines(frame),
        figures.compare_heatmaps({EVIL: frame}),
    ):
        text = json.dumps(json.loads(chart.figure.to_json()), ensure_ascii=False)
        assert "<script>" not in text  # only &lt;script&gt;, which Plotly shows literally
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
        assert "a&amp;b &lt;b&gt;x&lt;/b&gt;" in text
        assert EVIL in set(chart.data["layer"])


def test_a_chart_for_a_run_says_the_run_and_leaves_the_original_alone():
    frame = make_layer_stats()
    for chart in (figures.heatmap(frame), figures.profile(frame), figures.layer_lines(frame)):
        before = chart.figure.to_json()
        copy = chart.for_run(f"relu {EVIL}")
        assert (
            copy.figure.layout.title.subtitle.text == "relu &lt;script&gt;alert(1)&lt;/script&gt;"
        )
        assert copy.figure.layout.title.text == chart.figure.layout.title.text
        # The subtitle gets a line of its own above the plot.
        assert copy.figure.layout.margin.t > chart.figure.layout.margin.t
        assert copy.title == f"{chart.title} (relu {EVIL})"
        assert list(copy.data.columns) == ["run", *chart.data.columns]
        assert (copy.data["run"] == f"relu {EVIL}").all()
        pd.testing.assert_frame_equal(copy.data.drop(columns="run"), chart.data)
        assert chart.figure.to_json() == before and "run" not in chart.data.columns
    # Compare-page data names its runs already: not a second `run` column.
    compared = figures.compare_heatmaps({"a": frame, "b": frame}).for_run("a vs b")
    assert list(compared.data.columns).count("run") == 1 and set(compared.data["run"]) == {"a", "b"}


def test_layer_lines_log_axis_one_line_per_layer_and_nan_marker():
    frame = make_layer_stats()
    set_value(frame, 4, 2, "kernel", "max_abs", np.nan)
    chart = figures.layer_lines(frame, "max_abs", "kernel")
    lines = [t for t in chart.figure.data if t.mode == "lines"]
    assert [t.name for t in lines] == list(LAYERS)
    assert chart.figure.layout.yaxis.type == "log"
    reference = frame[(frame["tensor"] == "kernel") & (frame["layer_index"] == 0)].sort_values(
        "step"
    )
    np.testing.assert_allclose(np.asarray(lines[0].y), reference["max_abs"].to_numpy())
    nan_marker = marker_traces(chart)["NaN"]
    assert list(nan_marker.x) == [4]
    assert nan_marker.y[0] > np.nanmax(np.asarray(lines[2].y, dtype=float))  # drawn above the data
    subset = figures.layer_lines(frame, layers=["dense_2", 0])
    assert [t.name for t in subset.figure.data if t.mode == "lines"] == ["dense_2", "dense"]


def test_many_layers_get_a_depth_scale_instead_of_a_legend_of_names():
    """A 20-layer legend did not fit beside the chart: an exported PNG cut it after ten names."""
    layers = tuple(f"dense_{i}" for i in range(20))
    deep = figures.layer_lines(make_layer_stats(layers=layers), "max_abs", "kernel")
    lines = [t for t in deep.figure.data if t.mode == "lines"]
    assert [t.name for t in lines] == list(layers)
    assert not any(t.showlegend for t in lines)
    (scale,) = [t for t in deep.figure.data if t.marker.showscale]
    assert list(scale.marker.colorbar.ticktext) == ["dense_0 (input)", "dense_19"]
    # Each line's colour is the scale's at its depth.
    assert lines[0].line.color == style.line_colors(20)[0]
    shallow = figures.layer_lines(make_layer_stats(), "max_abs", "kernel")
    assert all(t.showlegend is not False for t in shallow.figure.data if t.mode == "lines")
    assert not any(t.marker.showscale for t in shallow.figure.data if t.type == "scatter")


def test_a_long_runs_loss_csv_says_it_is_each_blocks_lowest_and_highest():
    """Unlabelled, its mean read 0.196 against the run's true 0.116."""
    steps = np.arange(1, 100_001)
    loss = 1.0 / np.sqrt(steps) + 0.01 * np.sin(steps)
    metrics = pd.DataFrame({"step": steps, "name": "loss", "value": loss})
    data = figures.metrics_chart(metrics, max_points=1000).data
    block = decimate.envelope_block(len(steps), 1000)
    assert block == 200 and (data["block"] == block).all()
    # Each block of 200 steps kept its lowest and its highest value.
    first = loss[:block]
    assert data["value"].iloc[:2].tolist() == sorted(
        [first.min(), first.max()], key=list(first).index
    )
    short = figures.metrics_chart(metrics.iloc[:300]).data
    assert (short["block"] == 1).all() and len(short) == 300


def test_a_long_runs_loss_shows_its_trend_over_the_band_of_its_blocks():
    """A 20,000-step loss drawn as each block's lowest and highest value was a
    solid band that hid whether it fell."""
    rng = np.random.default_rng(0)
    steps = np.arange(1, 20_001)
    loss = 2.0 * np.exp(-steps / 5000) + rng.uniform(0, 1, len(steps))  # noisy batches
    metrics = pd.DataFrame({"step": steps, "name": "loss", "value": loss})
    chart = figures.metrics_chart(metrics)
    band, trend = chart.figure.data
    assert band.name == "training loss (each block's lowest and highest)" and band.opacity < 1
    assert trend.name == "training loss (mean of each 40 steps)"
    expected = loss.reshape(-1, 40).mean(axis=1)
    np.testing.assert_allclose(np.asarray(trend.y), expected)
    np.testing.assert_array_equal(np.asarray(trend.x), np.round(steps.reshape(-1, 40).mean(axis=1)))
    assert expected[0] - expected[-1] > 1.5  # the fall the band hid
    means = chart.data[chart.data["name"] == "loss (block mean)"]
    np.testing.assert_allclose(means["value"], expected)  # the CSV has what is drawn
    short = figures.metrics_chart(metrics.iloc[:300]).figure.data
    assert [t.name for t in short] == ["training loss"]


def test_metrics_chart_draws_train_and_validation_per_panel():
    metrics = pd.DataFrame(
        [
            dict(step=s, name=n, value=v)
            for s in range(1, 6)
            for n, v in (("loss", 1 / s), ("val_loss", 2 / s), ("accuracy", s / 10))
        ]
    )
    chart = figures.metrics_chart(metrics)
    names = [t.name for t in chart.figure.data]
    assert names == ["training loss", "validation loss", "training accuracy"]
    assert chart.figure.data[1].line.dash == "dash"
    np.testing.assert_allclose(np.asarray(chart.figure.data[1].y), [2 / s for s in range(1, 6)])
    assert set(chart.data["name"]) == {"loss", "val_loss", "accuracy"}
    only_loss = figures.metrics_chart(metrics[metrics["name"] == "loss"])
    assert len(only_loss.figure.data) == 1
    diverged = metrics.copy()
    diverged.loc[(diverged["name"] == "loss") & (diverged["step"] >= 4), "value"] = np.nan
    markers = marker_traces(figures.metrics_chart(diverged))
    assert list(markers["NaN"].x) == [4, 5]


def test_a_diverged_run_of_two_steps_is_drawn_on_whole_steps_and_plain_powers():
    """A run that blew up at step 2 was ticked 1, 1.2, ... 2, its loss "5.924305921B",
    and a layer whose only finite value was its first step had no line to show."""
    metrics = pd.DataFrame({"step": [1, 2], "name": "loss", "value": [5.9243e9, np.nan]})
    chart = figures.metrics_chart(metrics)
    assert (chart.figure.layout.xaxis.tick0, chart.figure.layout.xaxis.dtick) == (0, 1)
    assert chart.figure.layout.template.layout.yaxis.exponentformat == "e"
    frame = make_layer_stats(steps=2)
    set_value(frame, 2, 1, "kernel", "max_abs", np.nan)
    lines = figures.layer_lines(frame, "max_abs", "kernel")
    modes = {t.name: t.mode for t in lines.figure.data if t.name in LAYERS}
    assert modes[LAYERS[1]] == "markers" and modes[LAYERS[0]] == "lines"
    assert lines.figure.layout.xaxis.dtick == 1
    heat = figures.heatmap(frame)
    assert heat.figure.layout.xaxis.dtick == 1
    # A long run keeps Plotly's own ticks.
    long_run = figures.heatmap(make_layer_stats(steps=40))
    assert long_run.figure.layout.xaxis.dtick is None


@pytest.mark.parametrize(
    "step, shown",
    [(None, 6), (6, 6), (4, 4), (100, 6)],
)
def test_profile_at_a_step(step, shown):
    frame = make_layer_stats()
    frame = frame[frame["step"] != 5]  # a step that was not recorded
    chart = figures.profile(frame, step=step, tensor="kernel")
    bars = [t for t in chart.figure.data if t.type == "bar"]
    assert [b.name for b in bars] == ["max |gradient|", "mean |gradient|"]
    assert list(bars[0].x) == list(LAYERS)  # input on the left
    expected = frame[(frame["tensor"] == "kernel") & (frame["step"] == shown)].sort_values(
        "layer_index"
    )
    np.testing.assert_allclose(np.asarray(bars[0].y), expected["max_abs"].to_numpy())
    np.testing.assert_allclose(np.asarray(bars[1].y), expected["mean_abs"].to_numpy())
    assert chart.figure.layout.yaxis.type == "log"
    assert (chart.data["step"] == shown).all()


def test_profile_step_between_recorded_steps_uses_the_earlier_one_and_flags_nan():
    frame = make_layer_stats()
    frame = frame[frame["step"] != 5]
    set_value(frame, 4, 0, "kernel", "mean_abs", np.nan)
    chart = figures.profile(frame, step=5, tensor="kernel")
    assert (chart.data["step"] == 4).all()
    assert list(marker_traces(chart)["NaN"].x) == ["dense"]


def test_profile_marks_layers_whose_gradient_is_exactly_zero():
    """A dead layer had no bar on the log axis and no marker: it read as missing data."""
    frame = make_layer_stats()
    for statistic in ("max_abs", "mean_abs"):
        set_value(frame, 4, 1, "kernel", statistic, 0.0)
    chart = figures.profile(frame, step=4, tensor="kernel")
    [zeros] = [t for t in chart.figure.data if t.name == "exactly 0"]
    assert list(zeros.x) == [chart.figure.data[0].x[1]] and list(zeros.text) == ["0"]
    # Only where every drawn statistic is 0; none on a live profile.
    assert "exactly 0" not in {t.name for t in figures.profile(make_layer_stats()).figure.data}


def test_compare_profiles_and_metrics_overlay_runs():
    a, b = make_layer_stats(seed=3), make_layer_stats(seed=4, layers=LAYERS + ("dense_3",))
    chart = figures.compare_profiles({"relu": a, "sigmoid": b}, statistic="l2_norm")
    assert [t.name for t in chart.figure.data] == ["relu", "sigmoid"]
    assert list(chart.figure.data[1].x) == [0, 1, 2, 3]
    expected = b[(b["tensor"] == "kernel") & (b["step"] == 6)].sort_values("layer_index")["l2_norm"]
    np.testing.assert_allclose(np.asarray(chart.figure.data[1].y), expected.to_numpy())
    # Which step it shows (it did not say).
    assert chart.title == "gradient L2 norm by depth (kernels) at step 6"
    shorter = a[a["step"] < 6]
    chart = figures.compare_profiles({"relu": shorter, "sigmoid": b}, statistic="l2_norm")
    assert chart.title.endswith("at each run's last step")
    # A network with layers between its kernels (BatchNormalization, Activation) lines
    # up by depth: by layer index its second kernel layer stood at 3, beside the other's 1.
    spread = b.assign(layer_index=b["layer_index"] * 3)
    chart = figures.compare_profiles({"plain": b, "batch norm": spread}, statistic="l2_norm")
    assert list(chart.figure.data[0].x) == list(chart.figure.data[1].x) == [0, 1, 2, 3]
    assert chart.data.query("run == 'batch norm'")["layer_index"].tolist() == [0, 3, 6, 9]

    metrics = pd.DataFrame(
        {
            "step": [1, 2, 1, 2],
            "name": ["loss", "loss", "val_loss", "val_loss"],
            "value": [1.0, 0.5, 1.2, 0.7],
        }
    )
    chart = figures.compare_metrics(
        {"relu": metrics, "sigmoid": metrics.assign(value=metrics["value"] * 2)}
    )
    assert [t.name for t in chart.figure.data] == [
        "relu",
        "relu (validation)",
        "sigmoid",
        "sigmoid (validation)",
    ]
    assert chart.figure.data[0].line.color == chart.figure.data[1].line.color
    assert list(chart.figure.data[3].y) == [2.4, 1.4]


def histogram_rows(steps, layer="dense", tensor="kernel"):
    rows = []
    for step in steps:
        counts = np.zeros(schema.HISTOGRAM_BINS, dtype=np.int64)
        counts[10] = 90
        counts[12] = 10
        rows.append(
            dict(
                step=step,
                layer=layer,
                layer_index=0,
                tensor=tensor,
                **{f"b{i}": c for i, c in enumerate(counts)},
            )
        )
    return pd.DataFrame(rows)


def test_histogram_heatmap_shows_log_share_per_bin():
    frame = pd.concat([histogram_rows(range(1, 5)), histogram_rows(range(1, 5), layer="other")])
    chart = figures.histogram_heatmap(frame, "dense")
    trace = heat_trace(chart)
    z = np.asarray(trace.z)
    assert z.shape == (schema.HISTOGRAM_BINS, 4)
    np.testing.assert_allclose(z[10], np.log10(0.9))
    np.testing.assert_allclose(z[12], np.log10(0.1))
    assert np.isnan(z[0]).all()  # empty bins are blank
    np.testing.assert_allclose(np.asarray(trace.y), schema.histogram_bin_centers())
    assert set(chart.data["bin"]) == {10, 12}


def test_an_rnns_cell_kernels_have_their_histograms():
    """The Live page asked for "kernel" and an LSTM's `lstm_cell/kernel` raised instead."""
    frame = pd.concat(
        [
            histogram_rows(range(1, 4), tensor="lstm_cell/kernel"),
            histogram_rows(range(1, 4), tensor="lstm_cell/recurrent_kernel"),
        ]
    )
    kernel = figures.histogram_heatmap(frame, "dense", "kernel")
    recurrent = figures.histogram_heatmap(frame, "dense", "recurrent_kernel")
    assert np.asarray(heat_trace(kernel).z).shape == (schema.HISTOGRAM_BINS, 3)
    assert recurrent.title.endswith("dense (recurrent kernels)")


def test_histogram_axis_labels_of_the_open_ended_bins_stand_alone():
    """ ">=1e4" was drawn over "1e4", and "<1e-12" over "1e-12": half a bin apart."""
    chart = figures.histogram_heatmap(histogram_rows(range(1, 3)), "dense")
    axis = chart.figure.layout.yaxis
    values, texts = list(axis.tickvals), list(axis.ticktext)
    assert texts[0] == "&lt;1e-12" and texts[-1] == "&gt;=1e4"
    gaps = np.diff(values)
    assert (gaps >= 1.0).all(), list(zip(texts, values, strict=True))


def test_histogram_long_layout_and_decimation_keep_a_rare_bin():
    wide = histogram_rows(range(1, 401))
    wide.loc[wide["step"] == 123, "b33"] = 1  # one huge entry, once
    long = wide.melt(
        id_vars=["step", "layer", "layer_index", "tensor"], var_name="bin", value_name="count"
    )
    long["bin"] = long["bin"].str[1:].astype(int)
    from_wide = figures.histogram_heatmap(wide, "dense", max_columns=40)
    from_long = figures.histogram_heatmap(long, "dense", max_columns=40)
    np.testing.assert_allclose(
        np.asarray(heat_trace(from_wide).z), np.asarray(heat_trace(from_long).z)
    )
    rare = from_wide.data[from_wide.data["bin"] == 33]
    assert len(rare) == 1 and rare["step"].iloc[0] <= 123 <= rare["step_last"].iloc[0]


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda f: figures.heatmap([1, 2]), TypeError, "`layer_stats` must be a pandas DataFrame"),
        (lambda f: figures.heatmap(f, "grad"), ValueError, "`statistic` must be a column"),
        (lambda f: figures.heatmap(f, tensor="gamma"), ValueError, "'gamma' has no rows"),
        (lambda f: figures.heatmap(f, zmin=0), ValueError, "`zmin` must be a positive finite"),
        (lambda f: figures.heatmap(f, zmin=1.0, zmax=0.1), ValueError, "smaller than `zmax`"),
        (
            lambda f: figures.heatmap(f, max_columns=0),
            ValueError,
            "`max_columns` must be a positive integer",
        ),
        (lambda f: figures.profile(f, step=0), ValueError, "first recorded step 1"),
        (lambda f: figures.layer_lines(f, layers=["nope"]), ValueError, "'nope'"),
        (lambda f: figures.compare_heatmaps({}), ValueError, "non-empty mapping"),
        (lambda f: figures.metrics_chart(f), ValueError, "`metrics` is missing the columns"),
        (lambda f: figures.histogram_heatmap(histogram_rows([1]), "nope"), ValueError, "'nope'"),
    ],
)
def test_errors_name_the_argument_and_the_value(call, error, words):
    with pytest.raises(error, match=None) as info:
        call(make_layer_stats())
    assert words in str(info.value)


def test_empty_frames_give_a_no_data_figure():
    empty = make_layer_stats().iloc[:0]
    for chart in (figures.heatmap(empty), figures.layer_lines(empty), figures.profile(empty)):
        assert len(chart.data) == 0
        assert "No layer statistics" in chart.figure.layout.annotations[0].text
    metrics = figures.metrics_chart(pd.DataFrame(columns=["step", "name", "value"]))
    assert "No metrics" in metrics.figure.layout.annotations[0].text


def test_presentation_style_and_plotly_config():
    frame = make_layer_stats()
    screen = figures.heatmap(frame).figure
    slides = figures.heatmap(frame, presentation=True).figure
    assert slides.layout.font.size > screen.layout.font.size >= 12
    assert (
        slides.layout.paper_bgcolor == "white"
        or slides.layout.template.layout.paper_bgcolor == "white"
    )
    assert (
        heat_trace(figures.heatmap(frame)).colorscale[0][1] == "#440154"
    )  # viridis, colour-blind safe
    assert figures.PLOTLY_CONFIG["toImageButtonOptions"] == {
        "format": "svg",
        "scale": 2,
        "filename": "gradflow",
    }
    lines = figures.layer_lines(frame, presentation=True).figure
    assert lines.data[0].line.width == 4
    assert lines.data[0].line.color == figures.OKABE_ITO[0]


def test_histogram_heatmap_reads_the_run_store_layout(store_path):
    store_module = pytest.importorskip("gradflow.store")
    store = store_module.RunStore(store_path)
    run_id = store.create_run({}, name="hist")
    writer = store.writer(run_id, background_flush=False)
    for step in (1, 2, 3):
        counts = np.zeros(schema.HISTOGRAM_BINS, dtype=np.int64)
        counts[step + 5] = 4
        counts[20] = 12
        writer.add_histograms(
            step, [("dense", 0, "kernel", counts), ("dense_1", 1, "kernel", counts * 2)]
        )
    writer.close(status="completed")
    chart = figures.histogram_heatmap(store.histograms(run_id), "dense")
    z = np.asarray(heat_trace(chart).z)
    np.testing.assert_allclose(z[20], np.log10([0.75, 0.75, 0.75]))
    np.testing.assert_allclose([z[6, 0], z[7, 1], z[8, 2]], np.log10(0.25))
    assert list(chart.data["step"].unique()) == [1, 2, 3]


def test_live_charts_draw_only_the_trace_types_of_the_served_plotly_bundle():
    """The live page and the compare page draw through a partial Plotly.js (the cartesian
    bundle, `gradflow.ui.live_chart.TRACE_TYPES`); a trace type outside it would draw
    nothing there. `tests/test_browser_live_chart.py` checks the bundle's side."""
    from gradflow.figures.style import no_data_figure
    from gradflow.ui.live_chart import TRACE_TYPES

    stats = make_layer_stats()
    # NaN and Inf cells add their marker traces.
    set_value(stats, 2, 1, "kernel", "max_abs", np.nan)
    set_value(stats, 3, 2, "kernel", "max_abs", np.inf)
    metrics = pd.DataFrame(
        [
            dict(step=s, name=n, value=np.nan if s == 5 else 1 / s)
            for s in range(1, 6)
            for n in ("loss", "val_loss")
        ]
    )
    histograms = histogram_rows(range(1, 5))
    runs = {"relu": stats, "sigmoid": make_layer_stats(seed=1)}
    charts = [
        figures.heatmap(stats, "max_abs", "kernel"),
        figures.heatmap(stats, "l2_norm", figures.ALL_WEIGHTS),
        figures.layer_lines(stats, "max_abs", "kernel"),
        figures.profile(stats, tensor="kernel"),
        figures.metrics_chart(metrics),
        figures.histogram_heatmap(histograms, "dense"),
        figures.compare_heatmaps(runs, "max_abs", "kernel"),
        figures.compare_profiles(runs, statistic="max_abs", tensor="kernel"),
        figures.compare_metrics({"relu": metrics, "sigmoid": metrics}),
    ]
    used = {trace.type for chart in charts for trace in chart.figure.data}
    used |= {trace.type for trace in no_data_figure("Waiting for the first step").data}
    assert {"heatmap", "scatter", "bar"} <= used  # the builders above draw all three
    assert used <= set(TRACE_TYPES)


def test_a_compiled_metrics_panel_says_it_is_an_epochs_running_mean():
    """Training accuracy jumps at each new epoch (Keras's running mean): on a slide, without
    the page's caption, the jump read as real."""
    rows = [dict(step=s, name=n, value=0.5) for s in (1, 2) for n in ("loss", "accuracy")]
    chart = figures.metrics_chart(pd.DataFrame(rows))
    titles = [a.text for a in chart.figure.layout.annotations]
    assert titles[:2] == ["loss", "accuracy (running mean over each epoch)"]


@pytest.mark.parametrize("count", [7, 8, 30])
def test_line_colours_have_no_pale_yellow_on_white(count):
    """The seventh layer's line was Okabe-Ito yellow, hard to see on a projector."""
    import plotly.colors

    for colour in figures.style.line_colors(count):
        red, green, blue = plotly.colors.unlabel_rgb(
            plotly.colors.convert_colors_to_same_type(colour, "rgb")[0][0]
        )
        # Relative luminance (sRGB approximation) well below white's.
        assert 0.2126 * red + 0.7152 * green + 0.0722 * blue < 200, colour


def _deep_run(layers=100, steps=5):
    return pd.DataFrame(
        [
            {
                "step": step,
                "layer": f"dense_{i}",
                "layer_index": i,
                "tensor": "kernel",
                "max_abs": 0.1,
                "nonfinite": 0,
            }
            for step in range(1, steps + 1)
            for i in range(layers)
        ]
    )


@pytest.mark.parametrize("layers", [3, 34, 35, 100])
def test_a_deep_heatmap_labels_its_output_layer_and_a_readable_share_of_the_rest(layers):
    """At depth 100 Plotly labelled every third row from the bottom: the top
    row, the output layer, had no label."""
    stats = _deep_run(layers)
    for figure in (
        figures.heatmap(stats, "max_abs").figure,
        figures.compare_heatmaps({"relu": stats, "sigmoid": stats}, "max_abs").figure,
    ):
        for axis in ("yaxis", "yaxis2") if "yaxis2" in figure.layout else ("yaxis",):
            ticks = list(figure.layout[axis].tickvals)
            assert ticks[0] == "dense_0" and ticks[-1] == f"dense_{layers - 1}"
            assert len(ticks) == layers if layers <= 34 else len(ticks) <= 34
            assert len(set(ticks)) == len(ticks)


def test_a_nested_backbones_long_name_is_written_once_not_on_every_layer():
    """A fine-tuned MobileNetV2's 155 labels each began `mobilenetv2_0.35_32/`:
    the labels took a third of a half-width heatmap (the fine-tuning audit)."""
    outer = "mobilenetv2_0.35_32"
    stats = _deep_run(6).assign(
        layer=lambda f: [
            "head_out" if i == 5 else f"{outer}/block_{i}_expand" for i in f["layer_index"]
        ],
        mean_abs=0.01,
    )
    shown = ["…/block_0_expand", "…/block_1_expand", "…/block_4_expand", "head_out"]
    heat = figures.heatmap(stats, "max_abs").figure
    assert [heat.data[0].y[i] for i in (0, 1, 4, 5)] == shown
    assert heat.layout.yaxis.title.text == f"layer (input at the bottom; …/ = {outer}/)"
    compared = figures.compare_heatmaps({"a": stats, "b": stats}, "max_abs").figure
    assert compared.layout.yaxis.title.text == heat.layout.yaxis.title.text
    profile = figures.profile(stats).figure
    assert profile.data[0].x[-1] == "head_out" and profile.data[0].x[0] == shown[0]
    assert profile.layout.xaxis.title.text == f"layer (input on the left; …/ = {outer}/)"
    lines = figures.layer_lines(stats, "max_abs").figure
    assert [t.name for t in lines.data[:2]] == shown[:2]
    assert lines.layout.legend.title.text == f"layer; …/ = {outer}/"
    deep = _deep_run(12).assign(layer=lambda f: [f"{outer}/b{i}" for i in f["layer_index"]])
    scale = figures.layer_lines(deep, "max_abs").figure.data[-1].marker.colorbar
    assert scale.title.text == f"layer; …/ = {outer}/" and scale.ticktext[0] == "…/b0 (input)"
    # Compared profiles name each point in its hover text only: the whole path.
    hover = figures.compare_profiles({"a": stats}, statistic="max_abs").figure.data[0].text
    assert hover[0] == f"{outer}/block_0_expand"
    # A name of 80 characters keeps its start and end: it took the heatmap's width.
    long = stats.assign(layer=lambda f: [f"{'A' * 70}_layer_{i:03d}" for i in f["layer_index"]])
    labels = list(figures.heatmap(long, "max_abs").figure.data[0].y)
    assert labels[0] == "AAAAAAAAAAAAAAA…AAAAAA_layer_000" and max(map(len, labels)) == 32
    assert len(set(labels)) == len(labels)
    # A short outer name says more than "…" would: `mha/query` stays whole.
    short = stats.assign(layer=lambda f: [f"mha/part_{i}" for i in f["layer_index"]])
    heat = figures.heatmap(short, "max_abs").figure
    assert heat.data[0].y[0] == "mha/part_0"
    assert heat.layout.yaxis.title.text == "layer (input at the bottom)"


def test_compared_heatmaps_say_which_end_of_the_layer_axis_is_the_input():
    stats = _deep_run(4)
    figure = figures.compare_heatmaps({"relu": stats, "sigmoid": stats}, "max_abs").figure
    assert figure.layout.yaxis.title.text == "layer (input at the bottom)"


def test_compared_heatmaps_carry_a_one_per_row_layout_for_narrow_screens():
    stats = _deep_run(4)
    runs = {"relu": stats, "sigmoid": stats, "tanh": stats}
    wide = figures.compare_heatmaps(runs, "max_abs").figure
    stacked = figures.compare_heatmaps(runs, "max_abs", columns=1).figure
    narrow = wide.layout.meta["gradflow_narrow"]
    assert wide.layout.meta["gradflow_columns"] == 3 and stacked.layout.meta is None
    assert [t.xaxis for t in wide.data] == [t.xaxis for t in stacked.data]  # same axes
    for name in ("xaxis", "xaxis3", "yaxis2", "yaxis3"):
        assert narrow[name]["domain"] == list(stacked.layout[name].domain)
    assert narrow["height"] == stacked.layout.height > 3 * wide.layout.height  # + 2 row gaps
    with pytest.raises(ValueError, match="`columns` must be a positive integer or None, got 0"):
        figures.compare_heatmaps(runs, columns=0)
    # The one-per-row layout is made once per set of runs and layers: a run
    # that grew still gets its step axes' ranges right.
    longer = {name: _deep_run(4, steps=60) for name in runs}
    grown = figures.compare_heatmaps(longer, "max_abs").figure.layout.meta["gradflow_narrow"]
    fresh = figures.compare_heatmaps(longer, "max_abs", columns=1).figure.layout
    for name in ("xaxis", "xaxis2", "xaxis3"):
        assert grown[name]["range"] == list(fresh[name].range) != narrow[name]["range"]


def row_gaps(layout, count, cols):
    """Pixels between each row of panels and the row below it, from a figure's layout."""
    area = layout.height - layout.margin.t - layout.margin.b
    axis = lambda n: layout[f"yaxis{n + 1 if n else ''}"]  # noqa: E731
    return [
        (axis(row * cols).domain[0] - axis((row + 1) * cols).domain[1]) * area
        for row in range(math.ceil(count / cols) - 1)
    ]


@pytest.mark.parametrize("presentation", [False, True])
def test_rows_of_compared_heatmaps_leave_room_for_the_titles_below(presentation):
    """At slide size four runs' panels had a run's two-line name drawn over the "step" of
    the panel above (the gap was a share of the height between the margins: about 90 px)."""
    stats = _deep_run(4)
    names = ["Deep sigmoid: the gradient fades", "ReLU + He: it reaches the input", "lr 0.1"]
    runs = {name: stats for name in names + ["Learning rate 10: the loss diverges to NaN"]}
    figure = figures.compare_heatmaps(runs, "max_abs", presentation=presentation).figure
    font = figures.style.font_size_of(presentation)
    lower_title = figure.layout.annotations[3]
    lines = lower_title.text.count("<br>") + 1
    assert lines >= 2
    # The step axis's tick labels and title, then the title's lines.
    [gap] = row_gaps(figure.layout, 4, 3)
    assert gap >= 3 * font + lines * 1.3 * font, gap
    assert lower_title.y == figure.layout.yaxis4.domain[1]  # the title sits on its panel
    # Seven runs one to a row: the same gaps, within Plotly's limits.
    seven = figures.compare_heatmaps({f"run {n}": stats for n in range(7)}, columns=1).figure
    gaps = row_gaps(seven.layout, 7, 1)
    assert len(gaps) == 6 and min(gaps) == pytest.approx(max(gaps)) and min(gaps) > 3 * 13


def test_chart_descriptions_use_words_not_column_names():
    """A screen reader read "max_abs of the all_weights gradients" to a student."""
    stats = _deep_run(4)
    for chart in (
        figures.heatmap(stats, "max_abs", tensor=figures.ALL_WEIGHTS),
        figures.layer_lines(stats, "max_abs"),
    ):
        words = chart.description
        assert not {"max_abs", "l2_norm", "all_weights"} & set(re.findall(r"\w+", words)), words
    assert (
        "max |gradient| of the all weights"
        in figures.heatmap(stats, "max_abs", tensor=figures.ALL_WEIGHTS).description
    )


def test_a_compare_subtitle_leaves_room_above_the_panel_titles():
    """ "each column: max over up to 2 steps" was drawn over the left panel's title."""
    runs = {"a": make_layer_stats(steps=40), "b": make_layer_stats(steps=40, seed=1)}
    whole = figures.compare_heatmaps(runs, "max_abs")
    blocks = figures.compare_heatmaps(runs, "max_abs", max_columns=10)
    assert (
        "<br>" in blocks.figure.layout.title.text and "<br>" not in whole.figure.layout.title.text
    )
    assert blocks.figure.layout.margin.t >= whole.figure.layout.margin.t + 25


def test_the_compare_title_leaves_the_run_names_to_the_panels():
    """Two presets' names made the title run off the page; the panels name the runs."""
    long_a, long_b = "SimpleRNN on a long sequence: it cannot remember", "LSTM: it remembers"
    chart = figures.compare_heatmaps({long_a: make_layer_stats(), long_b: make_layer_stats()})
    assert chart.figure.layout.title.text == "max |gradient| per layer (kernels)"
    assert chart.title.endswith(f"{long_a} vs {long_b}")  # files and descriptions keep them
    said = {a.text.replace("<br>", " ") for a in chart.figure.layout.annotations}
    assert said >= {long_a, long_b}


def test_long_run_names_side_by_side_wrap_and_thirty_time_steps_fit_a_slide():
    """A teacher's 1280 px Compare page read "...it cannot remeLSTM on the same...", and
    the 30 time steps' labels overlapped into one block at slide size."""
    long_a = "SimpleRNN on a long sequence: it cannot remember"
    long_b = "LSTM on the same long sequence: it remembers"
    steps = [f"t={t:02d}" for t in range(1, 31)]
    runs = {
        name: make_layer_stats(layers=steps, tensors=("time_step",), seed=seed)
        for seed, name in enumerate((long_a, long_b))
    }
    short = {"relu": make_layer_stats(), "tanh": make_layer_stats(seed=1)}
    for presentation in (False, True):
        chart = figures.compare_heatmaps(runs, "max_abs", "time_step", presentation=presentation)
        titles = [a.text for a in chart.figure.layout.annotations if a.text]
        assert "SimpleRNN on a long sequence: it cannot<br>remember" in titles or (
            presentation and "SimpleRNN on a long sequence:<br>it cannot remember" in titles
        ), titles
        plain = figures.compare_heatmaps(short, "max_abs", presentation=presentation)
        assert chart.figure.layout.margin.t > plain.figure.layout.margin.t  # room for line two
        ticks = chart.figure.layout.yaxis.tickvals
        assert ticks[-1] == "t=30" and len(ticks) == (30 if not presentation else 15), ticks
    # Names are escaped line by line.
    odd = figures.compare_heatmaps({"<b>bold</b> " * 6: make_layer_stats(), "b": short["relu"]})
    assert "&lt;b&gt;bold&lt;/b&gt;" in odd.figure.layout.annotations[0].text
