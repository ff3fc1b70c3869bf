"""What the Compare page reads from the store at each tick of a long run.

    python3 bench/bench_compare_reads.py [--steps 40000] [--layers 6] [--repeats 5] [--out FILE]

A run of `--steps` steps of `--layers` layers (a kernel and a bias row each)
in a fresh run store; timed in interleaved repetitions:

- the whole run's kernel rows and metrics (`layer_stats(run, tensors=...)`,
  `metrics(run)`): what the Compare page read for every compared run at
  every tick (each second while a run trains) before the forty-first session;
- the rows after the last step read (`layer_stats(run, after_step=...)`):
  what it reads now, into rows shared with every session showing the run
  (`gradflow.ui.run_rows`), a tick's 1-second worth of new steps (`--new`).

Reports the median milliseconds. Writes bench/results/compare-reads.json (or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gradflow import schema  # noqa: E402
from gradflow.store import RunStore, tables  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40000)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--new", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare-reads.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        store = RunStore(os.path.join(folder, "runs.db"))
        run = store.create_run({"model": "long"}, name="long")
        series = [
            (f"dense_{i}", i, tensor, f"dense_{i}/{tensor}")
            for i in range(args.layers)
            for tensor in ("kernel", "bias")
        ]
        steps = np.arange(1, args.steps + 1)
        values = np.random.default_rng(0).random(
            (len(steps), len(series), len(tables.STAT_COLUMNS))
        )
        with store.writer(run) as writer:
            writer.add_layer_stats_array(steps, values, series)
            for step in steps:
                writer.add_metrics(int(step), {"loss": 1.0})
        whole, new = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            store.layer_stats(run, tensors=["kernel", schema.TIME_STEP])
            store.metrics(run)
            whole.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            store.layer_stats(run, after_step=args.steps - args.new)
            new.append((time.perf_counter() - start) * 1000)
    report = {
        "command": "python3 bench/bench_compare_reads.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "rows": int(args.steps * len(series)),
        "whole_run_ms_median": round(statistics.median(whole), 1),
        "new_steps_ms_median": round(statistics.median(new), 1),
        "whole_run_ms": [round(x, 1) for x in whole],
        "new_steps_ms": [round(x, 1) for x in new],
    }
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
