"""Checks of where a `GradientMonitor` or a `GradientLog` writes, made when it is created.

Here, not at the first step in SQLite's or TensorFlow's words, which name
neither the argument nor the value.
"""

import dataclasses
import math
import os

from gradflow.diagnosis import Thresholds
from gradflow.store.store import check_name, check_store_path


def check_outputs(store, run_name, tensorboard_dir, rules):
    """Raise a `ValueError` naming the argument unless each is usable.

    Args:
        store: A `gradflow.RunStore`, the path of one, or None.
        run_name: A string or None (the store shortens one over
            `MAX_NAME_LENGTH` characters).
        tensorboard_dir: A folder's path or None (a file is refused).
        rules: A `gradflow.diagnosis.Thresholds` or None.
    """
    if store is not None and not (
        isinstance(store, (str, os.PathLike)) or hasattr(store, "writer")
    ):
        raise ValueError(
            "`store` must be a gradflow.RunStore, the path of one, or None, got "
            f"{type(store).__name__} {store!r}."
        )
    for name, value in (("run_name", run_name), ("tensorboard_dir", tensorboard_dir)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(
                f"`{name}` must be a string or None, got {type(value).__name__} {value!r}."
            )
    # A name longer than `MAX_NAME_LENGTH` is shortened by the store, not
    # refused: KerasTuner's `run_name=str(hp.values)` (the README's recipe)
    # passed 200 characters with six values, and every trial failed.
    if run_name is not None:
        # A control character broke every image export of the run (plotly.js).
        check_name(str(run_name), "run_name")
    if isinstance(store, (str, os.PathLike)):
        check_store_path(store, "store")
    if tensorboard_dir is not None and os.path.isfile(tensorboard_dir):
        raise ValueError(
            "`tensorboard_dir` must be a folder (TensorBoard's --logdir), got the file "
            f"{os.fspath(tensorboard_dir)!r}."
        )
    if rules is not None and not isinstance(rules, Thresholds):
        raise ValueError(
            "`rules` must be a gradflow.diagnosis.Thresholds or None, got "
            f"{type(rules).__name__} {rules!r}: e.g. `rules=Thresholds(vanishing_norm=1e-6)`."
        )


def run_config(
    model,
    optimizer,
    every,
    histograms,
    rules,
    activations=False,
    through_time=False,
    recorded_by=None,
):
    """The settings stored with a script's run (`RunStore.create_run`'s `config`).

    The dashboard and the exports read them: `alert_rules` runs the rules
    again with the thresholds the run used, `histograms` chooses a page's
    hint, `recorded_by` (`"GradientLog"`) names the class in it.

    Args:
        model: The Keras model recorded.
        optimizer: Its optimizer, or None.
        every, histograms, activations, through_time: The recorder's options.
        rules: A `gradflow.diagnosis.Thresholds`, or None for the defaults.
        recorded_by: The recording class's name, if not `GradientMonitor`.
    """
    config = {
        "model": model.name,
        "optimizer": None if optimizer is None else type(optimizer).__name__,
        # A KerasTuner search or a grid search makes runs that differ in
        # these only: stored, a run says which trial it was.
        "optimizer_settings": _optimizer_settings(optimizer),
        "parameters": model.count_params() if model.built else None,
        "every": every,
        "activations": activations,
        "histograms": histograms,
        "through_time": through_time,
    }
    if recorded_by is not None:
        config["recorded_by"] = recorded_by
    if rules is not None:
        config["alert_rules"] = dataclasses.asdict(rules)
    return config


def _optimizer_settings(optimizer):
    """The optimizer's own settings that are plain numbers, names or switches (a dict)."""
    if optimizer is None:
        return {}
    try:
        settings = optimizer.get_config()
    except Exception:  # noqa: BLE001 - a user's optimizer may not implement it; the run goes on
        return {}
    kept = {}
    for name, value in settings.items():
        if isinstance(value, dict) and "class_name" in value:
            value = value["class_name"]  # a learning-rate schedule: its name
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            value = value.item()  # a NumPy number
        if isinstance(value, float):
            # The stored config is JSON; a float32 0.001 read 0.0010000000474974513.
            value = float(f"{value:.7g}") if math.isfinite(value) else str(value)
        if isinstance(value, (bool, int, float, str)):
            kept[name] = value  # `None`s (a switch left off) say nothing
    return kept
