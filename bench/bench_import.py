"""Copying runs between stores: `gradflow import` and `gradflow export --format store`.

    python3 bench/bench_import.py [--rows 1000000] [--repeats 3] [--out FILE]

A teacher imports a class's stores; a practitioner exports a long run to send.
Both copy whole runs through SQLite (`gradflow.store.transfer`), not the
files: this measures layer-step rows copied a second for a run of `--rows`
rows (with its metrics: 3 a step), next to the time to write those rows in
the first place (`bench_store.py`'s ingest, the same blocks) and to read them
into pandas, measured in the same run. Each copy is checked to read back
every row. Writes bench/results/import.json (or --out).
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_store import SERIES, ingest  # noqa: E402

from gradflow.store import RunStore  # noqa: E402
from gradflow.store.transfer import copy_runs, export_runs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="default bench/results/import.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    times = {"write_s": [], "read_s": [], "import_s": [], "export_store_s": []}
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        for repeat in range(args.repeats):  # interleaved: medians below
            source = RunStore(folder / f"source-{repeat}.db")
            start = time.perf_counter()
            run_id, _ = ingest(source, args.rows, rng)
            times["write_s"].append(time.perf_counter() - start)
            steps = args.rows // SERIES
            with source.writer(run_id) as writer:
                for step in range(1, steps + 1):
                    writer.add_metrics(step, {"loss": 1.0, "accuracy": 0.5, "learning_rate": 0.1})
            start = time.perf_counter()
            assert len(source.layer_stats(run_id)) == args.rows
            times["read_s"].append(time.perf_counter() - start)
            destination = folder / f"class-{repeat}.db"
            start = time.perf_counter()
            copied = copy_runs(source.path, destination)
            times["import_s"].append(time.perf_counter() - start)
            assert [c.run_id for c in copied if c.copied] == [run_id]
            start = time.perf_counter()
            export_runs(source.path, folder / f"sent-{repeat}.db", [run_id])
            times["export_store_s"].append(time.perf_counter() - start)
            for path in (destination, folder / f"sent-{repeat}.db"):
                assert len(RunStore(path).layer_stats(run_id)) == args.rows
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "command": "python3 bench/bench_import.py " + " ".join(sys.argv[1:]),
        "rows": args.rows,
        "load_average_1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        **median,
        "import_rows_per_s": args.rows / median["import_s"],
        "import_over_write": median["import_s"] / median["write_s"],
        "runs": times,
    }
    for name, value in result.items():
        if name != "runs":
            print(f"{name:<20} {value:,.3f}" if isinstance(value, float) else f"{name:<20} {value}")
    out = pathlib.Path(
        args.out or pathlib.Path(__file__).resolve().parent / "results" / "import.json"
    )
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
