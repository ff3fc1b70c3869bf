"""`fit` called again and again with a GradientMonitor: seconds a call.

    python3 bench/bench_refit.py [--fits 8] [--steps 20] [--model mlp5] [--root DIR] [--out FILE]

Users call `fit` in loops (an epoch at a time, a notebook cell run again). The
monitor's instrumented train step used to be traced anew at every `fit`; a
later `fit` now reuses the step the model's last monitored `fit` traced when
nothing it depends on changed (`GradientMonitor._reuse_last_step`). This
times `--fits` calls of `fit` (one epoch of `--steps` steps, `--model` of
`bench_monitor.py`, small size) for: a plain `fit`, the same monitor each
time, and a new `GradientMonitor()` each time. The first call (tracing) is
reported apart; the others as their median, and the last quarter's median
apart (a monitor given to many fits keeps a growing history: until the
thirtieth session each `fit`'s end ran the diagnosis rules over all of it,
so later fits took longer). `--root DIR` imports gradflow
from another checkout (e.g. `git worktree add /tmp/base <commit>`), to
compare with the code before the change in the same hour.
Writes bench/results/refit.json (or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = pathlib.Path(__file__).resolve().parent


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fits", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="mlp5", choices=["mlp5", "mlp20", "cnn"])
    parser.add_argument("--root", default=str(HERE.parent), help="the checkout to import")
    parser.add_argument("--out", default=str(HERE / "results" / "refit.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(pathlib.Path(args.root).resolve()))
    # gradflow first: `bench_monitor` puts this checkout first on the path.
    import tensorflow as tf

    import gradflow.monitor

    sys.path.insert(0, str(HERE))
    import bench_monitor

    GradientMonitor = gradflow.monitor.GradientMonitor
    print(f"gradflow from {pathlib.Path(gradflow.__file__).parent}")

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    x, y = bench_monitor.data(args.model, args.steps)
    results = {}
    for variant in ("plain fit", "the same monitor each fit", "a new monitor each fit"):
        model = bench_monitor.build(args.model)
        monitor = GradientMonitor()
        seconds = []
        for _ in range(args.fits):
            callbacks = {
                "plain fit": [],
                "the same monitor each fit": [monitor],
                "a new monitor each fit": [GradientMonitor()],
            }[variant]
            start = time.perf_counter()
            model.fit(
                x, y, batch_size=bench_monitor.BATCH, epochs=1, verbose=0, callbacks=callbacks
            )
            seconds.append(time.perf_counter() - start)
        last = seconds[-max(1, (args.fits - 1) // 4) :]
        results[variant] = {
            "first_fit_s": round(seconds[0], 3),
            "later_fits_median_s": round(statistics.median(seconds[1:]), 3),
            "last_quarter_median_s": round(statistics.median(last), 3),
            "all_s": [round(s, 3) for s in seconds],
        }
        print(
            f"{variant:28s} first {seconds[0]:.3f} s, later median "
            f"{statistics.median(seconds[1:]):.3f} s, last quarter {statistics.median(last):.3f} s"
        )
    result = {
        "command": "python3 bench/bench_refit.py " + " ".join(sys.argv[1:]),
        "root": str(pathlib.Path(args.root).resolve()),
        "model": args.model,
        "steps_per_fit": args.steps,
        "fits": args.fits,
        "load_average_1min": os.getloadavg()[0],
        "results": results,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
