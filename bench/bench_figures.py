"""How fast are gradflow figures and image export on a long, deep run?

Builds a synthetic tidy frame of 100 layers x 50,000 steps (one kernel row
per layer and step, 5M rows, with a NaN and an Inf spike), then times, in
interleaved repetitions:

- `heatmap` from a frame with object-dtype string columns and from the same
  frame with categorical columns (what `RunStore.layer_stats` returns);
- `heatmap(tensor="all_weights")` on kernel + bias rows (10M rows);
- `layer_lines` on 10 layers;
- `DataFrame.pivot` + `max` per block, the plain-pandas way, as a baseline;
- PNG export of the decimated heatmap with a fresh browser (the shared
  renderer closed first, as after `IDLE_SECONDS` without an export) and
  with the browser the renderer keeps open between exports (what every
  export after the first in a burst takes), and of a batch of 4 figures.

Target: a figure build <= 300 ms. Run: `python3 bench/bench_figures.py`
(writes bench/results/figures.json).
"""

import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np
import pandas as pd

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from gradflow import export, figures  # noqa: E402

LAYERS, STEPS = 100, 50_000
REPEATS = 7
IMAGE_REPEATS = 3


def synthetic_layer_stats(tensors=("kernel",)):
    """Tidy frame: every tensor of every layer at every step."""
    rng = np.random.default_rng(0)
    pieces = []
    for tensor in tensors:
        layer_index = np.repeat(np.arange(LAYERS), STEPS)
        step = np.tile(np.arange(1, STEPS + 1), LAYERS)
        depth_scale = 10.0 ** (-layer_index / 20)
        pieces.append(
            pd.DataFrame(
                {
                    "step": step,
                    "layer": np.array([f"block_{i}/dense" for i in range(LAYERS)], dtype=object)[
                        layer_index
                    ],
                    "layer_index": layer_index,
                    "tensor": tensor,
                    "variable": "",
                    "max_abs": depth_scale * rng.lognormal(0, 0.5, size=step.size),
                    "l2_norm": 10 * depth_scale * rng.lognormal(0, 0.5, size=step.size),
                }
            )
        )
    frame = pd.concat(pieces, ignore_index=True)
    frame.loc[123_456, "max_abs"] = np.nan
    frame.loc[2_345_678, "max_abs"] = np.inf
    return frame


def categorical(frame):
    out = frame.copy()
    for column in ("layer", "tensor", "variable"):
        out[column] = out[column].astype("category")
    return out


def pandas_baseline(frame):
    """Plain pandas pivot, then a numpy max per block of 50 steps (no figure)."""
    grid = frame.pivot(index="layer_index", columns="step", values="max_abs").to_numpy()
    return grid.reshape(grid.shape[0], -1, 50).max(axis=2)


def timed(function, cpu_times=None):
    """Wall seconds of one call; its CPU seconds are appended to `cpu_times`.

    CPU time is reported too because the shared machine is oversubscribed:
    wall time then mostly measures waiting for a core.
    """
    start, start_cpu = time.perf_counter(), time.process_time()
    function()
    if cpu_times is not None:
        cpu_times.append(time.process_time() - start_cpu)
    return time.perf_counter() - start


def main():
    kernels = synthetic_layer_stats()
    kernels_cat = categorical(kernels)
    weights_cat = categorical(synthetic_layer_stats(("kernel", "bias")))
    cases = {
        "heatmap (object columns, 5M rows)": lambda: figures.heatmap(kernels, "max_abs"),
        "heatmap (categorical columns, 5M rows)": lambda: figures.heatmap(kernels_cat, "max_abs"),
        "heatmap all_weights l2_norm (categorical, 10M rows)": lambda: figures.heatmap(
            weights_cat, "l2_norm", figures.ALL_WEIGHTS
        ),
        "layer_lines 10 layers (categorical, 5M rows)": lambda: figures.layer_lines(
            kernels_cat, "max_abs", layers=list(range(0, 100, 10))
        ),
        "baseline: pandas pivot + groupby max": lambda: pandas_baseline(kernels),
    }
    times = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    for _ in range(REPEATS):  # interleaved, so machine noise hits every case alike
        for name, case in cases.items():
            times[name].append(timed(case, cpu[name]))

    chart = figures.heatmap(kernels_cat, "max_abs")
    small = [
        chart,
        figures.profile(kernels_cat, statistics=("max_abs", "l2_norm")),
        figures.layer_lines(kernels_cat, layers=[0, 50, 99]),
        chart,
    ]
    fresh, warm, batch = (
        "PNG export, 1 heatmap, fresh browser (its start included)",
        "PNG export, 1 heatmap, browser kept open",
        "PNG export, batch of 4 figures, browser kept open",
    )
    image_times = {fresh: [], warm: [], batch: []}
    for _ in range(IMAGE_REPEATS):
        export.RENDERER.close()
        image_times[fresh].append(timed(lambda: export.to_image(chart, "png")))
        image_times[warm].append(timed(lambda: export.to_image(chart, "png")))
        image_times[batch].append(timed(lambda: export.to_images(small, "png")))
    times.update(image_times)

    medians = {name: statistics.median(values) for name, values in times.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    baseline = medians["baseline: pandas pivot + groupby max"]
    print(f"{'case':58s} {'median ms':>10s} {'min ms':>8s} {'cpu ms':>8s} {'vs pandas':>9s}")
    for name, values in times.items():
        ratio = f"{medians[name] / baseline:.2f}x" if "export" not in name else ""
        cpu_text = f"{cpu_medians[name] * 1e3:8.1f}" if name in cpu_medians else f"{'':8s}"
        print(
            f"{name:58s} {medians[name] * 1e3:10.1f} {min(values) * 1e3:8.1f} {cpu_text} {ratio:>9s}"
        )
    result = {
        "layers": LAYERS,
        "steps": STEPS,
        "repeats": REPEATS,
        "target_ms": 300,
        "drawn_columns": int(chart.figure.data[0].z.shape[1]),
        "median_ms": {name: round(value * 1e3, 1) for name, value in medians.items()},
        "median_cpu_ms": {name: round(value * 1e3, 1) for name, value in cpu_medians.items()},
        "all_ms": {name: [round(v * 1e3, 1) for v in values] for name, values in times.items()},
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "note": "shared 2-core machine, other engineers' jobs running; cpu ms = process CPU time",
    }
    out = pathlib.Path(__file__).resolve().parent / "results" / "figures.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
