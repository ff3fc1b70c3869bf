"""Polling fragments that neither crash nor stop on Streamlit's races (issue #7).

Two Streamlit 1.67 races hit a page whose fragments poll (`run_every`) on a
loaded server; both were seen on the live page in classroom benches and are
forced on purpose by small apps in `tests/apps/`.

**A crashed page** (`fragment_race.py`):

1. A fragment asks for a full rerun (`st.rerun(scope="app")`), or a student
   changes a setting; auto-rerun ticks of the page's fragments that the
   browser sent before it saw the new run are queued behind it, so one
   fragment run follows the full run at once.
2. When that fragment run starts, Streamlit drops the deltas of those
   fragments that the full run has not sent yet
   (`ForwardMsgQueue.clear(..., fragment_ids_this_run=...)`), but keeps the
   full run's "finished successfully" message as it is (streamlit/streamlit
   PR #10132, after issue #9921). On a loaded server the event loop lags, so
   the full run's messages often are still unsent.
3. The browser applies the full run without those fragments, then removes
   their containers as stale. The fragment run then re-adds each container at
   its old index, in the order of the ticks: if two fragments share a block
   and the later one comes first, or an element follows a fragment in its
   block, the index points past the end of the block. The frontend throws
   "Bad delta path index", closes its WebSocket for good (no reconnect) and
   the page freezes on whatever it showed; the server logs nothing.

A fragment that is the last element of its block, with no other fragment in
that block, is re-added at the block's end whatever the order: the message
sequence above becomes harmless. `isolated_fragment` gives a fragment a
container of its own, so that holds wherever it is called.

**A page that stops polling** (`lost_interval.py`): a rerun request that
reaches the server just after a script run ended, but before the event loop
sent that run's last messages, starts a new script runner, and Streamlit drops
the old runner's unsent messages ("Ignoring event from non-current
ScriptRunner", debug log only; the comment in `AppSession.request_rerun`
describes it). When that run was a full run whose "new session" message
already reached the browser, the browser has cleared its fragment timers, as
it does for every full run, and the `auto_rerun` messages that would set them
again are among the dropped ones: the page shows its last state, with its
WebSocket open, and never asks again. A reload recovers it.

`isolated_fragment` therefore also draws, in every polling fragment, a
watchdog: a hidden component whose timer restarts each time the fragment is
drawn. When the fragment has not been drawn for `stall_after` seconds, the
browser asks for a rerun of it. If the server has not drawn the fragment for
as long either (no tick came: the browser's timer is gone), the fragment
answers with a full rerun, the only kind that sends the `auto_rerun` interval
again (Streamlit sends it from the run that declares the fragment,
`streamlit/runtime/fragment.py`, `wrap`, not from the fragment's own
reruns). If the server drew it recently, ticks still come and the page is
only slow: a full rerun would add load, so the alarm is logged and left
alone. The browser asks again at doubling intervals, and the server restarts
a fragment at most once a minute, so an overloaded server is not flooded; a
page in a background tab does not ask.

**Ticking from the browser** (`tick_after`): a fragment that draws a ticker
instead of setting `run_every` changes its pace without a full rerun
(Streamlit sends `run_every` only from the full run that declares the
fragment), so its page need not be rerun whole when its run starts or ends;
and a tick that a race drops is sent again by the ticker itself, after
`STALL_AFTER_S` without a redraw. The live page and the compare page tick
this way; `run_every` and its watchdog stay for fragments that poll at one
pace.
"""

import functools
import logging
import re
import time

import streamlit as st

from gradflow.store import StoreGoneError

# A polling fragment is "stalled" after max(STALL_AFTER_S, STALL_TICKS ticks)
# without a redraw: longer than the slow ticks of a busy classroom server,
# so that the watchdog answers a stopped page and not a slow one.
STALL_AFTER_S = 8.0
STALL_TICKS = 4
# The watchdog asks again at doubling intervals, up to this; the server
# restarts one fragment of a page at most once in this time.
STALL_RETRY_MAX_S = 60.0
_LOG = logging.getLogger(__name__)

# Inline, so it needs no static file; kept small (sent with every redraw).
# The timer lives on the element Streamlit mounts the component in, which
# stays the same while the fragment redraws it. The component's element
# takes no space: the watchdog is invisible.
_WATCHDOG_JS = """export default function ({ data, parentElement, setTriggerValue }) {
  const box = parentElement.host ?? parentElement;
  box.closest?.('[data-testid="stElementContainer"]')?.style.setProperty("display", "none");
  const drawn = Date.now();
  const arm = (wait) => {
    clearTimeout(box.gradflowWatchdog);
    box.gradflowWatchdog = setTimeout(() => {
      if (document.hidden) return arm(wait);
      setTriggerValue("stalled", { at: Date.now(), silent_s: (Date.now() - drawn) / 1000 });
      arm(Math.min(2 * wait, data.retry_max_ms));
    }, wait);
  };
  arm(data.after_ms);
  return () => clearTimeout(box.gradflowWatchdog);
}"""


@functools.cache
def _watchdog():
    return st.components.v2.component("gradflow.fragment_watchdog", js=_WATCHDOG_JS)


def _stalled_after(every):
    """Seconds without a redraw after which a fragment ticking every `every` s counts as stopped."""
    return max(STALL_AFTER_S, STALL_TICKS * every)


def _restart_if_stalled(name, run_every, stall_after):
    """Draw the watchdog of fragment `name`; answer its alarm with a full rerun.

    Only when the server has not drawn the fragment either for as long: a
    page whose ticks still arrive (its timer lives; the server or the browser
    is only slow) is left alone, since a full rerun would cost the server
    more than the tick it waits for.
    """
    after = stall_after if stall_after is not None else _stalled_after(run_every)
    # Streamlit reserves "__" in a component's key.
    key = "gradflow.watchdog." + re.sub("_{2,}", "_", name)
    now = time.monotonic()
    seen = st.session_state.get(key + ".seen", {})
    last_drawn = seen.get("drawn", float("-inf"))
    seen["drawn"] = now
    st.session_state[key + ".seen"] = seen
    alarm = _watchdog()(
        key=key,
        # `drawn` changes on every redraw, so the browser restarts the timer.
        data={
            "after_ms": round(after * 1000),
            "retry_max_ms": round(STALL_RETRY_MAX_S * 1000),
            "drawn": time.time(),
        },
        on_stalled_change=_ignore,
    )
    if not alarm.stalled or alarm.stalled.get("at") == seen.get("alarm"):
        return  # no alarm, or one already answered (a trigger can outlive the rerun it asked for)
    seen["alarm"] = alarm.stalled.get("at")
    server_silent_s = now - last_drawn
    if server_silent_s < 0.9 * after:
        _LOG.warning(
            "gradflow: %s: the page saw no redraw for %.0f s, the server drew it %.1f s ago; "
            "slow, not stopped: left alone (issue #7).",
            name,
            alarm.stalled.get("silent_s", 0),
            server_silent_s,
        )
        return
    if now - seen.get("restarted", float("-inf")) < STALL_RETRY_MAX_S:
        return  # restarted less than a minute ago; the browser asks again later
    seen["restarted"] = now
    _LOG.warning(
        "gradflow: %s had not been redrawn for %.0f s although it polls every %g s; "
        "redrawing the whole page to restart its polling (issue #7).",
        name,
        alarm.stalled.get("silent_s", 0),
        run_every,
    )
    st.rerun(scope="app")


def _ignore():
    # A trigger needs a callback to be declared; the fragment reads the value itself.
    pass


# Inline and small (sent with every redraw). Streamlit calls the function
# again, on the same element and without the previous call's cleanup, each
# time the fragment draws the ticker: every call restarts the timer, so the
# next tick waits for the fragment's last redraw (a slow server gets fewer
# ticks, never a queue of them). A tick whose redraw never comes (a rerun
# lost in one of Streamlit's races, a restarted server) is sent again after
# `stall_ms`, then at doubling intervals. A hidden tab does not tick: it
# ticks within `every_ms` of being shown again. With `every_ms` null the
# ticker is drawn idle: mounted, so that a later pace starts at once.
_TICKER_JS = """export default function ({ data, parentElement, setTriggerValue }) {
  const box = parentElement.host ?? parentElement;
  box.closest?.('[data-testid="stElementContainer"]')?.style.setProperty("display", "none");
  clearTimeout(box.gradflowTicker);
  if (data.every_ms === null) return () => clearTimeout(box.gradflowTicker);
  const arm = (wait, next) => {
    clearTimeout(box.gradflowTicker);
    box.gradflowTicker = setTimeout(() => {
      if (document.hidden) return arm(data.every_ms, next);
      try {
        setTriggerValue("tick", Date.now());
      } catch (error) {
        console.warn("gradflow: the ticker could not ask for a rerun", error);
      }
      arm(next, Math.min(2 * next, data.retry_max_ms));
    }, wait);
  };
  arm(data.every_ms, data.stall_ms);
  return () => clearTimeout(box.gradflowTicker);
}"""


@functools.cache
def _ticker():
    return st.components.v2.component("gradflow.ticker", js=_TICKER_JS)


def tick_after(seconds, key="gradflow.ticker"):
    """Reruns the enclosing fragment `seconds` after this redraw of it reaches the browser.

    A timer in the browser, restarted at each redraw, instead of Streamlit's
    `run_every`: the fragment decides its pace at every run (four ticks a
    second until a run's first step, one a second while it trains, none
    once it has ended) without the full rerun of the page that changing
    `run_every` takes, and a tick waits for the previous one's redraw, so a
    busy server gets fewer ticks instead of a queue of them (issue #7). A
    tick that gets no redraw is sent again after `max(STALL_AFTER_S,
    STALL_TICKS * seconds)`, then at doubling intervals up to
    `STALL_RETRY_MAX_S`: that also restarts a fragment whose rerun one of
    Streamlit's races dropped (this module's docstring). Invisible.

    Call it once per fragment run, inside an `isolated_fragment` without
    `run_every`, from the fragment's body; `tick_after(None)` stops the
    ticks. Draw it in every run of the fragment, idle when no ticks are
    needed, at the same place: a component mounts in the browser in several
    steps (a module import among them), and in two classroom benches a
    ticker first drawn at the moment a run left the queue sent nothing for
    24-37 s (cause not found; docs/reliability.md). Mounted from the start,
    nothing has to load at that moment.

    Example:

    ```python
    def status():
        st.write(store.status(run_id))
        if store.status(run_id) == "running":
            tick_after(1.0)

    isolated_fragment(status)()
    ```

    Args:
        seconds: Seconds between a redraw and the next tick, or None: no
            ticks (the ticker waits, mounted).
        key: The ticker's widget key; one ticker per fragment.
    """
    every = None if seconds is None else float(seconds)
    _ticker()(
        key=key,
        # `drawn` changes on every redraw, so the browser restarts the timer.
        data={
            "every_ms": None if every is None else round(every * 1000),
            "stall_ms": None if every is None else round(_stalled_after(every) * 1000),
            "retry_max_ms": round(STALL_RETRY_MAX_S * 1000),
            "drawn": time.time(),
        },
        on_tick_change=_ignore,
    )


def isolated_fragment(function, run_every=None, stall_after=None):
    """`st.fragment(function, run_every=run_every)`, drawn alone in a new container.

    A fragment that polls (`run_every` set) also gets the watchdog described
    in this module's docstring. Draw one fragment of a given `function` per
    page: the watchdog's widget key is made from its name.

    Example:

    ```python
    def status():
        st.write(store.status(run_id))

    isolated_fragment(status, run_every=1.0)()
    ```

    Args:
        function: The fragment's body.
        run_every: Seconds between automatic reruns, or None.
        stall_after: Seconds without a redraw after which a polling fragment
            counts as stopped. Defaults to the larger of `STALL_AFTER_S` and
            `STALL_TICKS` ticks.

    Returns:
        A callable that takes `function`'s arguments and draws the fragment.
    """

    @functools.wraps(function)
    def said(*args, **kwargs):
        # A fragment reruns outside app.py's script, whose `except` says this for a page.
        try:
            return function(*args, **kwargs)
        except StoreGoneError as error:
            st.error(f":material/error: {error}")
            return None

    body = said
    if run_every:
        name = f"{function.__module__}.{function.__qualname__}"

        # Same name as `function`, so the fragment's id is the same as without the watchdog.
        @functools.wraps(function)
        def body(*args, **kwargs):
            _restart_if_stalled(name, run_every, stall_after)
            return said(*args, **kwargs)

    fragment = st.fragment(body, run_every=run_every)

    def draw(*args, **kwargs):
        with st.container():
            return fragment(*args, **kwargs)

    return draw
