"""Runner speed: start request -> first recorded step, and training steps/s.

    python3 bench/bench_runner.py [--repeats 3] [--steps 600]

Measures, interleaved and reported as medians:
- start latency: `RunManager.start()` until the first statistics row can be
  read from the store, with a pre-warmed worker (target <= 2 s) and cold;
- training speed of the default lab model (4 x 32 ReLU MLP on digits, batch
  32, one TF thread): inside the runner (GradientMonitor + RunControl +
  store) against the same plain `model.fit` in a bare script (target >=
  0.9x). Both feed `fit` the lab's input pipelines (`gradflow.lab.batches`);
  the runner also runs several steps per call of the compiled function
  (`steps_per_execution`, 5 for the default run), a plain fit one, so a
  fourth bare fit takes the runner's steps per call
  (`runner_vs_bare_fit_runner_steps_per_call`: what the monitor, the
  control and the store cost beyond that choice); a third bare fit is given the
  arrays, as a user's own script would (Keras then makes its batches anew
  every epoch, which made that fit about half as fast on this model), and
  `runner_vs_bare_fit_from_arrays` compares the runner with it;
  also the runner's speed once the manager's next spare worker, started
  beside the run, is warm (its TensorFlow import shares the cores until
  then; needs a run long enough, e.g. `--steps 10000`). With reused
  workers (the library's default, `runs_per_worker=25`) no spare is
  started while the one slot is busy, so that figure is absent; and
  the bare script with only GradientMonitor writing to a store, with the
  runner's steps per call and `stop_on_nonfinite=True` as the worker has
  them, which separates the monitor's own cost from the runner's. Each speed also comes
  as CPU ms per step of the training process, every thread counted (the
  worker's from /proc), over the same steps, and `runner_vs_bare_fit_cpu`
  is the target's ratio taken from it. On this VM wall-clock speed moves by
  10-20% from one fit to the next; CPU time was added in the hope that it
  moves less, but in its first run it moved as much (the bare fit 2.4-3.1
  ms a step between repetitions).
Writes bench/results/runner.json.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gradflow.lab.config import RunConfig  # noqa: E402
from gradflow.lab.runner import RunManager  # noqa: E402
from gradflow.store import ACTIVE_STATUSES, RunStore  # noqa: E402

# A bare Keras script: same data, model, batches, validation and thread
# count as a lab run. Prints steps/s between the end of the first step and
# the end of training (so tracing is left out, as for the runner).
BARE = """
import json, math, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
from gradflow.lab.config import RunConfig
from gradflow.lab.datasets import load_dataset
from gradflow.lab.models import build_model
config = RunConfig.from_json(sys.argv[1])
data = load_dataset(config)
model = build_model(config, data)
class Clock(keras.callbacks.Callback):
    steps = 0
    def on_train_batch_end(self, batch, logs=None):
        first = self.steps == 0
        self.steps += self.model.steps_per_execution  # Keras calls back once a call
        if first:
            self.first = self.steps
            self.start = time.perf_counter()
            self.cpu_start = time.process_time()
        if self.steps >= config.steps:
            self.model.stop_training = True
    def on_train_end(self, logs=None):
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start
clock = Clock()
callbacks = [clock]
if sys.argv[2] == "monitor":
    from gradflow.monitor import GradientMonitor
    from gradflow.store import RunStore
    # As the worker has it: a lab run stops at the first non-finite gradient.
    monitor = GradientMonitor(store=RunStore(sys.argv[3]), stop_on_nonfinite=True)
    callbacks.insert(0, monitor)
if sys.argv[2] == "arrays":  # what a user's script gives fit: Keras builds the batches
    inputs = dict(x=data.x_train, y=data.y_train, batch_size=config.batch_size,
                  validation_data=(data.x_val, data.y_val))
else:  # the lab's own pipelines, as the runner has them
    from gradflow.lab.batches import fit_inputs
    inputs = fit_inputs(data, config.batch_size, config.seed)
epochs = math.ceil(config.steps / math.ceil(len(data.x_train) / config.batch_size))
if sys.argv[2] in ("calls", "monitor"):  # the runner's steps per call
    from gradflow.lab.batches import steps_per_execution
    model.steps_per_execution = steps_per_execution(inputs["steps_per_epoch"], config.steps)
model.fit(**inputs, epochs=epochs, verbose=0, callbacks=callbacks)
steps = clock.steps - clock.first
print(json.dumps({"steps_per_s": steps / clock.seconds,
                  "cpu_ms_per_step": 1e3 * clock.cpu_seconds / steps,
                  "steps_per_execution": model.steps_per_execution}))
"""


def first_step_latency(manager, config):
    """Seconds from start() until the store has the run's first statistics row."""
    start = time.perf_counter()
    run_id = manager.start(config)
    while manager.store.layer_stats(run_id, columns=["l2_norm"]).empty:
        if manager.store.status(run_id) not in (*ACTIVE_STATUSES, "completed"):
            raise RuntimeError(manager.store.run_info(run_id)["message"])
        time.sleep(0.02)  # Polling harder would take CPU from the worker.
    latency = time.perf_counter() - start
    manager.store.request(run_id, "stop")
    manager.wait(run_id, timeout=300)
    return latency


def process_cpu_seconds(pid):
    """User + system CPU seconds of process `pid` so far, all its threads (Linux `/proc`)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runner_steps_per_s(manager, config):
    """Steps/s of a run inside the runner, from its first recorded step to its
    end; the worker's CPU ms per step over the same span; and steps/s from the
    moment the manager's next spare worker is warm to the end.

    A run that takes the warm spare makes the manager start the next one as
    soon as the run has its first step; that worker imports TensorFlow and
    traces a model (seconds of CPU) beside the run on the same cores. The
    third figure leaves that out (None when the spare was not warm before the
    run ended). The CPU time counts every thread of the worker (the store
    writer's too).
    """
    run_id = manager.start(config)
    store = manager.store
    while store.layer_stats(run_id, columns=["l2_norm"]).empty:
        time.sleep(0.02)
    start = time.perf_counter()
    pid = store.run_info(run_id)["pid"]
    cpu_start = process_cpu_seconds(pid)
    first = int(store.layer_stats(run_id, columns=["l2_norm"])["step"].max())
    warm_at_step = None  # the run's progress (heartbeats, once a second) when the spare was warm
    spare_warm = None  # (time, step) of the first heartbeat after that
    # Coarse polling keeps this process off the CPU.
    while (info := store.run_info(run_id))["status"] in ACTIVE_STATUSES:
        if warm_at_step is None and manager.wait_warm(0):
            warm_at_step = info["progress_step"]
        elif (
            spare_warm is None and warm_at_step is not None and info["progress_step"] > warm_at_step
        ):
            spare_warm = (time.perf_counter(), info["progress_step"])
        time.sleep(0.05)
    end = time.perf_counter()
    # The worker waits for its next run now (a reused worker), or has ended.
    cpu_ms = 1e3 * (process_cpu_seconds(pid) - cpu_start) / (config.steps - first)
    whole = (config.steps - first) / (end - start)
    if spare_warm is None or config.steps - spare_warm[1] < config.steps // 4:
        return whole, cpu_ms, None
    return whole, cpu_ms, (config.steps - spare_warm[1]) / (end - spare_warm[0])


def bare_steps_per_s(config, mode, path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", BARE, config.to_json(), mode, str(path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    latency_config = RunConfig(depth=2, width=8, steps=1000)  # stopped once measured
    speed_config = RunConfig(steps=args.steps)
    times = {
        "warm_start_s": [],
        "cold_start_s": [],
        "runner_steps_per_s": [],
        "runner_steps_per_s_once_the_next_spare_is_warm": [],
        "bare_fit_steps_per_s": [],
        "bare_fit_with_monitor_steps_per_s": [],
        "bare_fit_from_arrays_steps_per_s": [],
        "bare_fit_runner_steps_per_call_steps_per_s": [],
        "runner_cpu_ms_per_step": [],
        "bare_fit_cpu_ms_per_step": [],
        "bare_fit_with_monitor_cpu_ms_per_step": [],
        "bare_fit_from_arrays_cpu_ms_per_step": [],
        "bare_fit_runner_steps_per_call_cpu_ms_per_step": [],
    }
    steps_per_call = None
    with tempfile.TemporaryDirectory() as folder:
        store = RunStore(pathlib.Path(folder) / "runs.db")
        warm = RunManager(store, max_running=1, threads_per_run=1, prewarm=True)
        cold = RunManager(store, max_running=1, threads_per_run=1, prewarm=False)
        try:
            for _ in range(args.repeats):
                if not warm.wait_warm(timeout=300):
                    raise RuntimeError("the spare worker did not become warm")
                times["warm_start_s"].append(first_step_latency(warm, latency_config))
                times["cold_start_s"].append(first_step_latency(cold, latency_config))
                warm.wait_warm(timeout=300)
                whole, cpu_ms, spare_warm = runner_steps_per_s(warm, speed_config)
                times["runner_steps_per_s"].append(whole)
                times["runner_cpu_ms_per_step"].append(cpu_ms)
                if spare_warm is not None:
                    times["runner_steps_per_s_once_the_next_spare_is_warm"].append(spare_warm)
                for mode, name, path in (
                    ("bare", "bare_fit", None),
                    ("calls", "bare_fit_runner_steps_per_call", None),
                    ("monitor", "bare_fit_with_monitor", pathlib.Path(folder) / "bare.db"),
                    ("arrays", "bare_fit_from_arrays", None),
                ):
                    bare = bare_steps_per_s(speed_config, mode, path)
                    times[f"{name}_steps_per_s"].append(bare["steps_per_s"])
                    times[f"{name}_cpu_ms_per_step"].append(bare["cpu_ms_per_step"])
                    if mode == "calls":  # as the worker chooses them for this run
                        steps_per_call = bare["steps_per_execution"]
        finally:
            warm.shutdown()
            cold.shutdown()
    result = {
        "command": "python3 bench/bench_runner.py " + " ".join(sys.argv[1:]),
        "runner_steps_per_execution": steps_per_call,
        "repeats": args.repeats,
        "steps": args.steps,
        "load_average_1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    result.update(
        {name: statistics.median(values) if values else None for name, values in times.items()}
    )
    result["runner_vs_bare_fit"] = result["runner_steps_per_s"] / result["bare_fit_steps_per_s"]
    if result["runner_steps_per_s_once_the_next_spare_is_warm"] is not None:
        result["runner_once_the_next_spare_is_warm_vs_bare_fit"] = (
            result["runner_steps_per_s_once_the_next_spare_is_warm"]
            / result["bare_fit_steps_per_s"]
        )
    # What a user sees: the lab against the script they would write (Keras
    # makes the batches from the arrays, anew every epoch).
    result["runner_vs_bare_fit_from_arrays"] = (
        result["runner_steps_per_s"] / result["bare_fit_from_arrays_steps_per_s"]
    )
    # The same fit with the runner's steps per call: what the runner costs
    # beyond that choice (the monitor, the control, the store).
    result["runner_vs_bare_fit_runner_steps_per_call"] = (
        result["runner_steps_per_s"] / result["bare_fit_runner_steps_per_call_steps_per_s"]
    )
    result["runner_vs_bare_fit_with_monitor"] = (
        result["runner_steps_per_s"] / result["bare_fit_with_monitor_steps_per_s"]
    )
    # The same ratio from CPU time per step (> 1: the runner costs less).
    result["runner_vs_bare_fit_cpu"] = (
        result["bare_fit_cpu_ms_per_step"] / result["runner_cpu_ms_per_step"]
    )
    result["bare_fit_with_monitor_vs_bare_fit_cpu"] = (
        result["bare_fit_cpu_ms_per_step"] / result["bare_fit_with_monitor_cpu_ms_per_step"]
    )
    result["samples"] = times
    result["targets"] = {"warm_start_s": 2.0, "runner_vs_bare_fit": 0.9}
    width = max(map(len, result))
    for name, value in result.items():
        if name not in ("samples", "targets", "command"):
            print(
                f"{name:<{width}}  {value:,.3f}"
                if isinstance(value, float)
                else f"{name:<{width}}  {value}"
            )
    out = ROOT / "bench" / "results" / "runner.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
