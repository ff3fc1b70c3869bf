"""The Runs page's table, which follows the store by itself.

Runs reach the store from the dashboard, from `gradflow train` and from a
user's own script with `GradientMonitor(store=...)`; the table must show a
script's run appear and its step count grow without a click. It is a
fragment that reads the store again every `ACTIVE_POLL_SECONDS` while a run
is queued, running or paused, and every `IDLE_POLL_SECONDS` otherwise (a
run from another process may start at any time; one small query). When a
run appears, disappears or changes status, the whole page reruns once, so
the run picker and the buttons below the table show it too.
"""

import hashlib

import streamlit as st

from gradflow.run_settings import run_settings
from gradflow.store import ACTIVE_STATUSES
from gradflow.ui.fragments import isolated_fragment, tick_after

ACTIVE_POLL_SECONDS = 2.0
IDLE_POLL_SECONDS = 10.0

# The columns in a student's words (the store's names are for code).
COLUMNS = {
    "name": "Name",
    "status": "Status",
    "source": "Started from",
    "progress_step": "Step",
    "total_steps": "Planned steps",
    "created_at": st.column_config.DatetimeColumn("Started (UTC)", format="YYYY-MM-DD HH:mm:ss"),
    "run_id": "Run id",
}
# Shown once the store holds runs of several machines (`gradflow import`):
# whose laptop, or which server, a run trained on.
HOST_COLUMN = {"host": "Machine"}
# Shown once a run's name does not say what it trained: a KerasTuner search's
# trials are all named after their model, a renamed lab run after a student.
SETTINGS_COLUMN = {"settings": "Settings"}


def runs_table(store, runs):
    """Draw the table of `runs` (from `store.runs()`), kept up to date from `store`.

    Args:
        store: The `RunStore` to poll.
        runs: The runs the page read in this full run; the picker below the
            table lists them.
    """
    isolated_fragment(_table)(store, _statuses(runs))


def _statuses(runs):
    return tuple(zip(runs["run_id"], runs["status"], strict=True))


def _table(store, drawn):
    runs = store.runs(with_config=True)
    if _statuses(runs) != drawn:
        # A run came, went or changed status: the picker must know.
        st.rerun(scope="app")
    if runs.empty:
        st.info("No runs yet. Start one on the **Live training** page.")
    else:
        columns = dict(COLUMNS)
        runs["settings"] = [
            run_settings(row.source, row.config, row.name) for row in runs.itertuples()
        ]
        if runs["settings"].astype(bool).any():
            columns = {**dict(list(columns.items())[:1]), **SETTINGS_COLUMN, **columns}
        if runs["host"].nunique() > 1:
            columns.update(HOST_COLUMN)
        st.dataframe(runs[list(columns)], hide_index=True, width="stretch", column_config=columns)
    active = runs["status"].isin(ACTIVE_STATUSES).any()
    tick_after(ACTIVE_POLL_SECONDS if active else IDLE_POLL_SECONDS, key="runs.ticker")


def run_labels(runs):
    """`{run_id: "name · status · run_id"}` for `runs`, as the Runs page names them."""
    return {row.run_id: f"{row.name} · {row.status} · {row.run_id}" for row in runs.itertuples()}


def run_picker(labels):
    """The Runs page's "Run" box; returns the id of the run picked.

    It follows the newest run until the user picks one, then keeps that
    one. Its labels hold each run's name and status; when a label changes
    (a rename, a run that ended) the browser still held the old one, which
    the server no longer found, and the box fell back to the first run: a
    Delete right after a Rename asked about another run. So the box is a new
    widget whenever its labels change, given the picked run again.

    Args:
        labels: `run_labels(runs)` of `RunStore.runs()`, newest first, not empty.
    """
    selected = st.session_state.get(_SELECTED)
    if not st.session_state.get(_PICKED) or selected not in labels:
        selected = next(iter(labels))  # the newest; a picked run was deleted
        st.session_state[_PICKED] = False
    st.session_state[_SELECTED] = selected
    key = _PICKER + hashlib.sha1("\n".join(labels.values()).encode()).hexdigest()[:12]
    for old in [k for k in st.session_state if k.startswith(_PICKER) and k != key]:
        del st.session_state[old]
    if key not in st.session_state:
        st.session_state[key] = selected

    def picked():
        st.session_state[_SELECTED] = st.session_state[key]
        st.session_state[_PICKED] = True

    return st.selectbox("Run", list(labels), format_func=labels.get, key=key, on_change=picked)


# Said under both delete questions: a teacher who imports the class's stores
# each week should know that a deleted run stays out of the next import.
DELETION_REMEMBERED = (
    "The store remembers its deletions: importing a store that holds a deleted run "
    "(`gradflow import`) skips it; `--restore-deleted` brings it back."
)


def delete_several(store, runs, labels):
    """The Runs page's "Delete several runs": a teacher's clean-up at a term's end.

    Only runs that have ended can be picked (a training run keeps writing).
    A status box narrows the list, and one button picks every run it shows,
    so 200 failed or interrupted runs are two clicks, not 200. The runs are
    picked by id, not by their place in the table, which new runs shift.

    Args:
        store: The `RunStore`.
        runs: `store.runs()` as the page read it.
        labels: `run_labels(runs)`.
    """
    ended = runs[~runs["status"].isin(ACTIVE_STATUSES)]
    with st.expander(f"Delete several runs ({len(ended)} have ended)"):
        if ended.empty:
            st.caption("Runs can be deleted once they have ended.")
            return
        statuses = st.multiselect(
            "Only runs that are",
            sorted(ended["status"].unique()),
            key=_BULK + "status",
            placeholder="any status",
        )
        shown = ended[ended["status"].isin(statuses)] if statuses else ended
        options = shown["run_id"].tolist()
        key = _BULK + "runs"
        # Runs deleted or restarted since they were picked leave the box.
        st.session_state[key] = [r for r in st.session_state.get(key, []) if r in labels]
        if st.button(f"Pick all {len(options)} shown", key=_BULK + "all"):
            st.session_state[key] = list(dict.fromkeys(st.session_state[key] + options))
        picked = st.multiselect(
            "Runs to delete",
            list(dict.fromkeys(st.session_state[key] + options)),
            format_func=labels.get,
            key=key,
            placeholder="type a name, a status or an id",
        )
        if not picked:
            return
        if st.button(f"Delete {len(picked)} runs", key=_BULK + "delete", type="primary"):
            st.session_state[_BULK + "confirm"] = tuple(picked)
        if st.session_state.get(_BULK + "confirm") != tuple(picked):
            return
        st.warning(f"Delete these {len(picked)} runs and all their data? This cannot be undone.")
        st.caption(DELETION_REMEMBERED)
        yes, no = st.columns(2)
        if yes.button("Yes, delete them", key=_BULK + "yes"):
            st.session_state.pop(_BULK + "confirm")
            restarted = [r for r in picked if store.status(r) in ACTIVE_STATUSES]
            if restarted:  # a run started again since it was picked
                st.error(
                    f"{len(restarted)} of them are training again: stop them first. "
                    "Nothing was deleted."
                )
                return
            store.delete(*picked)
            st.rerun()  # (the box lets go of deleted runs as the page runs again)
        if no.button("Cancel", key=_BULK + "no"):
            st.session_state.pop(_BULK + "confirm")
            st.rerun()


_BULK = "runs.bulk."
_PICKER = "runs.picker."
_SELECTED = "runs.selected"  # the run id the box shows
_PICKED = "runs.picked"  # whether the user chose it (else the newest run is shown)
