"""The gradients of an uploaded model on an uploaded batch, worked out in a child process with limits.

`gradflow.safe_load_model` checks a `.keras` file and rehearses its load in
a limited child. What the dashboard did next ran in the server itself: a
forward and backward pass on the uploaded batch, and one more backward graph
per layer. Layers the checks allow can make outputs of any size from a few
weights: a 16 KB file with `RepeatVector(2_000_000)` took 2 GB of the
server's memory, 400 layers of `Activation` 134 s and 2.6 GB (the upload
audit, forty-third session). A wide CSV row was parsed there too.

So the Inspect page hands both files to `snapshot_of_upload`, which runs the
whole path in one child limited as the rehearsal is (`RLIMIT_AS`, a time
limit, no GPU, a private temporary folder): the checks, the load, the batch,
the snapshot. What comes back is the snapshot's tables as Parquet and plain
JSON values, never a pickle, so even a child something went wrong in cannot
make the server run code.

Run as `python -m gradflow.probe.uploads` with a JSON request on stdin.
"""

import base64
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile

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
# A real model's snapshot takes seconds to a minute or two here: MobileNetV2
# at 128x128 on 16 images took 86 s on this 2-core machine beside a test
# run. Ten minutes is room for larger ones; what takes longer holds a core
# while the class waits ($GRADFLOW_UPLOAD_TIMEOUT_S changes it).
UPLOAD_TIMEOUT_S = 600.0
# TensorFlow alone reserves about 2.5 GiB of address space; the rest is for
# the model, the batch and its activations ($GRADFLOW_UPLOAD_MEMORY_GIB).
UPLOAD_MEMORY_LIMIT = 8 * 2**30
_TABLES = ("weights", "activations", "inputs", "histograms")
# Nothing the snapshot does writes a file; Keras may unpack the weights.
_MAX_CHILD_FILE_BYTES = 50 * 2**20


class SpareChild:
    """A child ready for one upload: limited, TensorFlow imported, waiting for its request.

    Starting TensorFlow takes 4-8 s on this machine, most of an upload's
    time in a new child; a spare started while the user picks the files
    (`gradflow.ui.resources.spare_upload_child`) has done it by the click.

    Example:

    ```python
    spare = SpareChild()
    shot, message = snapshot_of_upload("m.keras", "d.npz", "mse", spare=spare)
    ```

    Args:
        memory_limit: the child's address-space limit in bytes.
    """

    def __init__(self, memory_limit=UPLOAD_MEMORY_LIMIT):
        from gradflow.safety import sandbox

        self.memory_limit = int(memory_limit)
        self.folder = tempfile.mkdtemp(prefix="gradflow-upload-run-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gradflow.probe.uploads", "--spare", str(self.memory_limit)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=sandbox.child_environment(self.folder),
            cwd=self.folder,
        )

    def usable(self, memory_limit):
        """Whether it is alive and was started with `memory_limit`."""
        return self.process.poll() is None and self.memory_limit == int(memory_limit)

    def run(self, request, timeout):
        """Give the child its request; `(result, returncode, stderr)` as `sandbox.run_in_child`.

        Raises:
            subprocess.TimeoutExpired: it ran longer than `timeout` (it is killed).
        """
        from gradflow.safety import sandbox

        try:
            stdout, stderr = self.process.communicate(json.dumps(request) + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        return sandbox.read_result(stdout), self.process.returncode, stderr

    def close(self):
        """Stop it if it still runs, and remove its folder."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def snapshot_of_upload(
    model_path,
    data_path,
    loss,
    *,
    timeout=UPLOAD_TIMEOUT_S,
    memory_limit=UPLOAD_MEMORY_LIMIT,
    spare=None,
):
    """Snapshot of an uploaded `.keras` model on an uploaded batch, taken in a limited child.

    Example:

    ```python
    shot, message = snapshot_of_upload("upload.keras", "upload.npz", "mse")
    ```

    Args:
        model_path, data_path: the uploaded files, saved by the server under
            names it chose.
        loss: a key of `LOSSES`.
        timeout: seconds before the child is stopped.
        memory_limit: the child's address-space limit in bytes.
        spare: a `SpareChild` to use (it takes one request), or None to
            start a child now. A spare that died or has another memory
            limit is not used.

    Returns:
        `(snapshot, None)`, or `(None, message)` when a file is refused, the
        batch does not fit the model, or the child ran out of time or
        memory; a snapshot may come with a note instead (`(snapshot, note)`)
        when its loss looks wrong for the model. Messages are for the
        person at the browser.
    """
    from gradflow.safety import sandbox

    request = {
        "model": str(model_path),
        "data": str(data_path),
        "loss": loss,
        "memory_limit": int(memory_limit),
        "max_bytes": _MAX_CHILD_FILE_BYTES,
    }
    try:
        if spare is not None and spare.usable(memory_limit):
            result, code, _ = spare.run(request, timeout)
        else:
            if spare is not None:
                spare.close()
            with tempfile.TemporaryDirectory(prefix="gradflow-upload-run-") as folder:
                result, code, _ = sandbox.run_in_child(
                    "gradflow.probe.uploads", request, folder=folder, timeout=timeout
                )
    except subprocess.TimeoutExpired:
        return None, (
            f"Working out this model's gradients took longer than {_duration(timeout)}, "
            "so it was stopped. Try a smaller batch or a smaller model."
        )
    if result is None or (not result["ok"] and result["kind"] == "memory"):
        # A failed allocation in TensorFlow's C++ may end the child without a word.
        return None, (
            f"Working out this model's gradients needed more memory than each upload may "
            f"use ({memory_limit / 2**30:g} GiB){'' if result else f' (exit code {code})'}. "
            "Try a smaller batch or a smaller model."
        )
    if not result["ok"]:
        if result["kind"] == "unsafe":
            return None, f"That file was refused: {for_the_page(result['message'])}"
        return None, f"No snapshot: {result['message']}"
    answer = result["summary"]
    if answer["snapshot"] is None:
        return None, answer["message"]
    return _snapshot_from(answer["snapshot"]), answer["message"]


def _duration(seconds):
    if seconds >= 120 and seconds % 60 == 0:
        return f"{seconds / 60:g} minutes"
    return f"{seconds:g} seconds"


def snapshot_here(model_path, data_path, loss):
    """`snapshot_of_upload`'s work, in this process: only for its limited child.

    Returns:
        `(snapshot, message)` as `snapshot_of_upload` does.

    Raises:
        UnsafeInputError: a file was refused.
    """
    import gradflow
    from gradflow.lab.datasets import examples_and_targets
    from gradflow.probe.labels import label_problem
    from gradflow.safety.errors import UnsafeInputError
    from gradflow.safety.models import load_in_limited_process

    try:
        model = load_in_limited_process(model_path)
    except (UnsafeInputError, MemoryError):
        raise
    except Exception as error:  # Keras's own, on a file the checks let through
        raise UnsafeInputError(f"The model could not be loaded: {plain_error(error)}") from error
    arrays = gradflow.load_arrays(data_path)
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
    except MemoryError:
        raise
    except Exception as error:  # TensorFlow's own errors: a message, never a traceback.
        if "resource exhausted" in str(error).lower() or "alloc" in str(error).lower():
            raise MemoryError(str(error)) from error
        return None, f"No snapshot: TensorFlow could not run this batch: {plain_error(error)}"
    return shot, _logits_note(model, loss_fn)


def _work(request):
    shot, message = snapshot_here(request["model"], request["data"], request["loss"])
    return {"snapshot": None if shot is None else _snapshot_to(shot), "message": message}


def _snapshot_to(shot):
    """A Snapshot as JSON values: its tables as Parquet (base64), the rest as they are."""
    tables = {}
    for name in _TABLES:
        frame = getattr(shot, name).copy()
        if "shape" in frame.columns:
            frame["shape"] = frame["shape"].map(list)
        buffer = io.BytesIO()
        frame.to_parquet(buffer, index=False)
        tables[name] = base64.b64encode(buffer.getvalue()).decode("ascii")
    return {
        "tables": tables,
        "loss": float(shot.loss),
        "training": bool(shot.training),
        "no_gradient": {layer: list(tensors) for layer, tensors in shot.no_gradient.items()},
        "layer_inputs": dict(shot.layer_inputs),
    }


def _snapshot_from(values):
    import pandas as pd

    from gradflow.probe.snapshot import Snapshot

    tables = {}
    for name in _TABLES:
        frame = pd.read_parquet(io.BytesIO(base64.b64decode(values["tables"][name])))
        if "shape" in frame.columns:
            frame["shape"] = frame["shape"].map(lambda shape: tuple(int(n) for n in shape))
        tables[name] = frame
    return Snapshot(
        loss=float(values["loss"]),
        training=bool(values["training"]),
        no_gradient={str(k): tuple(v) for k, v in values["no_gradient"].items()},
        layer_inputs={str(k): v for k, v in values["layer_inputs"].items()},
        **tables,
    )


def for_the_page(message):
    """A loader's refusal in a dashboard user's words.

    The library's messages name its arguments ("over the limit of
    `max_bytes`=52,428,800 ... or raise `max_bytes`"), which a student in
    the browser cannot raise.
    """
    text = str(message).removeprefix("Refused model file: ")
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


def _prepare_spare(memory_limit):
    """A spare child's start: limits first, then everything an upload imports."""
    from gradflow.safety import sandbox

    sandbox.limit_self(memory_limit, _MAX_CHILD_FILE_BYTES)
    import keras  # noqa: F401  (TensorFlow with it: the seconds a spare saves)
    import pyarrow.parquet  # noqa: F401  (the tables go back as Parquet)

    import gradflow.probe.snapshot  # noqa: F401
    import gradflow.safety.models  # noqa: F401


if __name__ == "__main__":
    from gradflow.safety.sandbox import serve_request

    if len(sys.argv) == 3 and sys.argv[1] == "--spare":
        _prepare_spare(int(sys.argv[2]))
    serve_request(_work)
