"""GradientMonitor overhead: steps/s of `model.fit` with and without the monitor.

    python3 bench/bench_monitor.py [--steps 200] [--repeats 3] [--models mlp5,mlp20,cnn]

For each model, three variants train side by side, interleaved repetition by
repetition: plain `fit`, `fit` with `GradientMonitor()` (weights, every step)
and with `GradientMonitor(activations=True)`. Each measurement is one `fit` of
two epochs of `--steps` steps; the first epoch (tracing, warm-up) is thrown
away and the second is timed with epoch callbacks only, so Keras's per-batch
path is the same as a plain fit's. Reports median steps/s and the ratio to
plain fit. Targets: weights >= 0.90x, activations >= 0.85x.
Writes bench/results/monitor.json.
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

BATCH = 32
TARGETS = {"weights": 0.90, "activations": 0.85}


def build(name):
    keras.utils.set_random_seed(0)
    if name == "cnn":
        layers = [
            keras.Input((16, 16, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:
        depth = {"mlp5": 5, "mlp20": 20}[name]
        layers = [keras.Input((32,))]
        layers += [keras.layers.Dense(64, activation="relu") for _ in range(depth - 1)]
        layers += [keras.layers.Dense(10)]
    model = keras.Sequential(layers, name=name)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data(name, steps):
    rng = np.random.default_rng(0)
    shape = (16, 16, 1) if name == "cnn" else (32,)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="mlp5,mlp20,cnn")
    args = parser.parse_args()

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
        }

    print(f"{'model':<8}{'plain/s':>10}{'weights/s':>11}{'ratio':>8}{'activ./s':>10}{'ratio':>8}")
    for name, r in results.items():
        s, q = r["steps_per_second"], r["ratio"]
        print(
            f"{name:<8}{s['plain']:>10.1f}{s['weights']:>11.1f}{q['weights']:>7.2f}x"
            f"{s['activations']:>10.1f}{q['activations']:>7.2f}x"
        )
    out = pathlib.Path(__file__).resolve().parent / "results" / "monitor.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_monitor.py " + " ".join(sys.argv[1:]),
                "steps": args.steps,
                "repeats": args.repeats,
                "batch_size": BATCH,
                "targets": TARGETS,
                "devices": [d.device_type for d in tf.config.list_logical_devices()],
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
