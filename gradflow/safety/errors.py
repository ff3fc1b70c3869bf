"""The one error type raised when a user upload is refused."""


class UnsafeInputError(ValueError):
    """A user-supplied file was refused before (or while) it was loaded.

    It is a `ValueError`, so code that already handles bad input keeps working.
    The message says what was found, where (a path such as
    `config.layers[3].config.function`), and what to do instead.

    Example:

    ```python
    try:
        model = gradflow.safe_load_model("upload.keras")
    except gradflow.UnsafeInputError as e:
        print(f"Upload refused: {e}")
    ```
    """
