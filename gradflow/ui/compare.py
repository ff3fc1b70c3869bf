"""The Compare page's pieces: an A/B launcher and side-by-side charts of several runs."""

import math

import pandas as pd
import streamlit as st

from gradflow import figures, schema
from gradflow.figures.lines import metric_panels
from gradflow.store import UnknownRunError
from gradflow.ui import resources, run_rows
from gradflow.ui.charts import plain_markdown, plain_message
from gradflow.ui.controls import WIDGETS
from gradflow.ui.fragments import isolated_fragment, tick_after
from gradflow.ui.live import (
    ACTIVE,
    LIVE_MAX_COLUMNS,
    NO_ALERTS,
    POLL_SECONDS,
    THROUGH_TIME,
    alert_box,
    more_alerts,
    read_rows,
    run_alerts,
    run_name,
    tensor_label,
)
from gradflow.ui.live_chart import show_live_chart

_SELECTED = "compare.run_ids"
_PICKER = "compare.picker"
_LINKED = "runs"  # the URL's list of compared runs
_ROWS = "compare.rows"  # run id -> the shared rows this session holds for the alerts
# Alert columns side by side: more made each too narrow to read a message.
_ALERT_COLUMNS = 3
_ALERT_COLUMNS_PRESENTED = 2  # at slide size the boxes' text is larger
# The server does not know the window's width: at 800 px, beside the sidebar,
# three columns were about 145 px each, a few words a line. A column narrower
# than this goes to the next line instead (Streamlit wraps only below 640 px
# of window). Style only: `st.html` puts it where it takes no space.
_WRAP_WHEN_NARROW = """<style>
.st-key-compare-alerts [data-testid="stHorizontalBlock"] { flex-wrap: wrap; }
.st-key-compare-alerts [data-testid="stColumn"] { min-width: min(220px, 100%); }
</style>"""
# Boxes shown through time: the story "vanished, came back, vanished again".
_THROUGH_TIME_SHOWN = 3
# While a run trains, "No alerts" is only so far.
_NO_ALERTS_YET = NO_ALERTS.replace("No alerts:", "No alerts so far:")
# Fields worth an A/B lesson, with the choices offered for each.
VARIABLE_FIELDS = {
    spec[0]: spec
    for spec in WIDGETS
    if spec[0]
    in (
        "activation",
        "initializer",
        "optimizer",
        "normalization",
        "clipping",
        "residual",
        "rnn_cell",
    )
}


def _choices(field):
    """The values A and B can take: a switch's are off and on."""
    return VARIABLE_FIELDS[field][3] or [False, True]


def _shown(value):
    return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value


def _pairs():
    """The presets meant to be run side by side, each pair once, in the presets' order."""
    from gradflow.lab.presets import PRESETS

    pairs = {}
    for preset in PRESETS.values():
        if preset.compare_with and (preset.compare_with, preset.key) not in pairs:
            pairs[(preset.key, preset.compare_with)] = (preset, PRESETS[preset.compare_with])
    return pairs


def preset_pairs():
    """Start two lecture presets that belong together ("deep sigmoid vs ReLU + He") at once.

    Each preset names its partner; before, a teacher ran the two one by one
    and then picked both here.
    """
    st.subheader("Lesson pairs: two presets side by side")
    pairs = _pairs()
    key = st.selectbox(
        "Pair",
        list(pairs),
        format_func=lambda k: f"{pairs[k][0].title} vs {pairs[k][1].title}",
        key="compare.pair",
    )
    first, second = pairs[key]
    st.caption(f"**A:** {first.description}  \n**B:** {second.description}")
    if st.button("Start the pair", key="compare.start_pair"):
        manager = resources.run_manager()
        run_ids = [manager.start(p.config, name=p.title) for p in (first, second)]
        st.session_state[_SELECTED] = run_ids
        st.session_state[_PICKER] = run_ids


def ab_launcher(config):
    """Launch the same configuration twice, differing in one field ("relu vs sigmoid")."""
    st.subheader("A/B: same settings, one difference")
    if config is None:
        st.warning("Fix the settings in the sidebar first.")
        return
    field_col, a_col, b_col = st.columns(3)
    field = field_col.selectbox(
        "Vary",
        list(VARIABLE_FIELDS),
        format_func=lambda f: VARIABLE_FIELDS[f][1],
        key="compare.field",
    )
    options = _choices(field)
    # "A" and "B" alone named the boxes for a screen reader (and said nothing
    # of what they choose).
    noun = VARIABLE_FIELDS[field][1]
    value_a = a_col.selectbox(
        f"A: {noun}",
        options,
        format_func=_shown,
        index=options.index(getattr(config, field)) if getattr(config, field) in options else 0,
        key=f"compare.a.{field}",
    )
    default_b = (
        "sigmoid"
        if field == "activation" and value_a != "sigmoid"
        else options[(options.index(value_a) + 1) % len(options)]
    )
    value_b = b_col.selectbox(
        f"B: {noun}",
        options,
        index=options.index(default_b),
        format_func=_shown,
        key=f"compare.b.{field}",
    )
    if st.button("Start comparison", type="primary"):
        if value_a == value_b:
            st.warning("A and B are the same: choose two different values.")
            return
        manager = resources.run_manager()
        run_ids = []
        for value in (value_a, value_b):
            try:
                variant = config.replace(**{field: value}, name=None)
            except ValueError as error:
                st.error(f"{value}: {error}")
                return
            # run_name already says the activation; other fields get named.
            prefix = (
                "" if field == "activation" else f"{VARIABLE_FIELDS[field][1]}: {_shown(value)} · "
            )
            run_ids.append(manager.start(variant, name=prefix + run_name(variant)))
        st.session_state[_SELECTED] = run_ids
        # The picker below has not been drawn yet in this rerun, so it may be set.
        st.session_state[_PICKER] = run_ids


def run_picker():
    """Choose the runs to compare (defaults to the last A/B launch)."""
    runs = resources.run_store().runs()
    if runs.empty:
        return []
    labels = {row.run_id: f"{row.name} ({row.status})" for row in runs.itertuples()}
    # Two runs of the same settings read the same: their ids tell them apart.
    repeated = pd.Series(list(labels.values())).duplicated(keep=False).to_numpy()
    labels = {
        run_id: f"{label} · {run_id}" if twin else label
        for (run_id, label), twin in zip(labels.items(), repeated, strict=True)
    }
    if _PICKER not in st.session_state:
        # A link to a comparison (`?runs=a,b`) opens it; else the last A/B launch.
        linked = [r for r in st.query_params.get(_LINKED, "").split(",") if r]
        st.session_state[_PICKER] = [
            r for r in linked or st.session_state.get(_SELECTED, []) if r in labels
        ]
        gone = len([r for r in linked if r not in labels])
        if gone:
            # Else "Pick two or more runs" alone, as if the link had held none.
            st.warning(
                f"{gone} of the {len(linked)} runs in this link no longer exist (deleted, or "
                "the link is wrong)."
                if gone < len(linked)
                else "The runs in this link no longer exist (deleted, or the link is wrong)."
            )
    # Keep only runs that still exist (one may have been deleted on the Runs page).
    st.session_state[_PICKER] = [r for r in st.session_state[_PICKER] if r in labels]
    chosen = st.multiselect("Runs to compare", list(labels), format_func=labels.get, key=_PICKER)
    # In the link, so that a teacher can send the class this comparison.
    if chosen:
        st.query_params[_LINKED] = ",".join(chosen)
    else:
        st.query_params.pop(_LINKED, None)
    return chosen


def comparison(run_ids):
    """Side-by-side heatmaps with one colour scale, overlaid profiles and loss curves."""
    if len(run_ids) < 2:
        st.info("Pick two or more runs, or start an A/B comparison above.")
        return
    store = resources.run_store()
    active = any(store.status(run_id) in ACTIVE for run_id in run_ids)
    # A container of its own: see gradflow/ui/fragments.py (issue #7).
    isolated_fragment(_charts)(tuple(run_ids), active)


def _charts(run_ids, was_active):
    # Ticks while a run trains (gradflow/ui/fragments.py, `tick_after`).
    tick_after(POLL_SECONDS if _draw_charts(run_ids, was_active) else None)


def _draw_charts(run_ids, was_active):
    """Draws the comparison; returns whether a run is still active."""
    store = resources.run_store()
    infos = []
    for run_id in run_ids:
        try:
            infos.append(store.run_info(run_id))
        except UnknownRunError:
            # A tick keeps the runs it was drawn with: this one was deleted on
            # the Runs page since (the picker leaves it out at the next full rerun).
            continue
    if len(infos) < 2:
        st.info("A compared run was deleted: pick two or more runs.")
        return False
    run_ids = [info["run_id"] for info in infos]
    held = _held_rows(store, run_ids)
    names, stats, metrics, statuses = {}, {}, {}, []
    for run_id, info in zip(run_ids, infos, strict=True):
        name = info["name"] if info["name"] not in names.values() else f"{info['name']} ({run_id})"
        names[run_id] = name
        statuses.append(info["status"])
        # Only what is new since the last tick, shared with every session
        # that shows the run: a whole 40,000-step run's kernel rows took
        # 0.3-0.6 s to read, per run and per tick (forty-first session).
        rows = read_rows(store, info, held[run_id])
        stats[name] = _charted(rows.layer_stats)
        metrics[name] = rows.metrics
    # Names from the store, shown as typed (`plain_markdown`), never as markdown.
    st.caption(
        " · ".join(
            f"{plain_markdown(names[r])}: {plain_markdown(s)}"
            for r, s in zip(run_ids, statuses, strict=True)
        )
    )
    active = any(s in ACTIVE for s in statuses)
    if was_active and not active:
        st.rerun(scope="app")  # once: the run picker shows the new statuses
    if all(frame.empty for frame in stats.values()):
        st.caption("Waiting for the first recorded steps…")
        return active
    ready = {name: frame for name, frame in stats.items() if not frame.empty}
    presentation = st.session_state.get("ui.presentation", False)
    tensor = "kernel"
    if all((frame["tensor"] == schema.TIME_STEP).any() for frame in ready.values()):
        # Recurrent runs (the SimpleRNN/LSTM pair): how far back each one's
        # gradient reaches, side by side on one colour scale.
        tensor = st.radio(
            "Gradients of",
            ["kernel", schema.TIME_STEP],
            # First: what the kernels' heatmap, summed over time, cannot show.
            index=1,
            format_func=tensor_label,
            horizontal=True,
            key="compare.tensor",
            help="Through time: one row per time step of the input sequence, the first at the "
            "bottom; dark bottom rows mean the start of the sequence no longer reaches the output.",
        )
    statistic = st.radio(
        "Statistic",
        ["max_abs", "l2_norm"],
        format_func=figures.style.STATISTIC_LABELS.get,
        horizontal=True,
        key="compare.statistic",
    )
    # Each run gets half the width, as a live-page heatmap does: the same column cap.
    show_live_chart(
        figures.compare_heatmaps(
            ready, statistic, tensor, max_columns=LIVE_MAX_COLUMNS, presentation=presentation
        ),
        "compare.heatmaps",
    )
    left, right = st.columns(2)
    with left:
        show_live_chart(
            figures.compare_profiles(
                ready, statistic=statistic, tensor=tensor, presentation=presentation
            ),
            "compare.profiles",
            run=" vs ".join(ready),
        )
    with right:
        _metric_chart(metrics, presentation)
    _diagnosis(store, infos, names, held, presentation)
    return active


def _metric_chart(metrics, presentation):
    """The runs' loss overlaid, or another metric they recorded, picked under the profiles.

    The loss alone was drawn: "which reached the higher accuracy?" and a
    GAN's `d_loss` could not be compared here.
    """
    choices = metric_choices(metrics.values())
    if not choices:
        return
    metric = choices[0]
    if len(choices) > 1:
        metric = st.selectbox(
            "Metric",
            choices,
            key="compare.metric",
            help="Drawn for each run that recorded it; validation dashed.",
        )
    drawn = [metric, f"val_{metric}"]
    ready = {name: frame for name, frame in metrics.items() if frame["name"].isin(drawn).any()}
    show_live_chart(
        figures.compare_metrics(ready, metric, presentation=presentation),
        "compare.loss",
        run=" vs ".join(ready),
    )


def metric_choices(frames):
    """The metrics any of the runs recorded (their `val_` twins drawn with them): the loss
    first, then as first met."""
    return metric_panels(
        str(name) for frame in frames if len(frame) for name in frame["name"].unique()
    )


def _charted(layer_stats):
    """The rows the comparison draws: the kernels', and the rows through time."""
    if layer_stats.empty:
        return layer_stats
    return layer_stats[layer_stats["tensor"].isin(["kernel", schema.TIME_STEP])]


def _diagnosis(store, infos, names, held, presentation):
    """What the diagnosis rules found in each run, one column per run, under the charts.

    The lesson's sentence ("the rules found vanishing gradients in the
    sigmoid network, nothing in the ReLU one") was only on each run's Live
    page. Each kind is told by its first alert, with a count of the others:
    the full list is the Live page's **Alerts** view.

    Args:
        store: The `RunStore`.
        infos: Each compared run's `RunStore.run_info`, in the picker's order.
        names: The runs' names on this page, by run id.
        held: The runs' shared rows (`_held_rows`), by run id.
        presentation: Whether Presentation style is on.
    """
    st.subheader("What the diagnosis rules found")
    st.html(_WRAP_WHEN_NARROW)
    grid = _in_rows(infos, presentation)
    with st.container(key="compare-alerts"):
        for line in grid:
            # As many columns in a shorter last row: each run's column keeps its width.
            for column, info in zip(st.columns(len(grid[0])), line, strict=False):
                with column:
                    _run_diagnosis(store, info, names[info["run_id"]], held[info["run_id"]])


def _in_rows(infos, presentation):
    """`infos` in rows of at most 3 (2 in Presentation style), as even as they come.

    Four runs are two rows of two, not three and one.
    """
    most = _ALERT_COLUMNS_PRESENTED if presentation else _ALERT_COLUMNS
    per_row = math.ceil(len(infos) / math.ceil(len(infos) / most))
    return [infos[i : i + per_row] for i in range(0, len(infos), per_row)]


def _held_rows(store, run_ids):
    """The server's shared rows of each compared run (`run_rows`), held by this session.

    Held here, not by the live panel, which holds one run at a time. A run
    no longer compared is let go: its rows go once no other session shows it.
    """
    held = {
        run_id: rows
        for run_id, rows in st.session_state.get(_ROWS, {}).items()
        if run_id in run_ids
    }
    for run_id in run_ids:
        if run_id not in held:
            held[run_id] = run_rows.shared_rows(store.path, run_id)
    st.session_state[_ROWS] = held
    return held


def _run_diagnosis(store, info, name, rows):
    """One run's column: its name, then "No alerts" or each kind's first alert."""
    st.markdown(f"**{plain_markdown(name)}**")
    try:
        # Incremental while the run trains: the rules read only the new steps.
        groups = run_alerts(store, info["run_id"], rows)
    except UnknownRunError:
        st.caption("This run was deleted meanwhile.")
        return
    active = info["status"] in ACTIVE
    if not groups:
        if active and not rows.last_step:
            st.caption("Waiting for the first recorded steps…")
        else:
            st.success(_NO_ALERTS_YET if active else NO_ALERTS)
        return
    for kind, group in groups:
        # One box per kind; through time the order is the story, so a few.
        shown = _THROUGH_TIME_SHOWN if kind == THROUGH_TIME else 1
        for alert in group.head(shown).itertuples():
            alert_box(alert.kind)(plain_message(alert.message))
        if len(group) > shown:
            st.caption(_more(kind, len(group) - shown))


def _more(kind, count):
    """ "…and 7 more alerts about vanishing gradients (the Live page's ... lists them)"."""
    if kind == "info":
        return f"…and {more_alerts(kind, count)}."
    return f"…and {more_alerts(kind, count)} (the Live page's **Alerts** view lists them)."
