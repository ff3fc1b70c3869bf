"""The gradient probe: per-layer gradients of any Keras 3 model on one batch."""
