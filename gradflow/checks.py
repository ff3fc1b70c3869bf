"""Argument checks shared by the library: one wording for one kind of mistake.

Every public function that takes a count or a limit checks it here, so that
`True`, `2.0`, `"3"` or `-1` meet the same message everywhere: the argument's
name, the value given and what is allowed. NumPy integers and floats count as
numbers (a value read from an array is often one); booleans do not, although
Python makes `True` an integer, since `every=True` is a mistake, not a 1. A
switch takes only True or False: `activations="no"` is a mistake too, not a yes.
"""

import json
import math
import numbers
import os
import re
import sys
import warnings

import numpy as np


def positive_int(name, value, allow_none=False):
    """Returns `value` as an `int` if it is a whole number of at least 1.

    Args:
        name: the argument's name, for the message.
        value: what the caller gave.
        allow_none: whether `None` ("no limit", "the default") is allowed;
            it is then returned as is.

    Raises:
        ValueError: naming the argument and showing the value, if it is not a
            positive integer (or None, where allowed).
    """
    return whole_number(name, value, least=1, allow_none=allow_none)


def whole_number(name, value, least=0, allow_none=True):
    """Returns `value` as a Python `int` if it is a whole number from `least` to 2**63 - 1.

    A Python int, not a NumPy one: SQLite stores a NumPy integer as an
    8-byte blob (one `heartbeat(step=np.int64(5))` made every later read of
    the run store fail).

    Args:
        name: the argument's name, for the message.
        value: what the caller gave.
        least: the smallest value allowed. Default 0.
        allow_none: whether `None` is allowed and returned as is. Default True.

    Raises:
        ValueError: naming the argument and showing the value, if it is not
            such a number (or None, where allowed).
    """
    if value is None and allow_none:
        return None
    allowed = "a positive integer" if least == 1 else f"an integer >= {least}"
    if _is_bool(value) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(
            f"`{name}` must be {allowed}{' or None' if allow_none else ''}, got {value!r:.80}."
        )
    if value > _LARGEST_INT64:
        # Step counts and intervals end up in int64 tensors, arrays and SQLite
        # integers, where a larger number fails deep inside with a bare OverflowError.
        raise ValueError(
            f"`{name}` must be {allowed} no larger than 2**63 - 1 (the largest int64), "
            f"got {value!r:.80}."
        )
    return int(value)


_LARGEST_INT64 = 2**63 - 1


def positive_number(name, value, unit=""):
    """Returns `value` as a `float` if it is a finite number above 0.

    Args:
        name: the argument's name, for the message.
        value: what the caller gave.
        unit: words after "a positive number" in the message, e.g.
            "of seconds".

    Raises:
        ValueError: naming the argument and showing the value, if it is not a
            finite positive number.
    """
    if (
        _is_bool(value)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not value > 0
    ):
        allowed = f"a positive number {unit}".rstrip()
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")
    return float(value)


def flag(name, value):
    """Returns `value` as a `bool` if it is True or False.

    `bool("no")` is True, so a string or a number meant as a switch would
    silently turn it on.

    Raises:
        ValueError: naming the argument and showing the value, if it is not
            True or False.
    """
    if not _is_bool(value):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return bool(value)


def _is_bool(value):
    return isinstance(value, (bool, np.bool_))


# Packages between a user's line and a warning gradflow raises from a callback
# or a traced step: a warning shown at their lines says nothing to the user.
_LIBRARY_PACKAGES = (
    "gradflow",
    "keras",
    "tensorflow",
    "tf_keras",
    "absl",
    "optree",
    # Tools that call `fit` for the user: a warning at `scikeras/wrappers.py:535`.
    "scikeras",
    "keras_tuner",
    "sklearn",
    "joblib",  # scikit-learn's folds run through it
)


def _in_a_library(module):
    # A package or one of its modules: not the user's own `keras_utils.py`.
    return any(module == name or module.startswith(name + ".") for name in _LIBRARY_PACKAGES)


def warn_user(message, category=UserWarning):
    """`warnings.warn` shown at the user's own line, not inside gradflow or Keras.

    Keras calls a callback from `fit` through its `CallbackList`, and traces
    a train step through TensorFlow; a fixed `stacklevel` points into them
    (`keras/src/callbacks/callback_list.py`). This finds the first caller
    outside those packages, e.g. the user's `model.fit(...)` line.
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and _in_a_library(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


# Keras's terminal styling (bold names in its messages) and the dump of a
# layer call's arguments that follows them.
_TERMINAL_STYLE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CALL_DUMP = re.compile(r"\s*Arguments received by .*\Z", re.DOTALL)


def error_text(error):
    """`"ValueError: ..."` for a run's message: without terminal codes or Keras's argument dump.

    A run that failed in a layer's call read "Training failed: ValueError:
    Exception encountered when calling Sequential.call(). [1m'x' is not a
    valid scope name [0m Arguments received by Sequential.call(): • inputs=
    tf.Tensor(...)" on the dashboard (the odd-runs audit).
    """
    text = _CALL_DUMP.sub("", _TERMINAL_STYLE.sub("", str(error)))
    return f"{type(error).__name__}: {' '.join(text.split())}"


def backend_problem(what="gradflow", command="python train.py"):
    """Why this process's Keras cannot run gradflow, in words, or None if it can.

    gradflow differentiates with TensorFlow's `GradientTape` and rebuilds
    Keras's TensorFlow train step, so it needs Keras 3 on the TensorFlow
    backend. Another backend (`KERAS_BACKEND=jax`, or `"backend": "jax"` in
    `~/.keras/keras.json`) failed deep inside with "Cannot convert a symbolic
    tf.Tensor" or "'Sequential' object has no attribute
    'distribute_strategy'". Imports Keras (which reads that choice once).

    Args:
        what: who needs it, the sentence's subject (`"gradflow.snapshot"`).
        command: the command of the example fix, after `KERAS_BACKEND=tensorflow`.
    """
    import keras

    version = str(getattr(keras, "__version__", "0"))
    if not version.split(".")[0].isdigit() or int(version.split(".")[0]) < 3:
        return (
            f"{what} needs Keras 3 on the TensorFlow backend; this process has Keras "
            f"{version}. Install Keras 3 (`pip install 'keras>=3'`)."
        )
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return None
    source, config = _backend_source(backend)
    return (
        f"{what} needs Keras 3 on the TensorFlow backend; this process uses {backend!r} "
        f"({source}). Set KERAS_BACKEND=tensorflow before Keras is imported (e.g. "
        f"`KERAS_BACKEND=tensorflow {command}`)"
        + (f', or "backend": "tensorflow" in {config}.' if config else ".")
    )


def check_backend(what="gradflow"):
    """Raises a RuntimeError saying so if Keras is not Keras 3 on TensorFlow (`backend_problem`)."""
    problem = backend_problem(what)
    if problem is not None:
        raise RuntimeError(problem)


def _backend_source(backend):
    """Where the backend `backend` came from, as far as one can tell afterwards.

    Returns:
        The words, and the path of the keras.json that chose it (else None).
    """
    variable = os.environ.get("KERAS_BACKEND")
    if variable == backend:
        return f"set by $KERAS_BACKEND={backend}", None
    if variable:
        return (
            f"chosen when Keras was first imported; $KERAS_BACKEND={variable} came too late "
            "to change it",
            None,
        )
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    config = os.path.join(home, "keras.json")
    try:
        with open(config, encoding="utf-8") as file:
            from_file = json.load(file).get("backend")
    except (OSError, ValueError, AttributeError):
        from_file = None
    if from_file == backend:
        return f'set by "backend": "{backend}" in {config}', config
    return "set by $KERAS_BACKEND or ~/.keras/keras.json", None


# Modules of Keras 2 classes: tf_keras (what `tf.keras` is under
# TF_USE_LEGACY_KERAS=1), Keras 2.13+ (`keras.src.engine`), older Keras 2
# (`keras.engine`) and TensorFlow's own copy before that.
_LEGACY_KERAS_MODULES = (
    "tf_keras.",
    "keras.src.engine.",
    "keras.engine.",
    "tensorflow.python.keras.",
)


def legacy_keras_words(obj):
    """A sentence saying that `obj` is a tf_keras (Keras 2) object gradflow cannot use, or None.

    A tf_keras model met "`model` must be a Keras model, got Sequential" (it
    is one, of Keras 2), and a `GradientMonitor` in a tf_keras `fit` an
    AttributeError from inside tf_keras. Recognised by the modules of its
    class and of the classes it derives from (a user's subclass of
    `tf_keras.Model` lives in `__main__`).
    """
    for kind in type(obj).__mro__:
        module = getattr(kind, "__module__", None) or ""
        if module == "tf_keras" or module.startswith(_LEGACY_KERAS_MODULES):
            return (
                f"this is a tf_keras (Keras 2) model ({type(obj).__name__}); gradflow needs "
                "Keras 3: unset TF_USE_LEGACY_KERAS and build it with `import keras`, or "
                "convert a saved .h5 with `keras.models.load_model('m.h5', compile=False)` "
                "in Keras 3 and save it as .keras"
            )
    return None


def check_not_legacy(name, value):
    """Raises a TypeError in words if `value` is a tf_keras (Keras 2) object (`legacy_keras_words`)."""
    words = legacy_keras_words(value)
    if words is not None:
        raise TypeError(f"`{name}` must be a Keras 3 model or layer: {words}.")
