"""Polling fragments laid out so that a Streamlit race cannot crash the page (issue #7).

The race, in Streamlit 1.67 (seen on the live page under classroom load,
reproduced on purpose by `tests/apps/fragment_race.py`):

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
"""

import streamlit as st


def isolated_fragment(function, run_every=None):
    """`st.fragment(function, run_every=run_every)`, drawn alone in a new container.

    Args:
        function: The fragment's body.
        run_every: Seconds between automatic reruns, or None.

    Returns:
        A callable that takes `function`'s arguments and draws the fragment.
    """
    fragment = st.fragment(function, run_every=run_every)

    def draw(*args, **kwargs):
        with st.container():
            return fragment(*args, **kwargs)

    return draw
