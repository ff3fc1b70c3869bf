"""Rehearse loading a checked `.keras` file in a child process with limits.

The parent (`gradflow.safety.models`) has already checked the zip structure
and allow-listed `config.json` in pure Python. What is left needs native
parsers that handle untrusted bytes: HDF5 for the weights and Keras building
the layers (which allocates the declared weights). Both run here first, in a
fresh interpreter that limits itself before touching the file:

- `RLIMIT_AS` (address space) to `memory_limit`, so a shape bomb fails with
  `MemoryError` instead of exhausting the shared server;
- `RLIMIT_FSIZE` to `max_bytes` and `RLIMIT_CORE` to 0; temporary files go
  to the parent's private folder (`TMPDIR`), which is deleted afterwards;
- the parent kills the child after `timeout` seconds;
- no GPU (`CUDA_VISIBLE_DEVICES=""`): CUDA reserves more address space than
  any sensible limit.

The child inspects every HDF5 object (no soft/external links, no external or
virtual datasets, numeric dtypes only, total values within
`max_weight_entries`), loads with `keras.saving.load_model(path,
safe_mode=True, compile=False)`, counts the built parameters, and prints one
JSON line. Loading is deterministic, so when the child succeeds the parent can
load the same private copy within the same bounds.

Run as `python -m gradflow.safety.sandbox` with a JSON request on stdin.
"""

import io
import json
import math
import os
import resource
import signal
import sys

RESULT_PREFIX = "GRADFLOW-SANDBOX-RESULT "
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MAX_H5_OBJECTS = 10_000
# How running out of address space shows up in TensorFlow and the dynamic loader.
_OUT_OF_MEMORY_SIGNS = ("memory", "alloc", "failed to map segment", "resource exhausted")


def limit_self(memory_limit, max_file_bytes):
    """Limit this process's address space, file size and core dumps (before reading any file)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Keras may extract the weights to a temporary file; nothing needs more.
    # Writing beyond it then fails with EFBIG instead of killing us with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))


def check_weights_file(data, max_weight_entries):
    """Walks every object of `model.weights.h5` without reading any data.

    Args:
        data: the bytes of `model.weights.h5`.
        max_weight_entries: most values all datasets may hold together.

    Returns:
        The total number of values in all datasets.

    Raises:
        gradflow.UnsafeInputError: links, external or virtual storage,
            non-numeric dtypes, too many objects or values.
    """
    import h5py

    from gradflow.safety.errors import UnsafeInputError

    total = 0
    objects = 0
    try:
        h5 = h5py.File(io.BytesIO(data), "r")
    except (OSError, ValueError) as e:
        raise UnsafeInputError(f"model.weights.h5 is not a valid HDF5 file: {e}.") from e
    with h5:
        groups = [(h5, "")]
        while groups:
            group, prefix = groups.pop()
            for name in group:
                path = f"{prefix}/{name}"
                objects += 1
                if objects > _MAX_H5_OBJECTS:
                    raise UnsafeInputError(
                        f"model.weights.h5 has more than {_MAX_H5_OBJECTS:,} objects."
                    )
                link = group.get(name, getlink=True)
                if not isinstance(link, h5py.HardLink):
                    raise UnsafeInputError(
                        f"model.weights.h5 has a {type(link).__name__} at {path}; links can "
                        "point to other files on the server and are not accepted."
                    )
                item = group[name]
                if isinstance(item, h5py.Group):
                    groups.append((item, path))
                elif isinstance(item, h5py.Dataset):
                    total += _check_dataset(item, path, UnsafeInputError)
                    if total > max_weight_entries:
                        raise UnsafeInputError(
                            f"model.weights.h5 holds more than {max_weight_entries:,} weight "
                            f"values (reached at {path}); `max_weight_entries` limits this."
                        )
                else:
                    raise UnsafeInputError(
                        f"model.weights.h5 has a {type(item).__name__} at {path}; only groups "
                        "and datasets are expected."
                    )
    return total


def _check_dataset(dataset, path, error):
    if dataset.external:
        raise error(
            f"model.weights.h5 dataset {path} stores its data in external files "
            f"{[e[0] for e in dataset.external]!r}; reading it would read server files."
        )
    if dataset.is_virtual:
        raise error(f"model.weights.h5 dataset {path} is a virtual dataset that maps other files.")
    if dataset.dtype.kind not in "biuf" or dataset.dtype.hasobject:
        raise error(
            f"model.weights.h5 dataset {path} has dtype {dataset.dtype}; only numeric "
            "weights are accepted."
        )
    if dataset.shape is None:
        return 0
    return math.prod(dataset.shape)


def load_checked(path, max_bytes, max_weight_entries):
    """Checks the weights file, loads the model and counts what it built: in a limited process only.

    Args:
        path: a private copy of a `.keras` file whose config
            `gradflow.safety.models.check_keras_file` accepted.
        max_bytes: largest size of `model.weights.h5`.
        max_weight_entries: most weight values stored or built.

    Returns:
        `(model, summary)`: the `keras.Model` (not compiled) and a dict with
        `class_name`, `layers`, `params` (built weight values) and
        `stored_values` (values in the weights file).

    Raises:
        gradflow.UnsafeInputError: the weights file or the built model was refused.
    """
    import zipfile

    from gradflow.safety.archives import read_member

    with zipfile.ZipFile(path) as archive:
        data = read_member(archive, "model.weights.h5", max_bytes, "model file")
    stored = check_weights_file(data, max_weight_entries)
    del data

    import keras

    from gradflow.safety.errors import UnsafeInputError

    model = keras.saving.load_model(path, safe_mode=True, compile=False)
    if not model.built:
        # Keras's own words here are about `count_params` and `layer.build`.
        raise UnsafeInputError(
            "This model was saved before it was built, so it has no weights yet and no "
            "gradients of its own to show. Call it on one batch (or start it with "
            "`keras.Input(shape=...)`), then save it again."
        )
    params = int(model.count_params())
    if params > max_weight_entries:
        raise UnsafeInputError(
            f"The model builds {params:,} weight values, over the limit of "
            f"`max_weight_entries`={max_weight_entries:,}."
        )
    summary = {
        "class_name": type(model).__name__,
        "layers": len(model.layers),
        "params": params,
        "stored_values": stored,
    }
    return model, summary


def _rehearse(request):
    _, summary = load_checked(request["path"], request["max_bytes"], request["max_weight_entries"])
    return summary


def child_environment(folder):
    """The environment of a limited child: no GPU, temporary files in `folder`, this gradflow."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["TMPDIR"] = str(folder)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Outright: an exported KERAS_BACKEND=jax (or keras.json's) is not gradflow's.
    env["KERAS_BACKEND"] = "tensorflow"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env


def read_result(stdout):
    """The dict a child reported on its stdout, or None."""
    result = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
    return result


def run_in_child(module, request, *, folder, timeout):
    """Run `python -m module` with `request` (JSON) on its stdin; returns its result and exit code.

    The child limits itself (`serve_request`) before it reads a file; its
    temporary files go to `folder`, there is no GPU, and it is killed after
    `timeout` seconds.

    Returns:
        `(result, returncode, stderr)`: the dict the child reported, or None
        when it died before reporting (a signal, a failed allocation in C).

    Raises:
        subprocess.TimeoutExpired: the child ran longer than `timeout`.
    """
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", module],
        input=json.dumps(request) + "\n",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_environment(folder),
        cwd=str(folder),
    )
    return read_result(done.stdout), done.returncode, done.stderr


def serve_request(work):
    """The child's side of `run_in_child`: limit this process, run `work(request)`, report.

    `work` returns a JSON-serialisable dict. Its `UnsafeInputError` is
    reported as `"unsafe"`, running out of memory as `"memory"`, any other
    error as `"error"`, all with their messages. Never returns.
    """
    line = sys.stdin.readline()
    if not line.strip():
        # A spare child whose server ended (its stdin closed) before it had work.
        os._exit(0)
    request = json.loads(line)
    limit_self(request["memory_limit"], request["max_bytes"])
    try:
        from gradflow.safety.errors import UnsafeInputError

        result = {"ok": True, "summary": work(request)}
    except UnsafeInputError as e:
        result = {"ok": False, "kind": "unsafe", "message": str(e)}
    except MemoryError:
        result = {"ok": False, "kind": "memory", "message": "out of memory"}
    except Exception as e:  # noqa: BLE001 -- every failure is reported to the parent
        text = str(e).lower()
        kind = "memory" if any(sign in text for sign in _OUT_OF_MEMORY_SIGNS) else "error"
        result = {"ok": False, "kind": kind, "message": f"{type(e).__name__}: {str(e)[:800]}"}
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    # Skip interpreter teardown: TensorFlow's can be slow and says nothing useful.
    os._exit(0)


def main():
    serve_request(_rehearse)


if __name__ == "__main__":
    main()
