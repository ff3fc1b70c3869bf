"""A small Streamlit app that forces the race behind the page that stops polling (issue #7).

One polling fragment, `ticker`, shows "tick N". At tick `RACE_AT_TICK` it asks
for a full rerun, as the live panel does when its first step is drawn or its
run ends. In that full run this app reproduces, on purpose, what a loaded
classroom server does by chance:

1. the full run's "new session" message reaches the browser, which clears
   its fragment timers, as it does for every full run;
2. a tick of `ticker` reaches the server after the run has ended but before
   the event loop has handled its remaining messages (here: the event loop is
   held until the run has ended, and then handles the tick first). Streamlit
   starts a new script runner for the tick and drops the old runner's
   messages, among them the `auto_rerun` that would set the browser's timer
   again, and the run's end.

The tick's fragment run still reaches the browser, once; then the page never
asks again. With `?mode=plain` (`st.fragment`) it stays frozen at the tick
after the race; with `?mode=gradflow` (`isolated_fragment`, which draws a
watchdog in the fragment) it resumes after `STALL_AFTER_S`.

With `?mode=ticker` the fragment has no `run_every`: it draws
`gradflow.ui.fragments.tick_after(TICK_S)`, a timer in the browser that the
fragment's own redraw restarts (what the live page does). The tick's
fragment run draws it again, so the page goes on, with no full run.

With `?mode=slow` there is no race: at tick `RACE_AT_TICK` the server's event
loop is held for `SLOW_S` (longer than `STALL_AFTER_S`), as a loaded server
does, so the page sees nothing for a while although its timer lives. The
watchdog's alarm reaches the server behind the ticks the browser sent
meanwhile, finds the fragment just drawn, and is left alone (no full run).

The caption "full runs: N" counts the full runs that reached the browser's
page (the one that loses its tail does not).
"""

import time

import streamlit as st
from race_tools import this_session, tick
from streamlit.runtime.scriptrunner_utils.script_requests import ScriptRequestType
from streamlit.runtime.scriptrunner_utils.script_run_context import ThreadState

from gradflow.ui.fragments import isolated_fragment, tick_after

TICK_S = 0.25
RACE_AT_TICK = 4
STALL_AFTER_S = 2.0
SLOW_S = 3.5


def _lose_this_runs_tail():
    """Hold the event loop until this run has ended, then hand it a tick of `ticker` first."""
    ctx, session = this_session()
    # Wait until this run's "new session" has left for the browser.
    deadline = time.monotonic() + 10
    time.sleep(0.3)
    while time.monotonic() < deadline and not session._browser_queue.is_empty():
        time.sleep(0.01)
    request = tick(ctx, st.session_state["ticker_id"])
    requests = ctx.script_requests

    def hold_then_tick():
        # Runs on the event loop: every message of the rest of this run is
        # queued behind it, and is handled only after the tick's new runner exists.
        until = time.monotonic() + 10
        while time.monotonic() < until and requests._state != ScriptRequestType.STOP:
            time.sleep(0.01)
        session.request_rerun(request)

    session._event_loop.call_soon_threadsafe(hold_then_tick)
    return "race: this run's tail is lost"


def ticker():
    st.session_state["ticker_id"] = ThreadState.get().fragment_id
    st.session_state["ticks"] = st.session_state.get("ticks", 0) + 1
    st.markdown(f"tick {st.session_state['ticks']}")
    if st.session_state["ticks"] == RACE_AT_TICK:
        if st.query_params.get("mode") == "slow":
            this_session()[1]._event_loop.call_soon_threadsafe(time.sleep, SLOW_S)
            return
        st.session_state["race"] = True
        st.rerun(scope="app")
    if st.query_params.get("mode") == "ticker":
        tick_after(TICK_S)


race = _lose_this_runs_tail() if st.session_state.pop("race", False) else None
st.session_state["full_runs"] = st.session_state.get("full_runs", 0) + 1
st.title("Lost interval")
st.caption(f"full runs: {st.session_state['full_runs']}")
st.caption(race or "race: not yet")
if st.query_params.get("mode") == "plain":
    with st.container():
        st.fragment(ticker, run_every=TICK_S)()
elif st.query_params.get("mode") == "ticker":
    isolated_fragment(ticker)()
else:
    isolated_fragment(ticker, run_every=TICK_S, stall_after=STALL_AFTER_S)()
