"""Run-store speed: ingest rows/s, bulk read into pandas, live poll of the newest rows.

    python3 bench/bench_store.py [--rows 1000000] [--repeats 3] [--checkout DIR] [--out FILE]

Targets: ingest >= 100,000 layer-step rows/s; 1,000,000 rows into pandas
<= 1 s; a live poll of the newest step <= 50 ms. Also a poll that finds
nothing new (most ticks of a live page), timed over 500 calls. Writes
bench/results/store.json (or --out). `--checkout DIR` runs the gradflow of
another checkout (e.g. `git worktree add /tmp/base <commit>`) for comparisons.

Every read goes through the public `RunStore.layer_stats` with the default
(`sqlite3`) reader the dashboard uses, and is checked to return every row.
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
import pandas as pd

# --checkout is read before the gradflow imports below; main() parses it again.
_early = argparse.ArgumentParser(add_help=False)
_early.add_argument("--checkout", default=str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(_early.parse_known_args()[0].checkout).resolve()))

from gradflow import schema  # noqa: E402
from gradflow.store import RunStore  # noqa: E402

SERIES = 50  # 25 layers x (kernel, bias)


def tidy_block(first_step, steps, rng):
    n = steps * SERIES
    layers = np.tile(np.repeat(np.arange(SERIES // 2), 2), steps)
    frame = pd.DataFrame(
        {
            "step": np.repeat(np.arange(first_step, first_step + steps), SERIES),
            "layer": [f"dense_{i}" for i in layers],
            "layer_index": layers,
            "tensor": np.tile(["kernel", "bias"], n // 2),
            "variable": [f"sequential/dense_{i}/w" for i in layers],
        }
    )
    for c in schema.STATISTICS + schema.EXTRA_COLUMNS:
        frame[c] = rng.random(n)
    return frame


def ingest(store, rows, rng):
    """Writes `rows` rows through one writer, a monitor-sized block per call."""
    run_id = store.create_run({"bench": True})
    writer = store.writer(run_id)
    steps_per_call = 20  # what a monitor recording every step hands over in 20 steps
    blocks = [
        tidy_block(1 + i * steps_per_call, steps_per_call, rng)
        for i in range(rows // (SERIES * steps_per_call))
    ]
    start = time.perf_counter()
    for block in blocks:
        writer.add_layer_stats(block)
    writer.close(status="completed")
    seconds = time.perf_counter() - start
    return run_id, sum(len(b) for b in blocks) / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkout", default=None, help="the gradflow checkout to measure")
    parser.add_argument("--out", default=None, help="default bench/results/store.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    eight = list(schema.STATISTICS + schema.EXTRA_COLUMNS[:2])
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "runs.db"
        store = RunStore(path)
        ingest_rates, run_id = [], None
        for _ in range(args.repeats):
            run_id, rate = ingest(store, args.rows, rng)
            ingest_rates.append(rate)
        last_step = int(store.run_info(run_id)["progress_step"] or 0) or args.rows // SERIES
        reads = {
            "read_all_columns_s": lambda: store.layer_stats(run_id),
            "read_8_columns_s": lambda: store.layer_stats(run_id, columns=eight),
            # What the Compare page asks for: kernels only, half the rows.
            "read_kernels_all_columns_s": lambda: store.layer_stats(run_id, tensors=["kernel"]),
        }
        times = {name: [] for name in reads}
        times["poll"] = []
        for _ in range(args.repeats):  # interleaved, medians below
            for name, read in reads.items():
                t = time.perf_counter()
                frame = read()
                times[name].append(time.perf_counter() - t)
                expected = args.rows // 2 if "kernels" in name else args.rows
                assert len(frame) == expected, (name, len(frame))
            for _ in range(5):
                t = time.perf_counter()
                newest = store.layer_stats(run_id, after_step=last_step - 1)
                times["poll"].append(time.perf_counter() - t)
            assert len(newest) == SERIES, len(newest)
        nothing_new = []
        for _ in range(500):
            t = time.perf_counter()
            assert store.layer_stats(run_id, after_step=last_step).empty
            nothing_new.append(time.perf_counter() - t)
        database_bytes = path.stat().st_size
    result = {
        "command": "python3 bench/bench_store.py " + " ".join(sys.argv[1:]),
        "rows": args.rows,
        "load_average_1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "ingest_rows_per_s": statistics.median(ingest_rates),
        **{name: statistics.median(times[name]) for name in reads},
        "poll_newest_step_ms": 1000 * statistics.median(times["poll"]),
        "poll_nothing_new_ms": 1000 * statistics.median(nothing_new),
        "gradflow": str(pathlib.Path(sys.modules["gradflow"].__file__).parent),
        # The file holds one run per ingest repeat.
        "database_mb_per_million_rows": database_bytes / (args.repeats * args.rows),
        "targets": {"ingest_rows_per_s": 100_000, "read_s": 1.0, "poll_ms": 50},
    }
    width = max(map(len, result))
    for name, value in result.items():
        if name not in ("command", "targets"):
            print(
                f"{name:<{width}}  {value:,.3f}"
                if isinstance(value, float)
                else f"{name:<{width}}  {value}"
            )
    out = pathlib.Path(
        args.out or pathlib.Path(__file__).resolve().parent / "results" / "store.json"
    )
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
