"""Labels that cannot be a model's classes, said before TensorFlow says it in a traceback.

TensorFlow's own words ("Received a label value of 5 which is outside the
valid range of [0, 5)", "Shapes (8, 3) and (8,) are incompatible") come from
inside the traced pass, wrapped in its source lines.
"""

import keras
import numpy as np


def output_units(model):
    """The size of the model's last output axis, or None when it is not known."""
    try:
        shape = model.output_shape
    except (AttributeError, ValueError, RuntimeError):
        return None
    if isinstance(shape, tuple) and shape and isinstance(shape[-1], int):
        return shape[-1]
    return None


def _kind(loss):
    """`"sparse"`, `"categorical"`, `"one_to_one"` (mse, binary crossentropy, ...) or None."""
    if isinstance(loss, str):
        name = loss
    elif isinstance(loss, keras.losses.Loss):
        name = type(loss).__name__
    else:
        name = getattr(loss, "__name__", "")
    name = name.lower().replace("_", "")
    if name == "sparsecategoricalcrossentropy":
        return "sparse"
    if name == "categoricalcrossentropy":
        return "categorical"
    if name in _ONE_TO_ONE:
        return "one_to_one"
    return None


# Losses that compare each output with its own target (`mse`, `MeanSquaredError`, ...).
_ONE_TO_ONE = {
    name.replace("_", "")
    for name in (
        "mse",
        "mae",
        "msle",
        "mape",
        "mean_squared_error",
        "mean_absolute_error",
        "mean_squared_logarithmic_error",
        "mean_absolute_percentage_error",
        "huber",
        "log_cosh",
        "binary_crossentropy",
        "binary_focal_crossentropy",
        "poisson",
    )
}


def label_problem(model, loss, y):
    """Why `y` cannot be this model's class labels under `loss`, in words, or None.

    Args:
        model: A built Keras model with one output.
        loss: The loss: a name, a `keras.losses.Loss` or a loss function.
        y: The labels (an array or a tensor).

    Returns:
        A sentence, or None when the labels fit (or the loss takes no classes).
    """
    kind = _kind(loss)
    units = output_units(model)
    try:
        y = np.asarray(y)
    except Exception:  # noqa: BLE001  (a structure the loss will judge)
        return None
    if kind is None or units is None or y.size == 0 or not np.issubdtype(y.dtype, np.number):
        return None
    if kind == "one_to_one":
        if units == 1 or (y.ndim >= 2 and y.shape[-1] == units):
            return None
        return (
            f"The labels have shape {y.shape}, one number per example, but this model gives "
            f"{units} outputs per example, and this loss compares each output with a target "
            "of its own. For class numbers use sparse categorical crossentropy; for one number "
            "to predict, a model with one output."
        )
    if kind == "categorical":
        if y.ndim >= 2 and y.shape[-1] == units:
            return None
        return (
            f"The labels have shape {y.shape}, but categorical crossentropy takes one-hot "
            f"labels of shape (batch, {units}), one column per class of this model. For class "
            "numbers (0, 1, 2, ...) use sparse categorical crossentropy."
        )
    if units > 1 and y.ndim >= 2 and y.shape[-1] == units and np.isin(y, (0, 1)).all():
        return (
            f"The labels look one-hot (shape {y.shape}), but sparse categorical crossentropy "
            "takes one class number a sample. Use `y.argmax(axis=-1)` as the labels, or "
            "categorical crossentropy as the loss."
        )
    if not np.all(np.isfinite(y)) or not np.all(np.equal(np.mod(y, 1), 0)):
        return (
            "The labels are not whole class numbers, which sparse categorical crossentropy "
            "needs. For numbers to predict, use mse or mae as the loss."
        )
    low, high = int(y.min()), int(y.max())
    if 0 <= low and high < units:
        return None
    message = (
        f"The labels run from {low} to {high}, but this model has {units} outputs, so it "
        f"takes class numbers 0 to {units - 1}."
    )
    if low == 1 and high == units:
        message += " They look numbered from 1: subtract 1 from every label."
    return message
