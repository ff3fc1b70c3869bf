"""GradientMonitor overhead: steps/s of `model.fit` with and without the monitor.

    python3 bench/bench_monitor.py [--steps 200] [--repeats 3] [--models mlp5,mlp20,cnn]
                                   [--size small|large] [--threads N] [--out FILE]

For each model, three variants train side by side, interleaved repetition by
repetition: plain `fit`, `fit` with `GradientMonitor()` (weights, every step)
and with `GradientMonitor(activations=True)`. Each measurement is one `fit` of
two epochs of `--steps` steps; the first epoch (tracing, warm-up) is thrown
away and the second is timed with epoch callbacks only, so Keras's per-batch
path is the same as a plain fit's. Reports median steps/s and the ratio to
plain fit, and the monitor's own cost per step in milliseconds
(1/monitored - 1/plain): a fixed cost per recorded step, which is why the
ratio depends so much on how long a plain step takes.
Targets: weights >= 0.90x, activations >= 0.85x.

`--size small` (default): width 64, 16x16x1 CNN input, batch 32; a plain
step takes about a millisecond on CPU, the worst case for a fixed cost.
`--size large`: width 512, 32x32x3 CNN input with 32 and 64 filters,
batch 128: models of the size the dashboard's users debug.
Writes bench/results/monitor.json (or monitor-large.json, or --out).
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradflow.monitor import GradientMonitor  # noqa: E402

SIZES = {
    "small": {"batch": 32, "width": 64, "image": (16, 16, 1), "filters": (8, 16), "features": 32},
    "large": {"batch": 128, "width": 512, "image": (32, 32, 3), "filters": (32, 64), "features": 256},
}
SIZE = SIZES["small"]
BATCH = SIZE["batch"]
TARGETS = {"weights": 0.90, "activations": 0.85}


def build(name):
    keras.utils.set_random_seed(0)
    if name == "cnn":
        layers = [
            keras.Input(SIZE["image"]),
            keras.layers.Conv2D(SIZE["filters"][0], 3, activation="relu"),
            keras.layers.Conv2D(SIZE["filters"][1], 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:
        depth = {"mlp5": 5, "mlp20": 20}[name]
        layers = [keras.Input((SIZE["features"],))]
        layers += [keras.layers.Dense(SIZE["width"], activation="relu") for _ in range(depth - 1)]
        layers += [keras.layers.Dense(10)]
    model = keras.Sequential(layers, name=name)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data(name, steps):
    rng = np.random.default_rng(0)
    shape = SIZE["image"] if name == "cnn" else (SIZE["features"],)
    x = rng.normal(size=(steps * BATCH, *shape)).astype("float32")
    y = rng.integers(0, 10, size=steps * BATCH)
    return x, y


class SecondEpochTimer(keras.callbacks.Callback):
    """Times the second epoch; epoch hooks keep Keras's batch path untouched."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start


VARIANTS = {
    "plain": lambda: [],
    "weights": lambda: [GradientMonitor()],
    "activations": lambda: [GradientMonitor(activations=True)],
}


def measure(model, x, y, steps, variant):
    timer = SecondEpochTimer()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=VARIANTS[variant]() + [timer],
    )
    return steps / timer.seconds


def machine_facts():
    """What a result file says about the machine it was measured on."""
    return {
        "load_average_1min": os.getloadavg()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="mlp5,mlp20,cnn")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TensorFlow intra- and inter-op threads (0: TensorFlow's default, all cores). "
        "On this 2-core VM a plain small step flips between two speeds from one fit to the "
        "next with the default; one thread gives repeatable ratios.",
    )
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    global SIZE, BATCH
    SIZE = SIZES[args.size]
    BATCH = SIZE["batch"]

    results = {}
    for name in args.models.split(","):
        x, y = data(name, args.steps)
        models = {variant: build(name) for variant in VARIANTS}
        rates = {variant: [] for variant in VARIANTS}
        for _ in range(args.repeats):
            for variant in VARIANTS:  # interleaved: noise hits all variants alike
                rates[variant].append(measure(models[variant], x, y, args.steps, variant))
        medians = {variant: statistics.median(r) for variant, r in rates.items()}
        results[name] = {
            "steps_per_second": medians,
            "all_steps_per_second": rates,
            "ratio": {v: medians[v] / medians["plain"] for v in ("weights", "activations")},
            # Each repetition's ratio to the plain fit run just before it: slow drifts of
            # the machine's speed cancel out.
            "paired_ratio_median": {
                v: statistics.median(m / p for m, p in zip(rates[v], rates["plain"], strict=True))
                for v in ("weights", "activations")
            },
            "monitor_ms_per_step": {
                v: 1e3 * (1 / medians[v] - 1 / medians["plain"]) for v in ("weights", "activations")
            },
        }

    print(f"size {args.size}: {SIZE}")
    print(
        f"{'model':<8}{'plain/s':>10}{'weights/s':>11}{'ratio':>8}{'paired':>8}{'ms':>7}"
        f"{'activ./s':>10}{'ratio':>8}{'paired':>8}{'ms':>7}"
    )
    for name, r in results.items():
        s, q, c = r["steps_per_second"], r["ratio"], r["monitor_ms_per_step"]
        p = r["paired_ratio_median"]
        print(
            f"{name:<8}{s['plain']:>10.1f}{s['weights']:>11.1f}{q['weights']:>7.2f}x"
            f"{p['weights']:>7.2f}x{c['weights']:>7.2f}"
            f"{s['activations']:>10.1f}{q['activations']:>7.2f}x"
            f"{p['activations']:>7.2f}x{c['activations']:>7.2f}"
        )
    default = "monitor" + ("" if args.size == "small" else f"-{args.size}")
    default += (f"-{args.threads}-thread" if args.threads else "") + ".json"
    out = pathlib.Path(args.out or pathlib.Path(__file__).resolve().parent / "results" / default)
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_monitor.py " + " ".join(sys.argv[1:]),
                "steps": args.steps,
                "repeats": args.repeats,
                "size": args.size,
                "model_sizes": SIZE,
                "batch_size": BATCH,
                "threads": args.threads or "default",
                "targets": TARGETS,
                "devices": [d.device_type for d in tf.config.list_logical_devices()],
                **machine_facts(),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
