"""Safe loading of files that strangers upload: Keras models and arrays.

Keras's `safe_mode` is not a security boundary, and `numpy.load`/`pandas`
trust their input, so every upload is checked here *before* any library
parses it, and model loading is first rehearsed in a child process with
memory and time limits. See SECURITY.md for the threat model.

- `safe_load_model(path)`: a `.keras` file -> `keras.Model`.
- `load_arrays(path)`: a `.npz`, `.npy` or `.csv` file -> dict of arrays.
- `UnsafeInputError`: raised for every refusal (a `ValueError`).
"""

from gradflow.safety.errors import UnsafeInputError

__all__ = ["UnsafeInputError", "load_arrays", "safe_load_model"]


def __getattr__(name):
    # Lazy, so `import gradflow.safety` for the error type loads no TensorFlow.
    if name == "safe_load_model":
        from gradflow.safety.models import safe_load_model

        return safe_load_model
    if name == "load_arrays":
        from gradflow.safety.arrays import load_arrays

        return load_arrays
    raise AttributeError(f"module 'gradflow.safety' has no attribute {name!r}")
