"""Memory and speed of a long monitored `fit` with `keep_steps`, as the lab's worker runs it.

    python3 bench/bench_keep_steps.py [--steps 30000] [--depth 20] [--repeats 2] [--out FILE]

A `--depth`-layer MLP of width 16 (`2 * (depth + 1)` weight tensors) trains
`--steps` steps of batch 8 with a `GradientMonitor` writing every step to a
run store, each setup in a fresh subprocess, the setups interleaved:

- `keep_steps=None`: every recorded step also stays in memory (the default,
  and the lab's worker before the forty-first session);
- `keep_steps=0`: the store has the steps, memory keeps none (the worker now);
- a plain `fit` with no monitor, for the memory a run needs anyway.

Reports the process's RSS every 2,000 steps of the `fit` (after a first
200-step `fit`, which traced everything) and its slope over the second half
of the run (a linear fit, MiB per 10,000 steps: what grows with the run, not
the allocator's high-water mark of a first diagnosis), the RSS at the end,
the bytes the monitor's blocks hold at the end, and the steps per second.
Median over `--repeats`.
Writes bench/results/keep-steps.json (or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

ONE_RUN = """
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import numpy as np
from gradflow.monitor import GradientMonitor

mode, steps, depth, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def rss_mib():
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((16,))] + [keras.layers.Dense(16, "relu") for _ in range(depth)]
    + [keras.layers.Dense(1)]
)
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(8 * steps, 16)).astype("float32")
y = rng.normal(size=(8 * steps, 1)).astype("float32")
keep = {"keep_steps=None": None, "keep_steps=0": 0}.get(mode)

def callbacks():
    if mode == "plain fit":
        return []
    return [GradientMonitor(store=store, keep_steps=keep)]

model.fit(x[:1600], y[:1600], batch_size=8, verbose=0, callbacks=callbacks())  # traced
trace = [(0, rss_mib())]

class Sample(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % 2000 == 0:
            trace.append((batch + 1, rss_mib()))

monitors = callbacks()
start = time.perf_counter()
model.fit(x, y, batch_size=8, verbose=0, callbacks=monitors + [Sample()])
seconds = time.perf_counter() - start
half = [(step, mib) for step, mib in trace if step >= steps / 2]
slope = np.polyfit([s for s, _ in half], [m for _, m in half], 1)[0] * 10000
held = 0
if monitors:
    for block in monitors[0]._blocks:
        held += sum(part.nbytes for part in block[:4] if part is not None)
print(json.dumps({
    "rss_mib_every_2000_steps": [round(mib, 1) for _, mib in trace],
    "growth_mib_per_10000_steps": slope,
    "rss_growth_mib": rss_mib() - trace[0][1],
    "held_mib": held / 2**20,
    "steps_per_s": steps / seconds,
}))
"""

MODES = ["keep_steps=None", "keep_steps=0", "plain fit"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30000)
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "keep-steps.json"))
    args = parser.parse_args()
    results = {mode: [] for mode in MODES}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for mode in MODES:
                store = os.path.join(folder, f"{repeat}-{mode}.db")
                command = [sys.executable, "-c", ONE_RUN, mode, str(args.steps)]
                command += [str(args.depth), store]
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(mode, results[mode][-1], flush=True)
    summary = {
        mode: {
            key: round(statistics.median(run[key] for run in runs), 2)
            for key in ("growth_mib_per_10000_steps", "rss_growth_mib", "held_mib", "steps_per_s")
        }
        for mode, runs in results.items()
    }
    report = {
        "command": "python3 bench/bench_keep_steps.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "steps": args.steps,
        "weight_tensors": 2 * (args.depth + 1),
        "median": summary,
        "runs": results,
    }
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
