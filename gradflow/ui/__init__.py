"""The Streamlit UI layer: the only part of gradflow (with app.py and pages/) that imports streamlit.

Pages stay thin: widgets, one gradflow call, a chart. What they share lives here:
`resources` (one run store and one run manager per server), `controls` (the
training form), `live` (the live panel), `charts` (a figure with its exports).
"""

import pathlib
import sys

# The browser tab's icon, a heatmap glyph (app.py). A local file: a Material
# icon there makes every page load fetch it from fonts.gstatic.com, which an
# offline classroom server's students may not reach.
FAVICON = pathlib.Path(__file__).with_name("favicon.png")


def _run_pages_through_app_py():
    """Leave Streamlit's pages-directory mode, so that every page runs through app.py.

    A Streamlit server whose main script has a `pages/` folder beside it runs
    a requested page's file directly (the old multipage mode) until some
    session has run `st.navigation`. So a link to `/runs` or
    `/compare?runs=...` opened first on a fresh server showed Streamlit's
    list of files (with "app") in a narrow layout, and started no warm
    worker. The first page script to import this package turns that mode
    off and reruns, through app.py, on the page it was asked for.
    """
    try:
        import streamlit as st
        from streamlit.runtime.pages_manager import PagesManager
        from streamlit.runtime.scriptrunner import get_script_run_ctx
    except ImportError:  # another Streamlit: nothing to turn off
        return
    ctx = get_script_run_ctx()
    if not PagesManager.uses_pages_directory or ctx is None or not st.runtime.exists():
        return
    PagesManager.uses_pages_directory = False
    # Imported by app.py itself (the first page opened was `/`): its
    # `st.navigation` comes next, and a rerun here would only cut short the
    # first page run, where a quick click was lost.
    main = pathlib.Path(ctx.main_script_path).resolve()
    frame = sys._getframe(1)
    while frame is not None:
        if pathlib.Path(frame.f_code.co_filename).resolve() == main:
            return
        frame = frame.f_back
    st.rerun()


_run_pages_through_app_py()
