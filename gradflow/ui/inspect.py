"""The Inspect page's pieces: pick or upload a model and a batch, take a snapshot, show it.

Uploads go through `gradflow.safe_load_model` and `gradflow.load_arrays`,
which refuse hostile files with a message a person can act on. The snapshot
is one batch, no weight update.
"""

import pathlib
import re
import tempfile

import streamlit as st

from gradflow import figures
from gradflow.diagnosis import no_gradient_message
from gradflow.ui.charts import show_chart

LOSSES = [
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
    "mse",
    "mae",
]
_RESULT = "inspect.snapshot"
# What the last snapshot was taken of, and what the widgets choose now.
_TAKEN_OF = "inspect.snapshot_of"
_SHOWN = "inspect.chosen"


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
    """Snapshot of an uploaded `.keras` model on an uploaded batch.

    Returns:
        `(snapshot, None)`, or `(None, message)` when a file is refused or the
        batch does not fit the model.
    """
    import gradflow

    with tempfile.TemporaryDirectory(prefix="gradflow-upload-") as folder:
        try:
            model = gradflow.safe_load_model(_save_upload(model_file, folder))
            arrays = gradflow.load_arrays(_save_upload(data_file, folder))
        except gradflow.UnsafeInputError as error:
            return None, f"That file was refused: {error}"
    x = arrays.get("x", arrays.get("x_train"))
    y = arrays.get("y", arrays.get("y_train"))
    if x is None or y is None:
        return None, f"The data file needs arrays named `x` and `y`; it has {sorted(arrays)}."
    try:
        return gradflow.snapshot(model, x, y, loss=loss), None
    except (ValueError, TypeError) as error:
        return None, f"The batch does not fit this model: {plain_error(error)}{_loss_hint(error)}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MESSAGE_LIMIT = 400


def plain_error(error):
    """The sentence of an error that a person needs, without the traceback around it.

    An error raised while TensorFlow traces a function comes as "in user
    code:", the source lines it passed through (with this server's paths),
    then the original error; Keras adds terminal colour codes and the
    arguments of the call. Only the original message is kept, on one line.
    """
    text = _ANSI.sub("", str(error))
    if "in user code:" in text:
        starts = list(re.finditer(r"^\s*\w+(?:Error|Exception): ", text, flags=re.MULTILINE))
        if starts:
            text = text[starts[-1].end() :]
    text = text.split("Arguments received by")[0]
    text = re.sub(r"Exception encountered when calling \S+\.", "", text)
    text = " ".join(text.split())
    if text and text[-1] not in ".!?…":
        text += "."
    return text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 1] + "…"


def _loss_hint(error):
    if "`target` and `output`" not in str(error):
        return ""
    return (
        " Check the loss against the labels: sparse_categorical_crossentropy takes one class "
        "number per sample, categorical_crossentropy one one-hot row per sample."
    )


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
        return
    model_file = st.file_uploader("Keras model (.keras)", type=["keras"], key="inspect.model_file")
    data_file = st.file_uploader(
        "One batch (.npz with x and y, or .csv with a label column)",
        type=["npz", "csv"],
        key="inspect.data_file",
    )
    loss = st.selectbox("Loss", LOSSES, key="inspect.loss")
    if st.button("Take snapshot", type="primary", disabled=not (model_file and data_file)):
        with st.spinner("Checking the files and computing gradients…"):
            st.session_state[_RESULT] = snapshot_of_upload(model_file, data_file, loss)
            st.session_state[_TAKEN_OF] = st.session_state[_SHOWN]


def snapshot_report():
    """Tables and charts of the session's last snapshot."""
    if st.session_state.get(_TAKEN_OF) != st.session_state.get(_SHOWN):
        return
    shot, message = st.session_state.get(_RESULT, (None, None))
    if message:
        st.error(message)
        return
    if shot is None:
        return
    st.metric("Loss on this batch", f"{shot.loss:.4g}")
    for layer, tensors in shot.no_gradient.items():
        st.warning(no_gradient_message(layer, tensors))
    presentation = st.session_state.get("ui.presentation", False)
    weights, activations, inputs = st.tabs(
        ["Weight gradients", "Activation gradients", "Input sensitivity"]
    )
    with weights:
        kinds = {figures.tensor_kind(t) for t in shot.weights["tensor"]}
        tensor = "kernel" if "kernel" in kinds else figures.ALL_WEIGHTS
        show_chart(
            figures.profile(shot.weights, step=0, tensor=tensor, presentation=presentation),
            "inspect.weights",
        )
        st.dataframe(shot.weights, hide_index=True)
    with activations:
        show_chart(
            figures.profile(
                shot.activations, step=0, tensor="activation", presentation=presentation
            ),
            "inspect.activations",
        )
        st.dataframe(shot.activations, hide_index=True)
    with inputs:
        from gradflow.figures.lessons import sensitivity_bars

        show_chart(sensitivity_bars(shot.inputs, presentation=presentation), "inspect.inputs")
        st.dataframe(shot.inputs, hide_index=True)
