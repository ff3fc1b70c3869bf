"""What a run trained, in one line: a script's model and optimizer, a lab run's settings.

Runs are listed by name (the Runs page, `gradflow runs`, the Live page's
header, a lesson pack's README). A script's runs are often named alike (a
KerasTuner search's trials after their model), and a renamed lab run no
longer says its settings: these lines tell them apart. No TensorFlow, no
Plotly: `gradflow runs` imports this.
"""

import dataclasses
import functools

# The optimizer settings a script's run is told apart by (a KerasTuner trial,
# a grid search's fold), in this order, when set.
_SETTINGS_SHOWN = (
    "learning_rate",
    "momentum",
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "gradient_accumulation_steps",
)


def script_settings(info):
    """One line on what a script's run trained: model, size, optimizer, `every`; or "".

    A KerasTuner search or a grid search stores runs named alike, told apart
    by these. The lab's runs have their own settings (`RunConfig`).

    ```python
    script_settings(store.run_info(run_id))
    # 'model `sequential`, 1,234 parameters · Adam: learning_rate 0.001 · every step'
    ```
    """
    config = (info or {}).get("config")
    if (info or {}).get("source") != "monitor" or not isinstance(config, dict):
        return ""
    parts = []
    if config.get("model"):
        parameters = config.get("parameters")
        parts.append(
            f"model `{config['model']}`"
            + (f", {parameters:,} parameters" if isinstance(parameters, int) else "")
        )
    if config.get("optimizer"):
        settings = config.get("optimizer_settings")
        settings = settings if isinstance(settings, dict) else {}
        shown = [
            f"{name} {settings[name]:g}"
            if isinstance(settings[name], float)
            else f"{name} {settings[name]}"
            for name in _SETTINGS_SHOWN
            if _worth_saying(name, settings.get(name))
        ]
        parts.append(f"{config['optimizer']}" + (f": {', '.join(shown)}" if shown else ""))
    every = config.get("every")
    if isinstance(every, int):
        parts.append("every step" if every == 1 else f"every {every} steps")
    return " · ".join(parts)


def run_settings(source, config, name):
    """What a run trained, where its name does not say it; or "".

    The Runs page and `gradflow runs` list runs by name. A KerasTuner
    search's trials or a grid search's folds are named alike (their model's
    name), and a lab run renamed "Alice" no longer says its depth and
    activation: both are told apart by their settings. A lab run that keeps
    its own name already says them.

    ```python
    run_settings("monitor", {"model": "sequential", "optimizer": "Adam", ...}, "sequential")
    # 'model `sequential`, 1,234 parameters · Adam: learning_rate 0.001 · every step'
    run_settings("lab", RunConfig(depth=3).to_dict(), "Alice")
    # 'relu · depth 3 · sgd lr=0.05'
    ```

    Args:
        source: The run's `source` column ("lab", "cli" or "monitor").
        config: The config dict the run was created with.
        name: The run's name as stored.
    """
    if source == "monitor":
        return script_settings({"source": source, "config": config})
    try:
        # A lab run's fields are plain values; the type is part of the key, as
        # `depth: True` is no depth 1 to `RunConfig`.
        fields = tuple((k, type(v).__name__, v) for k, v in sorted(config.items()))
        hash(fields)
    except (AttributeError, TypeError):
        return ""  # no dict of plain values: no lab run's config
    settings = _lab_settings(fields)
    return "" if settings == name else settings


# The Runs page's table asks again every 2 s while a run trains: a term's 300 lab
# runs took 26 ms of `RunConfig` validation a tick, per tab.
@functools.lru_cache(maxsize=4096)
def _lab_settings(fields):
    from gradflow.lab.config import RunConfig, run_name

    try:
        lab = RunConfig.from_dict({k: v for k, _, v in fields})
    except (ValueError, TypeError):
        return ""  # another gradflow's fields, or a config of no lab run
    return run_name(dataclasses.replace(lab, name=None))


def _worth_saying(name, value):
    """Whether a setting changes training: momentum 0, no clipping, accumulating 1 do not."""
    if isinstance(value, bool) or value is None:
        return False
    if name == "learning_rate":
        return True  # a number, or a schedule's name
    if name == "gradient_accumulation_steps":
        return isinstance(value, int) and value > 1
    return isinstance(value, (int, float)) and value != 0
