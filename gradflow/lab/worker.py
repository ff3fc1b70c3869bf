"""The training recipe of one lab run, and the worker process that runs it.

`execute(store, run_id)` trains one run in the calling process: the
foreground `gradflow.train(config)` calls it directly, and a worker process
calls it for background runs. A worker is started by `RunManager` as

    python -m gradflow.lab.worker --db PATH --threads N --niceness K --runs R

It imports TensorFlow and Keras, traces a toy model's monitored step once
(the warm-up; skipped when its run is already waiting on stdin), then waits
on stdin for a run id (this is the pre-warmed state) and trains that run. It then says `next RUN STATUS` on
stdout and waits for the next run id: a warm worker trains run after run, so
a class of thirty queued runs pays for importing TensorFlow (seconds of a
whole core each time) a few times, not thirty. Between runs it clears
Keras's session, so layer names and seeds start again as in a new process
(a run trains the same in a used worker as in a fresh one). After `--runs`
runs, or after a run that failed, it says `done RUN STATUS` instead and exits:
whatever a failed run left behind, and whatever memory TensorFlow does not
give back, ends with the process.

Its stdin is also its lifeline: when the launching process dies (or retires
the worker), stdin reaches end-of-file and the worker marks the run it holds,
if that is still active, `interrupted` and exits at once, so no worker
outlives its launcher.
"""

import argparse
import contextlib
import gc
import math
import os
import queue
import sys
import threading
import traceback
import warnings

from gradflow.checks import error_text
from gradflow.lab.datasets import DataFileError, DatasetDownloadError
from gradflow.quick_exit import quick_exit
from gradflow.safety.errors import UnsafeInputError
from gradflow.store import ACTIVE_STATUSES, RunStore


def execute(store, run_id):
    """Trains run `run_id` of `store` in this process and sets its final status.

    Reads the run's config from the store, loads the data, builds the model
    (seeded by `config.seed`, so the same config gives the same statistics),
    and trains with `model.fit`, recording through `GradientMonitor` and
    obeying pause/resume/step/stop requests through `RunControl`.

    Example:

    ```python
    store = RunStore()
    run_id = store.create_run(RunConfig(steps=50).to_dict())
    execute(store, run_id)          # "completed"
    ```

    Args:
        store: the `RunStore`.
        run_id: a run created with a `RunConfig` dict as its config.

    Returns:
        The final status: `"completed"`, `"stopped"` (asked to),
        `"diverged"` (NaN or Inf loss or gradient) or `"failed"` (an error;
        the run's message says which). A run that was no longer queued or
        running when called is left alone and its status returned.
    """
    if not store.set_status(run_id, "running", pid=os.getpid(), only_from=("queued", "running")):
        return store.status(run_id)
    try:
        status, message = _train(store, run_id)
    except Exception as error:  # Any failure becomes a readable run status.
        status = "failed"
        message = _failure_message(error)
    except KeyboardInterrupt:
        store.set_status(run_id, "interrupted", "Interrupted by the user (Ctrl-C).")
        raise
    store.set_status(run_id, status, message, only_from=ACTIVE_STATUSES)
    return store.status(run_id)


def _train(store, run_id):
    from gradflow.lab.batches import fit_inputs, steps_per_execution
    from gradflow.lab.config import RunConfig
    from gradflow.lab.control import FirstStepPublisher, RunControl
    from gradflow.lab.datasets import load_dataset
    from gradflow.lab.models import build_model
    from gradflow.monitor import GradientMonitor

    config = RunConfig.from_dict(store.run_info(run_id)["config"])
    data = load_dataset(config)
    model = build_model(config, data)  # Seeds weights, shuffling and dropout.
    inputs = fit_inputs(data, config.batch_size, config.seed)
    epochs = config.epochs or math.ceil(config.steps / inputs["steps_per_epoch"])
    total_steps = config.steps if config.epochs is None else epochs * inputs["steps_per_epoch"]
    if config.epochs is not None:
        # Only now, with the data set's size, is a run of epochs' length known:
        # progress bars and the Runs page show "step 40 / 450", not "step 40".
        store.set_total_steps(run_id, int(total_steps))
        if config.record_every > total_steps:
            # RunConfig checks this against `steps`; a run of epochs trained
            # to its end and recorded nothing, without a word.
            raise NothingToRecordError(
                f"Record every {config.record_every} steps is more than the {total_steps} "
                f"steps of this run ({epochs} epoch(s) of {inputs['steps_per_epoch']}): no step "
                f"would be recorded. Use a number from 1 to {total_steps}."
            )
    # Several steps per call of the compiled function; the same steps, batches
    # and statistics as one per call (`tests/test_runner.py`).
    model.steps_per_execution = (
        1 if config.pace else steps_per_execution(inputs["steps_per_epoch"], total_steps)
    )
    monitor = GradientMonitor(
        every=config.record_every,
        activations=config.activations,
        histograms=config.histograms,
        store=store,
        run_id=run_id,
        close_run=False,
        stop_on_nonfinite=True,
        # A recurrent network's gradient fades through time, which the
        # layers' rows (summed over every time step) cannot show.
        through_time=config.architecture == "rnn",
        # Every step is in the store, which is all the dashboard, the CLI and
        # `gradflow.train` read: kept in memory too, a 100-layer run of a
        # million steps (RunConfig allows both) would hold gigabytes.
        keep_steps=0,
    )
    control = RunControl(
        store,
        run_id,
        max_steps=None if config.epochs else config.steps,
        # A paused run must show every step it made before it says "paused".
        on_pause=monitor.flush,
        pace=config.pace,
    )
    try:
        model.fit(
            **inputs,
            epochs=epochs,
            verbose=0,
            callbacks=[monitor, FirstStepPublisher(monitor), control],
        )
    except BaseException:
        # Keras calls no callback when `fit` raises outside the step (the
        # validation set, a Ctrl-C in a callback): keep every recorded step.
        with contextlib.suppress(Exception):  # The error being raised matters more.
            monitor.flush()
        raise
    try:
        # What the store could not take at the end (a lock held longer than
        # its 30 s wait), tried once more: `fit` returned all the same, and
        # the run was stored "completed" with its last steps missing.
        monitor.flush()
    except RuntimeError as error:
        return "failed", f"Training finished, but its last steps could not be stored: {error}"
    # Optimizer steps taken: after a non-finite halt, fit's last few batches
    # changed nothing and do not count.
    store.heartbeat(run_id, int(model.optimizer.iterations.numpy()))
    nonfinite = monitor.events[monitor.events["kind"] == "nonfinite"]
    if len(nonfinite):
        return "diverged", nonfinite["message"].iloc[0]
    if control.stop_reason == "nonfinite":
        return "diverged", f"The loss became NaN or infinite at step {control.nonfinite_step}."
    finished = control.max_steps is not None and control.steps >= control.max_steps
    if control.stop_reason == "stop" and not finished:
        # A stop that came with the last batch found a finished run: "stopped · 300 / 300".
        steps = f"{control.steps} step{'' if control.steps == 1 else 's'}"
        return "stopped", (
            f"Stopped on request after {steps} (its Stop button, a new run started from its "
            "page, or every tab that showed it closed)."
        )
    return "completed", None


def _failure_message(error):
    if isinstance(error, _SAID_FOR_PEOPLE):
        # Written for whoever reads the run (a data set that needs a download,
        # a refused file): the class and the source line only get in the way.
        return str(error)
    where = traceback.extract_tb(error.__traceback__)
    last = f" (at {os.path.basename(where[-1].filename)}:{where[-1].lineno})" if where else ""
    return f"{error_text(error)}{last}"


class NothingToRecordError(ValueError):
    """The run's settings would record no step."""


# Errors whose message is written for whoever reads the run.
_SAID_FOR_PEOPLE = (DatasetDownloadError, UnsafeInputError, DataFileError, NothingToRecordError)


def _limit_threads(threads):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))


def _lower_priority(niceness):
    """Adds `niceness` to the niceness of this process's threads.

    On Linux niceness belongs to each thread, and the imports that ran before
    `main` already started some (OpenBLAS's pool, for one): each is lowered by
    its thread id. Threads started later inherit the main thread's.
    """
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        os.nice(niceness)
        return
    for tid in os.listdir(tasks):
        try:
            now = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, now + niceness))
        except ProcessLookupError:  # A thread that has just ended.
            pass


def _warm_up():
    """Imports and traces once what every run needs, so a run starts fast."""
    import keras
    import numpy as np

    import gradflow.lab.models  # noqa: F401
    from gradflow.lab.batches import fit_inputs
    from gradflow.lab.datasets import Dataset  # pulls in scikit-learn
    from gradflow.monitor import GradientMonitor

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((4, 2), "float32"), np.zeros((4, 1), "float32")
    # A run's input pipelines, so that their ops have been used once too. Made
    # once: each fit starts its own iterators over them.
    data = Dataset(x, y, x, y, n_classes=None, task="regression", input_shape=(2,), description="")
    inputs = fit_inputs(data, 4, seed=0)
    # Tracing the instrumented step once makes the first real trace faster.
    # Both paths: the statistics in the step (taken here because not every
    # step is recorded; with activations and histograms) and the deferred
    # ring of small models, which the lab's default run takes and whose
    # first read, op by op, is waited for (its ops' first use). Not with
    # several steps per call: a third fit for it cut a run's first call by
    # about 0.08 s (within this VM's spread) and would cost every fresh
    # worker of a classroom, whose short runs take one step per call.
    for monitor in (
        GradientMonitor(histograms=True, activations=True, stop_on_nonfinite=True, every=2),
        GradientMonitor(stop_on_nonfinite=True),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(**inputs, verbose=0, callbacks=[monitor])
    # Layer-name counters start again from zero, as in a cold process.
    keras.backend.clear_session()


def _lifeline(store_path, handoff):
    """Hands each run id from stdin to the main thread; at end-of-file, ends the process.

    End-of-file on stdin means the launcher ended, shut us down or retired
    us: the last run handed over is marked interrupted if it is still active
    (a finished run keeps its status), and the process ends at once, even in
    the middle of importing TensorFlow or of a training step.
    """
    last = None
    for line in sys.stdin:
        run_id = line.strip()
        if run_id:
            last = run_id
            handoff.put(run_id)
    if last is not None:
        try:
            RunStore(store_path).set_status(
                last,
                "interrupted",
                "Interrupted: the process that started the run ended.",
                only_from=ACTIVE_STATUSES,
            )
        except Exception:  # Exit regardless; recover() marks it later.
            pass
    os._exit(3 if last else 0)


def _forget_last_run():
    """Frees the last run's model and graphs; names and seeds start again from zero."""
    import keras

    keras.backend.clear_session()
    gc.collect()


def main(argv=None):
    """Entry point of a worker process (see the module docstring)."""
    parser = argparse.ArgumentParser(description="gradflow lab worker (started by RunManager)")
    parser.add_argument("--db", required=True, help="run store path")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads")
    parser.add_argument("--niceness", type=int, default=0, help="added to the CPU niceness")
    parser.add_argument("--no-warm-up", action="store_true", help="skip the warm-up fit")
    parser.add_argument("--runs", type=int, default=1, help="runs to train before exiting")
    args = parser.parse_args(argv)
    # First, so that every thread started below (TensorFlow's pools too) inherits it.
    if args.niceness > 0:
        _lower_priority(args.niceness)
    handoff = queue.Queue()
    threading.Thread(
        target=_lifeline, args=(args.db, handoff), name="gradflow-lifeline", daemon=True
    ).start()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Outright: a user's exported KERAS_BACKEND=jax is for their own scripts,
    # and the lab's training needs TensorFlow (RunManager sets it too).
    os.environ["KERAS_BACKEND"] = "tensorflow"
    _limit_threads(max(1, args.threads))
    # The warm-up is for a spare that waits: it makes a run handed over later
    # start sooner. A worker started for a run already queued (a class's
    # queue on a busy server) would spend a second of a core tracing a toy
    # model to save 0.15 s of its run's own first trace, so it goes straight
    # to the run (`bench/bench_student_cost.py`).
    if not args.no_warm_up and handoff.empty():
        _warm_up()
    print("ready", flush=True)
    store = RunStore(args.db)
    runs = max(1, args.runs)
    for count in range(1, runs + 1):
        run_id = handoff.get()
        status = execute(store, run_id)
        last = count == runs or status == "failed"
        print(f"{'done' if last else 'next'} {run_id} {status}", flush=True)
        if last:
            break
        _forget_last_run()
    return 0


if __name__ == "__main__":
    # Its runs are stored and closed: no need to wait for Python to unload
    # TensorFlow (`gradflow.quick_exit`).
    quick_exit(main())
