"""log10 colour and axis scales labelled in the statistic's real units."""

import math

import numpy as np

# Used when a figure has no positive finite value to derive a range from.
DEFAULT_LOG_RANGE = (-8.0, 0.0)

# Exact zeros (a dead layer) are drawn this many decades below the scale's
# lowest value, at a tick that reads "0": at the bottom decade itself they
# read as "1e-4", a small gradient, which a dead layer is not.
ZERO_GAP = 1.0


def format_decade(exponent):
    """Tick text for 10**exponent: `"1"`, `"10"`, `"100"`, else `"1e-6"`."""
    exponent = int(exponent)
    if 0 <= exponent <= 2:
        return str(10**exponent)
    return f"1e{exponent}"


def decade_ticks(log_min, log_max, max_ticks=8, zero_at=None):
    """Tick positions (log10) and texts for whole decades in a range.

    Args:
        log_min: lower end of the range, in log10 units.
        log_max: upper end of the range, in log10 units.
        max_ticks: at most this many ticks; wide ranges label every 2nd,
            3rd, ... decade. Default 8.
        zero_at: where exact zeros are drawn (`zero_level`), ticked `"0"`
            below the decades, or None (default) for no such tick.

    Returns:
        `(tickvals, ticktext)`, two lists.
    """
    first, last = math.ceil(log_min), math.floor(log_max)
    zero = ([float(zero_at)], ["0"]) if zero_at is not None else ([], [])
    if last < first:
        return zero
    stride = max(1, math.ceil((last - first + 1) / max_ticks))
    exponents = list(range(first, last + 1, stride))
    return zero[0] + [float(e) for e in exponents], zero[1] + [format_decade(e) for e in exponents]


def zero_level(values, log_min):
    """Where exact zeros go on a log scale whose lowest value is `log_min`.

    Args:
        values: numpy array of the values drawn.
        log_min: log10 of the bottom of the values' scale (`log_range`).

    Returns:
        `log_min - ZERO_GAP` if any value is exactly 0, else None (the scale
        needs no place for zeros).
    """
    values = np.asarray(values, dtype=np.float64)
    return log_min - ZERO_GAP if values.size and bool((values == 0).any()) else None


def log_range(values, vmin=None, vmax=None):
    """The log10 range of a colour scale: whole decades around the data.

    Args:
        values: numpy array of the values drawn; zeros, negatives and
            non-finite values are ignored.
        vmin: smallest value on the scale in real units (e.g. `1e-8`), or
            None (default) to take the decade below the smallest positive
            finite value.
        vmax: largest value on the scale in real units, or None (default)
            for the decade above the largest finite value.

    Returns:
        `(log_min, log_max)` with `log_min < log_max`.

    Raises:
        ValueError: if `vmin` or `vmax` is not a positive finite number, or
            `vmin >= vmax`.
    """
    for name, bound in (("zmin", vmin), ("zmax", vmax)):
        if bound is not None and not (np.isfinite(bound) and bound > 0):
            raise ValueError(
                f"`{name}` must be a positive finite number in the statistic's "
                f"units (e.g. 1e-6) or None, got {bound!r}."
            )
    if vmin is not None and vmax is not None and vmin >= vmax:
        raise ValueError(f"`zmin` must be smaller than `zmax`, got zmin={vmin!r}, zmax={vmax!r}.")
    positive = values[np.isfinite(values) & (values > 0)] if values.size else values
    if positive.size:
        data_min = math.floor(math.log10(positive.min()))
        data_max = math.ceil(math.log10(positive.max()))
    else:
        data_min, data_max = DEFAULT_LOG_RANGE
    log_min = math.log10(vmin) if vmin is not None else float(data_min)
    log_max = math.log10(vmax) if vmax is not None else float(data_max)
    if log_max <= log_min:
        # One value, or all data on one side of a user bound: open one decade.
        if vmax is None:
            log_max = log_min + 1.0
        else:
            log_min = log_max - 1.0
    return log_min, log_max


def to_log(values, log_floor, zero_at=None):
    """log10 of values for colouring; zeros go to the floor, non-finite to NaN.

    Args:
        values: numpy array of non-negative statistics.
        log_floor: log10 value given to anything below it, and to zeros
            when `zero_at` is None, so an exactly-zero gradient shows as
            the bottom of the scale.
        zero_at: log10 value given to exact zeros (`zero_level`), or None
            (default) for `log_floor`.

    Returns:
        A float64 array of the same shape; NaN where `values` is NaN or Inf
        (drawn as blank cells with a marker on top).
    """
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    with np.errstate(divide="ignore", invalid="ignore"):
        logged = np.log10(np.where(finite & (values > 0), values, 1.0))
    logged = np.where(finite & (values > 0), np.maximum(logged, log_floor), log_floor)
    if zero_at is not None:
        logged = np.where(values == 0, zero_at, logged)
    return np.where(finite, logged, np.nan)
