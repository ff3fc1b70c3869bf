"""A run's cold start: `RunManager.start()` to its first recorded step, with no warm worker.

    python3 bench/bench_cold_start.py [--rounds 4] [--baseline DIR] [--out FILE]

Each measurement is a new process with a new `RunManager(prewarm=False,
runs_per_worker=1)` that starts the lab's default run (`RunConfig()`), so
the worker it starts for that run imports TensorFlow while the run waits,
as the first run on a server that has just started, or a queued run on a
busy dashboard (which gives each run a fresh worker), does. Timed until the
first statistics row can be read from the store. `bench_runner.py` reports
the same cold figure beside the warm one; this bench exists to compare two
checkouts: `--baseline DIR` (e.g. `git worktree add /tmp/base <commit>`)
measures the other checkout in turn, round by round, so both see the same
drift of this VM. Writes bench/results/cold-start.json (or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHILD = """
import sys, tempfile, time
from gradflow.lab.config import RunConfig
from gradflow.lab.runner import RunManager
from gradflow.store import RunStore

with tempfile.TemporaryDirectory() as folder:
    store = RunStore(folder + "/runs.db")
    manager = RunManager(store, max_running=1, runs_per_worker=1, prewarm=False)
    began = time.monotonic()
    run_id = manager.start(RunConfig())
    while store.run_info(run_id)["progress_step"] == 0:
        time.sleep(0.01)
    print("FIRST_STEP_S", time.monotonic() - began, flush=True)
    manager.shutdown()
"""


def cold_start(checkout):
    """Seconds from start() to the first recorded step, in a new process using `checkout`."""
    env = dict(os.environ, PYTHONPATH=str(checkout), TF_CPP_MIN_LOG_LEVEL="3")
    child = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    for line in child.stdout.splitlines():
        if line.startswith("FIRST_STEP_S "):
            return round(float(line.split()[1]), 3)
    raise SystemExit(f"{checkout}: no first step\n{child.stderr[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--baseline", default=None, help="another checkout, measured in turn")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    checkouts = {"this checkout": ROOT}
    if args.baseline:
        checkouts["baseline"] = pathlib.Path(args.baseline).resolve()
    seconds = {name: [] for name in checkouts}
    for round_number in range(args.rounds):
        for name, checkout in checkouts.items():
            seconds[name].append(cold_start(checkout))
        print(
            f"round {round_number + 1}: " + ", ".join(f"{n} {s[-1]} s" for n, s in seconds.items())
        )
    report = {
        "command": " ".join(["python3", "bench/bench_cold_start.py"] + sys.argv[1:]),
        "baseline": args.baseline,
        "first_step_s": seconds,
        "median_s": {name: statistics.median(values) for name, values in seconds.items()},
    }
    print("median: " + ", ".join(f"{n} {s} s" for n, s in report["median_s"].items()))
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / "cold-start.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
