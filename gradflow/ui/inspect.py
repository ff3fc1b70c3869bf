"""The Inspect page's pieces: pick or upload a model and a batch, take a snapshot, show it.

Uploads go through `gradflow.safe_load_model` and `gradflow.load_arrays`,
which refuse hostile files with a message a person can act on. The snapshot
is one batch, no weight update.
"""

import pathlib
import tempfile

import streamlit as st

from gradflow import figures
from gradflow.diagnosis import no_gradient_message
from gradflow.probe import uploads
from gradflow.probe.uploads import LOSSES
from gradflow.ui.charts import plain_message, show_chart

_RESULT = "inspect.snapshot"
# What the last snapshot was taken of, and what the widgets choose now.
_TAKEN_OF = "inspect.snapshot_of"
_SHOWN = "inspect.chosen"
# The model (and batch) the last snapshot shows, named in its exported files:
# two models' exports were all "Gradient_flow_on_one_batch_kernels.png".
_SUBJECT = "inspect.subject"


def _save_upload(upload, folder):
    # The server picks the file name: the upload's own name never reaches the disk.
    path = pathlib.Path(folder) / f"upload{pathlib.Path(upload.name).suffix.lower()}"
    path.write_bytes(upload.getvalue())
    return path


def snapshot_of_example(name):
    """Snapshot of a built-in example; returns (snapshot, None) or (None, message)."""
    import gradflow
    from gradflow.probe.examples import load_example

    example = load_example(name)
    return gradflow.snapshot(example.model, example.x, example.y, loss=example.loss), None


def snapshot_of_upload(model_file, data_file, loss):
    """Snapshot of an uploaded `.keras` model on an uploaded batch (`gradflow.probe.uploads`).

    Both files are saved under names the server picks, then read, loaded and
    differentiated in a child process with memory and time limits: the
    server never runs an uploaded model itself.

    Returns:
        `(snapshot, None)`, `(snapshot, note)` or `(None, message)`.
    """
    from gradflow.ui.resources import spare_uploads, upload_limits, upload_slots

    timeout, memory_limit = upload_limits()
    slots, count = upload_slots()
    waiting = None
    if not slots.acquire(blocking=False):
        waiting = st.info(
            f"{count} other upload{'s are' if count > 1 else ' is'} being worked out on this "
            "server: yours starts when one ends."
        )
        slots.acquire()
    try:
        if waiting is not None:
            waiting.empty()
        with tempfile.TemporaryDirectory(prefix="gradflow-upload-") as folder:
            return uploads.snapshot_of_upload(
                _save_upload(model_file, folder),
                _save_upload(data_file, folder),
                loss,
                timeout=timeout,
                memory_limit=memory_limit,
                spare=spare_uploads().take(),
            )
    finally:
        slots.release()


def model_source():
    """Widgets to choose a built-in example or upload files; stores the snapshot in the session."""
    from gradflow.probe.examples import EXAMPLES

    source = st.radio(
        "Model", ["Built-in example", "Upload my own"], horizontal=True, key="inspect.source"
    )
    # A snapshot belongs to what it was taken of: another source or example
    # hides it (it stays in the session, and comes back with its choice).
    st.session_state[_SHOWN] = source
    if source == "Built-in example":
        name = st.selectbox("Example", list(EXAMPLES), key="inspect.example")
        st.session_state[_SHOWN] = f"{source}: {name}"
        if st.button("Take snapshot", type="primary"):
            with st.spinner("Computing gradients for one batch…"):
                st.session_state[_RESULT] = snapshot_of_example(name)
                st.session_state[_TAKEN_OF] = st.session_state[_SHOWN]
                st.session_state[_SUBJECT] = name
        return
    from gradflow.ui.resources import spare_uploads, upload_limits

    # TensorFlow starts in a spare child while the files are picked.
    spare_uploads().ensure(upload_limits()[1])
    model_file = st.file_uploader("Keras model (.keras)", type=["keras"], key="inspect.model_file")
    data_file = st.file_uploader(
        "One batch (.npz with x and y, or .csv with a label column)",
        type=["npz", "csv"],
        key="inspect.data_file",
    )
    loss = st.selectbox(
        "Loss",
        list(LOSSES),
        key="inspect.loss",
        help="The model's own is the loss it was compiled with before saving, when that is a "
        "built-in Keras loss.",
    )
    if st.button("Take snapshot", type="primary", disabled=not (model_file and data_file)):
        with st.spinner("Checking the files and computing gradients…"):
            st.session_state[_RESULT] = snapshot_of_upload(model_file, data_file, loss)
            st.session_state[_TAKEN_OF] = st.session_state[_SHOWN]
            st.session_state[_SUBJECT] = f"{model_file.name} on {data_file.name}"


# A snapshot has no training steps: its statistics are filed under step 0.
_ONE_BATCH = "on one batch"


def snapshot_report():
    """Tables and charts of the session's last snapshot."""
    if st.session_state.get(_TAKEN_OF) != st.session_state.get(_SHOWN):
        return
    shot, message = st.session_state.get(_RESULT, (None, None))
    if shot is None:
        if message:
            st.error(message)
        return
    if message:  # a note beside a snapshot
        st.warning(message)
    st.metric("Loss on this batch", f"{shot.loss:.4g}")
    st.caption(
        "One batch, in inference mode, with no weight update: Dropout passes everything "
        "through and BatchNormalization uses its moving statistics, as in `model.predict`. "
        "(`gradflow.snapshot(..., training=True)` takes a training pass.)"
    )
    for layer, tensors in shot.no_gradient.items():
        # The layer's name is the uploaded model's: shown as typed, not as markdown.
        st.warning(plain_message(no_gradient_message(layer, tensors)))
    presentation = st.session_state.get("ui.presentation", False)
    subject = st.session_state.get(_SUBJECT)
    weights, activations, inputs = st.tabs(
        ["Weight gradients", "Activation gradients", "Input sensitivity"]
    )
    with weights:
        kinds = {figures.tensor_kind(t) for t in shot.weights["tensor"]}
        tensor = "kernel" if "kernel" in kinds else figures.ALL_WEIGHTS
        show_chart(
            figures.profile(
                shot.weights, step=0, tensor=tensor, when=_ONE_BATCH, presentation=presentation
            ),
            "inspect.weights",
            run=subject,
        )
        st.dataframe(shot.weights, hide_index=True)
    with activations:
        show_chart(
            figures.profile(
                shot.activations,
                step=0,
                tensor="activation",
                when=_ONE_BATCH,
                presentation=presentation,
            ),
            "inspect.activations",
            run=subject,
        )
        st.dataframe(shot.activations, hide_index=True)
    with inputs:
        from gradflow.figures.lessons import sensitivity_bars

        show_chart(
            sensitivity_bars(shot.inputs, presentation=presentation), "inspect.inputs", run=subject
        )
        st.dataframe(shot.inputs, hide_index=True)
