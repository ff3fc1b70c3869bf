"""GradientLog overhead: steps/s of a hand-written training loop with and without it.

    python3 bench/bench_gradient_log.py [--steps 200] [--rounds 15] [--models mlp5,mlp20,cnn]
                                        [--size small|large] [--out FILE]

For each model, three copies (same weights, same batches) train in turn,
`--steps` steps each per round: the plain loop (its `tf.function` step
returns the loss), the loop with `log.record(gradients, loss=loss)` at every
step (the step returns its gradients too), and the same with
`update_ratio=True`. Turns this short put the variants of a round in the same
drift of this noisy 2-core VM. The first `--warmup` rounds (tracing) are not
timed.

Reports, per model and variant, the median over rounds of each round's
steps/s ratio to the plain loop of the same round, its quartiles, and the
log's own cost per step in milliseconds (from the median steps/s).
Writes bench/results/gradient-log.json (or -large, or --out).
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_monitor  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import gradflow  # noqa: E402

VARIANTS = ("plain", "log", "log + update ratio", "log, summarize in the step")


def loop_of(model, logged, log=None):
    optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        if log is not None:
            return loss, log.summarize(gradients)
        return (loss, gradients) if logged else loss

    return train_step


def run_turn(step_fn, log, batches):
    # On CPU a tf.function call returns when its step is done: the plain turn is timed whole too.
    start = time.perf_counter()
    for x, y in batches:
        if log is None:
            step_fn(x, y)
        else:
            loss, gradients = step_fn(x, y)
            log.record(gradients, loss=loss)
    return len(batches) / (time.perf_counter() - start)


def measure(name, steps, rounds, warmup):
    x, y = bench_monitor.data(name, steps)
    batch = bench_monitor.BATCH
    batches = [
        (tf.constant(x[i : i + batch]), tf.constant(y[i : i + batch]))
        for i in range(0, len(x), batch)
    ]
    runs = {}
    for variant in VARIANTS:
        model = bench_monitor.build(name)
        log = None
        if variant != "plain":
            log = gradflow.GradientLog(model, update_ratio=variant.endswith("ratio"))
        in_step = log if variant.endswith("step") else None
        runs[variant] = (loop_of(model, log is not None, in_step), log)
    rates = {variant: [] for variant in VARIANTS}
    for round_ in range(warmup + rounds):
        for variant, (step_fn, log) in runs.items():
            rate = run_turn(step_fn, log, batches)
            if round_ >= warmup:
                rates[variant].append(rate)
    medians = {v: statistics.median(r) for v, r in rates.items()}
    logged = [v for v in VARIANTS if v != "plain"]
    paired = {v: [m / p for m, p in zip(rates[v], rates["plain"], strict=True)] for v in logged}
    return {
        "steps_per_second": medians,
        "paired_ratio_median": {v: statistics.median(r) for v, r in paired.items()},
        "paired_ratio_quartiles": {v: bench_monitor.quartiles(r) for v, r in paired.items()},
        "log_ms_per_step": {v: 1e3 * (1 / medians[v] - 1 / medians["plain"]) for v in logged},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of each variant per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default="mlp5,mlp20,cnn")
    parser.add_argument("--size", choices=sorted(bench_monitor.SIZES), default="small")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bench_monitor.SIZE = bench_monitor.SIZES[args.size]
    bench_monitor.BATCH = bench_monitor.SIZE["batch"]
    results = {}
    for name in args.models.split(","):
        results[name] = measure(name, args.steps, args.rounds, args.warmup)
        figures = results[name]
        print(
            f"{name}: plain {figures['steps_per_second']['plain']:.0f} steps/s; "
            + "; ".join(
                f"{v} {figures['paired_ratio_median'][v]:.2f}x "
                f"({figures['log_ms_per_step'][v]:.2f} ms/step)"
                for v in figures["paired_ratio_median"]
            ),
            flush=True,
        )
    suffix = "" if args.size == "small" else f"-{args.size}"
    bench_monitor.write_results(
        args.out,
        f"gradient-log{suffix}.json",
        {"settings": vars(args), "results": results},
    )


if __name__ == "__main__":
    main()
