"""The Inspect page's upload: seconds from the two files to the snapshot, in a child or in the server.

    python3 bench/bench_upload.py [--repeats 3] [--pick-s 15] [--out FILE]

Since the forty-third session the dashboard differentiates an upload in one
limited child process (`gradflow.probe.uploads.snapshot_of_upload`):
TensorFlow starts there, the model is checked, loaded and differentiated, and
Parquet tables come back. The page starts a spare child while the files are
picked (`SpareChild`; `--pick-s` seconds here), so TensorFlow has started by
the click; a new child at the click is timed too. Before, the server ran `gradflow.safe_load_model`
(whose checks rehearse the load in a child, which also starts TensorFlow)
and then the snapshot itself. Both paths are timed here side by side,
interleaved, on the same files: a 3-layer MLP on 32 rows and a small CNN on
16 images of 32x32. "In the server" is the library's own path,
`safe_load_model` + `load_arrays` + `snapshot`, in this process.
Writes bench/results/upload.json (or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def models():
    import keras

    mlp = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="mlp",
    )
    cnn = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ],
        name="cnn",
    )
    return {"mlp": (mlp, (32, 20)), "cnn": (cnn, (16, 32, 32, 3))}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--pick-s", type=float, default=15.0, help="seconds a spare child has before the click"
    )
    parser.add_argument("--out", default=str(HERE / "results" / "upload.json"))
    args = parser.parse_args()
    import keras
    import numpy as np

    import gradflow
    from gradflow.probe import uploads

    loss = "sparse_categorical_crossentropy (from logits)"
    chosen = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        files = {}
        for name, (model, shape) in models().items():
            model.save(pathlib.Path(folder) / f"{name}.keras")
            rng = np.random.default_rng(0)
            np.savez(
                pathlib.Path(folder) / f"{name}.npz",
                x=rng.normal(size=shape).astype("float32"),
                y=rng.integers(0, 10, shape[0]),
            )
            files[name] = (
                pathlib.Path(folder) / f"{name}.keras",
                pathlib.Path(folder) / f"{name}.npz",
            )
        # TensorFlow imported and warmed in this process first, as in a running server.
        in_server(*files["mlp"], chosen, gradflow)
        for name, (model_path, data_path) in files.items():
            times = {
                "in a spare child (now)": [],
                "in a new child": [],
                "in the server (before)": [],
            }
            for _ in range(args.repeats):
                spare = uploads.SpareChild()
                time.sleep(args.pick_s)  # the user picks the files
                start = time.perf_counter()
                shot, message = uploads.snapshot_of_upload(model_path, data_path, loss, spare=spare)
                times["in a spare child (now)"].append(time.perf_counter() - start)
                assert shot is not None, message
                start = time.perf_counter()
                shot, message = uploads.snapshot_of_upload(model_path, data_path, loss)
                times["in a new child"].append(time.perf_counter() - start)
                assert shot is not None, message
                start = time.perf_counter()
                in_server(model_path, data_path, chosen, gradflow)
                times["in the server (before)"].append(time.perf_counter() - start)
            results[name] = {way: statistics.median(seconds) for way, seconds in times.items()}
            for way in ("in a spare child (now)", "in a new child"):
                results[name][f"ratio ({way} / in the server)"] = (
                    results[name][way] / results[name]["in the server (before)"]
                )
            print(name, {k: round(v, 2) for k, v in results[name].items()}, flush=True)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


def in_server(model_path, data_path, loss, gradflow):
    model = gradflow.safe_load_model(model_path)
    arrays = gradflow.load_arrays(data_path)
    return gradflow.snapshot(model, arrays["x"], arrays["y"], loss=loss)


if __name__ == "__main__":
    main()
