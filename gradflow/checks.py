"""Argument checks shared by the library: one wording for one kind of mistake.

Every public function that takes a count or a limit checks it here, so that
`True`, `2.0`, `"3"` or `-1` meet the same message everywhere: the argument's
name, the value given and what is allowed. NumPy integers and floats count as
numbers (a value read from an array is often one); booleans do not, although
Python makes `True` an integer, since `every=True` is a mistake, not a 1. A
switch takes only True or False: `activations="no"` is a mistake too, not a yes.
"""

import math
import numbers
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
_LIBRARY_PACKAGES = ("gradflow", "keras", "tensorflow", "tf_keras", "absl", "optree")


def warn_user(message, category=UserWarning):
    """`warnings.warn` shown at the user's own line, not inside gradflow or Keras.

    Keras calls a callback from `fit` through its `CallbackList`, and traces
    a train step through TensorFlow; a fixed `stacklevel` points into them
    (`keras/src/callbacks/callback_list.py`). This finds the first caller
    outside those packages, e.g. the user's `model.fit(...)` line.
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_LIBRARY_PACKAGES):
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
