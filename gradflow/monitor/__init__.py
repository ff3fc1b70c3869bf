"""The GradientMonitor callback: per-layer gradient statistics inside `model.fit`.

Modules: `callback` (the Keras callback), `step` (the instrumented train
step), `buffer` (the ring of variables the step writes), `records` (numpy
blocks to tidy DataFrames), `tensorboard` (summaries for TensorBoard).
"""

from gradflow.monitor.callback import GradientMonitor

__all__ = ["GradientMonitor"]
