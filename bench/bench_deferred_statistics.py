"""Would deferring the statistics pay? The eighth session's feasibility measurement for issue #4.

The design is built since the ninth session (`gradflow/monitor/deferred.py`,
measured as it is with `bench_monitor_step.py`'s `weights deferred`); this
bench keeps the prototype's figures reproducible.

    python3 bench/bench_deferred_statistics.py [--models lab,mlp5,mlp20] [--rounds 9] [--ring 64] [--out FILE]

Before, the compiled train step computed every statistic of every step
(`gradflow/monitor/step.py`): on small models most of its cost is the
dispatch of about 200 small ops a step. The alternative measured here: the
step only copies its weight gradients into a ring (`[ring, parameters]`, one
concat and one in-place scatter), and the statistics of `--ring` steps are
computed later in one call (`statistics._raw_sums` on each variable's
`[ring, entries]` block, so the op count is paid once per ring, not per step).

Times, per step, paired round by round against Keras's own step as in
`bench_monitor_step.py`:
- `weights`: today's recording (the monitor's default);
- `ring copy`: the step of the deferred design (gradients only: the update
  ratio, weight norms, clipping and activations would add their own copies);
- `deferred statistics`: the later call's time divided by the ring's steps.
The ring costs `ring x parameters x 4` bytes (and more for weights and
updates), so such a design would suit small models only.
Writes bench/results/deferred-statistics.json (or --out).
"""

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_monitor_step  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradflow import statistics as kernel  # noqa: E402
from gradflow.monitor import step as monitor_step  # noqa: E402


@contextlib.contextmanager
def patched(owner, name, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def ring_copy_step(name, ring_steps):
    """The monitor's step with its recording replaced by a copy of the gradients into a ring."""
    ring = {}

    def record(
        plan, when, step, loss, learning_rate, weight_gradients, activation_gradients, weights, **_
    ):
        flat = tf.concat([tf.reshape(g, [-1]) for g in weight_gradients], 0)
        if "variable" not in ring:
            with tf.init_scope():
                ring["variable"] = tf.Variable(
                    tf.zeros([ring_steps, flat.shape[0]]), trainable=False
                )
        slot = tf.cast(tf.math.floormod(step, ring_steps), tf.int32)
        # In place; `ring[slot].assign(...)` copied the whole ring every step (3.5 ms on the 20-layer MLP).
        ring["variable"].scatter_update(tf.IndexedSlices(flat[None], slot[None]))

    no_capture = classmethod(lambda cls, *args: None)
    with (
        patched(monitor_step._UpdateCapture, "for_step", no_capture),
        patched(monitor_step, "_record", record),
    ):
        return bench_monitor_step.compiled_step(name, {})


def deferred_ms(name, ring_steps, repeats=7, calls=20):
    """Time of the statistics of `ring_steps` steps computed in one call."""
    model = bench_monitor_step.build(name)[0]
    sizes = [v.shape.num_elements() for v in model.trainable_weights]
    ring = tf.random.normal([ring_steps, sum(sizes)])

    @tf.function
    def summarize_ring(ring):
        blocks = tf.split(ring, sizes, axis=1)
        return kernel._finish(tf.concat([kernel._raw_sums(block) for block in blocks], 0))

    summarize_ring(ring)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            summarize_ring(ring).numpy()
        best = min(best, (time.perf_counter() - start) / calls)
    return 1e3 * best, sum(sizes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lab,mlp5,mlp20")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ring", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    results = {}
    for name in args.models.split(","):
        steps = {
            "plain": bench_monitor_step.compiled_step(name, None),
            "weights": bench_monitor_step.compiled_step(name, {}),
            "ring copy": ring_copy_step(name, args.ring),
        }
        times = bench_monitor_step.paired_times(steps, args.rounds, args.steps)
        plain = statistics.median(times["plain"])
        extra = {
            v: 1e3 * bench_monitor_step.extra_over_plain(times, v) for v in ("weights", "ring copy")
        }
        ring_ms, parameters = deferred_ms(name, args.ring)
        results[name] = {
            "plain_ms": 1e3 * plain,
            "extra_ms": extra,
            "deferred_statistics_ms_per_step": ring_ms / args.ring,
            "parameters": parameters,
            "ring_mib": args.ring * parameters * 4 / 2**20,
        }
        print(
            f"{name:<6} plain {1e3 * plain:.3f} ms  weights {extra['weights']:+.3f} ms  "
            f"ring copy {extra['ring copy']:+.3f} ms  + deferred statistics {ring_ms / args.ring:.3f} ms/step "
            f"({parameters:,} parameters, ring {args.ring * parameters * 4 / 2**20:.1f} MiB)",
            flush=True,
        )

    out = pathlib.Path(
        args.out or pathlib.Path(__file__).resolve().parent / "results" / "deferred-statistics.json"
    )
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_deferred_statistics.py " + " ".join(sys.argv[1:]),
                "threads": 1,
                "ring": args.ring,
                "rounds": args.rounds,
                "steps": args.steps,
                "load_average_1min": os.getloadavg()[0],
                "cpus": os.cpu_count(),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
