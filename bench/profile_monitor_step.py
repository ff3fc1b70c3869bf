"""Where a monitored train step's time goes, op type by op type, against Keras's own step.

    python3 bench/profile_monitor_step.py [--models mlp20] [--size large] [--variant weights]
                                          [--steps 10] [--top 25] [--out FILE]

`bench_monitor_step.py` says how much the monitor adds to a step; this says
where. Each model's plain step and monitored step (`--variant`, one of
`bench_monitor_step.VARIANTS`) are built as there (one TensorFlow thread, one
fixed batch, warmed up there), then run `--steps` times under TensorFlow's profiler.
The trace's host plane is read back (the profiler's XSpace protobuf) and every
op's time is summed per op type, per step. The table shows the types whose
time differs most, with their counts, so a change in the recording block can
be told apart from a change in Keras's own ops (the twenty-first session found
Adam's `Square`, `Sub` and `Mul` 0.5-0.9 ms slower on the large 20-layer MLP
with the monitor: it reads the gradients after the statistics did).

The op times leave out the executor's own work between ops (about 1.7 us an
op here), so the wall-clock step time is printed too. Under the profiler a
step runs slower (a small model's 2.4 ms step took 3.2 ms), so read the table
for shares, not for absolute times. It sees large models only: on the small
ones (width 64) the trace held 12-36 op events a step out of hundreds, with
`host_tracer_level=3` too (twenty-first session).

Writes bench/results/profile-monitor-step.json (or --out): per model and
variant, the step's wall time and `{op type: [us per step, ops per step]}`.
"""

import argparse
import collections
import glob
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_monitor  # noqa: E402
import bench_monitor_step  # noqa: E402
import tensorflow as tf  # noqa: E402

# Events of the host plane that are not ops: the function call around the
# step, and the executor's own regions.
_NOT_OPS = ("Run", "Process", "Record", "StartRegion")


def op_times(logdir, steps):
    """`{op type: [us per step, ops per step]}` from the profiler's trace in `logdir`."""
    # The XSpace protobuf ships with TensorFlow (its TSL profiler); no
    # tensorboard plugin needed to read it.
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    space = xplane_pb2.XSpace()
    space.ParseFromString(pathlib.Path(path).read_bytes())
    times = collections.defaultdict(lambda: [0.0, 0.0])
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" not in name:
                    continue  # TensorFlow names op events "name:Type"
                kind = name.rsplit(":", 1)[1].strip()
                if kind in _NOT_OPS or kind.startswith("__inference"):
                    continue
                times[kind][0] += event.duration_ps / 1e6 / steps
                times[kind][1] += 1 / steps
    return dict(times)


def profile(step, batch, steps):
    """Wall ms per step (unprofiled, median of 5 runs) and the op table of a profiled run.

    `step` comes warmed up from `bench_monitor_step.compiled_step`.
    """
    walls = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            step(batch)
        walls.append((time.perf_counter() - start) / steps * 1e3)
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(steps):
            step(batch)
        tf.profiler.experimental.stop()
        return statistics.median(walls), op_times(logdir, steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp20")
    parser.add_argument("--size", choices=sorted(bench_monitor.SIZES), default="large")
    parser.add_argument("--variant", choices=sorted(bench_monitor_step.VARIANTS), default="weights")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--out",
        default=str(pathlib.Path(__file__).parent / "results" / "profile-monitor-step.json"),
    )
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    bench_monitor.SIZE = bench_monitor.SIZES[args.size]
    bench_monitor.BATCH = bench_monitor.SIZE["batch"]

    report = {"command": " ".join(["python3", *sys.argv]), "size": args.size, "models": {}}
    for name in args.models.split(","):
        results = {}
        for variant in ("plain", args.variant):
            step, batch = bench_monitor_step.compiled_step(
                name, bench_monitor_step.VARIANTS[variant]
            )
            wall, ops = profile(step, batch, args.steps)
            results[variant] = {"wall_ms": wall, "op_types": ops}
        plain, monitored = results["plain"], results[args.variant]
        report["models"][name] = results
        print(
            f"{name} ({args.size}): plain {plain['wall_ms']:.2f} ms, {args.variant} "
            f"{monitored['wall_ms']:.2f} ms a step (not profiled); "
            f"ops a step {sum(v[1] for v in plain['op_types'].values()):.0f} -> "
            f"{sum(v[1] for v in monitored['op_types'].values()):.0f}"
        )
        kinds = set(plain["op_types"]) | set(monitored["op_types"])

        def of(table, kind):
            return table["op_types"].get(kind, [0.0, 0.0])

        rows = sorted(kinds, key=lambda k: -abs(of(monitored, k)[0] - of(plain, k)[0]))
        print(f"  {'op type':30s} {'plain us':>10s} {'ops':>6s} {'monitored us':>13s} {'ops':>6s}")
        for kind in rows[: args.top]:
            (a, n), (b, m) = of(plain, kind), of(monitored, kind)
            print(f"  {kind:30s} {a:10.1f} {n:6.0f} {b:13.1f} {m:6.0f}")
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
