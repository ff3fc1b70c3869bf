"""The statistics kernel: per-tensor reductions against the earlier segment-op design.

    python3 bench/bench_statistics.py [--repeats 7]

Both compute the same six statistics for every weight gradient of an MLP
inside one `tf.function`. `segment` flattens all tensors into one vector and
reduces with (sorted) segment ops, so its op count does not grow with depth;
`summarize` (gradflow's kernel) reduces each tensor on its own. Timed
interleaved, CPU time per call, medians. Writes bench/results/statistics.json.
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

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from gradflow.statistics import summarize  # noqa: E402


def segment_summarize(tensors):
    """The previous kernel: one flat vector, sorted segment sums (kept here as the baseline)."""
    flats = [tf.reshape(t, [-1]) for t in tensors]
    sizes = tf.stack([tf.size(f) for f in flats])
    values = tf.concat(flats, 0)
    ids = tf.repeat(tf.range(len(flats)), sizes)
    count = tf.maximum(tf.cast(sizes, tf.float32), 1.0)
    magnitude = tf.abs(values)
    sums = tf.math.segment_sum(
        tf.stack(
            [
                tf.square(values),
                magnitude,
                values,
                tf.cast(tf.equal(values, 0.0), tf.float32),
                tf.cast(tf.logical_not(tf.math.is_finite(values)), tf.float32),
            ],
            1,
        ),
        ids,
    )
    square_sum, abs_sum, value_sum, zeros, nonfinite = tf.unstack(sums, axis=1)
    centered = values - tf.gather(value_sum / count, ids)
    deviation = tf.math.segment_sum(tf.stack([tf.square(centered), centered], 1), ids)
    variance = (deviation[:, 0] - tf.square(deviation[:, 1]) / count) / count
    return tf.stack(
        [
            tf.math.segment_max(magnitude, ids),
            tf.sqrt(square_sum),
            abs_sum / count,
            tf.sqrt(tf.maximum(variance, 0.0)),
            zeros / count,
            nonfinite,
        ],
        1,
    )


def mlp_shapes(depth, width=64):
    shapes = [(32, width), (width,)]
    for _ in range(depth - 2):
        shapes += [(width, width), (width,)]
    return shapes + [(width, 10), (10,)]


def cpu_ms(function, calls=200):
    start = time.process_time()
    for _ in range(calls):
        function()
    return (time.process_time() - start) / calls * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = {
        "command": f"python3 bench/bench_statistics.py --repeats {args.repeats}",
        "load_average": os.getloadavg(),
        "results": {},
    }
    for depth in (5, 20, 100):
        tensors = [tf.random.normal(s) for s in mlp_shapes(depth)]
        variants = {
            "summarize": tf.function(lambda t=tensors: summarize(t)[0]),
            "segment": tf.function(lambda t=tensors: segment_summarize(t)),
            "empty_call": tf.function(lambda t=tensors: t[0][0, 0]),
        }
        np.testing.assert_allclose(
            variants["summarize"]().numpy(), variants["segment"]().numpy(), rtol=1e-4, atol=1e-5
        )
        for function in variants.values():
            function()
        times = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, function in variants.items():
                times[name].append(cpu_ms(function))
        medians = {name: statistics.median(values) for name, values in times.items()}
        medians["segment_over_summarize"] = medians["segment"] / medians["summarize"]
        results["results"][f"mlp{depth}"] = medians
        print(
            f"mlp{depth:<4} summarize {medians['summarize']:.3f} ms  segment {medians['segment']:.3f} ms  "
            f"(empty tf.function call {medians['empty_call']:.3f} ms)  segment/summarize "
            f"{medians['segment_over_summarize']:.2f}x"
        )
    out = pathlib.Path(__file__).resolve().parent / "results" / "statistics.json"
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
