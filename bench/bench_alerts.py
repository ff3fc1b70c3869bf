"""What the dashboard's Alerts view costs a redraw on a long run.

    python3 bench/bench_alerts.py [--steps 10000] [--layers 20] [--new 1] [--repeats 5]
                                  [--time-steps 100]

Builds a synthetic tidy frame of `--layers` layers x `--steps` steps (kernel
and bias rows, as `RunStore.layer_stats` returns them), then times, in
interleaved repetitions:

- `diagnose` of the whole frame, what the view ran at every redraw before
  the thirty-first session (a running run's page redraws once a second);
- `diagnose_new` of the newest `--new` steps, what it runs now;

each on calm statistics (no alert), on random ones (many), and on calm
layers with `--time-steps` rows through time per step (a recurrent run,
`GradientMonitor(through_time=True)`), whose first time steps fade to a
thousandth every other 200 steps: the rule for vanishing through time
comes and goes. Reports the median milliseconds.
Writes bench/results/alerts.json (or --out).
"""

import argparse
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

from gradflow import diagnosis, schema  # noqa: E402


def run_frame(steps, layers, calm, seed=0):
    """Tidy layer statistics of one run: a kernel and a bias row per layer and step."""
    rng = np.random.default_rng(seed)
    step = np.repeat(np.arange(1, steps + 1), 2 * layers)
    index = np.tile(np.repeat(np.arange(layers), 2), steps)
    rows = len(step)
    frame = pd.DataFrame(
        {
            "step": step,
            "layer": pd.Categorical([f"dense_{i}" for i in range(layers)])[index],
            "layer_index": index,
            "tensor": np.tile(["kernel", "bias"], steps * layers),
            "variable": "",
            **{name: rng.random(rows) for name in schema.STATISTICS},
        }
    )
    frame["nonfinite"] = 0.0
    if calm:
        frame = frame.assign(l2_norm=1.0, max_abs=1.0, zero_fraction=0.0)
    return frame


def time_rows(steps, time_steps, seed=1):
    """Rows through time: `time_steps` rows per step, norms random over a decade."""
    rng = np.random.default_rng(seed)
    step = np.repeat(np.arange(1, steps + 1), time_steps)
    index = np.tile(np.arange(time_steps), steps)
    labels = pd.Categorical([f"t={t + 1:03d}" for t in range(time_steps)])
    norms = 10.0 ** rng.uniform(-1.0, 0.0, len(step))
    # The first tenth fades to a thousandth in every other 200 steps: the
    # alert comes and goes.
    faded = (index < max(1, time_steps // 10)) & ((step // 200) % 2 == 1)
    norms[faded] *= 1e-3
    return pd.DataFrame(
        {
            "step": step,
            "layer": labels[index],
            "layer_index": index,
            "tensor": schema.TIME_STEP,
            "variable": "input",
            **{name: norms for name in ("max_abs", "l2_norm", "mean_abs")},
            "std": 0.0,
            "zero_fraction": 0.0,
            "nonfinite": 0.0,
        }
    )


def milliseconds(function):
    start = time.perf_counter()
    function()
    return 1e3 * (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--new", type=int, default=1, help="steps added since the last look")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-steps", type=int, default=100, help="rows through time a step")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    results = {}
    for kind in ("calm", "random", "through time"):
        frame = run_frame(args.steps, args.layers, calm=kind != "random")
        if kind == "through time":
            frame = pd.concat([frame, time_rows(args.steps, args.time_steps)], ignore_index=True)
            frame = frame.sort_values("step", kind="stable", ignore_index=True)
        after = args.steps - args.new
        times = {"diagnose (whole run)": [], f"diagnose_new ({args.new} new steps)": []}
        for _ in range(args.repeats):
            whole, new = times
            times[whole].append(milliseconds(lambda f=frame: diagnosis.diagnose(f)))
            times[new].append(milliseconds(lambda f=frame, a=after: diagnosis.diagnose_new(f, a)))
        medians = {name: statistics.median(values) for name, values in times.items()}
        events = len(diagnosis.diagnose(frame))
        results[kind] = {"median_ms": medians, "all_ms": times, "events_in_whole_run": events}
        print(
            f"{kind:<12} rows {len(frame):>9,}  events {events:>6}  "
            + "  ".join(f"{name} {ms:7.1f} ms" for name, ms in medians.items())
        )

    out = pathlib.Path(args.out or pathlib.Path(__file__).resolve().parent / "results/alerts.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_alerts.py " + " ".join(sys.argv[1:]),
                "steps": args.steps,
                "layers": args.layers,
                "new_steps": args.new,
                "time_steps": args.time_steps,
                "repeats": args.repeats,
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
