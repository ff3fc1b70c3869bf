"""`safe_load_model`: load a `.keras` file from a stranger without trusting it.

Keras's `safe_mode=True` only blocks `__lambda__` bytecode; it is not a
security boundary (CVE-2025-1550 module import through `module`, CVE-2025-12058
vocabulary files, HDF5 external storage, shape bombs, ...). So loading is in
three stages, each of which must pass before the next runs:

1. Structure, in pure Python on a private copy of the file: the size, the zip
   directory (exactly `config.json`, `metadata.json`, `model.weights.h5`; no
   absolute or `..` names; entry count, total uncompressed size and
   compression ratio capped), then `config.json` parsed with a size cap and
   walked at every depth against an allow-list of core Keras classes
   (`gradflow.safety.keras_config`). Legacy HDF5 models are refused by their
   magic bytes.
2. Rehearsal in a child process (`gradflow.safety.sandbox`) limited in memory
   (`RLIMIT_AS`) and time: it checks every HDF5 object of the weights, loads
   the model with `safe_mode=True, compile=False` and counts its parameters.
3. Only then the parent loads the same private copy with
   `keras.saving.load_model(copy, safe_mode=True, compile=False)`. Its config
   is allow-listed and the child proved it builds within the limits.

The private copy means the file cannot be swapped between checking and loading.
"""

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import zipfile

from gradflow.checks import positive_int, positive_number
from gradflow.safety import archives, sandbox
from gradflow.safety.errors import UnsafeInputError
from gradflow.safety.keras_config import check_model_config

_EXPECTED_ENTRIES = ("config.json", "metadata.json", "model.weights.h5")
_MAX_CONFIG_BYTES = 4 << 20
_MAX_METADATA_BYTES = 64 << 10
# Keras stores entries uncompressed; anything far above DEFLATE's usual ratio is a bomb.
_MAX_RATIO = 100
_HDF5_ADVICE = (
    "Legacy HDF5 model files can run code or read files on load; re-save the model as "
    ".keras with model.save('m.keras') and upload that. A tf_keras (Keras 2) .h5 file you "
    'trust converts in Keras 3: model = keras.models.load_model("m.h5", compile=False), '
    'then model.save("m.keras").'
)


def safe_load_model(
    path,
    *,
    max_bytes=50 * 2**20,
    max_entries=16,
    max_weight_entries=20_000_000,
    timeout=120.0,
    memory_limit=6 * 2**30,
):
    """Loads a `.keras` model file from an untrusted source.

    The file is checked before any Keras code sees it, then loaded once in a
    child process with memory and time limits, then loaded here. See the
    module docstring and SECURITY.md for what is checked.

    Example:

    ```python
    model = gradflow.safe_load_model("upload.keras")
    shot = gradflow.snapshot(model, x, y, loss="mse")
    ```

    Args:
        path: path of the uploaded `.keras` file (any file name).
        max_bytes: largest accepted file size, and largest uncompressed size
            of all its entries together. Defaults to 50 MiB.
        max_entries: most entries the zip directory may declare. Defaults to
            16 (a `.keras` file has 3).
        max_weight_entries: most weight values (scalars) the model may
            declare in its config, store in its weights file, or build.
            Defaults to 20,000,000 (80 MB of float32).
        timeout: seconds the child process may take to load the model,
            TensorFlow start-up included. Defaults to 120.
        memory_limit: address-space limit of the child process in bytes;
            TensorFlow alone reserves about 2.5 GiB of it. Defaults to 6 GiB.

    Returns:
        A `keras.Model`. When the file was saved compiled with one built-in
        Keras loss, the model is compiled with that loss alone (its
        `from_logits` and other plain settings kept; optimizer and metrics
        left out), so `gradflow.snapshot(model, x, y)` differentiates the
        loss the model trains with. Otherwise it is not compiled.

    Raises:
        UnsafeInputError: the file was refused; the message says what was
            found, where, and what to do.
        ValueError: an argument is out of range.
    """
    max_bytes = positive_int("max_bytes", max_bytes)
    max_entries = positive_int("max_entries", max_entries)
    max_weight_entries = positive_int("max_weight_entries", max_weight_entries)
    timeout = positive_number("timeout", timeout, unit="of seconds")
    memory_limit = positive_int("memory_limit", memory_limit)

    with _checked_copy(path, max_bytes, max_entries, max_weight_entries) as (copy, config):
        summary = rehearse_load(
            copy,
            max_bytes=max_bytes,
            max_weight_entries=max_weight_entries,
            timeout=timeout,
            memory_limit=memory_limit,
        )
        import keras

        model = keras.saving.load_model(copy, safe_mode=True, compile=False)
    if model.count_params() != summary["params"]:
        raise UnsafeInputError(
            "The model built differently here than in the checking process "
            f"({model.count_params():,} vs {summary['params']:,} parameters); refused."
        )
    return _with_saved_loss(model, config)


def load_in_limited_process(
    path, *, max_bytes=50 * 2**20, max_entries=16, max_weight_entries=20_000_000
):
    """`safe_load_model`'s checks and load, all in this process: call it only in a limited child.

    The process that calls it must already be limited as the rehearsal child
    is (`gradflow.safety.sandbox`): the dashboard's uploads run their whole
    path (load, batch, snapshot) in one such child (`gradflow.probe.uploads`),
    so a second child only to rehearse the load would cost another
    TensorFlow start-up for nothing.

    Args:
        path: the uploaded `.keras` file.
        max_bytes, max_entries, max_weight_entries: as for `safe_load_model`.

    Returns:
        The `keras.Model`, compiled with its saved loss as `safe_load_model` does.

    Raises:
        UnsafeInputError: the file was refused.
    """
    with _checked_copy(path, max_bytes, max_entries, max_weight_entries) as (copy, config):
        model, _ = sandbox.load_checked(copy, max_bytes, max_weight_entries)
    return _with_saved_loss(model, config)


@contextlib.contextmanager
def _checked_copy(path, max_bytes, max_entries, max_weight_entries):
    """A private copy of the file, checked (stage 1): yields `(copy's path, parsed config)`.

    The copy means the file cannot be swapped between checking and loading.
    """
    with tempfile.TemporaryDirectory(prefix="gradflow-upload-") as private:
        copy = os.path.join(private, "model.keras")
        _private_copy(path, copy, max_bytes)
        config = check_keras_file(
            copy,
            max_bytes=max_bytes,
            max_entries=max_entries,
            max_weight_entries=max_weight_entries,
            private_copy=True,
        )
        yield copy, config


def _with_saved_loss(model, config):
    loss = saved_loss(config)
    if loss is not None:
        # Only the loss: a model trained on logits (from_logits=True) read
        # with the bare name of its loss got wrong gradients, 3-5x too large.
        model.compile(loss=loss)
    return model


# Settings of a built-in loss taken from its saved config: plain values only.
_LOSS_SETTINGS = {
    "from_logits",
    "label_smoothing",
    "axis",
    "ignore_class",
    "delta",
    "alpha",
    "gamma",
    "apply_class_balancing",
    "reduction",
    "name",
}


def saved_loss(config):
    """The loss a `.keras` file was compiled with, if it is one built-in Keras loss.

    Read from the already checked `config.json` (its `compile_config` names
    only `keras.losses`, `keras.metrics` and `keras.optimizers` objects); the
    loss is built here from its class in `keras.losses` and plain settings,
    never through Keras's deserializer.

    Args:
        config: the parsed `config.json`.

    Returns:
        A `keras.losses.Loss`, or None: no loss saved, a custom or per-output
        loss, or settings this cannot rebuild.
    """
    import keras

    from gradflow.probe.snapshot import loss_object

    compile_config = config.get("compile_config") if isinstance(config, dict) else None
    loss = compile_config.get("loss") if isinstance(compile_config, dict) else None
    if isinstance(loss, dict) and loss.get("class_name") == "function":
        loss = loss.get("config")  # a built-in function, by name
    if isinstance(loss, str):
        try:
            return loss_object(keras.losses.get(loss))
        except (ValueError, TypeError):
            return None
    if not isinstance(loss, dict) or loss.get("module") != "keras.losses":
        return None
    if loss.get("registered_name") not in (None, loss.get("class_name")):
        return None  # a custom loss under a built-in's name
    kind = getattr(keras.losses, str(loss.get("class_name")), None)
    if not (isinstance(kind, type) and issubclass(kind, keras.losses.Loss)):
        return None
    settings = loss.get("config") if isinstance(loss.get("config"), dict) else {}
    plain = {
        key: value
        for key, value in settings.items()
        if key in _LOSS_SETTINGS and isinstance(value, (str, int, float, bool, type(None)))
    }
    try:
        return kind(**plain)
    except (TypeError, ValueError):
        return None


def check_keras_file(path, *, max_bytes, max_entries, max_weight_entries, private_copy=False):
    """Checks the structure and config of a `.keras` file; nothing is executed.

    Args:
        path: the file to check.
        max_bytes: largest file size and largest total uncompressed size.
        max_entries: most zip entries.
        max_weight_entries: most weight values the config may declare.
        private_copy: `path` is the loader's own copy: when the check
            dropped settings Keras would build on load (a nested model's
            `compile_config`), the checked config is written into it, for
            Keras to read. Never for a user's file.

    Returns:
        The parsed `config.json`.

    Raises:
        UnsafeInputError: for the first problem found.
    """
    archives.check_file_size(path, max_bytes, "model file")
    _refuse_hdf5(path)
    with archives.open_checked_zip(
        path,
        what="model file",
        max_bytes=max_bytes,
        max_entries=max_entries,
        max_total_bytes=max_bytes,
        max_ratio=_MAX_RATIO,
    ) as archive:
        names = sorted(archive.namelist())
        if names != sorted(_EXPECTED_ENTRIES):
            raise UnsafeInputError(
                f"The model file contains {names!r}; a .keras file saved by Keras 3 holds "
                f"exactly {list(_EXPECTED_ENTRIES)!r} (extra entries such as assets/ belong "
                "to layers that read files, which are not accepted). Save it with "
                "model.save('m.keras')."
            )
        config = _parse_json(archive, "config.json", _MAX_CONFIG_BYTES)
        metadata = _parse_json(archive, "metadata.json", _MAX_METADATA_BYTES)
    if not isinstance(metadata, dict) or not str(metadata.get("keras_version", "")).startswith(
        "3."
    ):
        raise UnsafeInputError(
            "metadata.json of the model file does not say it was saved by Keras 3 "
            f"(found {metadata!r:.120}). Save the model with Keras 3: model.save('m.keras')."
        )
    checked = json.dumps(config)
    check_model_config(config, max_weight_entries=max_weight_entries)
    if private_copy and json.dumps(config) != checked:
        # The check dropped settings Keras would build (a nested model's
        # compile_config): Keras reads the private copy, so it gets the config
        # as checked.
        _rewrite_config(path, config)
    return config


def _rewrite_config(path, config):
    """Replace `config.json` in the zip at `path` (a private copy), keeping its other entries."""
    rewritten = f"{path}.rewritten"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(rewritten, "w") as target:
        for info in source.infolist():
            if info.filename == "config.json":
                target.writestr("config.json", json.dumps(config))
                continue
            with source.open(info) as entry, target.open(info.filename, "w") as copy:
                shutil.copyfileobj(entry, copy)
    os.replace(rewritten, path)


def rehearse_load(path, *, max_bytes, max_weight_entries, timeout, memory_limit):
    """Loads the checked file once in a limited child process; returns its summary.

    Call it only on a private copy that `check_keras_file` accepted: the child
    trusts the config check and adds the weights-file and build checks.

    Args:
        path: the private copy of the model file.
        max_bytes: largest size of `model.weights.h5`, and of any file the
            child may write.
        max_weight_entries: most weight values stored or built.
        timeout: seconds before the child is killed.
        memory_limit: the child's address-space limit in bytes.

    Returns:
        Dict with `class_name`, `layers`, `params` (built weight values) and
        `stored_values` (values in the weights file).

    Raises:
        UnsafeInputError: the child refused the weights, ran out of memory or
            time, or failed to load the model.
    """
    request = {
        "path": path,
        "max_bytes": max_bytes,
        "max_weight_entries": max_weight_entries,
        "memory_limit": memory_limit,
    }
    try:
        result, code, stderr = sandbox.run_in_child(
            "gradflow.safety.sandbox", request, folder=os.path.dirname(path), timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        raise UnsafeInputError(
            f"Loading the model took longer than `timeout`={timeout} seconds and was "
            "stopped. Upload a smaller model or raise `timeout`."
        ) from e
    if result is None:
        raise UnsafeInputError(
            f"Loading the model failed in the checking process (exit code {code}, "
            f"within `memory_limit`={memory_limit:,} bytes): {stderr.strip()[-300:]!r}"
        )
    if result["ok"]:
        return result["summary"]
    if result["kind"] == "unsafe":
        raise UnsafeInputError(f"Refused model file: {result['message']}")
    if result["kind"] == "memory":
        raise UnsafeInputError(
            f"Loading the model needed more than `memory_limit`={memory_limit:,} bytes "
            f"({result['message'][:200]}). Upload a smaller model or raise `memory_limit`."
        )
    raise UnsafeInputError(f"The model could not be loaded: {result['message']}")


def _private_copy(path, copy, max_bytes):
    if os.path.isdir(path):
        raise UnsafeInputError(
            f"The model path {os.fspath(path)!r} is a folder: SavedModel folders (TensorFlow's, "
            "or Keras 2's `model.save('folder')`) are not supported. Give a Keras 3 .keras "
            "file: re-save the model with `model.save('m.keras')` in Keras 3."
        )
    archives.check_file_size(path, max_bytes, "model file")
    with open(path, "rb") as source, open(copy, "wb") as target:
        # Copy at most one byte more than allowed, so a file that grows is caught.
        shutil.copyfileobj(_Limited(source, max_bytes + 1), target)


class _Limited:
    def __init__(self, f, limit):
        self.f, self.left = f, limit

    def read(self, n=-1):
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data


def _refuse_hdf5(path):
    # HDF5 accepts a user block, so the signature may sit at 0, 512, 1024, ...
    with open(path, "rb") as f:
        offset = 0
        while True:
            f.seek(offset)
            head = f.read(8)
            if len(head) < 8:
                return
            if head == archives.HDF5_MAGIC:
                raise UnsafeInputError(
                    f"Refused model file: it is an HDF5 (.h5) file, not a .keras file. "
                    f"{_HDF5_ADVICE}"
                )
            offset = 512 if offset == 0 else offset * 2


def _parse_json(archive, name, limit):
    data = archives.read_member(archive, name, limit, "model file")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise UnsafeInputError(f"{name} in the model file is not valid JSON: {e}.") from e
