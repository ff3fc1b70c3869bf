"""Writing one step into a ring variable: the two scatters TensorFlow offers, side by side.

    python3 bench/bench_ring_write.py [--models lab,mlp5,mlp20] [--rounds 7] [--calls 500]
                                      [--out FILE]

Every recorded step writes into a ring variable inside the train step
(`gradflow/monitor/buffer.py: _write_slot`); on the deferred path that slot
holds the step's gradients and weights, so its size follows the model's
(the lab's MLP 45 KB, the 5-layer MLP 120 KB, the 20-layer MLP 620 KB). This
bench times a compiled function that writes one slot of that size, by
`scatter_nd_update` (what the ring used until the thirtieth session) and by
`scatter_update` along the first axis (what it uses now), against the same
function without the write, on one TensorFlow thread, in interleaved rounds.
Reports the median extra ms per write. Writes bench/results/ring-write.json
(or --out).
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

import bench_monitor_step  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradflow.monitor import deferred  # noqa: E402


def slot_width(name):
    """Floats in one deferred slot of `name`'s model (gradients, weights, loss, learning rate)."""
    model = bench_monitor_step.build(name)[0]
    return 2 * sum(int(tf.size(v)) for v in model.trainable_variables) + 2


def writers(width):
    """`{name: compiled function}`: no write, `scatter_nd_update`, `scatter_update`."""
    capacity = max(2, deferred.RING_BYTES // (4 * width))
    ring = tf.Variable(tf.zeros([capacity, width]))
    step = tf.Variable(0, dtype=tf.int64)

    def slot():
        step.assign_add(1)
        return tf.math.floormod(step, capacity)

    @tf.function
    def nothing(value):
        slot()

    @tf.function
    def scatter_nd(value):
        ring.scatter_nd_update(tf.reshape(slot(), [1, 1]), value[tf.newaxis])

    @tf.function
    def scatter(value):
        ring.scatter_update(tf.IndexedSlices(value[tf.newaxis], tf.reshape(slot(), [1])))

    return {"no write": nothing, "scatter_nd_update": scatter_nd, "scatter_update": scatter}


def measure(width, rounds, calls):
    """Median ms per call of each writer, in interleaved rounds."""
    value = tf.random.normal([width])
    functions = writers(width)
    for function in functions.values():
        function(value)  # trace
    times = {name: [] for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            start = time.perf_counter()
            for _ in range(calls):
                function(value)
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(ms) for name, ms in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lab,mlp5,mlp20")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    results = {}
    for name in args.models.split(","):
        width = slot_width(name)
        ms = measure(width, args.rounds, args.calls)
        extra = {k: v - ms["no write"] for k, v in ms.items() if k != "no write"}
        results[name] = {"slot_kb": 4 * width / 1e3, "ms": ms, "extra_ms": extra}
        print(
            f"{name:6} slot {4 * width / 1e3:6.0f} KB  "
            + "  ".join(f"{k} +{v:.3f} ms" for k, v in extra.items())
        )
    out = pathlib.Path(args.out or pathlib.Path(__file__).parent / "results" / "ring-write.json")
    out.write_text(
        json.dumps({"rounds": args.rounds, "calls": args.calls, "models": results}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
