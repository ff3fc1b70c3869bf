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
from gradflow.probe.labels import label_problem
from gradflow.ui.charts import show_chart

SAVED_LOSS = "the model's own (saved with it)"
# Choice -> (Keras loss name, from_logits). "From logits" is for an output
# layer without softmax/sigmoid: read as probabilities, its scores gave wrong
# gradients.
LOSSES = {
    SAVED_LOSS: (None, None),
    "sparse_categorical_crossentropy": ("sparse_categorical_crossentropy", False),
    "sparse_categorical_crossentropy (from logits)": ("sparse_categorical_crossentropy", True),
    "categorical_crossentropy": ("categorical_crossentropy", False),
    "categorical_crossentropy (from logits)": ("categorical_crossentropy", True),
    "binary_crossentropy": ("binary_crossentropy", False),
    "binary_crossentropy (from logits)": ("binary_crossentropy", True),
    "mse": ("mse", None),
    "mae": ("mae", None),
}
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
    """Snapshot of an uploaded `.keras` model on an uploaded batch.

    Args:
        model_file, data_file: the uploads.
        loss: a key of `LOSSES`.

    Returns:
        `(snapshot, None)`, or `(None, message)` when a file is refused or the
        batch does not fit the model; a snapshot may come with a note instead
        (`(snapshot, note)`) when its loss looks wrong for the model.
    """
    import gradflow

    with tempfile.TemporaryDirectory(prefix="gradflow-upload-") as folder:
        try:
            model = gradflow.safe_load_model(_save_upload(model_file, folder))
            arrays = gradflow.load_arrays(_save_upload(data_file, folder))
        except gradflow.UnsafeInputError as error:
            return None, f"That file was refused: {_for_the_page(error)}"
    from gradflow.lab.datasets import examples_and_targets

    names = _input_names(model)
    if len(names) > 1:
        # A model of several inputs: one array for each, named after it.
        missing = [name for name in names if name not in arrays]
        if missing or "y" not in arrays:
            return None, (
                f"This model takes {len(names)} inputs ({', '.join(names)}): the .npz file "
                "needs an array for each, named after the input, and `y`; it has "
                f"{sorted(arrays)}."
            )
        pair = {name: arrays[name] for name in names}, arrays["y"]
    else:
        pair = examples_and_targets(arrays)
    if pair is None and "x_train" in arrays and "y_train" in arrays:
        pair = arrays["x_train"], arrays["y_train"]
    if pair is None:
        return None, f"The data file needs arrays named `x` and `y`; it has {sorted(arrays)}."
    x, y = pair
    bad = _nonfinite_count(x)
    if bad:
        # The compiled pass gives a finite loss all the same: numbers that mean nothing.
        return None, (
            f"The inputs hold {bad} NaN or infinite value(s): gradients of them mean nothing. "
            "Fill or drop those examples first."
        )
    loss_fn, problem = _chosen_loss(model, loss)
    if problem:
        return None, problem
    problem = label_problem(model, loss_fn, y)
    if problem:
        return None, problem
    try:
        shot = gradflow.snapshot(model, x, y, loss=loss_fn)
    except (ValueError, TypeError) as error:
        return None, f"No snapshot: {plain_error(error)}{_loss_hint(error)}"
    except Exception as error:  # TensorFlow's own errors: a message, never a traceback.
        return None, f"No snapshot: TensorFlow could not run this batch: {plain_error(error)}"
    return shot, _logits_note(model, loss_fn)


def _for_the_page(error):
    """A loader's refusal in a dashboard user's words.

    The library's messages name its arguments ("over the limit of
    `max_bytes`=52,428,800 ... or raise `max_bytes`"), which a student in
    the browser cannot raise.
    """
    text = str(error).removeprefix("Refused model file: ")
    text = re.sub(r" or raise `[a-z_]+`", "", text)
    return re.sub(r"`[a-z_]+`=", "", text)


def _nonfinite_count(x):
    import numpy as np

    if isinstance(x, dict):
        return sum(_nonfinite_count(part) for part in x.values())
    x = np.asarray(x)
    return int(np.size(x) - np.isfinite(x).sum()) if np.issubdtype(x.dtype, np.number) else 0


def _input_names(model):
    """The names of a model's declared inputs (none for a subclassed model)."""
    try:
        return [tensor.name for tensor in model.inputs]
    except (AttributeError, ValueError, TypeError):
        return []


def _chosen_loss(model, choice):
    """`(loss, None)` for the choice in the Loss box, or `(None, message)`."""
    import keras

    name, from_logits = LOSSES.get(choice, (choice, None))
    if name is None:
        if getattr(model, "loss", None) is None:
            return None, (
                "This model file was saved without a built-in Keras loss (not compiled, or "
                "compiled with a loss of its own): choose the loss in the **Loss** box."
            )
        return model.loss, None
    if from_logits is None:
        return name, None
    kinds = {
        "sparse_categorical_crossentropy": keras.losses.SparseCategoricalCrossentropy,
        "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
        "binary_crossentropy": keras.losses.BinaryCrossentropy,
    }
    return kinds[name](from_logits=from_logits), None


def _logits_note(model, loss):
    """A note when a probability loss reads an output layer that has no softmax/sigmoid."""
    import keras

    settings = loss.get_config() if isinstance(loss, keras.losses.Loss) else {}
    name = loss if isinstance(loss, str) else type(loss).__name__
    if "crossentropy" not in name.lower() or settings.get("from_logits"):
        return None
    last = model.layers[-1] if getattr(model, "layers", None) else None
    activation = getattr(last, "activation", None)
    if activation is None or getattr(activation, "__name__", "") != "linear":
        return None
    return (
        f"The model's last layer ({last.name}) has no softmax or sigmoid: it outputs raw "
        "scores (logits), which this loss reads as probabilities. Unless a layer after it "
        "does the softmax, choose the loss marked **(from logits)**: the gradients below "
        "may be far too large."
    )


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
    text = str(error)
    if "must have rank" in text and "target.ndim - 1" in text:
        return (
            " The labels look one-hot (one row of 0s and 1s per sample): choose "
            "categorical_crossentropy, or give one class number per sample."
        )
    if "`target` and `output`" not in text:
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
                st.session_state[_SUBJECT] = name
        return
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
        st.warning(no_gradient_message(layer, tensors))
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
