"""Ending a process that imported TensorFlow without Python's teardown of it.

When a Python process ends normally, the interpreter unloads its modules and
frees their objects one by one. After TensorFlow and Keras were imported and
a model trained, that took 1.1-1.2 s of a core, after the last line of
output: the time a `gradflow train` user waited for the shell prompt, and
what every lab worker cost the machine once its run was stored (a classroom
dashboard starts one per run; docs/reliability.md, forty-ninth session).
The operating system frees all of it at once anyway.
"""

import atexit
import contextlib
import os
import sys


def quick_exit(code):
    """Ends the process with exit status `code`, as `sys.exit(code)` would, minus the teardown.

    Exit handlers (`atexit`: logging's flush, gradflow's closing of runs
    left open, a user's own) run first, and standard output and error are
    flushed; other files must be closed by the caller. Only for a program's
    own entry point: it never returns.

    Example:

    ```python
    if __name__ == "__main__":
        quick_exit(main())
    ```

    Args:
        code: The exit status, an int (`None` counts as 0, as for `sys.exit`).
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe (`gradflow runs | head`)
            stream.flush()
    os._exit(0 if code is None else int(code))
