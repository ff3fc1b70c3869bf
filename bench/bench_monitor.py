"""GradientMonitor overhead: steps/s of `model.fit` with and without the monitor.

    python3 bench/bench_monitor.py [--steps 250] [--rounds 15] [--models mlp5,mlp20,cnn]
                                   [--size small|large] [--threads N] [--out FILE]

For each model, three variants train side by side: plain `fit`, `fit` with
`GradientMonitor()` (weights, every step) and with
`GradientMonitor(activations=True)`. Each variant is one `fit` of many epochs
of `--steps` steps, in a thread of its own, and the three fits take turns
epoch by epoch (plain, weights, activations, plain, ...): a fit waits for its
turn in its first callback's `on_epoch_begin` and hands the turn on in its last
callback's `on_epoch_end`, so only one of them trains at any time and one
round of three epochs takes a second or two. The speed of this 2-core VM
drifts by up to 2x from one `fit` to the next (seventeenth session: a plain
20-layer MLP ran 325, 525 and 335 steps/s in three successive two-epoch fits);
turns this short put the variants of a round in the same drift, which the
earlier bench (one whole `fit` per measurement) could not. The first
`--warmup` epochs (tracing) are not timed; everything from the first epoch
callback to the last is, the monitor's epoch-end read included.

Reports, per model and variant: the median over rounds of each round's
steps/s ratio to the plain epoch of the same round (the headline figure),
its quartiles, the ratio of median steps/s, and the monitor's own cost per
step in milliseconds (1/monitored - 1/plain, from the medians): a fixed cost
per recorded step, which is why the ratio depends so much on how long a plain
step takes.
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
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradflow.monitor import GradientMonitor  # noqa: E402

SIZES = {
    "small": {"batch": 32, "width": 64, "image": (16, 16, 1), "filters": (8, 16), "features": 32},
    "large": {
        "batch": 128,
        "width": 512,
        "image": (32, 32, 3),
        "filters": (32, 64),
        "features": 256,
    },
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


class OptimizerBuiltInStep(GradientMonitor):
    """The monitor as it was before the seventeenth session: a fresh model's
    optimizer built inside the traced step (see `StepPlan._build_optimizer`)."""

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        object.__setattr__(optimizer, "build", lambda variables: None)
        try:
            super().on_train_begin(logs)
        finally:
            object.__delattr__(optimizer, "build")


VARIANTS = {
    "plain": lambda: [],
    "weights": lambda: [GradientMonitor()],
    "activations": lambda: [GradientMonitor(activations=True)],
}
MONITORED = ["weights", "activations"]
# `--unbuilt-optimizer` adds a fourth fit: `weights` as it was before.
BUILT_IN_STEP = "weights, optimizer built in the step"


class Turns:
    """Lets several fits, each in a thread of its own, train one epoch at a time, in turn.

    Args:
        names: The fits, in the order they take turns.
    """

    def __init__(self, names):
        self._names = list(names)
        self._index = 0
        self._changed = threading.Condition()

    def wait(self, name):
        """Block until it is `name`'s turn."""
        with self._changed:
            self._changed.wait_for(lambda: self._names[self._index] == name)

    def pass_on(self):
        """Give the turn to the next fit."""
        with self._changed:
            self._index = (self._index + 1) % len(self._names)
            self._changed.notify_all()

    def leave(self, name):
        """Take a fit that has ended (or failed) out of the turns."""
        with self._changed:
            index = self._names.index(name)
            del self._names[index]
            if index < self._index:
                self._index -= 1
            if self._names:
                self._index %= len(self._names)
            self._changed.notify_all()


class TakeTurn(keras.callbacks.Callback):
    """First in a fit's callbacks: waits for the fit's turn, then starts the epoch's clock."""

    def __init__(self, turns, name):
        super().__init__()
        self.turns, self.name = turns, name
        self.seconds, self.cpu_seconds = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.turns.wait(self.name)
        self.start, self.cpu_start = time.perf_counter(), time.process_time()


class PassTurn(keras.callbacks.Callback):
    """Last in a fit's callbacks: stops the epoch's clock and passes the turn on."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def on_epoch_end(self, epoch, logs=None):
        self.clock.seconds.append(time.perf_counter() - self.clock.start)
        self.clock.cpu_seconds.append(time.process_time() - self.clock.cpu_start)
        self.clock.turns.pass_on()


def measure_in_turns(models, x, y, epochs):
    """Each variant's epochs, the fits taking turns: `{variant: (seconds, cpu_seconds)}`.

    `cpu_seconds` is the process's CPU time in each epoch (all its threads;
    the fits waiting for their turn use none).
    """
    turns = Turns(models)
    clocks = {variant: TakeTurn(turns, variant) for variant in models}
    errors = []

    def train(variant):
        clock = clocks[variant]
        try:
            models[variant].fit(
                x,
                y,
                batch_size=BATCH,
                epochs=epochs,
                shuffle=False,
                verbose=0,
                callbacks=[clock, *VARIANTS[variant](), PassTurn(clock)],
            )
        except BaseException as error:  # reported by the main thread
            errors.append((variant, error))
        finally:
            turns.leave(variant)

    threads = [threading.Thread(target=train, args=(v,), name=v) for v in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        variant, error = errors[0]
        raise RuntimeError(f"the {variant!r} fit failed") from error
    return {variant: (clock.seconds, clock.cpu_seconds) for variant, clock in clocks.items()}


def quartiles(values):
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return {"q1": low, "median": median, "q3": high}


def summarize(rates):
    """Per-variant figures from `{variant: [steps/s of each round]}`."""
    medians = {variant: statistics.median(r) for variant, r in rates.items()}
    # Each round's ratio to the plain epoch of the same round.
    paired = {v: [m / p for m, p in zip(rates[v], rates["plain"], strict=True)] for v in MONITORED}
    figures = {
        "steps_per_second": medians,
        "all_steps_per_second": rates,
        "paired_ratio_median": {v: statistics.median(r) for v, r in paired.items()},
        "paired_ratio_quartiles": {v: quartiles(r) for v, r in paired.items()},
        "ratio": {v: medians[v] / medians["plain"] for v in MONITORED},
        "monitor_ms_per_step": {
            v: 1e3 * (1 / medians[v] - 1 / medians["plain"]) for v in MONITORED
        },
    }
    if BUILT_IN_STEP in rates:
        # The change itself, round by round.
        change = [w / b for w, b in zip(rates["weights"], rates[BUILT_IN_STEP], strict=True)]
        figures["weights_vs_optimizer_built_in_step"] = quartiles(change)
    return figures


def write_results(out, default_name, payload):
    """Write `payload` as JSON, after the command that made it and the machine's facts.

    Args:
        out: The `--out` path, or None for `bench/results/<default_name>`.
        default_name: The file name in `bench/results`.
        payload: The bench's settings and `results`.
    """
    out = pathlib.Path(out or pathlib.Path(__file__).resolve().parent / "results" / default_name)
    out.parent.mkdir(exist_ok=True)
    command = f"python3 bench/{pathlib.Path(sys.argv[0]).name} " + " ".join(sys.argv[1:])
    out.write_text(json.dumps({"command": command, **machine_facts(), **payload}, indent=2))
    print(f"wrote {out}")


def machine_facts():
    """What a result file says about the machine it was measured on."""
    return {
        "load_average_1min": os.getloadavg()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250, help="steps per epoch (one turn)")
    parser.add_argument("--rounds", type=int, default=15, help="timed epochs of each variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first epochs (tracing)")
    parser.add_argument("--models", default="mlp5,mlp20,cnn")
    parser.add_argument(
        "--unbuilt-optimizer",
        action="store_true",
        help=f"add the fit {BUILT_IN_STEP!r}: the monitor before the seventeenth session, "
        "which let a fresh model's optimizer be built inside its traced step",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TensorFlow intra- and inter-op threads (0: TensorFlow's default, all cores).",
    )
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    global SIZE, BATCH
    SIZE = SIZES[args.size]
    BATCH = SIZE["batch"]

    if args.unbuilt_optimizer:
        VARIANTS[BUILT_IN_STEP] = lambda: [OptimizerBuiltInStep()]
        MONITORED.append(BUILT_IN_STEP)
    results = {}
    for name in args.models.split(","):
        x, y = data(name, args.steps)
        models = {variant: build(name) for variant in VARIANTS}
        epochs = measure_in_turns(models, x, y, args.warmup + args.rounds)
        timed = {v: [t[args.warmup :] for t in epochs[v]] for v in VARIANTS}
        results[name] = summarize({v: [args.steps / t for t in timed[v][0]] for v in VARIANTS})
        # The same per CPU second: on this VM a plain step's wall time flips
        # between two speeds (perhaps whether TensorFlow's two threads get both vCPUs),
        # while its CPU time moves far less.
        results[name]["cpu"] = summarize(
            {v: [args.steps / t for t in timed[v][1]] for v in VARIANTS}
        )

    print(f"size {args.size}: {SIZE}")
    print(
        f"{'model':<12}{'plain/s':>10}{'weights/s':>11}{'paired':>8}{'q1-q3':>12}{'ms':>7}"
        f"{'activ./s':>10}{'paired':>8}{'q1-q3':>12}{'ms':>7}"
    )
    lines = [(n, r) for n, r in results.items()] + [
        (f"{n} (cpu)", r["cpu"]) for n, r in results.items()
    ]
    for name, r in lines:
        s, p, c = r["steps_per_second"], r["paired_ratio_median"], r["monitor_ms_per_step"]
        q = {
            v: f"{r['paired_ratio_quartiles'][v]['q1']:.2f}-{r['paired_ratio_quartiles'][v]['q3']:.2f}"
            for v in MONITORED
        }
        print(
            f"{name:<12}{s['plain']:>10.1f}{s['weights']:>11.1f}{p['weights']:>7.2f}x"
            f"{q['weights']:>12}{c['weights']:>7.2f}"
            f"{s['activations']:>10.1f}{p['activations']:>7.2f}x"
            f"{q['activations']:>12}{c['activations']:>7.2f}"
        )
        if "weights_vs_optimizer_built_in_step" in r:
            change = r["weights_vs_optimizer_built_in_step"]
            print(
                f"{'':<12}weights / {BUILT_IN_STEP}: {change['median']:.2f}x "
                f"(q1-q3 {change['q1']:.2f}-{change['q3']:.2f})"
            )
    default = "monitor" + ("" if args.size == "small" else f"-{args.size}")
    default += (f"-{args.threads}-thread" if args.threads else "") + ".json"
    write_results(
        args.out,
        default,
        {
            "method": "fits in threads taking turns epoch by epoch",
            "steps_per_epoch": args.steps,
            "rounds": args.rounds,
            "warmup_epochs": args.warmup,
            "size": args.size,
            "model_sizes": SIZE,
            "batch_size": BATCH,
            "threads": args.threads or "default",
            "targets": TARGETS,
            "devices": [d.device_type for d in tf.config.list_logical_devices()],
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
