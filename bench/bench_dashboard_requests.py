"""What the dashboard's Pause/Stop cost a script's run: `DashboardRequests.check` per step.

    python3 bench/bench_dashboard_requests.py [--rounds 15] [--steps 200] [--out FILE]

A run a script records into a store (`GradientMonitor(store=...)`,
`GradientLog(store=...)`) looks at the store for the Live page's requests
after every step, at most every `remote.POLL_SECONDS` seconds. Measured:

- `check()` alone: between two looks (most steps), and when it reads the
  store (a `SELECT` on the requests table), in microseconds;
- steps/s of `fit` on a 5-layer MLP with a monitor writing to a store, with
  the check as it is and with it replaced by a no-op, alternating round by
  round (the same model, the same batches) so both share the drift of this
  noisy VM. Reports the median of each round's ratio and its quartiles.

Writes bench/results/dashboard-requests.json (or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import gradflow  # noqa: E402
from gradflow.monitor import remote  # noqa: E402
from gradflow.store import RunStore  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def check_costs(folder):
    store = RunStore(pathlib.Path(folder) / "check.db")
    run_id = store.create_run({}, name="check", source="monitor")
    between = remote.DashboardRequests(store, run_id)
    between.check()  # the first looks; the next ones wait POLL_SECONDS
    n = 200_000
    between_us = timeit.timeit(between.check, number=n) / n * 1e6
    reading = remote.DashboardRequests(store, run_id, poll_interval=0.0)
    n = 2_000
    read_us = timeit.timeit(reading.check, number=n) / n * 1e6
    return between_us, read_us


def fit_rate(model, x, y, monitor, steps, checked):
    # One monitor for every fit: its run trains on, and its step is reused, not traced again.
    original = remote.DashboardRequests.check
    if not checked:
        remote.DashboardRequests.check = lambda self: None
    try:
        start = time.perf_counter()
        model.fit(
            x, y, batch_size=32, epochs=1, steps_per_epoch=steps, callbacks=[monitor], verbose=0
        )
        return steps / (time.perf_counter() - start)
    finally:
        remote.DashboardRequests.check = original


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(RESULTS / "dashboard-requests.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        between_us, read_us = check_costs(folder)
        print(f"check(): {between_us:.2f} us between looks, {read_us:.1f} us with a store read")
        keras.utils.set_random_seed(0)
        layers = [keras.Input((64,))]
        layers += [keras.layers.Dense(64, activation="relu") for _ in range(4)]
        model = keras.Sequential([*layers, keras.layers.Dense(10)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32 * args.steps, 64)).astype("float32")
        y = rng.integers(0, 10, size=32 * args.steps)
        monitor = gradflow.GradientMonitor(
            store=RunStore(pathlib.Path(folder) / "runs.db"), run_name="bench"
        )
        fit_rate(model, x, y, monitor, 20, True)  # tracing, not timed
        ratios, rates = [], {"checked": [], "no-op": []}
        for round_ in range(args.rounds):
            # Alternate which goes first: neither always meets a warmer cache.
            order = (True, False) if round_ % 2 == 0 else (False, True)
            got = {
                checked: fit_rate(model, x, y, monitor, args.steps, checked) for checked in order
            }
            rates["checked"].append(got[True])
            rates["no-op"].append(got[False])
            ratios.append(got[True] / got[False])
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    result = {
        "command": "python3 bench/bench_dashboard_requests.py "
        f"--rounds {args.rounds} --steps {args.steps}",
        "check_between_looks_us": round(between_us, 3),
        "check_with_a_store_read_us": round(read_us, 2),
        "poll_seconds": remote.POLL_SECONDS,
        "fit_steps_per_s_median": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "ratio_checked_to_noop": {
            "median": round(median, 3),
            "q1": round(q1, 3),
            "q3": round(q3, 3),
        },
    }
    print(json.dumps(result, indent=2))
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
