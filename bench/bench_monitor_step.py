"""The monitor's cost inside the compiled train step, without `fit` around it.

    python3 bench/bench_monitor_step.py [--models lab,mlp5,mlp20,cnn] [--threads 1]
                                        [--steps 200] [--rounds 15] [--baseline DIR] [--detail]
                                        [--out FILE]

`bench_monitor.py` measures what a user sees (steps/s of `model.fit`); on this
2-core VM one plain `fit` of a small model can run at half the speed of the
next, so its ratios move by +-0.1 between runs. This bench isolates the part
gradflow adds: Keras's own `train_step` and gradflow's instrumented one, each
in a `tf.function`, called on one fixed batch. Every round times `--steps`
calls of each variant back to back, and the cost of a variant is the median
over rounds of (its time - the plain step's time in the same round), so drifts
of the machine's speed cancel out.

Variants: `plain` (Keras), `weights` (the monitor's default), `weights
in-step` and `weights deferred` (the same with the path forced: statistics in
the step, or a copy into a ring summarized when read, which the monitor picks
for models of at most `deferred.MAX_PARAMETERS` parameters), `activations`
(`activations=True`; `activations in-step` forces the in-step path there
too) and `stop_on_nonfinite` (the lab runner's setting: the
update is skipped on a non-finite step). The monitored steps read their ring
as `fit` does, so the deferred path pays its read here too. `--detail`
adds the deferred path without its reads and with 2 and 4 MiB rings. Models: those of `bench_monitor.py`
(small size) and `lab`, the lab's default 4x32 MLP on digits with SGD.

`--baseline DIR` adds `baseline weights`, `baseline activations` and `baseline stop_on_nonfinite`:
the same steps built by the statistics kernel and train step of another
checkout (e.g. `git worktree add /tmp/base <commit>`), timed in the same
rounds, so a change is measured side by side in one process.
Each variant also reports the graph ops it adds to the step (constants and
identities not counted): a count that does not depend on the machine's load.
Writes bench/results/monitor-step.json (or --out).
"""

import argparse
import os
import pathlib
import statistics
import sys
import time
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_monitor  # noqa: E402
import tensorflow as tf  # noqa: E402

VARIANTS = {
    "plain": None,
    "weights": {},
    "weights in-step": {"path": "in-step"},
    "weights deferred": {"path": "deferred"},
    "activations": {"activations": True},
    "activations in-step": {"activations": True, "path": "in-step"},
    "stop_on_nonfinite": {"stop_on_nonfinite": True},
}
# `--detail`: where the deferred path's time goes (the step's copy against the
# read) and what a smaller ring would cost.
DETAIL_VARIANTS = {
    "deferred without reads": {"path": "deferred", "reads": False},
    "deferred, 2 MiB ring": {"path": "deferred", "ring_mib": 2},
    "deferred, 4 MiB ring": {"path": "deferred", "ring_mib": 4},
}


def build(name):
    if name != "lab":
        x, y = bench_monitor.data(name, 1)
        return bench_monitor.build(name), x, y
    from gradflow.lab.config import RunConfig
    from gradflow.lab.datasets import load_dataset
    from gradflow.lab.models import build_model

    config = RunConfig()
    dataset = load_dataset(config)
    return build_model(config, dataset), dataset.x_train[:32], dataset.y_train[:32]


def load_module(name, path, replace=()):
    """Import another checkout's source file as module `name`, after `(old, new)` text replacements."""
    source = path.read_text()
    for old, new in replace:
        source = source.replace(old, new)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def load_baseline(checkout):
    """The train-step module of another checkout, on top of its own statistics kernel."""
    root = pathlib.Path(checkout)
    load = load_module
    load("baseline_statistics", root / "gradflow" / "statistics.py")
    kernel = ("from gradflow.statistics import", "from baseline_statistics import")
    # The checkout's own deferred ring too (it came in the ninth session).
    # (Since the thirteenth session the same line imports `trace_gradients`,
    # which stays this checkout's.)
    # (Since the thirty-ninth, also `through_time`, which stays this checkout's too.)
    rings = [
        (
            "from gradflow.monitor import deferred, through_time, trace_gradients",
            "import baseline_deferred as deferred\n"
            "from gradflow.monitor import through_time, trace_gradients",
        ),
        (
            "from gradflow.monitor import deferred, trace_gradients",
            "import baseline_deferred as deferred\nfrom gradflow.monitor import trace_gradients",
        ),
        ("from gradflow.monitor import deferred", "import baseline_deferred as deferred"),
    ]
    if (root / "gradflow" / "monitor" / "deferred.py").exists():
        load("baseline_deferred", root / "gradflow" / "monitor" / "deferred.py", [kernel])
    return load("baseline_step", root / "gradflow" / "monitor" / "step.py", [kernel, *rings])


class MonitoredStep:
    """The instrumented step, called like a `tf.function`, with the monitor's ring reads.

    It reads the ring when `GradientMonitor` does in `fit`: once the ring is
    full or 0.2 s after the last read. So a path that leaves work for the
    read (the deferred statistics of small models) pays it here too.
    """

    def __init__(self, function, plan, reads=True):
        self.function, self.plan, self.reads = function, plan, reads
        self.since_read, self.last_step = 0, 0
        self.last_read = time.monotonic()

    def __call__(self, batch):
        logs = self.function(batch)
        self.since_read += 1
        due = self.since_read >= self.plan.capacity or time.monotonic() - self.last_read >= 0.2
        if self.reads and due:
            self.read()
        return logs

    def read(self):
        steps = self.plan.buffer.read(self.last_step)[0]
        if len(steps):
            self.last_step = int(steps[-1])
        self.since_read, self.last_read = 0, time.monotonic()

    @property
    def path(self):
        return "deferred" if getattr(self.plan, "deferred", False) else "in-step"


def compiled_step(name, options, step_module=None):
    if step_module is None:
        from gradflow.monitor import step as step_module
    StepPlan, instrumented_train_step = step_module.StepPlan, step_module.instrumented_train_step

    model, x, y = build(name)
    batch = (tf.constant(x), tf.constant(y))
    # Traced as `fit` traces it: the batch dimension unknown (Keras's
    # datasets keep a last batch that may be smaller), so layer outputs have
    # an unknown first dimension, which matters to the activations' kernel.
    signature = [tuple(tf.TensorSpec([None, *t.shape[1:]], t.dtype) for t in batch)]
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # builds the optimizer
    if options is None:
        step = tf.function(model.train_step, input_signature=signature)
    else:
        plan = StepPlan(
            model,
            capacity=64,  # the callback's ring, one step per execution
            activations=options.get("activations", False),
            every=1,
            histograms=False,
            stop_on_nonfinite=options.get("stop_on_nonfinite", False),
        )
        # Which path the step takes: the monitor's own choice, or one forced.
        deferred = getattr(step_module, "deferred", None)
        if deferred is None:
            from gradflow.monitor import deferred

        limit = {"in-step": 0, "deferred": 2**62}.get(options.get("path"), deferred.MAX_PARAMETERS)
        ring_bytes = options.get("ring_mib", deferred.RING_BYTES / 2**20) * 2**20
        saved = deferred.MAX_PARAMETERS, deferred.RING_BYTES
        deferred.MAX_PARAMETERS, deferred.RING_BYTES = limit, int(ring_bytes)
        try:
            plan.prepare(model.trainable_weights)
        finally:
            deferred.MAX_PARAMETERS, deferred.RING_BYTES = saved
        function = tf.function(instrumented_train_step(plan), input_signature=signature)
        step = MonitoredStep(function, plan, reads=options.get("reads", True))
    for _ in range(20):  # trace and warm up
        step(batch)
    if options is not None:  # the first read runs eagerly, the second traces the compiled one
        step.read()
        step(batch)
        step.read()
    return step, batch


def paired_times(steps, rounds, calls):
    """Seconds per call of each `(step, batch)`, round by round: `{variant: [one per round]}`.

    Every round times `calls` calls of each variant back to back, so a drift
    of the machine's speed hits all variants of a round alike.
    """
    times = {variant: [] for variant in steps}
    for _ in range(rounds):
        for variant, (step, batch) in steps.items():
            start = time.perf_counter()
            for _ in range(calls):
                logs = step(batch)
            float(logs["loss"])  # wait for the last step
            times[variant].append((time.perf_counter() - start) / calls)
    return times


def extra_over_plain(times, variant):
    """Median over rounds of the variant's time less the plain step's in the same round."""
    return statistics.median(t - p for t, p in zip(times[variant], times["plain"], strict=True))


def graph_ops(step, batch):
    """Ops in the traced step and the functions it calls, constants and identities not counted."""
    step = getattr(step, "function", step)
    graph = step.get_concrete_function(batch).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sum(n.op not in ("Const", "Identity", "NoOp") for n in nodes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lab,mlp5,mlp20,cnn")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads (0: default)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--size",
        choices=sorted(bench_monitor.SIZES),
        default="small",
        help="the models' size, as in bench_monitor.py (the lab's model has one size)",
    )
    parser.add_argument("--baseline", default=None, help="another checkout to compare with")
    parser.add_argument(
        "--detail",
        action="store_true",
        help="also the deferred path without its reads, and with 2 and 4 MiB rings",
    )
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    bench_monitor.SIZE = bench_monitor.SIZES[args.size]
    bench_monitor.BATCH = bench_monitor.SIZE["batch"]
    baseline = load_baseline(args.baseline) if args.baseline else None
    results = {}
    for name in args.models.split(","):
        variants = {**VARIANTS, **(DETAIL_VARIANTS if args.detail else {})}
        steps = {v: compiled_step(name, options) for v, options in variants.items()}
        if baseline is not None:
            for variant in ("weights", "activations", "stop_on_nonfinite"):
                steps[f"baseline {variant}"] = compiled_step(name, VARIANTS[variant], baseline)
        times = paired_times(steps, args.rounds, args.steps)
        plain = statistics.median(times["plain"])
        extra = {v: extra_over_plain(times, v) for v in steps if v != "plain"}
        ops = {v: graph_ops(step, batch) for v, (step, batch) in steps.items()}
        results[name] = {
            "plain_ms": 1e3 * plain,
            "extra_ms": {v: 1e3 * e for v, e in extra.items()},
            "ratio": {v: plain / (plain + e) for v, e in extra.items()},
            "extra_graph_ops": {v: ops[v] - ops["plain"] for v in extra},
            "path": {v: steps[v][0].path for v in extra},
        }
        row = " ".join(
            f"{v} {1e3 * e:+.3f} ms ({plain / (plain + e):.2f}x, +{ops[v] - ops['plain']} ops,"
            f" {steps[v][0].path})"
            for v, e in extra.items()
        )
        print(f"{name:<6} plain {1e3 * plain:.3f} ms  {row}", flush=True)

    bench_monitor.write_results(
        args.out,
        "monitor-step.json",
        {
            "threads": args.threads or "default",
            "baseline": args.baseline,
            "size": args.size,
            "steps": args.steps,
            "rounds": args.rounds,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
