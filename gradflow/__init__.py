"""gradflow: see how gradients flow through a Keras 3 network while it trains.

The public API is imported lazily: `import gradflow` costs almost nothing, and
`import gradflow.figures` never pulls in TensorFlow. The names below resolve on
first use.

Example:

```python
import gradflow
shot = gradflow.snapshot(model, x_batch, y_batch)
print(shot.weights[["layer", "tensor", "max_abs", "l2_norm"]])
```
"""

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it.
_EXPORTS = {
    "snapshot": "gradflow.probe.snapshot",
    "Snapshot": "gradflow.probe.snapshot",
    "input_sensitivity": "gradflow.probe.sensitivity",
    "chain_gradients": "gradflow.probe.chain",
    "GradientMonitor": "gradflow.monitor.callback",
    "GradientLog": "gradflow.monitor.loop",
    "RunConfig": "gradflow.lab.config",
    "train": "gradflow.lab.training",
    "Run": "gradflow.lab.training",
    "RunStore": "gradflow.store.store",
    "safe_load_model": "gradflow.safety.models",
    "load_arrays": "gradflow.safety.arrays",
    "UnsafeInputError": "gradflow.safety.errors",
    "diagnose": "gradflow.diagnosis",
    "diagnose_new": "gradflow.diagnosis",
    "first_nonfinite": "gradflow.diagnosis",
    "Thresholds": "gradflow.diagnosis",
    "GradientProbe": "gradflow.probe.snapshot",
    "InputSensitivity": "gradflow.probe.sensitivity",
    "ChainedBackprop": "gradflow.probe.chain",
    "split_cnn": "gradflow.probe.chain",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradflow' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
