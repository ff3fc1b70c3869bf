"""What `GradientMonitor(through_time=True)` costs: the lab's recurrent presets, side by side.

    python3 bench/bench_through_time.py [--steps 60] [--rounds 9] [--out FILE]

The SimpleRNN and LSTM of the adding-problem presets (`rnn_simple`,
`rnn_lstm`: 30 time steps, width 32, batch 32), each trained three ways in
turns, epoch by epoch, with `bench_monitor.py`'s `Turns` (plain `fit`; with
`GradientMonitor()`; with `GradientMonitor(through_time=True)`, which the lab
turns on for every recurrent run). Through time costs a second backward
pass, from the outputs to the input sequence, at every step.

Reports per model the median over rounds of each round's steps/s ratio to
the plain epoch of the same round. Writes bench/results/through_time.json.
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import bench_monitor  # noqa: E402

from gradflow.lab.datasets import load_dataset  # noqa: E402
from gradflow.lab.models import build_model  # noqa: E402
from gradflow.lab.presets import get_preset  # noqa: E402
from gradflow.monitor import GradientMonitor  # noqa: E402

VARIANTS = {
    "plain": lambda: [],
    "weights": lambda: [GradientMonitor()],
    "through_time": lambda: [GradientMonitor(through_time=True)],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch (one turn)")
    parser.add_argument("--rounds", type=int, default=9, help="timed epochs of each variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first epochs (tracing)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bench_monitor.VARIANTS = VARIANTS
    bench_monitor.MONITORED = ["weights", "through_time"]
    results = {}
    for preset in ("rnn_simple", "rnn_lstm"):
        config = get_preset(preset).config
        data = load_dataset(config)
        bench_monitor.BATCH = config.batch_size
        count = args.steps * config.batch_size
        x, y = data.x_train[:count], data.y_train[:count]
        steps = len(x) // config.batch_size
        models = {variant: build_model(config, data) for variant in VARIANTS}
        epochs = bench_monitor.measure_in_turns(models, x, y, args.warmup + args.rounds)
        timed = {v: epochs[v][0][args.warmup :] for v in VARIANTS}
        results[preset] = bench_monitor.summarize(
            {v: [steps / t for t in timed[v]] for v in VARIANTS}
        )
        results[preset]["steps_per_epoch"] = steps
    print(
        f"{'preset':<12}{'plain/s':>9}{'weights':>9}{'through time':>14}{'through time / weights':>24}"
    )
    for preset, r in results.items():
        s, p = r["steps_per_second"], r["paired_ratio_median"]
        print(
            f"{preset:<12}{s['plain']:>9.1f}{p['weights']:>8.2f}x{p['through_time']:>13.2f}x"
            f"{p['through_time'] / p['weights']:>23.2f}x"
        )
    bench_monitor.write_results(
        args.out,
        "through_time.json",
        {
            "method": "fits in threads taking turns epoch by epoch (bench_monitor.Turns)",
            "rounds": args.rounds,
            "warmup_epochs": args.warmup,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
