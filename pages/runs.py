"""Runs: every run in the store, from the dashboard, the CLI or GradientMonitor in a user's script."""

import streamlit as st

from gradflow.store.tables import ACTIVE_STATUSES
from gradflow.ui import resources
from gradflow.ui.charts import plain_markdown, plain_message
from gradflow.ui.live import show_on_live_page
from gradflow.ui.runs_table import (
    DELETION_REMEMBERED,
    delete_several,
    run_labels,
    run_picker,
    runs_table,
)

st.title("Runs")
store = resources.run_store()
# Named: a mistyped GRADFLOW_DB made a new, empty store that read as lost runs.
st.caption(
    "Runs started here, with `gradflow train`, or logged by `GradientMonitor(store=...)` or "
    f"`GradientLog(store=...)` in your own script all land in the same store, `{store.path}`. The table follows them as they train; open "
    "one to watch its gradients live."
)

runs = store.runs()
runs_table(store, runs)
if runs.empty:
    st.stop()

labels = run_labels(runs)
chosen = run_picker(labels)
open_col, rename_col, delete_col = st.columns([1, 2, 1])
if open_col.button("Open in Live training"):
    show_on_live_page(chosen)
with rename_col.form("rename", border=False):
    new_name = st.text_input(
        "New name", value=str(runs.set_index("run_id").loc[chosen, "name"]), max_chars=80
    )
    if st.form_submit_button("Rename"):
        if not new_name.strip():
            st.error("Type a name first.")
        else:
            try:
                store.rename(chosen, new_name)
            except ValueError as error:  # a control character (a pasted tab); a deleted run
                st.error(f"The run was not renamed: {plain_message(error)}")
            else:
                st.rerun()
# A run still training keeps writing: it is stopped first, then deleted.
if store.status(chosen) in ACTIVE_STATUSES:
    if delete_col.button("Stop", help="Asks the run to stop; it can be deleted once stopped."):
        store.request(chosen, "stop")
        st.info("Asked the run to stop; it can be deleted once the table says it has.")
elif delete_col.button("Delete", help="Removes the run and all its statistics."):
    st.session_state["runs.confirm_delete"] = chosen
if st.session_state.get("runs.confirm_delete") == chosen:
    # A student's run name is shown as typed, not as markdown (":red[...]").
    st.warning(f"Delete {plain_markdown(labels[chosen])} and all its data?")
    st.caption(DELETION_REMEMBERED)
    yes, no = st.columns(2)
    if yes.button("Yes, delete"):
        st.session_state.pop("runs.confirm_delete")
        if store.status(chosen) in ACTIVE_STATUSES:  # restarted since the question
            st.error("This run is training again: stop it before deleting it.")
        else:
            store.delete(chosen)
            st.rerun()
    if no.button("Cancel"):
        st.session_state.pop("runs.confirm_delete")
        st.rerun()

delete_several(store, runs, labels)
