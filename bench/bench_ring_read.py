"""The deferred ring's read: one compiled call that summarizes the steps a small model recorded.

    python3 bench/bench_ring_read.py [--models lab,mlp5,mlp20,cnn] [--rounds 15]
                                     [--baseline DIR] [--out FILE]
    python3 bench/bench_ring_read.py --first-reads [--steps-per-read 45] [--rounds 3]

On the deferred path (`gradflow/monitor/deferred.py`) the train step only
copies its gradients and weights into a ring; `GradientMonitor` reads the
ring when it is full, 0.2 s after the last read or at the end of an epoch,
and that read computes every statistic of the new steps. This bench times the
read of a full ring (as many steps as the monitor's ring holds for the model,
filled with random gradients and weights), on one TensorFlow thread, outside
`fit`: no training step runs in between, so the figure moves far less than
those of `bench_monitor.py` or `bench_monitor_step.py` on this VM.

`--baseline DIR` also times the read of another checkout's `deferred.py` and
statistics kernel (e.g. `git worktree add /tmp/base <commit>`) on the same ring contents, in the same
rounds, alternating with this checkout's: a change to the read is measured
side by side in one process. Reports the median over rounds, in ms per read
and per recorded step, and checks that both reads return the same rows.
Writes bench/results/ring-read.json (or --out).

`--first-reads` measures what decides whether a run compiles its read at all
(`deferred.COMPILE_WHEN_SECONDS_LEFT`): on a fresh ring per round, holding
`--steps-per-read` steps (45: one epoch of digits at batch 32, when the
monitor reads at the epoch's end), the first read (in NumPy), later reads in
NumPy, the same read op by op in TensorFlow (what a ring with histograms
does), the compiled read's trace and first call, and later compiled reads;
then how many reads the compile costs (compile / (NumPy or op by op -
compiled)).
Writes bench/results/ring-first-reads.json (or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_monitor  # noqa: E402
import bench_monitor_step  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradflow.monitor import deferred  # noqa: E402


def load_deferred(checkout):
    """Another checkout's `gradflow/monitor/deferred.py`, on its own statistics kernel
    and this checkout's buffer."""
    root = pathlib.Path(checkout) / "gradflow"
    load = bench_monitor_step.load_module
    load("baseline_statistics", root / "statistics.py")
    kernel = ("from gradflow.statistics import", "from baseline_statistics import")
    return load("baseline_deferred", root / "monitor" / "deferred.py", [kernel])


def full_ring(module, variables, capacity, seed):
    """A ring of `module` holding `capacity` steps of random gradients and weights."""
    ring = module.DeferredRing(variables, capacity)
    rng = np.random.default_rng(seed)
    ring.raw.assign(rng.normal(size=ring.raw.shape).astype(np.float32))
    ring.steps.assign(np.arange(1, capacity + 2, dtype=np.int64))
    return ring


def timed_read(ring):
    start = time.perf_counter()
    steps, stats, metrics, _ = ring.read(0)
    return time.perf_counter() - start, stats


def seconds(read):
    start = time.perf_counter()
    read()
    return time.perf_counter() - start


def first_reads(variables, steps_per_read, rounds):
    """Seconds of each kind of read on fresh rings holding `steps_per_read` steps, medians."""
    capacity = deferred.ring_capacity(variables, 64)
    kinds = ("first", "numpy", "op_by_op", "compile", "compiled")
    times = {kind: [] for kind in kinds}
    for seed in range(rounds):
        ring = full_ring(deferred, variables, capacity, seed)
        steps = np.zeros(capacity + 1, np.int64)
        steps[:steps_per_read] = np.arange(1, steps_per_read + 1)
        ring.steps.assign(steps)
        slots = tf.constant(np.arange(steps_per_read), tf.int32)

        def op_by_op(ring=ring, slots=slots):
            return [t.numpy() for t in ring._summarize_slots(slots) if t is not None]

        # final_step=0: no steps left, so the ring never compiles and reads
        # in NumPy (no histograms here).
        times["first"].append(seconds(lambda ring=ring: ring.read(0, final_step=0)))
        times["numpy"].extend(
            seconds(lambda ring=ring: ring.read(0, final_step=0)) for _ in range(3)
        )
        assert not ring.compiled
        times["op_by_op"].extend(seconds(op_by_op) for _ in range(3))
        ring.compiled = True
        times["compile"].append(seconds(lambda ring=ring: ring.read(0)))
        times["compiled"].extend(seconds(lambda ring=ring: ring.read(0)) for _ in range(3))
    medians = {kind: statistics.median(t) for kind, t in times.items()}

    def repaid_by(kind):
        return medians["compile"] / max(medians[kind] - medians["compiled"], 1e-9)

    return {
        "steps_per_read": steps_per_read,
        "ms": {kind: 1e3 * m for kind, m in medians.items()},
        "compile_costs_numpy_reads": repaid_by("numpy"),
        "compile_costs_op_by_op_reads": repaid_by("op_by_op"),
        "all_ms": {kind: [1e3 * t for t in ts] for kind, ts in times.items()},
    }


def main_first_reads(args):
    results = {}
    for name in args.models.split(","):
        variables = bench_monitor_step.build(name)[0].trainable_weights
        results[name] = first_reads(variables, args.steps_per_read, args.rounds)
        ms = results[name]["ms"]
        print(
            f"{name:<6} {args.steps_per_read} steps a read: first {ms['first']:.1f} ms, "
            f"NumPy {ms['numpy']:.1f} ms, op by op {ms['op_by_op']:.1f} ms, "
            f"compile {ms['compile']:.0f} ms, compiled {ms['compiled']:.2f} ms: the compile "
            f"costs {results[name]['compile_costs_numpy_reads']:.0f} NumPy reads, "
            f"{results[name]['compile_costs_op_by_op_reads']:.0f} op by op"
        )
    return results, "ring-first-reads.json"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lab,mlp5,mlp20,cnn")
    parser.add_argument("--rounds", type=int, default=None, help="15, or 3 with --first-reads")
    parser.add_argument("--baseline", default=None, help="another checkout to compare with")
    parser.add_argument("--first-reads", action="store_true", help="what compiling the read costs")
    parser.add_argument("--steps-per-read", type=int, default=45)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.first_reads:
        args.rounds = args.rounds or 3
        results, default_out = main_first_reads(args)
    else:
        args.rounds = args.rounds or 15
        results, default_out = main_full_rings(args)
    out = pathlib.Path(
        args.out or pathlib.Path(__file__).resolve().parent / "results" / default_out
    )
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_ring_read.py " + " ".join(sys.argv[1:]),
                "rounds": args.rounds,
                "threads": 1,
                "baseline": args.baseline,
                **bench_monitor.machine_facts(),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


def main_full_rings(args):
    modules = {"read": deferred}
    if args.baseline:
        modules["baseline read"] = load_deferred(args.baseline)

    results = {}
    for name in args.models.split(","):
        model = bench_monitor_step.build(name)[0]
        variables = model.trainable_weights
        # The ring the monitor gives this model, the deferred path forced for
        # models above its size limit (the 20-layer MLP).
        capacity = deferred.ring_capacity(variables, 64)
        rings = {
            label: full_ring(module, variables, capacity, 0) for label, module in modules.items()
        }
        times = {label: [] for label in rings}
        outputs = {}
        for label, ring in rings.items():  # first read (not compiled), then the compiled one traced
            timed_read(ring)
            ring.compiled = True
            outputs[label] = timed_read(ring)[1]
        for _ in range(args.rounds):
            for label, ring in rings.items():
                times[label].append(timed_read(ring)[0])
        same = all(
            np.allclose(outputs["read"], other, rtol=1e-5, atol=1e-6, equal_nan=True)
            for other in outputs.values()
        )
        medians = {label: statistics.median(t) for label, t in times.items()}
        results[name] = {
            "parameters": int(sum(np.prod(v.shape) for v in variables)),
            "steps_per_read": capacity,
            "ms_per_read": {label: 1e3 * m for label, m in medians.items()},
            "ms_per_step": {label: 1e3 * m / capacity for label, m in medians.items()},
            "all_ms_per_read": {label: [1e3 * t for t in ts] for label, ts in times.items()},
            "same_rows": bool(same),
        }
        line = "  ".join(f"{label} {1e3 * m:.2f} ms" for label, m in medians.items())
        print(f"{name:<6} {capacity:>4} steps  {line}  same rows: {same}")
    return results, "ring-read.json"


if __name__ == "__main__":
    main()
