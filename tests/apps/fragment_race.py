"""A small Streamlit app that forces the race behind the frozen live page (issue #7).

Two polling fragments, laid out like the live page: `first` after a row of
buttons (the trainer-readiness fragment), `second` below it (the live
panel). After a few ticks `second` asks for a full rerun, as the live panel
does when it has drawn its first step or when its run ends. In that full run
this app reproduces, on purpose, what a loaded classroom server does by
chance:

1. auto-rerun ticks of both fragments arrive while the full run is still
   running (the browser sent them before it saw the new run), `second`'s
   first, so Streamlit queues one fragment run of [second, first] after it;
2. the server's event loop lags, so the full run's messages are still in the
   session's outgoing queue when that fragment run starts. Streamlit then
   drops the full run's unsent deltas of those fragments, but still tells the
   browser that the full run finished successfully; the browser removes the
   two fragments' containers as stale, and the fragment run's first delta
   (`second`'s container) points past the end of its block.

With `?layout=siblings` both fragments sit in the page's main block and the
browser's delta check throws ("Bad delta path index"), after which the
frontend closes its WebSocket for good: the page freezes. With
`?layout=isolated` (the layout gradflow uses) each fragment is the last
element of a container of its own, so the same message sequence is harmless.

The status line "tick N" tells a test whether the page is still following.
"""

import threading
import time

import streamlit as st
from race_tools import this_session, tick
from streamlit.runtime.scriptrunner_utils.script_requests import ScriptRequestType
from streamlit.runtime.scriptrunner_utils.script_run_context import ThreadState

TICK_S = 0.25
# `first` polls too (it has a timer in the browser), but too slowly to tick
# during the test: its tick in the race comes from this app, after `second`'s.
FIRST_TICK_S = 60
RACE_AT_TICK = 4
HOLD_LOOP_S = 1.5


def _pending_fragments(ctx):
    requests = ctx.script_requests
    with requests._lock:
        if requests._state != ScriptRequestType.RERUN:
            return []
        return list(requests._rerun_data.fragment_id_queue)


def _race_setup():
    """Queue ticks of [second, first] behind this full run, then stall the event loop."""
    ctx, session = this_session()
    ids = st.session_state["ids"]
    for name in ("second", "first"):
        session._event_loop.call_soon_threadsafe(session.request_rerun, tick(ctx, ids[name]))
    # Wait until both ticks are queued and this run's new-session message has
    # left for the browser (which then stops its fragment timers), and a
    # little more for ticks the browser had already sent.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
        ids["first"] in _pending_fragments(ctx) and session._browser_queue.is_empty()
    ):
        time.sleep(0.01)
    time.sleep(0.3)
    held = threading.Event()

    def hold():
        held.set()
        time.sleep(HOLD_LOOP_S)

    session._event_loop.call_soon_threadsafe(hold)
    held.wait(10)
    queue = _pending_fragments(ctx)
    return "race: fragment run queued as " + ", ".join(
        next(name for name, id_ in ids.items() if id_ == fragment_id) for fragment_id in queue
    )


def _remember_id(name):
    st.session_state.setdefault("ids", {})[name] = ThreadState.get().fragment_id


def first():
    _remember_id("first")
    st.caption("first fragment (the trainer-readiness line)")


def second():
    _remember_id("second")
    st.session_state["ticks"] = st.session_state.get("ticks", 0) + 1
    st.markdown(f"tick {st.session_state['ticks']}")
    if st.session_state["ticks"] == RACE_AT_TICK and len(st.session_state.get("ids", {})) == 2:
        st.session_state["race"] = True
        st.rerun(scope="app")


race = _race_setup() if st.session_state.pop("race", False) else None
st.title("Fragment race")
# In every full run, at the same place: the fragments keep their ids.
st.caption(race or "race: not yet")
isolated = st.query_params.get("layout") == "isolated"
if isolated:
    with st.container():
        st.columns(3)[0].button("A button")
        st.fragment(first, run_every=FIRST_TICK_S)()
    with st.container():
        st.fragment(second, run_every=TICK_S)()
else:
    st.columns(3)[0].button("A button")
    st.fragment(first, run_every=FIRST_TICK_S)()
    st.fragment(second, run_every=TICK_S)()
