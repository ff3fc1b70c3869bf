"""Names shared by every part of gradflow: statistics, tidy columns, histogram bins.

This module imports neither TensorFlow nor Streamlit, so the run store, the
figures and the dashboard can all agree on one vocabulary without pulling in
the training stack.

Statistic definitions (the same everywhere in gradflow):

- `max_abs`: the largest absolute entry of the gradient tensor.
- `l2_norm`: the Frobenius (L2) norm of the whole tensor.
- `mean_abs`: the mean of the absolute entries.
- `std`: the population standard deviation (ddof=0) of the entries.
- `zero_fraction`: the share of entries that are exactly zero.
- `nonfinite`: the number of NaN or Inf entries.

When a tensor holds a NaN, `max_abs`, `l2_norm`, `mean_abs` and `std` are NaN
too: a statistic never hides a broken gradient.
"""

import re

STATISTICS = ("max_abs", "l2_norm", "mean_abs", "std", "zero_fraction", "nonfinite")

# One row per step x layer x tensor. `layer_index` is 0 for the layer nearest
# the input. `tensor` is the variable's short name (`kernel`, `bias`,
# `gamma`, ...) or `activation` for the gradient w.r.t. a layer's output.
# `variable` is the Keras `Variable.path` ("" for activations).
KEY_COLUMNS = ("step", "layer", "layer_index", "tensor", "variable")

# Optional per-row columns the monitor fills in when it can (NaN otherwise).
#   weight_norm: L2 norm of the variable after the update (and constraint);
#     before it in the probe fallback of a model with its own train_step.
#   weight_norm_unconstrained: the same before a max-norm constraint ran.
#   update_ratio: ||w_after - w_before|| / ||w_before||.
#   l2_norm_clipped / max_abs_clipped: the gradient after optimizer clipping.
EXTRA_COLUMNS = (
    "weight_norm",
    "weight_norm_unconstrained",
    "update_ratio",
    "l2_norm_clipped",
    "max_abs_clipped",
)

LAYER_STATS_COLUMNS = KEY_COLUMNS + STATISTICS + EXTRA_COLUMNS

ACTIVATION = "activation"

# Rows through time (`GradientMonitor(through_time=True)`): one per time step
# of a sequence; `layer` is "t=01", "t=02", ... and `layer_index` the position
# in time. Like activation rows, they are gradients of no weight.
TIME_STEP = "time_step"


# The labels of rows through time (`gradflow.monitor.through_time.row_labels`).
_TIME_LABEL = re.compile(r"^t=\d+(–\d+)?$")


def is_time_label(layer):
    """Whether `layer` is a row through time's label (`"t=01"`, `"t=001–003"`), not a layer's.

    Events carry a layer, not a tensor: an alert about the gradient through
    time names its first row.
    """
    return bool(_TIME_LABEL.match(str(layer)))


def is_weight(tensor):
    """Whether rows of tensor `tensor` hold a weight's gradient (not a layer output's or a time step's)."""
    return tensor not in (ACTIVATION, TIME_STEP)


def tensor_kind(name):
    """The kind of a variable from its tensor name: `"kernel"` for `"lstm_cell/kernel"` too.

    A recurrent layer keeps its weights in a cell (`simple_rnn_cell/kernel`,
    `forward/lstm_cell/recurrent_kernel`); its input kernel belongs
    with every other layer's kernel in a "Kernels" heatmap.
    """
    return str(name).rsplit("/", 1)[-1]


def is_tensor(name, wanted):
    """Whether tensor `name` is `wanted`: the same name, or of kind `wanted` (`tensor_kind`)."""
    return name == wanted or tensor_kind(name) == wanted


# Per-step scalars of a run, in long form: step, name, value.
# Well-known names: loss, accuracy, learning_rate, global_norm,
# global_norm_clipped, clipped (1.0 when clipping changed the gradients),
# val_loss, val_accuracy, steps_per_second.
METRICS_COLUMNS = ("step", "name", "value")

# Events from the diagnosis rules and the monitor.
EVENT_KINDS = (
    "nonfinite",
    "vanishing",
    "exploding",
    "dead_relu",
    "saturation",
    "no_gradient",
    "info",
)
EVENTS_COLUMNS = ("step", "layer", "kind", "message")

# Histograms of log10|g| with fixed bins, so that every run, step and layer is
# comparable without storing edges. Bin 0 holds |g| < 1e-12 (exact zeros
# included); bins 1..32 cover [1e-12, 1e4) in half decades; the last bin holds
# |g| >= 1e4. Non-finite entries are not binned (see `nonfinite`).
HISTOGRAM_LOW = -12.0
HISTOGRAM_HIGH = 4.0
HISTOGRAM_BIN_WIDTH = 0.5
HISTOGRAM_BINS = int((HISTOGRAM_HIGH - HISTOGRAM_LOW) / HISTOGRAM_BIN_WIDTH) + 2


def histogram_bin_labels():
    """Human-readable labels of the fixed log10|g| histogram bins.

    Returns:
        A list of `HISTOGRAM_BINS` strings such as `"<1e-12"`, `"1e-12..3e-12"`
        and `">=1e4"`.
    """
    labels = [f"<1e{int(HISTOGRAM_LOW)}"]
    edge = HISTOGRAM_LOW
    for _ in range(HISTOGRAM_BINS - 2):
        labels.append(f"10^{edge:g}..10^{edge + HISTOGRAM_BIN_WIDTH:g}")
        edge += HISTOGRAM_BIN_WIDTH
    labels.append(f">=1e{int(HISTOGRAM_HIGH)}")
    return labels


def histogram_bin_centers():
    """log10 centres of the histogram bins (the open ends get half a bin)."""
    centers = [HISTOGRAM_LOW - HISTOGRAM_BIN_WIDTH / 2]
    edge = HISTOGRAM_LOW
    for _ in range(HISTOGRAM_BINS - 2):
        centers.append(edge + HISTOGRAM_BIN_WIDTH / 2)
        edge += HISTOGRAM_BIN_WIDTH
    centers.append(HISTOGRAM_HIGH + HISTOGRAM_BIN_WIDTH / 2)
    return centers


# C0 and C1 control characters (tab, newline, ESC, BEL, DEL, ...): refused in
# run names (`store.check_name`), replaced in figure labels and printed as
# escapes by the CLI. One BEL in a run name broke every image export of it.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Bidirectional embeddings, overrides and isolates (U+202A-U+202E,
# U+2066-U+2069): one in a run name reversed the rest of a caption that listed
# other runs' names, or of a figure's title. Refused in run names too, and
# replaced where shown.
BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")
