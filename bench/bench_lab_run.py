"""The lab's default run with and without GradientMonitor: what a teacher waits for.

    python3 bench/bench_lab_run.py [--rounds 6] [--fits 2] [--steps 300] [--baseline DIR]

The dashboard's default run (a 4 x 32 ReLU MLP on digits, 300 steps, batch
32, validation after each 45-step epoch, one TensorFlow thread, fed by the
lab's input pipelines, `gradflow.lab.batches`, and with the worker's steps
per call of the compiled function, where the checkout has them) is short, so
what the monitor costs once per fit or once per read weighs more there than
in the long fits of `bench_monitor.py`. Each fit gets a fresh model; a plain
`fit` and a `fit` with `GradientMonitor(store=..., stop_on_nonfinite=True)`
(as the lab's worker has it) take turns, `--fits` pairs per process. Timed
from the end of the first step (tracing left out) to the end of the fit;
the time spent in the deferred ring's reads is timed too.

`--baseline DIR` runs the same in another checkout (e.g. `git worktree add
/tmp/base <commit>`): each round starts one process for this checkout and
one for the baseline, in turn, so both see the same drift of this VM.
Reports medians over every pair: the monitored fit's time over the plain
one's, seconds a fit and seconds in reads. Writes
bench/results/lab-run.json (or --out).
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHILD = """
import json, math, os, sys, tempfile, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
from gradflow.lab.config import RunConfig
from gradflow.lab.datasets import load_dataset
from gradflow.lab.models import build_model
from gradflow.monitor import GradientMonitor, deferred
from gradflow.store import RunStore

fits, steps = int(sys.argv[1]), int(sys.argv[2])
in_reads = [0.0]
read = deferred.DeferredRing.read
def timed_read(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return read(self, *args, **kwargs)
    finally:
        in_reads[0] += time.perf_counter() - start
deferred.DeferredRing.read = timed_read

class Clock(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if not hasattr(self, "start"):
            self.start = time.perf_counter()
            in_reads[0] = 0.0  # the first step's read is part of the first step
    def on_train_end(self, logs=None):
        self.seconds = time.perf_counter() - self.start

config = RunConfig(steps=steps)
data = load_dataset(config)
epochs = math.ceil(steps / math.ceil(len(data.x_train) / config.batch_size))
results = []
with tempfile.TemporaryDirectory() as folder:
    store = RunStore(os.path.join(folder, "runs.db"))
    for _ in range(fits):
        pair = {}
        for mode in ("plain", "monitor"):
            model = build_model(config, data)
            clock = Clock()
            callbacks = [clock]
            if mode == "monitor":
                callbacks.insert(0, GradientMonitor(store=store, stop_on_nonfinite=True))
            try:  # the lab's own input pipelines, where the checkout has them
                from gradflow.lab.batches import fit_inputs
                inputs = fit_inputs(data, config.batch_size, config.seed)
            except ImportError:  # a checkout before the twenty-third session
                inputs = dict(x=data.x_train, y=data.y_train, batch_size=config.batch_size,
                              validation_data=(data.x_val, data.y_val))
            try:  # the worker's steps per call, where the checkout has them
                from gradflow.lab.batches import steps_per_execution
                model.steps_per_execution = steps_per_execution(inputs["steps_per_epoch"], steps)
            except ImportError:  # a checkout before the twenty-fourth session
                pass
            model.fit(**inputs, epochs=epochs, verbose=0, callbacks=callbacks)
            pair[mode] = clock.seconds
            if mode == "monitor":
                pair["reads"] = in_reads[0]
            keras.backend.clear_session()
        results.append(pair)
print(json.dumps(results))
"""


def run_child(root, fits, steps):
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(fits), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=tempfile.gettempdir(),  # import gradflow from `root`, not from the cwd
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(pairs):
    ratios = [p["monitor"] / p["plain"] for p in pairs]
    return {
        "monitored_over_plain_time": statistics.median(ratios),
        "quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
        "plain_s": statistics.median(p["plain"] for p in pairs),
        "monitor_s": statistics.median(p["monitor"] for p in pairs),
        "reads_s": statistics.median(p["reads"] for p in pairs),
        "pairs": pairs,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--fits", type=int, default=2, help="pairs of fits per process")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--baseline", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    checkouts = {"this": ROOT}
    if args.baseline:
        checkouts["baseline"] = pathlib.Path(args.baseline).resolve()
    pairs = {name: [] for name in checkouts}
    for round_ in range(args.rounds):
        for name, root in checkouts.items():
            pairs[name].extend(run_child(root, args.fits, args.steps))
        print(f"round {round_ + 1}/{args.rounds}", flush=True)
    results = {name: summary(p) for name, p in pairs.items()}
    for name, result in results.items():
        print(
            f"{name:<9} monitored / plain time {result['monitored_over_plain_time']:.3f} "
            f"(plain {result['plain_s']:.3f} s, monitored {result['monitor_s']:.3f} s, "
            f"in reads {result['reads_s']:.3f} s)"
        )
    command = "python3 bench/bench_lab_run.py " + " ".join(sys.argv[1:])
    report = {
        "command": command.strip(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "steps": args.steps,
        "baseline": args.baseline,
        "results": results,
    }
    out = pathlib.Path(args.out) if args.out else ROOT / "bench" / "results" / "lab-run.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
