"""gradflow dashboard: watch gradients flow through a network while it trains.

Start with `bash scripts/serve.sh`, `gradflow serve` or `streamlit run app.py`.
Each page lives in pages/ and stays thin; shared UI code is in gradflow/ui/.
"""

import os
import pathlib
import sqlite3
import sys

import streamlit as st

from gradflow.checks import backend_problem
from gradflow.store import NewerStoreError, StoreGoneError, StoreUpgradeError, default_path
from gradflow.store.trouble import explain
from gradflow.ui import FAVICON, live_chart, resources

st.set_page_config(page_title="gradflow", page_icon=str(FAVICON), layout="wide")

navigation = st.navigation(
    [
        st.Page(
            "pages/live_training.py",
            title="Live training",
            icon=":material/monitoring:",
            default=True,
        ),
        st.Page("pages/compare.py", title="Compare", icon=":material/compare:"),
        st.Page("pages/inspect_model.py", title="Inspect your model", icon=":material/biotech:"),
        st.Page("pages/split_backprop.py", title="Split backprop", icon=":material/link:"),
        st.Page("pages/runs.py", title="Runs", icon=":material/folder_open:"),
    ]
)
# Each page its own tab title, read first by a screen reader (all were "gradflow").
st.set_page_config(page_title=f"{navigation.title} · gradflow")
# gradflow needs Keras on TensorFlow, in this server (built-in examples, the
# split-backprop lesson) and in its workers and upload children (which
# inherit it): a KERAS_BACKEND=jax exported for the user's own scripts, or
# "backend": "jax" in ~/.keras/keras.json, is not the dashboard's. Keras
# reads the choice once, when first imported: nothing above imports it.
# Imported before this line with another backend (another script in this process):
# asked before the variable is set, so that the words name what chose it.
wrong_keras = "keras" in sys.modules and backend_problem(
    "The gradflow dashboard", command="streamlit run app.py"
)
os.environ["KERAS_BACKEND"] = "tensorflow"
try:
    if wrong_keras:
        st.error(f":material/error: {wrong_keras}")
        st.stop()
    # Start the run manager (and its warm worker, which imports TensorFlow in
    # its own process) with the server, not on the first click of Start training.
    resources.run_manager()
    # Plotly.js (also gzipped) and the live-chart module, as static files beside this script (once per server).
    live_chart.publish_assets(pathlib.Path(__file__).parent)
    # The queue and the warm spare as a static file that waiting pages watch (gradflow/ui/board.py).
    resources.run_board()
    # Whether this run is the first of a page the user just went to: the forms
    # then set their widgets' values again (gradflow/ui/controls.py: keep_across_pages).
    st.session_state["ui.arrived"] = st.session_state.get("ui.page") != navigation.url_path
    st.session_state["ui.page"] = navigation.url_path
    navigation.run()
except (StoreGoneError, StoreUpgradeError) as error:
    # A store file moved or deleted under the server, or an older one that could
    # not be upgraded: said in words on every page, where Streamlit showed its
    # "This app has encountered an error".
    st.error(f":material/error: {error}")
except (NewerStoreError, sqlite3.Error) as error:
    # One too new, damaged, on a full or read-only disk, locked for minutes.
    where = default_path()
    st.error(f":material/error: gradflow cannot use its run store: {explain(error, where)}.")
