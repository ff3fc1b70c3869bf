"""The live panel: Start/Pause/Stop and charts that update while a run trains.

The buttons, the status line and the charts are one `st.fragment` that
follows the run by itself: a timer in the browser (`fragments.tick_after`)
reruns it every second while its run is running or paused, and it stops
ticking once the run has ended. The page itself (title, sidebar settings) is
not rerun over a run's life: not when it starts, leaves the queue, draws its
first step or ends. A run waiting in this server's queue is not polled: its
page follows its place on the run board from the browser
(`gradflow.ui.board`) and reruns the fragment when the run leaves the
queue. Each tick reads only the rows newer than the last step read and
appends them to the run's rows, which the server keeps once for every
session that shows the run (`gradflow.ui.run_rows`), so a long run costs the
same per tick as a short one, and thirty tabs on it as much memory as one.

The heatmaps and the layer lines are drawn with `live_chart.show_live_chart`:
the browser keeps each figure between ticks, and a tick sends only the new
and changed columns (and the layout entries that changed), not the history.
They are decimated to at most `LIVE_MAX_COLUMNS` columns (lines: the figures'
default of 1,000 points) in blocks of a power-of-two number of steps, so the
drawn columns stay put as the run grows: the last, partial column changes and
new ones are added, and every column changes only when the block doubles.
The other views (profile, histograms, loss) go through the same component:
their figures are not built for appending (the loss curve's envelope
decimation moves its points as the run grows), but the update still carries
only the arrays' columns from the first one that changed.

Until a training run's first step is drawn, the panel polls four times a
second: the first column is what the user is waiting for. Before that the
panel is drawn empty, as it will look (disabled view controls, two chart
frames), so nothing moves when the data arrive. The frames are blank Plotly
heatmaps drawn by the live-chart component, so the browser loads Plotly
before the first step arrives, not after (Plotly's cartesian bundle, 1.4 MB
of JavaScript; the full 4.8 MB one took about 1.1 s of a page's main thread
to evaluate, two thirds of what opening the page cost: see
`gradflow/ui/live_chart.py`).
On a server with more open pages than cores, a page without a run, or whose
run waits in the queue, draws plain bordered boxes instead and loads Plotly
once its run is near the front of the queue (`board.PRELOAD_PLACE`) or a
worker has it: a class that opened the page at once loaded 30 copies of
Plotly at once, right after the clicks, and on one 2-core machine its pages
then ran no timer for 30-40 s (issue #7, docs/reliability.md).
"""

import functools
import os
import time

import numpy as np
import pandas as pd
import streamlit as st

from gradflow import diagnosis, export, figures, schema
from gradflow.figures.style import STATISTIC_LABELS, no_data_figure
from gradflow.lab.config import run_name
from gradflow.run_settings import script_settings
from gradflow.store import UnknownRunError
from gradflow.ui import controls, resources, run_rows
from gradflow.ui.board import watch_place, watch_warm
from gradflow.ui.charts import image_export_available, plain_markdown, plain_message
from gradflow.ui.fragments import isolated_fragment, tick_after
from gradflow.ui.live_chart import show_live_chart
from gradflow.ui.sessions import session_ownership

ACTIVE = ("queued", "running", "paused")
# Heard by a screen reader, not seen (the usual visually-hidden recipe).
_UNSEEN = (
    "position:absolute;width:1px;height:1px;overflow:hidden;clip-path:inset(50%);white-space:nowrap"
)
POLL_SECONDS = 1.0
# While a just-started run has drawn nothing yet, for at most FIRST_POLL_FOR_S.
FIRST_POLL_SECONDS = 0.25
FIRST_POLL_FOR_S = 20.0
# While a run waits in the queue only its place changes; a class puts most of
# its runs there at once, and every tick costs the shared server a script run.
# (Only without a run board, or for a run queued by another process.)
QUEUED_POLL_SECONDS = 2.0
# While the spare worker warms up, on a server without a run board.
WARMING_POLL_SECONDS = 1.0
# Heatmap columns drawn live (exports keep the figures' default of 1,000).
LIVE_MAX_COLUMNS = 500
_EMPTY_HEIGHT = 380  # px, an empty chart frame: as tall as a heatmap
_CURRENT = "live.run_id"
# The runs this browser session started (a second Start stops the one before).
_STARTED = "live.started"
_PLOTLY_EARLY = "live.plotly_early"
# The Speed limit the form had at the page's last run (a change goes to the open run).
_PACE_SHOWN = "live.pace_shown"
_FOLLOWED = "live.followed"  # runs this session saw active and has not redrawn since they ended

_STATUS_TEXT = {
    "queued": ":material/hourglass_top: Waiting in the queue",
    "running": ":material/directions_run: Training",
    "paused": ":material/pause: Paused",
    "completed": ":material/check_circle: Completed",
    "stopped": ":material/stop_circle: Stopped",
    "diverged": ":material/error: Diverged (the loss or a gradient became NaN or infinite)",
    "interrupted": ":material/warning: Interrupted (the worker or the server stopped unexpectedly)",
    "failed": ":material/cancel: Failed",
}
_VIEWS = ["Heatmaps", "Lines", "Profile", "Histograms", "Loss", "Alerts"]
_TENSOR_LABELS = {
    "kernel": "Kernels",
    # An RNN's weights from one time step to the next: where gradients
    # vanish through time.
    "recurrent_kernel": "Recurrent kernels",
    "bias": "Biases",
    # A normalization layer's scales and shifts (ResNet's 52 BatchNorms) were
    # only inside "All weights", between the convolutions' rows.
    "gamma": "Norm. scales (gamma)",
    "beta": "Norm. shifts (beta)",
    "depthwise_kernel": "Depthwise kernels",
    "embeddings": "Embeddings",
    "activation": "Activations",
    figures.ALL_WEIGHTS: "All weights",
    # A sequence's time steps (recurrent lab runs, `through_time` monitors).
    schema.TIME_STEP: "Through time",
}


def current_run():
    """The run the live page shows in this browser session, or None.

    After a page reload the session is new, but the run id is in the URL:
    the new session takes the run over.
    """
    if _CURRENT not in st.session_state and st.query_params.get("run"):
        open_run(st.query_params["run"])
    return st.session_state.get(_CURRENT)


def open_run(run_id):
    """Show `run_id` on the live page of this browser session, and own it."""
    st.session_state[_CURRENT] = run_id
    st.query_params["run"] = run_id
    session_ownership().claim(run_id)


def show_on_live_page(run_id):
    """Go to the Live training page with `run_id` open and its settings in the form.

    The link keeps both, so a reload keeps the run, and Start training trains
    what the page shows. Runs logged by a user's own `GradientMonitor` have
    no lab settings: the form keeps its own.
    """
    open_run(run_id)
    query = {"run": run_id}
    config = controls.lab_config_of(resources.run_store().run_info(run_id))
    if config is not None:
        controls.load_config_into_widgets(config)
        query.update(config.to_query())
    st.switch_page("pages/live_training.py", query_params=query)


def live_page(config):
    """Start/Pause/Stop, the status of this session's run and its live charts.

    One fragment, alone in its container, that follows the run on its own:
    it reruns on a timer in the browser (`fragments.tick_after`), at a pace
    it chooses at each run, and stops ticking once the run has ended. A run
    starting, leaving the queue, drawing its first step or ending costs
    one fragment run, never a rerun of the whole page with its sidebar: in
    a class of 30 on one 2-core server those full reruns queued behind each
    other and pages fell seconds behind their runs (issue #7). The buttons
    are in the fragment so that they follow the run too.

    Args:
        config: The `RunConfig` from the form, or None while it is invalid
            (Start training is then disabled).
    """
    isolated_fragment(_live)(config)


def _live(config):
    run_id = current_run()
    store = resources.run_store()
    info = None
    if run_id is not None:
        try:
            info = store.run_info(run_id)
        except ValueError:
            st.session_state.pop(_CURRENT, None)
            st.query_params.pop("run", None)
    status = info["status"] if info else None
    script = _recorded_by(info) if info else None
    control_buttons(config, run_id, status, script)
    _follow_speed_limit(config, run_id, status, script)
    paces = [_trainer_readiness(status)]
    if run_id is not None and info is None:
        st.warning("That run no longer exists (or the link is wrong).")
    else:
        paces.append(live_panel(info))
    paces = [pace for pace in paces if pace]
    # Drawn in every run, idle when nothing needs ticks (fragments.tick_after).
    tick_after(min(paces) if paces else None)


def control_buttons(config, run_id, status, script=None):
    """Start training / Pause / Stop / Step once for this session's run.

    Args:
        config: The form's `RunConfig`, or None while it is invalid.
        run_id: The open run, or None.
        status: Its status, or None.
        script: `"GradientMonitor"` or `"GradientLog"` for a run a script
            records (it obeys the buttons in the script's own process, after
            **Take control**), else None.
    """
    store = resources.run_store()
    start, pause, stop, step = st.columns([2, 1, 1, 1])
    # A callback runs before the script: the click costs one run, not two.
    start.button(
        "Start training",
        type="primary",
        disabled=config is None,
        width="stretch",
        on_click=_start_run,
    )
    paused = status == "paused"
    # A run this page did not start (a shared link, a run from another tab)
    # is watched: a student's Pause paused the teacher's demo for everyone.
    watched = status in ACTIVE and not _started_here(run_id)
    if pause.button(
        "Resume" if paused else "Pause",
        # One element whichever its label: a new one lost the keyboard's
        # focus, and Space no longer resumed what it had paused.
        key="live.pause",
        disabled=status not in ("running", "paused") or watched,
        width="stretch",
    ):
        store.request(run_id, "resume" if paused else "pause")
        if script and not paused:
            # Resumed once this tab is gone, rather than left waiting for ever.
            session_ownership().paused_script(run_id)
    if stop.button("Stop", disabled=status not in ACTIVE or watched, width="stretch"):
        store.request(run_id, "stop")
    if step.button(
        "Step once",
        disabled=not paused or watched,
        width="stretch",
        help=_STEP_ONCE_SCRIPT if script == "GradientMonitor" else _STEP_ONCE,
    ):
        store.request(run_id, "step")
        if script:
            session_ownership().paused_script(run_id)
    if watched:
        note, take = st.columns([4, 1])
        note.caption(
            _SCRIPT_WATCHED.format(script=script)
            if script
            else "This run was started in another tab or by someone else: watching it here "
            "does not pause or stop it."
        )
        take.button(
            "Take control",
            width="stretch",
            help="Pause, Stop and Step once then act on this run, for everyone watching it.",
            # Before the fragment runs again, so that the buttons above are on in that run.
            on_click=lambda: st.session_state.setdefault(_STARTED, set()).add(run_id),
        )
    elif script == "GradientLog" and status in ACTIVE:
        st.caption(_LOG_STOP)
    if config is None and controls.form_problem():
        # Also here, beside the grey button: the sidebar's message may be far
        # above the box that caused it, out of view.
        st.warning(
            controls.form_problem() + " Start training is off until it is fixed in the sidebar.",
            icon=":material/error:",
        )


# A script's run is the user's own more often than a classmate's: say what
# taking control does to it.
_SCRIPT_WATCHED = (
    "This run trains in a script (`{script}`). **Take control** to pause, step or stop it from "
    "here: the script waits while it is paused."
)
_STEP_ONCE = "While paused: train exactly one more step."
# `fit` calls the monitor once per call of its train function.
_STEP_ONCE_SCRIPT = (
    "While paused: train one more step (one call of several steps, for a `fit` with "
    "`steps_per_execution` above 1)."
)
# Stop cannot end a hand-written loop from outside, as it ends `fit`.
_LOG_STOP = (
    "Stop sets `log.stop_training` in the script: its loop ends when it reads it "
    "(`if log.stop_training: break`)."
)


def _started_here(run_id):
    """Whether this browser session started the run, or took control of it."""
    return run_id in st.session_state.get(_STARTED, ())


def _follow_speed_limit(config, run_id, status, script=None):
    """Send a Speed limit moved during the page's own run to that run.

    A teacher slows a run down in the middle of a demo to talk over a
    heatmap: the limit applied only from the next Start, silently.
    """
    if config is None:
        return
    before = st.session_state.get(_PACE_SHOWN, config.pace)
    st.session_state[_PACE_SHOWN] = config.pace
    if config.pace == before or status not in ACTIVE:
        return
    if not _started_here(run_id) or script:
        st.toast("The new **Speed limit** is for the runs you start here: this one is not.")
        return
    resources.run_store().request_pace(run_id, config.pace)
    speed = "full speed" if config.pace is None else f"at most {config.pace:g} steps a second"
    st.toast(f"This run now trains {speed}.")


def _start_run():
    try:
        config = controls.config_from_widgets()
    except ValueError:  # The form shows why on this run; nothing starts.
        return
    _stop_the_run_this_page_started()
    run_id = resources.run_manager().start(config, name=run_name(config))
    st.session_state.setdefault(_STARTED, set()).add(run_id)
    open_run(run_id)


def _stop_the_run_this_page_started():
    """Stop the open run before a new one, if this page started it and it still trains.

    The page shows one run: a second Start once left the first training out
    of sight, taking a slot of a shared server. A run this page only opened
    (a shared link) is someone else's and trains on.
    """
    previous = st.session_state.get(_CURRENT)
    if previous is None or not _started_here(previous):
        return
    store = resources.run_store()
    try:
        info = store.run_info(previous)
    except ValueError:  # deleted meanwhile
        return
    if info["status"] not in ACTIVE:
        return
    if _recorded_by(info):
        # A script's run, taken control of, is the user's own training: a new
        # lab run beside it must not stop it, nor leave it paused out of sight.
        if info["status"] == "paused":
            store.request(previous, "resume")
            st.toast(
                f"Resumed **{plain_markdown(info['name'])}** (your script) to start the new "
                "run; it trains on, on the Runs page."
            )
        return
    message = "Stopped: a new run was started from its page."
    if not store.set_status(previous, "stopped", message, only_from=("queued",)):
        store.request(previous, "stop")
    st.toast(
        f"Stopped **{plain_markdown(info['name'])}** to start the new run; it stays on the Runs page."
    )


def _trainer_readiness(status=None):
    """The trainer line; returns the ticks it needs (seconds), or None.

    A fresh server spends a few seconds importing TensorFlow in its spare
    worker; say so, so that a slow first start does not look like a hang.
    Not while the open run trains: the spare warming then is the one for
    the next start, and the line read as if this run were still loading.

    Args:
        status: the open run's status, or None.
    """
    manager = resources.run_manager()
    if not manager.prewarm or status in ("running", "paused"):
        return None
    polls = status not in ACTIVE
    board = resources.run_board()
    if manager.wait_warm(0):
        st.caption(":material/bolt: Trainer ready", help="A worker process is warm and waiting.")
        return None
    if not manager.warming():
        # No spare on its way: every slot is busy and the worker that frees
        # one takes the next run, warm (the queue line says so), or a run
        # has just taken the spare and the next one starts after its first step.
        return None
    # Under a finished run the spare is for the next start, not for the run
    # on the page, which reads as if it were still loading.
    ended = status is not None and status not in ACTIVE
    for_whom = " for the next run" if ended else ""
    st.caption(f":material/hourglass_top: Warming up the trainer{for_whom} (loading TensorFlow)…")
    if not polls:
        return None  # the run's own ticks redraw the line
    if board is not None:
        # Watched from the browser, no ticks: the fragment reruns once the
        # spare is warm (gradflow/ui/board.py, issue #7).
        watch_warm(board)
        return None
    return WARMING_POLL_SECONDS


# What a panel shows before its run has any statistics (never written to).
_NOTHING_READ = run_rows.RunRows()


def _appended(old, new):
    """`old` with `new` rows below it (an empty side is skipped, not concatenated)."""
    if new.empty:
        return old
    if old.empty:
        return new.reset_index(drop=True)
    return pd.concat([old, new], ignore_index=True)


_ROWS = "live.cache."  # + run id: the run's shared rows this session holds


def _cache_key(run_id):
    return _ROWS + run_id


def _drawn_steps(run_id):
    """Whether this session has read (and drawn) statistics of `run_id`."""
    cache = st.session_state.get(_cache_key(run_id))
    return cache is not None and cache.last_step > 0


def _rows_of(store, run_id):
    """The server's shared `RunRows` of `run_id`, held by this session while it shows that run."""
    key = _cache_key(run_id)
    rows = st.session_state.get(key)
    if rows is None:
        rows = st.session_state[key] = run_rows.shared_rows(store.path, run_id)
    # Only the run on the panel is held: the rows of a run this session
    # showed before go once no other session shows it.
    for other in [k for k in st.session_state if k.startswith(_ROWS) and k != key]:
        del st.session_state[other]
    return rows


def _read_new(store, run_id, progress_step=0, ended=False, rows=None):
    """The rows of `run_id` read so far, with those new since the last read appended.

    The rows are the server's, shared by every session that shows the run
    (`gradflow.ui.run_rows`): the first session to see a new step reads it
    for all of them. `rows`: the run's `RunRows` held by a page that shows
    several runs; by default the live panel's (`_rows_of`), which holds one.
    """
    cache = _rows_of(store, run_id) if rows is None else rows
    with cache.lock:
        if not cache.loaded:
            cache.layer_stats = store.layer_stats(run_id)
            cache.metrics = store.metrics(run_id)
            cache.histograms = store.histograms(run_id)
            cache.read_after_end = ended
            cache.loaded = True
        elif not 0 < progress_step <= cache.last_step:
            # (Otherwise nothing is new: the store's writer keeps a run's progress
            # at or past its newest statistics. A paused run, a slow one, the full
            # reruns of a page whose run has ended.)
            after = cache.last_step
            new_stats = store.layer_stats(run_id, after_step=after)
            if len(new_stats):
                # The metrics and histograms first: a session drawing
                # meanwhile (without the lock) then never sees statistics
                # newer than its loss curve.
                cache.metrics = _metrics_from(cache.metrics, store, run_id, after)
                cache.histograms = _appended(
                    cache.histograms, store.histograms(run_id, after_step=after)
                )
                cache.layer_stats = _appended(cache.layer_stats, new_stats)
        if ended and not cache.read_after_end:
            # The last validation results come after the last statistics.
            cache.metrics = _metrics_from(cache.metrics, store, run_id, cache.last_step)
            cache.read_after_end = True
        if len(cache.layer_stats):
            cache.last_step = int(cache.layer_stats["step"].max())
    return cache


def _metrics_from(cached, store, run_id, step):
    """`cached` with its metrics from `step` on read again.

    A `fit` writes an epoch's validation results at its last step after that
    step's statistics, which the page may have read already: reading only
    what is after the newest statistics never showed them.
    """
    kept = cached[cached["step"] < step] if len(cached) else cached
    # Step 0: nothing was read yet (rows first read while the run had no
    # step, as the Compare page reads a pair's second run): read them all.
    after = step - 1 if step > 0 else None
    return _appended(kept, store.metrics(run_id, after_step=after))


def live_panel(info, key="live"):
    """The status and live charts of one run; returns the seconds until the next tick, or None.

    A run just handed to a worker is polled four times a second until its
    first step is drawn (at most `FIRST_POLL_FOR_S` after it was created),
    a running or paused one once a second, and a run waiting in this
    server's queue not at all: its page follows its place on the run board
    and reruns the fragment when it leaves the queue. An ended run is not
    polled.

    Args:
        info: The run's `RunStore.run_info`, or None: no run yet.
        key: Prefix of the panel's widget keys.
    """
    if info is None:
        st.info(
            "Choose settings in the sidebar and press **Start training**. "
            "Or load a lecture preset first."
        )
        _empty_heatmaps("The heatmaps of your run appear here.", plotly=_plotly_early())
        return None
    store = resources.run_store()
    run_id, status = info["run_id"], info["status"]
    active = status in ACTIVE
    waiting = _waiting_for_first_step(run_id, info)
    queued = status == "queued" and not waiting
    # A run in this server's queue is watched from the browser on the run
    # board: no ticks until it leaves the queue (gradflow/ui/board.py).
    watched = (
        queued and resources.run_board() is not None and run_id in resources.run_manager().queued()
    )
    pace = None
    if active and not watched:
        pace = FIRST_POLL_SECONDS if waiting else QUEUED_POLL_SECONDS if queued else POLL_SECONDS
    followed = st.session_state.setdefault(_FOLLOWED, set())
    just_ended = not active and run_id in followed
    if active:
        followed.add(run_id)
    elif run_id in followed:
        # The run has just ended: one more tick redraws the panel once more.
        # On a loaded server Streamlit sometimes drops a fragment run's
        # messages (gradflow/ui/fragments.py); the end is the one redraw
        # that no later tick would repeat.
        followed.discard(run_id)
        pace = POLL_SECONDS
    if active and not info["progress_step"]:
        # Nothing is recorded yet: the store's writer keeps a run's progress
        # at or past its newest statistics. These ticks (four a second for a
        # run just started, one every two seconds for a run queued by
        # another process) read nothing more.
        _status_line(info, _NOTHING_READ, status, watched)
        # Plotly at the latest once a worker has the run (module docstring).
        _empty_panel(active=True, plotly=status != "queued" or _plotly_early())
        return pace
    cache = _read_new(store, run_id, int(info["progress_step"] or 0), ended=not active)
    _status_line(info, cache, status, announce=just_ended)
    _charts(info, cache, key)
    if pace == FIRST_POLL_SECONDS and cache.last_step:
        pace = POLL_SECONDS  # the first step is drawn: the normal pace from now on
    return pace


def _plotly_early():
    """Whether this page loads Plotly before a worker has its run (module docstring).

    Decided once per browser session, when it first draws the empty panel.
    """
    if _PLOTLY_EARLY not in st.session_state:
        st.session_state[_PLOTLY_EARLY] = resources.open_sessions() <= (os.cpu_count() or 1)
    return st.session_state[_PLOTLY_EARLY]


def _waiting_for_first_step(run_id, info):
    """Whether the panel should poll fast: a run just handed to a worker, with no step yet."""
    # Not a run waiting in the queue, nor a first step that takes long (a
    # cold worker, a download): fast ticks cost CPU that training needs.
    if info["progress_step"] or _drawn_steps(run_id) or info["status"] not in ("queued", "running"):
        return False
    if info["status"] == "queued":
        # Handed to a worker that has not marked it running yet (a moment).
        return run_id in resources.run_manager().running()
    # Counted from the moment it started running, not from its creation:
    # in a class most runs wait in the queue first.
    return time.time() - max(info["created_at"], info["updated_at"] or 0) < FIRST_POLL_FOR_S


def _charts(info, cache, key):
    run_id, status, run = info["run_id"], info["status"], info["name"]
    store = resources.run_store()
    stats = cache.layer_stats
    presentation = st.session_state.get("ui.presentation", False)
    if stats.empty:
        _empty_panel(active=status in ACTIVE)
        return
    view = st.segmented_control("View", _VIEWS, default="Heatmaps", key=f"{key}.view") or "Heatmaps"
    if view != "Alerts" and status not in ACTIVE:
        _alerts_hint(store, run_id, cache)
    every = (info.get("config") or {}).get("record_every", 1)
    if isinstance(every, int) and every > 1:
        # Else a Step once that changed no chart looked like a step that did nothing.
        st.caption(
            f":material/info: Statistics are recorded every {every} steps (**Record every N "
            "steps**): the charts move at each recorded step, not at every step."
        )
    tensors = _tensor_choices(stats)
    # With clipping the rows also hold the norms after it: what the optimizer applied.
    clipped = export.recorded(stats, "l2_norm_clipped")
    # With a max-norm constraint, the weight norms before and after it.
    constrained = export.recorded(stats, "weight_norm_unconstrained")
    if view in ("Heatmaps", "Lines", "Profile", "Histograms"):
        tensor = st.radio(
            "Gradients of",
            tensors,
            # A recurrent run opens on its lesson, as on the Compare page.
            index=tensors.index(schema.TIME_STEP) if schema.TIME_STEP in tensors else 0,
            format_func=tensor_label,
            horizontal=True,
            key=f"{key}.tensor",
        )
    if view == "Heatmaps":
        left, right = _heatmap_places(presentation)
        show_clipped = clipped and schema.is_weight(tensor)
        heatmaps = functools.partial(
            _live_heatmaps, stats, tensor=tensor, presentation=presentation
        )
        [maxima] = heatmaps(["max_abs"])
        # With clipping, the norms before and after it on one colour scale.
        norms = heatmaps(["l2_norm", "l2_norm_clipped"] if show_clipped else ["l2_norm"])
        with left:
            show_live_chart(maxima, f"{key}.max", run=run)
        with right:
            show_live_chart(norms[0], f"{key}.norm", run=run)
        if show_clipped:
            st.caption(
                ":material/content_cut: Gradient clipping is on: the heatmaps above are the "
                "gradients as computed, before clipping. Below, the norm of what the optimizer "
                "applied, after clipping, on the same colour scale as the norm above."
            )
            show_live_chart(norms[1], f"{key}.clipped", run=run)
        if tensor == schema.TIME_STEP:
            st.caption(
                ":material/timeline: One row per time step of the input sequence, the first at "
                "the bottom: how much a change at that step still moves the network's output "
                "(the gradient of the output with respect to the sequence there: the input, or "
                "an Embedding's output for tokens). Where the bottom rows fade to dark while the "
                "top stays bright, the start of the sequence no longer reaches the output: the "
                "gradient vanishes through time, and the network cannot learn from it. An "
                "LSTM's or GRU's gates carry it further. (Padding reads dark too: a padded, "
                "masked step's gradient is 0, and Keras's `pad_sequences` pads at the front.)"
            )
        if constrained and schema.is_weight(tensor):
            st.caption(
                ":material/straighten: The max-norm constraint is on: **Lines** shows each "
                "layer's weight norm after it and before it. Keras's max-norm caps each unit's "
                "incoming weights (each filter, in a convolution) at the limit, so a whole "
                "layer's norm can reach √units × the limit."
            )
    elif view == "Lines":
        statistic = st.radio(
            "Statistic",
            ["max_abs", "l2_norm", "mean_abs"]
            + (["l2_norm_clipped"] if clipped and schema.is_weight(tensor) else [])
            + (
                ["weight_norm", "weight_norm_unconstrained"]
                if constrained and schema.is_weight(tensor)
                else []
            )
            # How far a step moves a layer's weights: where the gradient becomes learning.
            + (
                ["update_ratio"]
                if export.recorded(stats, "update_ratio") and schema.is_weight(tensor)
                else []
            ),
            format_func=STATISTIC_LABELS.get,
            horizontal=True,
            key=f"{key}.line_stat",
        )
        if statistic == "update_ratio":
            st.caption(
                ":material/info: The update ratio ‖Δw‖/‖w‖ is how far one step moves a "
                "layer's weights, for their size. A rule of thumb: about 1e-3 is healthy; far "
                "below (1e-6) the layer barely learns; far above (1e-1) the steps are too large."
            )
        show_live_chart(
            figures.layer_lines(
                stats, statistic, tensor, power_of_two_blocks=True, presentation=presentation
            ),
            f"{key}.lines",
            run=run,
        )
    elif view == "Profile":
        steps = sorted(stats["step"].unique())
        step = _profile_step(steps, key) if len(steps) > 1 else steps[0]
        show_live_chart(
            figures.profile(stats, step=step, tensor=tensor, presentation=presentation),
            f"{key}.profile",
            run=run,
        )
    elif view == "Histograms":
        _histograms(cache.histograms, stats, tensor, key, presentation, run, _recorded_by(info))
    elif view == "Loss":
        if cache.metrics.empty:
            st.caption("No metrics recorded yet.")
        else:
            # A loop's run (GradientLog): its own metrics too (a GAN's d_loss,
            # g_loss), each step's number as the loop passed it, not Keras's
            # running mean; the chart's caption names any left out.
            show_live_chart(
                figures.metrics_chart(
                    cache.metrics,
                    per_step=export.loop_run(info),
                    presentation=presentation,
                ),
                f"{key}.metrics",
                run=run,
            )
    else:
        _alerts(store, run_id, cache)
    if status not in ACTIVE:
        _lesson_pack_button(info, cache, key)


def _heatmap_places(presentation):
    """Where the max and the norm heatmap go: side by side, or one above the other.

    Presentation style's large fonts take their width from the plot: side by
    side at 1024 px, each heatmap kept about 65 px for its cells. One above
    the other, each has the page's width.
    """
    if presentation:
        return st.container(), st.container()
    st.html(_STACK_WHEN_NARROW)
    with st.container(key="live-heatmaps"):
        return st.columns(2)


# Side by side, a phone held sideways (664 px) left each heatmap about 70 px
# of plot: Streamlit stacks columns only below 640 px of window. Below 720 px
# of panel they stand one above the other. (Style only: Streamlit puts it in
# the page's event container, where it takes no space.)
_STACK_WHEN_NARROW = """<style>
.st-key-live-heatmaps { container-type: inline-size; }
@container (max-width: 720px) {
  .st-key-live-heatmaps [data-testid="stHorizontalBlock"] { flex-direction: column; }
  .st-key-live-heatmaps [data-testid="stColumn"] { width: 100% !important; flex: 1 1 auto !important; }
}
</style>"""


def _empty_panel(active, plotly=True):
    if active:
        st.caption("The first statistics appear after the first recorded step.")
        _empty_heatmaps("Waiting for the first training step…", plotly)
    else:  # They never will: a run that failed before its first step, or was stopped.
        st.caption("This run recorded no statistics.")


def _empty_heatmaps(message, plotly=True):
    # The panel as it will look, empty and disabled, so nothing moves when the
    # first step arrives; with `plotly`, blank heatmaps that make the browser
    # load Plotly before then (module docstring), else bordered boxes.
    presentation = st.session_state.get("ui.presentation", False)
    st.segmented_control("View", _VIEWS, default="Heatmaps", disabled=True)
    st.radio(
        "Gradients of",
        ["kernel", "bias", figures.ALL_WEIGHTS],
        format_func=_TENSOR_LABELS.get,
        horizontal=True,
        disabled=True,
    )
    for column, statistic in zip(
        _heatmap_places(presentation), ("max_abs", "l2_norm"), strict=True
    ):
        with column:
            if plotly:
                show_live_chart(
                    _empty_heatmap(message, statistic, presentation),
                    f"live.empty.{statistic}",
                    exports=False,
                )
            else:
                with st.container(border=True, height=_EMPTY_HEIGHT):
                    st.caption(f"**{STATISTIC_LABELS[statistic]} per layer**")
                    st.caption(message)


@functools.lru_cache(maxsize=8)
def _empty_heatmap(message, statistic, presentation):
    # Built once: a styled Plotly figure takes tens of milliseconds, and
    # drawing it copies it rather than changing it.
    figure = no_data_figure(message, presentation)
    figure.update_layout(title=f"{STATISTIC_LABELS[statistic]} per layer", height=_EMPTY_HEIGHT)
    return figures.Chart(figure, pd.DataFrame())


def lesson_pack_of(info, cache):
    """The lesson pack (zip bytes) of the run the page shows, from the rows it holds."""
    charts = export.run_charts(
        cache.layer_stats,
        cache.metrics,
        presentation=True,
        run=info["name"],
        histograms=cache.histograms,
        # A hand-written loop's own metrics (a GAN's d_loss), as the Loss view draws them.
        per_step=export.loop_run(info),
    )
    # What the Alerts view shows, so the handout says what went wrong too.
    try:
        alerts = _run_events(resources.run_store(), info["run_id"], cache)
    except UnknownRunError:
        # Deleted from another page since this one read it: the button gave no
        # file and no word. The pack is made of what the page shows.
        alerts = None
    return export.lesson_pack(
        charts,
        config=info.get("config"),
        title=f"gradflow: {info['name']}",
        alerts=[] if alerts is None else alerts,
        run_info=info,
        metrics=export.every_metric(cache.metrics, charts.get("metrics"), info["name"]),
    )


def _lesson_pack_button(info, cache, key):
    if not image_export_available():
        st.caption("The lesson pack needs Chromium on the server for its PNG figures.")
        return

    st.download_button(
        "Download lesson pack (.zip)",
        data=functools.partial(lesson_pack_of, info, cache),
        # The run's id after its name, as the CLI's: two runs of one setting
        # (another seed) gave one file name.
        file_name=f"{export.file_stem(info['run_id'], info['name'])}_lesson.zip",
        mime="application/zip",
        key=f"{key}.lesson_pack",
        on_click="ignore",
        help="Figures (PNG + interactive HTML), the data as CSV, the alerts, the settings and a README, for slides and handouts.",
    )


def _live_heatmaps(stats, statistics, *, tensor, presentation):
    """Live heatmaps of `statistics` (layer x step) on one colour scale, at most
    `LIVE_MAX_COLUMNS` columns."""
    return figures.heatmaps_on_one_scale(
        stats,
        statistics,
        tensor,
        max_columns=LIVE_MAX_COLUMNS,
        power_of_two_blocks=True,
        presentation=presentation,
    )


def _profile_step(steps, key):
    """The Profile view's Step slider: at the newest step, following it as the run trains,
    until the student moves it to another step (it stayed where it was first drawn)."""
    chosen, newest = f"{key}.profile_step", f"{key}.profile_newest"
    if st.session_state.get(chosen) in (None, st.session_state.get(newest)) or (
        st.session_state[chosen] not in steps
    ):
        st.session_state[chosen] = steps[-1]
    st.session_state[newest] = steps[-1]
    return st.select_slider(
        "Step", steps, key=chosen, help="Follows the newest step; move it to stay at one."
    )


def tensor_label(tensor):
    """A tensor choice in the dashboard's words ("Kernels", "Through time", ...)."""
    return _TENSOR_LABELS.get(tensor, tensor)


def _tensor_choices(stats):
    present = set(stats["tensor"].unique())
    kinds = {figures.tensor_kind(t) for t in present}  # an RNN's cell/kernel is a kernel
    choices = [t for t in _TENSOR_LABELS if t in kinds and schema.is_weight(t)]
    if any(schema.is_weight(t) for t in present):
        choices.append(figures.ALL_WEIGHTS)
    choices += [t for t in (schema.ACTIVATION, schema.TIME_STEP) if t in present]
    return choices


def _status_line(info, cache, status, watched=False, announce=False):
    """The run's name, status, step and loss, and what its status calls for.

    `announce`: the run has just ended on this page. A screen reader heard
    nothing of it (the line is plain text, rewritten every second while the
    run trains); the end is said once, in a visually hidden alert (a failure
    or a divergence has its own alert box).
    """
    total = info.get("total_steps") or 0
    step = int(info.get("progress_step") or cache.last_step or 0)
    losses = cache.metrics[cache.metrics["name"] == "loss"] if len(cache.metrics) else []
    parts = [_STATUS_TEXT.get(status, status), f"step {step}" + (f" / {total}" if total else "")]
    if len(losses):
        last = losses.iloc[-1]
        # With "Record every N steps" above 1 the loss is that of the last recorded step.
        at = "" if int(last["step"]) == step else f" (at step {int(last['step'])})"
        parts.append(f"loss {last['value']:.4g}{at}")
    line = f"**{plain_markdown(info['name'])}** — " + " · ".join(parts)
    if announce and status in ("completed", "stopped"):
        said = f"Training {status} at step {step}" + (f" of {total}." if total else ".")
        # HTML allowed in this one line: `plain_markdown` has escaped the
        # name's < and > too, which markdown then shows as text, never as tags.
        st.markdown(
            line + f'<span role="alert" style="{_UNSEEN}">{said}</span>', unsafe_allow_html=True
        )
    else:
        st.markdown(line)
    settings = script_settings(info)
    if settings:
        # KerasTuner's trials and a grid search's folds have runs named alike.
        st.caption(plain_message(settings))
    if total:
        st.progress(min(step / total, 1.0))
    if status == "queued":
        queue = resources.run_manager().queued()
        ahead = queue.index(info["run_id"]) if info["run_id"] in queue else 0
        if watched:
            # Its place follows the queue in the browser (gradflow/ui/board.py).
            st.info("All training slots are busy: this run starts when a slot frees.")
            watch_place(resources.run_board(), info["run_id"], ahead)
        else:
            st.info(
                f"All training slots are busy: this run starts when a slot frees ({ahead} ahead of it)."
            )
    if status in ("failed", "interrupted") and info.get("message"):
        st.error(plain_message(info["message"]))
    if status in ("completed", "stopped") and info.get("message"):
        # Why it ended where it did: EarlyStopping, a new run started from its page.
        st.caption(f":material/info: {plain_markdown(info['message'])}")
    if status == "diverged":
        origin = diagnosis.first_nonfinite(cache.layer_stats)
        alone = _loss_alone(cache.metrics)
        if alone is not None and (origin is None or alone[0] < origin.step):
            # The loss overflowed while every gradient was finite (a squared
            # error); the gradients may have followed later.
            later = f" The gradients followed at step {origin.step}." if origin is not None else ""
            st.error(
                f"The loss became {alone[1]} at step {alone[0]} while every gradient was still "
                f"finite: the loss overflowed first.{later} Try a smaller learning rate, or "
                "scale the inputs and targets to about 1."
            )
            return
        where = (
            f" It started at step {origin.step} in layer **{plain_message(origin.layer)}**."
            if origin
            else ""
        )
        loss = _loss_before(cache.metrics, origin.step) if origin else None
        if loss is not None:
            # Every gradient comes from the loss: a NaN loss makes them all NaN,
            # and "the layer nearest the loss" is then only where backprop starts.
            before, at = loss
            where = (
                f" At step {origin.step} the loss itself was {at}"
                + (
                    f" (its last finite value, at step {before[0]}, was {before[1]:.3g})"
                    if before is not None
                    else ""
                )
                + ": the network's outputs blew up, so every gradient was NaN from the last "
                "layer down."
            )
        # A monitor without `stop_on_nonfinite` trains on through its NaNs; a
        # run that halted ends at its first NaN, even one at its last step.
        trained_on = origin is not None and bool(total) and origin.step < step >= total
        ended = (
            " (training went on to its end: `stop_on_nonfinite` was off)."
            if trained_on
            else ", so training stopped."
        )
        if origin is not None and origin.step == 1 and loss is not None:
            # No update came before step 1: no learning rate made this.
            advice = (
                " At the first step no weight had been updated yet, so the learning rate did "
                "not cause it: check the inputs and labels for NaN or Inf values, and the "
                "loss for values it cannot take (a log of 0)."
            )
        else:
            advice = " Try a smaller learning rate, gradient clipping, or normalization."
        st.error("The gradients became NaN or infinite" + ended + where + advice)


def _losses(metrics):
    """The run's loss by step (a float Series, each step once, in order)."""
    losses = metrics[metrics["name"] == "loss"].set_index("step")["value"].astype(float)
    return losses[~losses.index.duplicated(keep="last")].sort_index()


def _loss_alone(metrics):
    """`(step, "NaN"/"infinite")` of the first non-finite loss, or None."""
    losses = _losses(metrics)
    bad = losses[~np.isfinite(losses)]
    if bad.empty:
        return None
    return int(bad.index[0]), "NaN" if np.isnan(bad.iloc[0]) else "infinite"


def _loss_before(metrics, step):
    """`((step, loss) of the last finite loss before it or None, "NaN"/"infinite")` when
    the loss at `step` is not finite, else None."""
    losses = _losses(metrics)
    if step not in losses.index or np.isfinite(losses.loc[step]):
        return None
    earlier = losses[(losses.index < step) & np.isfinite(losses)]
    before = (int(earlier.index[-1]), float(earlier.iloc[-1])) if len(earlier) else None
    return before, "NaN" if np.isnan(losses.loc[step]) else "infinite"


def _recorded_by(info):
    """`"GradientMonitor"` or `"GradientLog"` for a script's run, None for the lab's."""
    if info.get("source") != "monitor":
        return None
    return "GradientLog" if export.loop_run(info) else "GradientMonitor"


def _histograms(histograms, stats, tensor, key, presentation, run, recorded_by=None):
    if histograms.empty:
        if recorded_by is not None:
            # The sidebar's switch is for lab runs; a script's run says so in its code.
            st.info(
                "No histograms in this run: its script records them with "
                f"`{recorded_by}(histograms=True)`."
            )
        else:
            st.info("No histograms in this run: turn on **Record histograms** under More settings.")
        return
    layers = stats.sort_values("layer_index").drop_duplicates("layer")["layer"].tolist()
    with_hist = [layer for layer in layers if layer in set(histograms["layer"])]
    layer = st.selectbox("Layer", with_hist, key=f"{key}.hist_layer")
    hist_tensor = "kernel" if tensor == figures.ALL_WEIGHTS else tensor
    if tensor == figures.ALL_WEIGHTS:
        # A histogram is recorded per tensor; one over a layer's kernel and
        # bias together does not exist, so the chart shows the kernel's.
        st.caption(
            "Histograms are recorded for each tensor on its own: with **All weights** chosen, "
            "this shows the kernels'. Choose another kind above for the others."
        )
    show_live_chart(
        figures.histogram_heatmap(histograms, layer, hist_tensor, presentation=presentation),
        f"{key}.hist",
        run=run,
    )


def _rule_events(store, run_id, cache):
    """What the diagnosis rules find in the statistics read so far.

    The Alerts view of a running run redraws every second: the rules read
    only the steps since the last look (and the few before them they look
    back at), not the whole run each time. They use the thresholds the
    run's monitor was given, so the page says what the monitor said.
    """
    with cache.lock:  # the rows are shared: the rules run once per new step, not per session
        if cache.last_step > cache.diagnosed_step:
            if cache.thresholds is None:
                # Read with the first rows: a monitor writes which layer reads
                # which into the config before it stores any.
                config = store.run_info(run_id).get("config")
                cache.thresholds = diagnosis.run_thresholds(config)
                cache.layer_inputs = diagnosis.run_layer_inputs(config)
            new = diagnosis.diagnose_new(
                cache.layer_stats, cache.diagnosed_step, cache.thresholds, cache.layer_inputs
            )
            cache.found = _appended(cache.found, new)
            cache.diagnosed_step = cache.last_step
        return cache.found


def _alerts_hint(store, run_id, cache):
    """One line under the views of an ended run that has alerts, which only the Alerts view showed.

    Not while it trains: the rules would run at every tick of every page.
    """
    events = _run_events(store, run_id, cache)
    if events is None:
        return
    through, layers = _split_through_time(events)
    words = [ALERT_WORDS[k] for k in layers["kind"].drop_duplicates() if k in ALERT_WORDS]
    came_back = len(through) and through["kind"].iloc[-1] == "info"
    if len(through):
        # An LSTM's gradient fades through time until it learns to carry it.
        words.append(
            "a gradient that vanished through time and came back"
            if came_back
            else "a gradient vanishing through time"
        )
    if words:
        # Good news alone is no warning.
        icon = ":material/info:" if came_back and len(words) == 1 else ":material/warning:"
        st.caption(f"{icon} The diagnosis rules found {', '.join(words)}: see the **Alerts** view.")


def _split_through_time(events):
    """`(events about the gradient through time in step order, the other events)`."""
    about_time = events["layer"].map(schema.is_time_label).to_numpy(bool)
    through = events[about_time].sort_values("step", kind="stable")
    return through, events[~about_time]


# Each kind of alert in a student's words ("... found vanishing gradients").
ALERT_WORDS = {
    "nonfinite": "NaN/Inf gradients",
    "exploding": "exploding gradients",
    "vanishing": "vanishing gradients",
    "dead_relu": "dead ReLUs or saturated units",
    "saturation": "saturated units",
    "no_gradient": "layers no gradient reaches",
}


def _run_events(store, run_id, cache):
    """The run's stored events and what the rules find in what was read, each told once
    (`export.merge_alerts`), or None if there are none."""
    alerts = export.merge_alerts(store.events(run_id), _rule_events(store, run_id, cache))
    return alerts if len(alerts) else None


NO_ALERTS = "No alerts: no vanishing, exploding, dead or non-finite gradients detected."
# Through time, an alert and its coming back are one story, not two kinds.
THROUGH_TIME = "through time"


def run_alerts(store, run_id, rows):
    """What the diagnosis rules found in a run, for a page that shows its alerts.

    The rules run on the steps `rows` got since they last ran (`_rule_events`):
    a page that redraws every second while the run trains costs the rules
    over the new steps, once for every session that shows the run.

    Args:
        store: The `RunStore`.
        run_id: The run.
        rows: The run's `run_rows.RunRows`, as the caller read them this tick
            (`read_rows`).

    Returns:
        The alerts as the Alerts view tells them (`alert_groups`), `[]` when
        there are none.
    """
    events = _run_events(store, run_id, rows)
    return [] if events is None else alert_groups(events, rows.layer_stats)


def read_rows(store, info, rows=None):
    """A run's rows read so far (`run_rows.RunRows`), with those new since the last look.

    Args:
        store: The `RunStore`.
        info: The run's `RunStore.run_info`: its progress says whether
            anything is new, its status whether the run ended.
        rows: The run's `run_rows.RunRows`, held by the caller while it shows
            the run (`run_rows.shared_rows`); by default the live panel's.
    """
    return _read_new(
        store,
        info["run_id"],
        int(info.get("progress_step") or 0),
        ended=info["status"] not in ACTIVE,
        rows=rows,
    )


def alert_groups(events, layer_stats):
    """`events` as the Alerts views tell them: `[(kind, its events)]`.

    The most serious kind first (NaN/Inf, exploding: `export.gravity`),
    then in the order of their first alerts; each kind's events in step
    order, then layers in network order (input first, not as strings:
    dense_2 before dense_10), each message once. The gradient through time's
    alerts come last, as one group (`THROUGH_TIME`) in step order: it
    vanished, came back (an `info`), vanished again.

    Args:
        events: A run's events (`_run_events`), not empty.
        layer_stats: The run's statistics read so far, for the layers' order.
    """
    events = events.drop_duplicates(subset=["kind", "layer", "message"])
    order = layer_stats.drop_duplicates("layer").set_index("layer")["layer_index"]
    events = events.assign(_order=events["layer"].map(order).astype(float).fillna(-1.0))
    events = events.sort_values(["step", "_order"], kind="stable")
    through, events = _split_through_time(events)
    # A run that diverged: its NaN is the lesson, not the explosion two steps before.
    by_kind = sorted(events.groupby("kind", sort=False), key=lambda group: export.gravity(group[0]))
    return by_kind + ([(THROUGH_TIME, through)] if len(through) else [])


def more_alerts(kind, count):
    """ "7 more alerts about dead ReLUs or saturated units": a group's rest, in a student's words.

    Before, the kind's code name: "7 more dead_relu alerts", "2 more info alerts".
    """
    if kind == "info":
        return f"{count} more {'note' if count == 1 else 'notes'}"
    about = (
        "the gradient through time"
        if kind == THROUGH_TIME
        else ALERT_WORDS.get(kind, kind.replace("_", " "))
    )
    return f"{count} more {'alert' if count == 1 else 'alerts'} about {about}"


def alert_box(kind):
    """The Streamlit box an alert of `kind` is shown in (`st.error`, `st.info`, `st.warning`).

    NaN/Inf and exploding gradients wreck training: errors. An `info` event
    (a loss-scale overflow, a gradient come back through time) is no alarm;
    the other kinds are warnings.
    """
    return {"nonfinite": st.error, "exploding": st.error, "info": st.info}.get(kind, st.warning)


def _alerts(store, run_id, cache):
    groups = run_alerts(store, run_id, cache)
    if not groups:
        st.success(NO_ALERTS)
        return
    for kind, group in groups:
        for row in group.head(5).itertuples():
            alert_box(row.kind)(plain_message(row.message))
        if len(group) > 5:
            with st.expander(more_alerts(kind, len(group) - 5)):
                st.dataframe(
                    group.iloc[5:][["step", "layer", "message"]],
                    hide_index=True,
                    width="stretch",
                )
