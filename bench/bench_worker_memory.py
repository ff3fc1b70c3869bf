"""Memory of repeated monitored fits, and of a worker that trains run after run.

    python3 bench/bench_worker_memory.py [--fits 12] [--runs 30] [--out FILE]

1. `fit` with a `GradientMonitor`, again and again in one process (the lab's
   default MLP, 30 steps a fit, `clear_session()` between fits), each setup in
   a fresh subprocess: RSS growth per fit with the monitor as committed, with
   its traced-step release turned off (`trace_gradients.forget` a no-op; the
   leak of tensorflow/tensorflow#97697 plus the monitor's ring), and for a
   plain `fit`.
2. `RunManager(max_running=1)`: `--runs` lab runs one after another in one
   reused worker (`runs_per_worker=--runs`), against a third as many with a
   fresh worker each (`runs_per_worker=1`): wall time per run and the
   worker's RSS after each run.
Writes bench/results/worker-memory.json (or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FITS = """
import gc, json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from gradflow.lab.config import RunConfig
from gradflow.lab.datasets import load_dataset
from gradflow.lab.models import build_model
from gradflow.monitor import GradientMonitor, trace_gradients

mode, fits = sys.argv[1], int(sys.argv[2])
if mode == "monitor without release":
    trace_gradients.forget = lambda names: names.clear()

def rss_mib():
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

sizes = []
for seed in range(fits):
    config = RunConfig(steps=30, depth=4, width=32, seed=seed)
    data = load_dataset(config)
    model = build_model(config, data)
    callbacks = [] if mode == "plain fit" else [GradientMonitor(stop_on_nonfinite=True)]
    model.fit(data.x_train[:960], data.y_train[:960], batch_size=32, epochs=1, verbose=0,
              callbacks=callbacks)
    del model, data, callbacks
    keras.backend.clear_session()
    gc.collect()
    sizes.append(rss_mib())
print(json.dumps(sizes))
"""


def rss_mib(pid):
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None


def repeated_fits(mode, fits):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", FITS, mode, str(fits)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    # The first fits load libraries and data; the growth after them is the leak.
    per_fit = (sizes[-1] - sizes[2]) / (len(sizes) - 3)
    return {
        "rss_mib_after_each_fit": [round(s, 1) for s in sizes],
        "growth_mib_per_fit": round(per_fit, 2),
    }


def queued_runs(runs, runs_per_worker):
    from gradflow.lab.config import RunConfig
    from gradflow.lab.runner import RunManager
    from gradflow.store import RunStore

    with tempfile.TemporaryDirectory() as folder:
        manager = RunManager(
            RunStore(pathlib.Path(folder) / "runs.db"),
            max_running=1,
            threads_per_run=1,
            runs_per_worker=runs_per_worker,
        )
        try:
            manager.wait_warm(300)
            start = time.perf_counter()
            pids, sizes = [], []
            for seed in range(runs):
                run_id = manager.start(RunConfig(steps=30, depth=4, width=32, seed=seed))
                manager.wait(run_id, timeout=300)
                pid = manager.store.run_info(run_id)["pid"]
                time.sleep(0.3)  # the worker frees the run (clear_session) before it is read
                pids.append(pid)
                sizes.append(rss_mib(pid))
            wall = time.perf_counter() - start
        finally:
            manager.shutdown()
    return {
        "runs": runs,
        "workers": len(set(pids)),
        "wall_s_per_run": round(wall / runs, 2),
        "worker_rss_mib_after_each_run": [None if s is None else round(s) for s in sizes],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=12)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fits = {
        mode: repeated_fits(mode, args.fits)
        for mode in ("monitor", "monitor without release", "plain fit")
    }
    for mode, result in fits.items():
        print(f"{mode:<26} RSS growth {result['growth_mib_per_fit']:6.2f} MiB a fit", flush=True)
    reused = queued_runs(args.runs, args.runs)
    fresh = queued_runs(max(3, args.runs // 3), 1)
    for name, result in (("reused worker", reused), ("a worker per run", fresh)):
        known = [s for s in result["worker_rss_mib_after_each_run"] if s is not None]
        print(
            f"{name:<26} {result['runs']} runs, {result['workers']} workers, "
            f"{result['wall_s_per_run']} s a run, worker RSS "
            f"{min(known, default=0)}-{max(known, default=0)} MiB "
            f"(median {statistics.median(known) if known else '-'})",
            flush=True,
        )
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / "worker-memory.json")
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_worker_memory.py " + " ".join(sys.argv[1:]),
                "load_average_1min": os.getloadavg()[0],
                "cpus": os.cpu_count(),
                "repeated_fits": fits,
                "reused_worker": reused,
                "worker_per_run": fresh,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
