"""The training form: sidebar widgets <-> `RunConfig`, presets and shareable links.

Widget labels are part of gradflow's public contract (tests and screen readers
rely on them): Depth, Width, Activation, Initializer, Optimizer, Learning rate,
Batch size, Dataset, Gradient clipping, Normalization, Residual connections,
Seed. The configuration lives in the URL query, so a link restores it.
"""

import dataclasses

import streamlit as st

from gradflow.lab import config as lab_config
from gradflow.lab.config import RunConfig
from gradflow.lab.datasets import needs_download
from gradflow.lab.presets import PRESETS
from gradflow.store.store import check_name

_WIDTHS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
_BATCH_SIZES = [1, 8, 16, 32, 64, 128, 256, 512, 1024]
_LEARNING_RATES = [
    1e-5,
    1e-4,
    3e-4,
    1e-3,
    3e-3,
    1e-2,
    3e-2,
    0.1,
    0.3,
    1.0,
    3.0,
    10.0,
    100.0,
    1000.0,
]
_STEPS = [50, 100, 200, 300, 500, 1000, 2000, 5000, 10000]
# Steps a second; 0 is full speed (`RunConfig.pace` None).
_PACES = [0, 1, 2, 5, 10, 20, 50, 100]

# (field, label, kind, options). Options None means a number input.
_MAIN = [
    ("architecture", "Architecture", "select", ["mlp", "residual_mlp", "cnn", "rnn"]),
    ("depth", "Depth", "slider", (1, 100)),
    ("width", "Width", "select_slider", _WIDTHS),
    ("activation", "Activation", "select", list(lab_config.ACTIVATIONS)),
    ("initializer", "Initializer", "select", list(lab_config.INITIALIZERS)),
    ("optimizer", "Optimizer", "select", list(lab_config.OPTIMIZERS)),
    ("learning_rate", "Learning rate", "select_slider", _LEARNING_RATES),
    ("batch_size", "Batch size", "select_slider", _BATCH_SIZES),
    # "file" (a data set read from `data_path`) is for the library and the CLI:
    # the dashboard has no widget for a path on the server.
    ("dataset", "Dataset", "select", [d for d in lab_config.DATASETS if d != "file"]),
    ("clipping", "Gradient clipping", "select", list(lab_config.CLIPPINGS)),
    ("normalization", "Normalization", "select", list(lab_config.NORMALIZATIONS)),
    ("residual", "Residual connections", "toggle", None),
    ("seed", "Seed", "number", None),
]
_MORE = [
    ("steps", "Steps", "select_slider", _STEPS),
    ("pace", "Speed limit (steps a second)", "select_slider", _PACES),
    ("clip_value", "Clip threshold", "number_float", None),
    ("init_stddev", "Init stddev (random_normal)", "number_float", None),
    ("dropout", "Dropout", "slider_float", (0.0, 0.9)),
    ("max_norm", "Max-norm constraint (0 = off)", "number_float", None),
    ("rnn_cell", "Recurrent cell", "select", list(lab_config.RNN_CELLS)),
    ("record_every", "Record every N steps", "number", None),
    ("activations", "Record activation gradients", "toggle", None),
    ("histograms", "Record histograms", "toggle", None),
]

# The "?" beside each widget, for a first-year student: what it changes and
# what it does to the gradients.
_HELP = {
    "architecture": "mlp: stacked dense layers. residual_mlp: the same with a shortcut around "
    "each layer. cnn: convolutions, for images. rnn: a recurrent layer, for sequences.",
    "depth": "How many hidden layers. The deeper the network, the clearer vanishing or "
    "exploding gradients show.",
    "width": "Units (or filters, in a cnn) in each hidden layer.",
    "activation": "The function after each hidden layer. sigmoid and tanh flatten out for "
    "large inputs, so the gradient shrinks through each of them; relu passes the gradient of "
    "its positive inputs on unchanged.",
    "initializer": "How the starting weights are drawn. glorot suits sigmoid and tanh; he "
    "(√2 larger) suits relu: the signal keeps its size from layer to layer. random_normal "
    "uses **Init stddev**.",
    "optimizer": "How gradients become weight updates. sgd steps along the gradient (momentum "
    "and nesterov keep a running direction); adam, rmsprop and the like scale each weight's "
    "step, so even small gradients move the weights.",
    "learning_rate": "How big each update is. Too large and the loss jumps about or becomes "
    "NaN; too small and nothing moves.",
    "batch_size": "Examples per step: each step's gradient is the average over its batch.",
    "dataset": "What the network learns: small data sets that come with the dashboard "
    "(mnist, fashion_mnist and cifar10 need a copy on the server).",
    "clipping": "Caps the gradients before each update. value: each entry to ± the threshold; "
    "norm: each weight tensor's gradient to a norm of at most the threshold; global_norm: all "
    "of them together to a joint norm of at most the threshold.",
    "normalization": "batch or layer normalization re-centres and re-scales what goes into "
    "each activation, which keeps sigmoids in their steep range.",
    "residual": "Adds each hidden layer's input to its output: a shortcut the gradient can "
    "flow back along.",
    "seed": "Fixes the starting weights and the order of the data: the same seed gives the "
    "same run.",
    "steps": "How many training steps (one batch each) to run.",
    "pace": "Slows training down so that a class can watch it; full speed is as fast as "
    "the machine goes.",
    "clip_value": "The threshold of **Gradient clipping** (unused when it is none).",
    "init_stddev": "The standard deviation of the starting weights, read only by the "
    "random_normal initializer.",
    "dropout": "The share of units switched off at random at each training step.",
    "max_norm": "After each update, caps the length of each unit's incoming weights at this "
    "value (Keras's MaxNorm). 0 is off.",
    "rnn_cell": "The recurrent layer. lstm and gru have gates that carry the gradient across "
    "many time steps; simple_rnn has none.",
    "record_every": "Record the statistics every N steps: fewer points and less work, for "
    "long runs.",
    "activations": "Also record the gradient of the loss with respect to each layer's output: "
    "what flows back from layer to layer (**Gradients of: Activations**).",
    "histograms": "Also record how each layer's gradient values are spread (the "
    "**Histograms** view).",
}

_FIELD_NAMES = {f.name for f in dataclasses.fields(RunConfig)}
WIDGETS = [spec for spec in _MAIN + _MORE if spec[0] in _FIELD_NAMES]


def keep_across_pages(key, default):
    """Make the widget drawn next under `key` keep its value when the user changes pages.

    Streamlit 1.67 resets a keyed widget to its first option when another
    page draws a widget under the same key (the Compare page draws this
    form's), and drops the value of a widget the page shown does not draw
    (the Runs page draws no Presentation style switch). A value set from
    code survives the first, and a copy under a key no widget has survives
    the second. Call before the widget renders.

    Set from code only in the first run of a page the user has just gone
    to (`app.py` says which): set in every run, a value could undo a change
    the user made while that run ran (a slider moved during a select's
    rerun went back, `tests/test_browser_smoke.py`).
    """
    kept = f"_kept.{key}"
    if key not in st.session_state:
        st.session_state[key] = st.session_state.get(kept, default)
    elif st.session_state.get("ui.arrived"):
        st.session_state[key] = st.session_state[key]
    st.session_state[kept] = st.session_state[key]


def _key(prefix, field):
    return f"{prefix}.{field}"


# Fields whose None ("off") a widget shows as 0.
_ZERO_IS_NONE = {"max_norm", "pace"}


def _to_widget(field, value):
    if field in _ZERO_IS_NONE:
        return float(value or 0)
    return value


def _from_widget(field, value):
    if field in _ZERO_IS_NONE:
        return None if not value else float(value)
    return value


def _shown(field):
    """How a select slider writes its values."""
    if field == "pace":
        return lambda value: "full speed" if not value else f"{value:g}"
    return str


def _with_option(options, value):
    """Keep a value from a link or preset selectable even if it is not a usual choice."""
    if value is None or value in options:
        return list(options)
    return (
        sorted([*options, value])
        if all(isinstance(o, (int, float)) for o in options)
        else [*options, value]
    )


def load_config_into_widgets(config, prefix="cfg"):
    """Put a `RunConfig`'s values into the form's widgets (call before they render).

    Its settings that have no widget (a preset's sequence length, its title)
    stay with the form: `config_from_widgets` keeps them.
    """
    for field, *_ in WIDGETS:
        st.session_state[_key(prefix, field)] = _to_widget(field, getattr(config, field))
    st.session_state[_key(prefix, "_config")] = config
    # A run the CLI trained on a file: the form does not read files on the
    # server (its links would then choose them), so it says the file is missing.
    st.session_state[_key(prefix, "_base")] = dataclasses.replace(config, data_path=None)


def lab_config_of(info):
    """The `RunConfig` a stored run was trained with, or None (a script's `GradientMonitor` or `GradientLog` run)."""
    if info is None or info.get("source") == "monitor":
        return None
    try:
        return RunConfig.from_dict(info.get("config"))
    except (ValueError, TypeError):
        return None


def _initial_config():
    """The configuration in the URL query, or the defaults when the link is broken."""
    query = st.query_params.to_dict()
    if "data_path" in query or query.get("dataset") == "file":
        # Whoever sends the link would choose a file on the server for it to read.
        return RunConfig(), (
            "A link cannot choose a data file on the server: the dashboard trains on its "
            "own data sets (use `gradflow train --data-path` for yours). Using the defaults."
        )
    try:
        settings = {k: v for k, v in query.items() if k in _FIELD_NAMES}
        if not settings and query.get("run"):
            # A link to a run alone (`?run=...`): the form shows that run's
            # settings, not the defaults beside its charts.
            opened = _settings_of_run(query["run"])
            if opened is not None:
                return opened, None
            if _came_from_own_model(query["run"]):
                # Beside a ResNet50's charts the form read "mlp, depth 4, sgd": as if it were that run's.
                st.session_state["_form_note"] = query["run"]
        config = RunConfig.from_query(settings)
        if config.name:
            # Refused when the run starts (`RunStore.create_run`): said here, before.
            check_name(config.name)
        return config, None
    except ValueError as error:
        # Here: gradflow.ui.charts imports this module.
        from gradflow.ui.charts import plain_markdown

        # The error quotes the link's value: escaped, a crafted link's
        # `![...](http://...)` or `[Log in](https://...)` shows as typed.
        return RunConfig(), (
            f"The link's settings were not valid ({plain_markdown(error)}). Using the defaults."
        )


def _came_from_own_model(run_id):
    from gradflow.ui import resources

    try:
        return resources.run_store().run_info(run_id).get("source") == "monitor"
    except ValueError:
        return False


def _settings_of_run(run_id):
    """The lab settings of a stored run (without a server path), or None."""
    # Here: gradflow.ui.resources imports the chart modules, which import this one.
    from gradflow.ui import resources

    try:
        config = lab_config_of(resources.run_store().run_info(run_id))
    except ValueError:  # no such run: the page says so
        return None
    if config is None:
        return None
    try:
        check_name(config.name or "")
    except ValueError:  # named before names were checked: a new run could not keep it
        config = dataclasses.replace(config, name=None)
    return dataclasses.replace(config, data_path=None)


def _render(container, prefix, field, label, kind, options):
    key = _key(prefix, field)
    value = st.session_state.get(key)
    helped = {"help": _HELP.get(field)}
    if kind == "select":
        container.selectbox(label, _with_option(options, value), key=key, **helped)
    elif kind == "select_slider":
        container.select_slider(
            label, _with_option(options, value), key=key, format_func=_shown(field), **helped
        )
    elif kind == "slider":
        container.slider(label, options[0], options[1], key=key, **helped)
    elif kind == "slider_float":
        container.slider(label, options[0], options[1], step=0.05, key=key, **helped)
    elif kind == "toggle":
        container.toggle(label, key=key, **helped)
    # Number boxes take what is typed, with no range of their own: a box with
    # one kept an out-of-range number on show, under Streamlit's note, while
    # Start trained the value before, and an emptied box took its minimum
    # (a clip threshold of 1e-6). RunConfig's check says what is wrong beside
    # the form and beside Start, which it turns off. `value=None` lets an
    # emptied box read None ("enter a number") instead of 0.
    elif kind == "number":
        container.number_input(label, value=None, step=1, key=key, **helped)
    elif kind == "number_float":
        container.number_input(label, value=None, format="%g", key=key, **helped)


def _empty_box(field):
    """The error for a number box left empty, with the range it takes."""
    label = next(label for name, label, *_ in WIDGETS if name == field)
    return ValueError(f"**{label}** is empty: enter a number {lab_config.allowed_range(field)}.")


def _in_words(message):
    """A RunConfig error with each `field` named as its widget is labelled.

    `field` becomes **Label**, and `field='value'` (with or without the
    backticks) becomes **Label** value: "**Architecture** cnn needs an image
    data set (...), got **Dataset** spirals."
    """
    labels = {field: label for field, label, *_ in WIDGETS}

    def said(field, value):
        if field not in labels:
            return None
        return f"**{labels[field]}**" + (f" {value}" if value is not None else "")

    # The form's "off" for an optional number (Max-norm, Speed limit) is 0, not Python's None.
    return lab_config.rename_settings(message, said).replace(
        "must be None or ", "must be 0 (off) or "
    )


def training_form(prefix="cfg", container=None, sync_url=True):
    """Render the training form and return the `RunConfig` it describes.

    Args:
        prefix: Session-state key prefix, so two forms can live on one page.
        container: Where to draw; defaults to the sidebar.
        sync_url: Whether the form reads its first values from, and writes its
            values to, the URL query (shareable links). Defaults to `True`.

    Returns:
        A valid `RunConfig`, or `None` after showing the problem beside the form.
    """
    container = container or st.sidebar
    remembered = _key(prefix, "_config")
    if remembered not in st.session_state:
        config, warning = _initial_config() if sync_url else (RunConfig(), None)
        st.session_state[remembered] = config
        st.session_state[_key(prefix, "_base")] = config
        if warning:
            st.session_state[_key(prefix, "_warning")] = warning
    # Streamlit forgets widget values on pages that do not draw them; refill
    # any that are missing from the last valid configuration of this form.
    last = st.session_state[remembered]
    for field, *_ in WIDGETS:
        keep_across_pages(_key(prefix, field), _to_widget(field, getattr(last, field)))
    if st.session_state.get(_key(prefix, "_warning")):
        container.warning(st.session_state[_key(prefix, "_warning")])
    opened = st.query_params.get("run")
    if sync_url and opened and st.session_state.get("_form_note") == opened:
        container.caption(
            ":material/info: This run was recorded from a model of your own (a script's "
            "GradientMonitor or GradientLog). The settings below are not its settings: they "
            "are for a new lab run."
        )
    # Above the settings, where the eye is when Start turns grey.
    problem = container.empty()

    _preset_picker(container, prefix)
    main = [s for s in WIDGETS if s in _MAIN]
    more = [s for s in WIDGETS if s in _MORE]
    for spec in main:
        _render(container, prefix, *spec)
    with container.expander("More settings"):
        for spec in more:
            _render(st, prefix, *spec)

    try:
        config = config_from_widgets(prefix)
    except ValueError as error:
        st.session_state[_key(prefix, "_problem")] = _in_words(str(error))
        problem.error(st.session_state[_key(prefix, "_problem")], icon=":material/error:")
        return None
    st.session_state.pop(_key(prefix, "_problem"), None)
    if needs_download(config.dataset):
        problem.info(
            f"The {config.dataset} data set is not on this server yet: its first run "
            "downloads it, which needs internet access. The digits data set is always here.",
            icon=":material/download:",
        )
    st.session_state[remembered] = config
    if sync_url:
        # Keep what is not a setting (the open run) in the link.
        others = {k: v for k, v in st.query_params.to_dict().items() if k not in _FIELD_NAMES}
        st.query_params.from_dict({**others, **config.to_query()})
    return config


def form_problem(prefix="cfg"):
    """What is wrong with the form's settings (in its labels' words), or None."""
    return st.session_state.get(_key(prefix, "_problem"))


def config_from_widgets(prefix="cfg"):
    """The `RunConfig` that the form's widgets hold right now.

    Also usable in a widget callback, which runs before the form is drawn
    again: a click that arrives together with a changed setting gets the
    changed setting.

    The settings no widget shows (a preset's or a link's sequence length,
    number of examples, loss, epochs) come from the configuration the form
    was loaded with, a preset's or a link's; so does its name (a preset's
    title), while every setting is still that configuration's. Epochs stay
    while the Steps slider is where it was.

    Args:
        prefix: The form's session-state key prefix. Defaults to `"cfg"`.

    Returns:
        A `RunConfig`.

    Raises:
        ValueError: if a setting is invalid (the message names it).
    """
    values = {
        field: _from_widget(field, st.session_state[_key(prefix, field)]) for field, *_ in WIDGETS
    }
    base = st.session_state.get(_key(prefix, "_base")) or RunConfig()
    for field, is_read in _READ_ONLY_WHEN.items():
        if field in values and not is_read(values) and not _allowed(field, values[field]):
            # A box the run does not read (a clip threshold with clipping off)
            # must not grey out Start; the run keeps the configuration's value,
            # and the box's problem shows once its choice is made.
            values[field] = getattr(base, field)
    for field, _, kind, _ in WIDGETS:
        if kind.startswith("number") and values[field] is None and field not in _ZERO_IS_NONE:
            raise _empty_box(field)
    if values["steps"] != base.steps:
        values["epochs"] = None  # the student chose a length in steps
    config = dataclasses.replace(base, name=None, **values)
    # A preset's runs keep its title until a setting changes.
    return base if config == _unnamed(base) else config


# Settings that only one choice of another setting reads.
_READ_ONLY_WHEN = {
    "clip_value": lambda values: values["clipping"] != "none",
    "init_stddev": lambda values: values["initializer"] == "random_normal",
}


def _allowed(field, value):
    try:
        lab_config.check_setting(field, value)
    except ValueError:
        return False
    return True


def _apply_preset(prefix):
    name = st.session_state[_key(prefix, "_preset")]
    if name in PRESETS:
        load_config_into_widgets(PRESETS[name].config, prefix)


def _unnamed(config):
    return dataclasses.replace(config, name=None)


def _preset_picker(container, prefix):
    names = list(PRESETS)
    with container.expander("Lecture presets", expanded=False):
        st.selectbox(
            "Preset",
            names,
            key=_key(prefix, "_preset"),
            format_func=lambda name: PRESETS[name].title,
        )
        chosen = st.session_state.get(_key(prefix, "_preset"))
        if chosen in PRESETS:
            # The sidebar's box cuts a long title: the caption has it whole.
            st.caption(f"**{PRESETS[chosen].title}.** {PRESETS[chosen].description}")
        st.button(
            "Load preset", key=_key(prefix, "_load_preset"), on_click=_apply_preset, args=(prefix,)
        )
