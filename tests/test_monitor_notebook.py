"""A notebook's Interrupt button during a monitored `fit`: a real IPython shell, in a subprocess.

A Ctrl-C most often lands between two steps, in Keras's own code, where no
callback sees it. The run then read "running" in the dashboard (whose Stop
did nothing) until the next `fit` or the kernel's exit, and its last steps
were not in the store.
"""

import json
import subprocess
import sys

# Each cell is run by IPython's own shell, as a notebook's kernel runs it.
SCRIPT = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
shell.user_ns["DB"] = sys.argv[1]
cells = [
    '''
import numpy as np, keras, gradflow

class CtrlC(keras.callbacks.Callback):
    # The Interrupt button, landing between two epochs (outside the train step).
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise KeyboardInterrupt

keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(128, 8)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
model.compile("sgd", "sparse_categorical_crossentropy")
monitor = gradflow.GradientMonitor(store=DB, run_name="interrupted in a notebook")
''',
    "model.fit(x, y, batch_size=32, epochs=5, shuffle=False, callbacks=[monitor, CtrlC()], verbose=0)",
    '''
info = gradflow.RunStore(DB).run_info(monitor.run_id)
seen = dict(status=info["status"], message=info["message"], progress=info["progress_step"],
            stored=sorted(gradflow.RunStore(DB).layer_stats(monitor.run_id)["step"].unique().tolist()),
            recorded=sorted(monitor.history["step"].unique().tolist()),
            instrumented="train_step" in model.__dict__)
model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # a plain fit after it
''',
]
errors = [type(shell.run_cell(cell).error_in_exec).__name__ for cell in cells]
print("RESULT " + json.dumps(dict(errors=errors, **shell.user_ns["seen"])))
"""


def test_an_interrupt_between_steps_ends_the_run_interrupted_as_the_cell_ends(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "runs.db")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(lines[-1][len("RESULT ") :])
    assert seen["errors"] == ["NoneType", "KeyboardInterrupt", "NoneType"]
    assert seen["status"] == "interrupted", seen
    assert "KeyboardInterrupt" in seen["message"]
    # Two epochs of four steps: every one of them stored, as the monitor has them.
    assert seen["recorded"] == list(range(1, 9))
    assert seen["stored"] == seen["recorded"] and seen["progress"] == 8
    assert not seen["instrumented"]
