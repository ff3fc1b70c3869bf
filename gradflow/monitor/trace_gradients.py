"""Let a finished `fit` give its traced train step back to the garbage collector.

Keras's optimizer sums gradients with `ReplicaContext.all_reduce`, which is a
`tf.custom_gradient`. Traced in graph mode, every custom gradient registers a
function under a fresh name (`CustomGradient-N`) in TensorFlow's global
gradient registry, and nothing ever removes it; the function's closure holds
the tensors of the traced step, so the whole step graph lives on, with the
resource handles it captured (tensorflow/tensorflow#97697, #27492;
keras-team/keras#20245). For a plain `fit` that is about 1 MB a call. The
monitor's step captures its ring buffer too (up to 16 MiB), so each `fit`
with a `GradientMonitor` kept 12-14 MB that `clear_session()` could not free
(lab MLP, 30 steps a fit; `python3 bench/bench_worker_memory.py`: 13.6 MiB a
fit without the release below, 0.06 with it, 0.95 for a plain `fit`).

The registered function is only needed while the step is being traced (the
tape's gradient is taken then); afterwards nothing looks it up. So the step
notes the names registered while it is traced, and the callback drops them
from the registry once `fit` has ended and the step is no longer used.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

_PREFIX = "CustomGradient-"


def _registry():
    """TensorFlow's gradient registry as a dict, or None if this TensorFlow keeps it elsewhere."""
    registry = getattr(getattr(tf_ops, "_gradient_registry", None), "_registry", None)
    return registry if isinstance(registry, dict) else None


@contextlib.contextmanager
def noted_while_tracing(names):
    """Add to the set `names` the custom gradients registered inside the block (when traced)."""
    registry = _registry()
    if registry is None or tf.executing_eagerly():
        # Eager steps register nothing; an unknown registry is left alone.
        yield
        return
    before = set(registry)
    try:
        yield
    finally:
        names.update(name for name in registry if name.startswith(_PREFIX) and name not in before)


def forget(names):
    """Drop the custom gradients `names` from the registry (their step is no longer used)."""
    registry = _registry()
    if registry is not None:
        for name in names:
            registry.pop(name, None)
    names.clear()
