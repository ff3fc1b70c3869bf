"""Python time per training batch in the lab's callbacks, around Keras's own hook.

    python3 bench/bench_batch_callbacks.py [--steps 3000] [--checkout DIR]

Trains one lab run (the default 4x32 MLP on digits, one TF thread) with the
worker's recipe (`gradflow.lab.worker.execute`: GradientMonitor with
`stop_on_nonfinite`, FirstStepPublisher, RunControl) and times, per batch,
Keras's `CallbackList.on_train_batch_end` (which turns the logs into floats
and calls every callback) and GradientMonitor's own hook. Whole-`fit` ratios
on this VM move by +-0.1 from run to run; these hooks are timed call by call,
so a change to them can be compared across checkouts: `--checkout DIR` runs
the gradflow of another checkout (e.g. `git worktree add /tmp/base <commit>`).
Prints mean and median microseconds per call.
"""

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def timed(cls, name, samples):
    """Wrap `cls.name` to append its duration (seconds) to `samples[label]`."""
    original = getattr(cls, name)
    label = f"{cls.__name__}.{name}"
    samples[label] = []

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            samples[label].append(time.perf_counter() - start)

    setattr(cls, name, wrapper)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--checkout", default=str(pathlib.Path(__file__).resolve().parent.parent))
    args = parser.parse_args()
    sys.path.insert(0, str(pathlib.Path(args.checkout).resolve()))

    from keras.src.callbacks.callback_list import CallbackList

    from gradflow.lab import worker
    from gradflow.lab.config import RunConfig
    from gradflow.monitor.callback import GradientMonitor
    from gradflow.store import RunStore

    worker._limit_threads(1)
    samples = {}
    timed(CallbackList, "on_train_batch_end", samples)
    timed(GradientMonitor, "on_train_batch_end", samples)
    with tempfile.TemporaryDirectory() as folder:
        store = RunStore(pathlib.Path(folder) / "runs.db")
        run_id = store.create_run(
            RunConfig(steps=args.steps).to_dict(), source="lab", status="running"
        )
        worker.execute(store, run_id)
    print(f"gradflow from {args.checkout}, {args.steps} steps")
    for label, values in samples.items():
        print(
            f"{label:40s} {len(values):6d} calls  mean {statistics.mean(values) * 1e6:7.1f} us"
            f"  median {statistics.median(values) * 1e6:7.1f} us"
        )


if __name__ == "__main__":
    main()
