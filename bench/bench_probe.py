"""Speed of the gradient probe, each variant timed side by side with its baseline.

    python3 bench/bench_probe.py [--repeats 7] [--calls 5]

Three comparisons, interleaved repetition by repetition (so machine noise hits
every variant alike); each figure is the median over `--repeats` of the mean
time of `--calls` back-to-back calls. Compiled functions are traced and run
once before timing.

1. Input sensitivity of every layer: one compiled `InputSensitivity` call vs
   the eager loop (one persistent tape, one `tape.gradient` per layer).
   Target: >= 10x faster.
2. `chain_gradients` on the teaching split CNN: compiled VJP chain vs the
   Jacobian chain (target: VJP >= 100x faster) and vs one joint compiled tape
   (target: VJP within 1.3x).
3. `snapshot` (a warm `GradientProbe`: weights, activations, input
   sensitivity, histograms, pandas tables) on a 20-layer MLP and a small CNN vs
   one compiled plain-tape weight-gradient call; reported as a ratio, with the
   one-shot `snapshot()` (tracing included) alongside.

Writes bench/results/probe.json.
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

import gradflow  # noqa: E402
from gradflow.probe.chain import (
    ChainedBackprop,  # noqa: E402
    split_cnn,  # noqa: E402
    toy_batch,  # noqa: E402
)
from gradflow.probe.sensitivity import InputSensitivity  # noqa: E402
from gradflow.probe.snapshot import GradientProbe  # noqa: E402

BATCH = 32
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "probe.json"


def mlp20():
    keras.utils.set_random_seed(0)
    layers = [keras.Input((32,))]
    layers += [keras.layers.Dense(64, activation="tanh") for _ in range(19)]
    layers += [keras.layers.Dense(10, activation="softmax")]
    model = keras.Sequential(layers, name="mlp20")
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(BATCH, 32)).astype("float32"), rng.integers(0, 10, BATCH)


def small_cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16, 16, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="cnn",
    )
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(BATCH, 16, 16, 1)).astype("float32"), rng.integers(0, 10, BATCH)


MODELS = {"mlp20": mlp20, "cnn": small_cnn}


def interleaved(variants, repeats, calls):
    """Median seconds per call of each variant, timed in turns."""
    for run in variants.values():  # warm-up: tracing and first-call costs
        run()
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}, times


def eager_sensitivity_loop(model, x):
    """The baseline: one persistent eager tape, one gradient call per layer."""
    x = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        h, sums = x, []
        for layer in model.layers:
            h = layer(h)
            sums.append(tf.reduce_sum(h))
    return [float(tf.reduce_max(tf.abs(tape.gradient(s, x)))) for s in sums]


def bench_sensitivity(args):
    rows = {}
    for name, build in MODELS.items():
        model, x, _ = build()
        probe = InputSensitivity(model)
        medians, raw = interleaved(
            {
                "compiled": lambda probe=probe, x=x: probe(x),
                "eager_loop": lambda model=model, x=x: eager_sensitivity_loop(model, x),
            },
            args.repeats,
            args.calls,
        )
        start = time.perf_counter()
        gradflow.input_sensitivity(model, x)
        one_shot = time.perf_counter() - start
        rows[name] = {
            "seconds": medians,
            "all_seconds": raw,
            "one_shot_with_tracing_s": one_shot,
            "speedup": medians["eager_loop"] / medians["compiled"],
            "target_speedup": 10.0,
        }
    return rows


def bench_chain(args):
    rows = {}
    parts = split_cnn(input_shape=(8, 8, 1), seed=0)
    variables = [v for part in parts for v in part.trainable_variables]

    @tf.function
    def joint(x, y):
        with tf.GradientTape() as tape:
            h = x
            for part in parts:
                h = part(h, training=False)
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, h))
        return tape.gradient(loss, variables)

    # The full Jacobians include every sample against every other sample, so
    # their cost grows with the square of the batch; the VJP's linearly.
    for batch in (8, 32):
        x, y = toy_batch(batch)
        vjp = ChainedBackprop(parts, loss="mse")
        jacobian = ChainedBackprop(parts, loss="mse", method="jacobian")
        xt, yt = tf.constant(x), tf.constant(y)
        medians, raw = interleaved(
            {
                # All three get the same tensors: no numpy conversion is timed.
                "vjp": lambda vjp=vjp, xt=xt, yt=yt: vjp(xt, yt),
                "jacobian": lambda jacobian=jacobian, xt=xt, yt=yt: jacobian(xt, yt),
                "joint_tape": lambda xt=xt, yt=yt: [g.numpy() for g in joint(xt, yt)],
            },
            args.repeats,
            args.calls,
        )
        rows[f"batch_{batch}"] = {
            "seconds": medians,
            "all_seconds": raw,
            "jacobian_over_vjp": medians["jacobian"] / medians["vjp"],
            "vjp_over_joint_tape": medians["vjp"] / medians["joint_tape"],
            "targets": {"jacobian_over_vjp": ">= 100", "vjp_over_joint_tape": "<= 1.3"},
        }
    return rows


def plain_gradients(model, loss_fn):
    """The baseline: one tape, the loss, the weight gradients; nothing else."""

    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=False))
        return tape.gradient(loss, model.trainable_variables)

    return gradients


def bench_snapshot(args):
    rows = {}
    for name, build in MODELS.items():
        model, x, y = build()
        loss_fn = keras.losses.SparseCategoricalCrossentropy()
        probe = GradientProbe(model, loss=loss_fn)

        plain = tf.function(plain_gradients(model, loss_fn))

        xt, yt = tf.constant(x), tf.constant(y)
        probe_no_inputs = GradientProbe(model, loss=loss_fn, sensitivity=False, histograms=False)
        medians, raw = interleaved(
            {
                "snapshot": lambda probe=probe, x=x, y=y: probe(x, y),
                "snapshot_weights_activations_only": (
                    lambda probe=probe_no_inputs, x=x, y=y: probe(x, y)
                ),
                "plain_tape": lambda plain=plain, xt=xt, yt=yt: [g.numpy() for g in plain(xt, yt)],
            },
            args.repeats,
            args.calls,
        )
        start = time.perf_counter()
        gradflow.snapshot(model, x, y, loss=loss_fn)
        one_shot = time.perf_counter() - start
        rows[name] = {
            "seconds": medians,
            "all_seconds": raw,
            "one_shot_with_tracing_s": one_shot,
            "snapshot_over_plain_tape": medians["snapshot"] / medians["plain_tape"],
            "weights_activations_only_over_plain_tape": (
                medians["snapshot_weights_activations_only"] / medians["plain_tape"]
            ),
        }
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()

    results = {
        "sensitivity": bench_sensitivity(args),
        "chain": bench_chain(args),
        "snapshot": bench_snapshot(args),
        "config": {
            "repeats": args.repeats,
            "calls": args.calls,
            "batch": BATCH,
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
    }

    ms = 1e3
    print("Input sensitivity, all layers (ms per call)")
    print(f"{'model':<8}{'compiled':>10}{'eager loop':>12}{'speedup':>9}{'one-shot':>10}")
    for name, row in results["sensitivity"].items():
        s = row["seconds"]
        print(
            f"{name:<8}{s['compiled'] * ms:>10.2f}{s['eager_loop'] * ms:>12.2f}"
            f"{row['speedup']:>8.1f}x{row['one_shot_with_tracing_s'] * ms:>10.0f}"
        )
    print("\nchain_gradients on the split CNN (ms per call)")
    print(f"{'batch':<10}{'vjp':>8}{'jacobian':>10}{'joint':>8}{'jac/vjp':>9}{'vjp/joint':>11}")
    for name, row in results["chain"].items():
        s = row["seconds"]
        print(
            f"{name:<10}{s['vjp'] * ms:>8.2f}{s['jacobian'] * ms:>10.2f}{s['joint_tape'] * ms:>8.2f}"
            f"{row['jacobian_over_vjp']:>8.0f}x{row['vjp_over_joint_tape']:>10.2f}x"
        )
    print("targets: jacobian/vjp >= 100x, vjp/joint <= 1.3x")
    print("\nsnapshot vs one plain compiled tape gradient (ms per call)")
    print(
        f"{'model':<8}{'snapshot':>10}{'w+a only':>10}{'plain':>8}{'ratio':>8}{'w+a ratio':>11}{'one-shot':>10}"
    )
    for name, row in results["snapshot"].items():
        s = row["seconds"]
        print(
            f"{name:<8}{s['snapshot'] * ms:>10.2f}{s['snapshot_weights_activations_only'] * ms:>10.2f}"
            f"{s['plain_tape'] * ms:>8.2f}{row['snapshot_over_plain_tape']:>7.1f}x"
            f"{row['weights_activations_only_over_plain_tape']:>10.1f}x{row['one_shot_with_tracing_s'] * ms:>10.0f}"
        )

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
