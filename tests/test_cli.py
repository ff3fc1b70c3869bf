"""The `gradflow` command line, through main([...]) and one real subprocess."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from gradflow import cli
from gradflow.lab.config import RunConfig, run_name
from gradflow.lab.presets import get_preset
from gradflow.store import RunStore
from tests.browser import wait_until

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--depth", "2", "--width", "4", "--batch-size", "16", "--no-progress"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny CLI run shared by the read-only tests (train, runs, export)."""
    db = tmp_path_factory.mktemp("cli") / "runs.db"
    code = cli.main(["train", "--steps", "4", "--name", "cli demo", "--db", str(db), *TINY])
    store = RunStore(db)
    return code, store, store.runs()["run_id"].iloc[0]


def test_train_records_a_cli_run_with_the_flags(trained):
    code, store, run_id = trained
    assert code == 0
    info = store.run_info(run_id)
    assert (info["status"], info["source"], info["name"]) == ("completed", "cli", "cli demo")
    assert info["progress_step"] == 4
    assert RunConfig.from_dict(info["config"]) == RunConfig(
        steps=4, depth=2, width=4, batch_size=16, name="cli demo"
    )


def test_final_table_is_the_last_step_per_layer(trained):
    _, store, run_id = trained
    table = cli.final_layer_table(store, run_id)
    rows = store.layer_stats(run_id)
    rows = rows[(rows["step"] == 4) & (rows["tensor"] != "activation")]
    assert table.attrs["step"] == 4
    assert list(table["layer"]) == ["dense_1", "dense_2", "output"]
    for _, row in table.iterrows():
        mine = rows[rows["layer"] == row["layer"]]
        assert row["max_abs"] == pytest.approx(mine["max_abs"].max())
        assert row["l2_norm"] == pytest.approx(np.sqrt((mine["l2_norm"] ** 2).sum()))


def test_runs_lists_the_run(trained, capsys):
    _, store, run_id = trained
    assert cli.main(["runs", "--db", str(store.path)]) == 0
    output = capsys.readouterr().out
    assert run_id in output and "cli demo" in output and "completed" in output


def test_runs_compact_gives_an_older_stores_space_back(tmp_path, capsys):
    import sqlite3

    import pandas as pd

    from gradflow.store import RunStore

    path = tmp_path / "last-term.db"
    store = RunStore(path)
    gone = store.create_run({}, name="last term")
    with store.writer(gone) as writer:
        writer.add_layer_stats(
            pd.DataFrame(
                {
                    "step": range(1, 40_001),
                    "layer": "d",
                    "layer_index": 0,
                    "tensor": "kernel",
                    "max_abs": 1.0,
                }
            )
        )
    store.create_run({}, name="kept")
    with sqlite3.connect(path) as conn:  # a store from before deletes gave space back
        conn.execute("PRAGMA auto_vacuum = NONE")
        conn.execute("VACUUM")
    RunStore(path).delete(gone)
    assert cli.main(["runs", "--db", str(path), "--compact"]) == 0
    first, *rest = capsys.readouterr().out.splitlines()
    before, after = (float(size) for size in re.findall(r"([0-9.]+) MB", first))
    assert first.startswith(str(path)) and after < before / 2
    assert any("kept" in line for line in rest) and not any("last term" in line for line in rest)


def test_runs_narrows_a_terms_list_by_status_name_and_count(tmp_path, capsys):
    from gradflow.store import RunStore

    path = tmp_path / "term.db"
    store = RunStore(path)
    for name, status in [
        ("alice relu", "completed"),
        ("bob sigmoid", "failed"),
        ("alice sigmoid", "failed"),
        ("carol tanh", "stopped"),
    ]:
        store.create_run({}, name=name, status=status)

    def listed(*flags):
        assert cli.main(["runs", "--db", str(path), *flags]) == 0
        return [line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]]

    assert listed("--status", "failed") == [["alice", "sigmoid"], ["bob", "sigmoid"]]
    assert listed("--status", "failed", "--status", "stopped", "--last", "2") == [
        ["carol", "tanh"],
        ["alice", "sigmoid"],
    ]
    assert listed("--name", "ALICE") == [["alice", "sigmoid"], ["alice", "relu"]]
    assert cli.main(["runs", "--db", str(path), "--name", "dave"]) == 0
    assert capsys.readouterr().out == "No runs match.\n"


def test_runs_name_the_machine_once_runs_come_from_several(tmp_path, capsys):
    """Runs imported from the class's stores all read "relu · depth 4 · sgd lr=0.05"."""
    import sqlite3

    from gradflow.store import RunStore

    path = tmp_path / "class.db"
    store = RunStore(path)
    store.create_run({}, name="mine", status="completed")
    assert cli.main(["runs", "--db", str(path)]) == 0
    assert "machine" not in capsys.readouterr().out  # one machine: nothing to tell apart
    theirs = store.create_run({}, name="theirs", status="completed")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET host = 'alice-laptop' WHERE run_id = ?", (theirs,))
    assert cli.main(["runs", "--db", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "machine"
    assert next(line for line in lines if theirs in line).split()[-1] == "alice-laptop"
    # A run of a store that kept no host: said as nothing, not "None" or pandas 3's "nan".
    nameless = store.create_run({}, name="no host", status="completed")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET host = NULL WHERE run_id = ?", (nameless,))
    assert cli.main(["runs", "--db", str(path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if nameless in line)
    assert not re.search(r"\b(nan|None)\b", line), line


def test_runs_say_what_runs_named_alike_trained(tmp_path, capsys):
    """A KerasTuner search's trials all read "sequential": which learning rate was which?"""
    from gradflow.store import RunStore

    path = tmp_path / "search.db"
    store = RunStore(path)
    trials = {
        rate: store.create_run(
            {
                "model": "sequential",
                "optimizer": "Adam",
                "optimizer_settings": {"learning_rate": rate},
            },
            name="sequential",
            source="monitor",
        )
        for rate in (0.01, 0.001)
    }
    assert cli.main(["runs", "--db", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "settings"
    for rate, run_id in trials.items():
        line = next(line for line in lines if run_id in line)
        assert line.endswith(f"model `sequential` · Adam: learning_rate {rate:g}")
    # Runs whose names say what they trained need no column.
    store.delete(trials[0.01])
    store.delete(trials[0.001])
    store.create_run(RunConfig(depth=3).to_dict(), name=run_name(RunConfig(depth=3)), source="cli")
    assert cli.main(["runs", "--db", str(path)]) == 0
    assert "settings" not in capsys.readouterr().out


def test_export_csv_writes_files(trained, tmp_path, capsys):
    _, store, run_id = trained
    assert (
        cli.main(
            ["export", run_id, "--format", "csv", "--out", str(tmp_path), "--db", str(store.path)]
        )
        == 0
    )
    written = [pathlib.Path(line) for line in capsys.readouterr().out.split()]
    assert written and all(path.is_file() and path.parent == tmp_path for path in written)
    assert any("dense_1" in path.read_text() for path in written)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--depth", "0"], "gradflow train: --depth must be an integer from 1 to 100"),
        (["train", "--learning-rate", "fast"], "--learning-rate must be a number, got 'fast'."),
        (["train", "--activation", "relu6"], "--activation must be one of 'relu'"),
        (["train", "--architecture", "cnn", "--dataset", "moons"], "needs an image data set"),
        (["train", "--preset", "nope"], "Unknown preset 'nope'"),
        (["train", "--colour", "red"], "unrecognized arguments: --colour red"),
        (["export", "abc", "--format", "gif", "--out", "x"], "--format must be one of png"),
        (["export", "abc"], "the following arguments are required: --format, --out"),
        ([], "choose a command"),
        (["fly"], "invalid choice: 'fly'"),
        (["runs", "--status", "done"], "--status must be one of queued, running, paused"),
        (["runs", "--last", "0"], "--last must be a positive number, got 0"),
    ],
)
def test_usage_errors_exit_2_with_one_line(argv, message, capsys, tmp_path):
    assert (
        cli.main([*argv, *(["--db", str(tmp_path / "r.db")] if argv[:1] == ["train"] else [])]) == 2
    )
    error = capsys.readouterr().err
    assert message in error
    assert error.count("\n") == 1 and "Traceback" not in error


def test_export_of_an_unknown_run_exits_2(tmp_path, capsys):
    RunStore(tmp_path / "r.db")
    code = cli.main(
        [
            "export",
            "0123456789ab",
            "--format",
            "csv",
            "--out",
            str(tmp_path),
            "--db",
            str(tmp_path / "r.db"),
        ]
    )
    assert code == 2
    assert "0123456789ab" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", [["runs"], ["export", "0123456789ab", "--format", "csv", "--out", "exports"]]
)
def test_a_db_path_with_no_store_is_said_not_made(tmp_path, capsys, monkeypatch, command):
    """`gradflow runs --db typo.db` made an empty store there and said "No runs yet"."""
    typo = tmp_path / "typo.db"
    assert cli.main([*command, "--db", str(typo)]) == 2
    error = capsys.readouterr().err
    assert f"no run store at {str(typo)!r} (--db)" in error and "gradflow train --db" in error
    assert error.count("\n") == 1
    assert not typo.exists()
    # The same store named by the environment.
    monkeypatch.setenv("GRADFLOW_DB", str(typo))
    assert cli.main(command) == 2
    assert f"no run store at {str(typo)!r} ($GRADFLOW_DB)" in capsys.readouterr().err
    assert not typo.exists()


def test_preset_with_overrides_and_boolean_flags(tmp_path):
    db = tmp_path / "runs.db"
    argv = [
        "train",
        "--preset",
        "dead_relu",
        "--steps",
        "2",
        "--residual",
        "--histograms",
        "--db",
        str(db),
        *TINY,
    ]
    assert cli.main(argv) == 0
    store = RunStore(db)
    config = RunConfig.from_dict(store.run_info(store.runs()["run_id"].iloc[0])["config"])
    # From the preset: learning rate 1.0 and He init; from the flags: the rest.
    assert (config.learning_rate, config.initializer) == (1.0, "he_normal")
    assert (config.steps, config.depth, config.residual, config.histograms) == (2, 2, True, True)
    # `--no-residual` turns off what a preset (here: residual) turned on; the
    # preset's title, which says "residual", no longer names the run.
    args = cli._build_parser().parse_args(["train", "--preset", "residual", "--no-residual"])
    changed = cli._config_from(args)
    assert changed == get_preset("residual").config.replace(residual=False, name=None)
    assert store.run_info(store.runs()["run_id"].iloc[0])["name"] == run_name(config)
    args = cli._build_parser().parse_args(["train", "--preset", "residual"])
    assert cli._config_from(args).name == get_preset("residual").config.name


def test_serve_runs_streamlit_on_the_repository_app(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cli.os, "chdir", lambda folder: calls.append(folder))
    monkeypatch.setattr(cli.os, "execve", lambda path, command, env: calls.append((command, env)))
    cli.main(["serve", "--port", "8600", "--db", str(tmp_path / "r.db")])
    cwd, (command, env) = calls
    app = pathlib.Path(command[command.index("run") + 1])
    assert app == REPO / "app.py" and app.is_file() and cwd == REPO
    assert command[:3] == [sys.executable, "-m", "streamlit"]
    assert command[command.index("--server.port") + 1] == "8600"
    # Safe by default: only this machine can reach the dashboard.
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    assert env["GRADFLOW_DB"] == str((tmp_path / "r.db").resolve())


def test_serve_on_a_port_in_use_says_so_before_any_address(monkeypatch, capsys):
    """It printed "dashboard at http://127.0.0.1:8614" (the other server, another store)
    and then failed."""
    import socket

    monkeypatch.setattr(cli.os, "execve", lambda *a: pytest.fail("started a second server"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == cli.EXIT_FAILED
    said = capsys.readouterr()
    assert f"port {port} on 127.0.0.1 is in use" in said.err and "dashboard at" not in said.out


def test_serve_under_a_path_prefix_says_where(monkeypatch, capsys):
    """`--server.baseUrlPath` was refused, and with Streamlit's environment variable
    the printed address was the root, a 404."""
    calls = []
    monkeypatch.setattr(cli.os, "chdir", lambda folder: None)
    monkeypatch.setattr(cli.os, "execve", lambda path, command, env: calls.append(command))
    cli.main(["serve", "--port", "8600", "--base-url-path", "/gradflow/"])
    assert calls[0][calls[0].index("--server.baseUrlPath") + 1] == "gradflow"
    assert "dashboard at http://127.0.0.1:8600/gradflow/ " in capsys.readouterr().out
    monkeypatch.setenv("STREAMLIT_SERVER_BASE_URL_PATH", "school")
    cli.main(["serve", "--port", "8600"])
    assert "--server.baseUrlPath" not in calls[1]
    assert "dashboard at http://127.0.0.1:8600/school/ " in capsys.readouterr().out


def test_a_sigterm_to_gradflow_serve_stops_the_dashboard(tmp_path):
    """The server went on serving the port, re-parented, after `kill <gradflow pid>`."""
    import signal
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradflow",
            "serve",
            "--port",
            str(port),
            "--db",
            str(tmp_path / "r.db"),
        ],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    health = f"http://127.0.0.1:{port}/_stcore/health"

    def serving():
        try:
            return urllib.request.urlopen(health, timeout=2).status == 200
        except OSError:
            return False

    try:
        assert wait_until(serving, seconds=90)
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        assert wait_until(lambda: not serving(), seconds=10)
    finally:
        if server.poll() is None:
            server.kill()


def test_python_dash_m_gradflow_train(tmp_path):
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    db = tmp_path / "runs.db"
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "always::ResourceWarning",
            "-m",
            "gradflow",
            "train",
            "--epochs",
            "1",
            "--batch-size",
            "512",
            "--depth",
            "2",
            "--width",
            "4",
            "--db",
            str(db),
        ],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # digits: 1,437 training examples, 3 batches of 512.
    assert "completed after 3 steps" in result.stdout
    assert "dense_1" in result.stdout and "l2_norm" in result.stdout
    # The progress bar, with the length of a run of epochs once its data is loaded.
    assert "step/s" in result.stderr and "3/3" in result.stderr
    # TensorFlow's start-up lines, which TF_CPP_MIN_LOG_LEVEL does not silence, stay out of it.
    assert "oneDNN" not in result.stderr and "InitializeLog" not in result.stderr
    # Its store and the bar's reader closed, not left to the garbage collector.
    assert "ResourceWarning" not in result.stderr, result.stderr[-2000:]
    assert RunStore(db).runs()["status"].tolist() == ["completed"]


@pytest.mark.parametrize(
    "command",
    [
        ["runs"],
        ["export", "RUN", "--format", "csv", "--out", "csv"],
        ["export", "RUN", "--format", "store", "--out", "copy"],
    ],
    ids=["runs", "export", "export-store"],
)
def test_a_command_closes_the_stores_it_opened(tmp_path, command):
    """Python 3.13 warns of a sqlite3 connection left to the garbage collector.

    An unclosed connection sits in a cycle with its statement cache, so it was
    closed only at exit, and 3.13 printed `ResourceWarning: unclosed database`
    whenever warnings were shown (`-W default`, `-X dev`). 3.11 and 3.12 do not warn.
    """
    db = tmp_path / "runs.db"
    store = RunStore(db)
    run_id = store.create_run({"depth": 2}, name="closed", status="completed")
    with store.writer(run_id) as writer:
        writer.add_metrics(1, {"loss": 1.0})
    store.close()
    argv = [run_id if word == "RUN" else word for word in command]
    result = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-m", "gradflow", *argv, "--db", str(db)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ResourceWarning" not in result.stderr, result.stderr[-2000:]


def test_final_table_shows_nan_instead_of_hiding_it(tmp_path):
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({"record_every": 1}, source="cli")
    rows = [
        # step, layer, layer_index, tensor, max_abs, l2_norm, nonfinite
        (1, "dense_1", 0, "kernel", 9.0, 9.0, 0),
        (2, "dense_1", 0, "kernel", 3.0, 3.0, 0),
        (2, "dense_1", 0, "bias", 4.0, 4.0, 0),
        (2, "dense_2", 1, "kernel", np.nan, np.nan, 5),
        (2, "dense_2", 1, "bias", 1.0, 1.0, 0),
        (2, "dense_2", 1, "activation", 7.0, 7.0, 0),
    ]
    with store.writer(run_id) as writer:
        writer.add_layer_stats(
            [
                {
                    "step": s,
                    "layer": la,
                    "layer_index": i,
                    "tensor": t,
                    "variable": f"{la}/{t}",
                    "max_abs": m,
                    "l2_norm": n,
                    "nonfinite": f,
                }
                for s, la, i, t, m, n, f in rows
            ]
        )
        writer.progress(2)
    table = cli.final_layer_table(store, run_id)
    assert table.attrs["step"] == 2
    first, second = table.to_dict("records")
    assert (first["layer"], first["max_abs"], first["l2_norm"], first["nonfinite"]) == (
        "dense_1",
        4.0,
        5.0,
        0,
    )
    assert second["layer"] == "dense_2" and second["nonfinite"] == 5
    assert np.isnan(second["max_abs"]) and np.isnan(second["l2_norm"])


def test_train_ends_with_the_runs_alerts_the_most_serious_first(tmp_path, capsys):
    """The dashboard's Alerts view had no word in the terminal: a class trying the
    vanishing-gradient presets from the command line saw only a table."""
    db = tmp_path / "runs.db"
    assert cli.main(["train", "--preset", "deep_sigmoid", "--steps", "2", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    said = out[out.index("Alerts (1):") :].splitlines()
    assert said[1].startswith("- vanishing: Layer dense_1: gradient norm"), said[1]
    assert said[2].startswith("Export: gradflow export ")

    store = RunStore(db)
    run_id = store.create_run({"record_every": 1}, source="cli")
    with store.writer(run_id) as writer:
        for step in range(1, 8):
            writer.add_event(step, "dense", "vanishing", f"vanishing at step {step}")
        writer.add_event(9, "dense", "nonfinite", "NaN at step 9")
    cli._print_alerts(store, run_id, "gradflow export RUN")
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "Alerts (8):",
        "- nonfinite: NaN at step 9",
        "- vanishing: vanishing at step 1",
    ]
    assert len(lines) == 7 and lines[-1] == (
        "- ... and 3 more; the export's data/alerts.csv has them all (gradflow export RUN)."
    )
    quiet = store.create_run({}, source="cli")
    cli._print_alerts(store, quiet, "gradflow export RUN")
    assert capsys.readouterr().out == ""


def test_a_run_that_did_not_complete_ends_its_bar_with_its_status(tmp_path, capsys):
    store = RunStore(tmp_path / "runs.db")
    run_id = store.create_run({"record_every": 1}, source="cli", total_steps=300)
    with store.writer(run_id) as writer:
        writer.progress(3)
    follower = cli._ProgressFollower(store.path, run_id, RunConfig(steps=300), interval=0.01)
    follower.finish("diverged")
    bar = capsys.readouterr().err.splitlines()[-1].split("\r")[-1]
    assert bar.startswith("diverged:") and "3/300" in bar


def test_a_killed_train_reads_interrupted_not_running_for_ever(tmp_path, capsys):
    """After `kill -9`, `gradflow runs` said "running" and `Run.wait()` never returned."""
    import signal
    import time

    import gradflow

    db = tmp_path / "runs.db"
    process = subprocess.Popen(
        [sys.executable, "-m", "gradflow", "train", "--steps", "1000000", "--db", str(db), *TINY],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = RunStore(db).runs() if db.exists() else None
            if runs is not None and len(runs) and (runs["progress_step"].fillna(0) > 0).all():
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run never started training")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    run_id = RunStore(db).runs()["run_id"].iloc[0]
    assert gradflow.Run(run_id, db).wait(timeout=10) == "interrupted"
    assert cli.main(["runs", "--db", str(db)]) == 0
    assert "interrupted" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "said", "code"),
    [
        (["runs", "--db", "{tmp}/not-a-db.db"], "is not a gradflow run store", 2),
        (["runs", "--db", "{tmp}"], "`--db` must be a run-store file, got the folder", 2),
        (["export", "RUN", "--format", "csv", "--out", "{tmp}/a-file"], "File exists", 1),
        (["export", "RUN", "--format", "csv", "--out", "{tmp}/a-file/sub"], "Not a directory", 1),
    ],
)
def test_a_bad_db_or_out_path_is_one_line_not_a_traceback(
    trained, argv, said, code, tmp_path, capsys
):
    _, store, run_id = trained
    (tmp_path / "not-a-db.db").write_bytes(b"these are not the bytes of an SQLite file" * 50)
    (tmp_path / "a-file").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("RUN", run_id) for a in argv]
    if "--db" not in argv:
        argv += ["--db", str(store.path)]
    assert cli.main(argv) == code
    error = capsys.readouterr().err.strip()
    assert said in error and "Traceback" not in error and len(error.splitlines()) == 1, error


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--clip-value", "0.5"], "--clip-value has no effect without clipping"),
        (["--rnn-cell", "lstm"], "--rnn-cell is for --architecture rnn"),
        (["--init-stddev", "2"], "--init-stddev is for --initializer random_normal"),
        (["--architecture", "residual_mlp", "--no-residual"], "skip connections on"),
        (["--clipping", "norm", "--clip-value", "1"], None),
    ],
)
def test_flags_a_run_will_not_use_get_a_note(flags, said, capsys):
    """They were accepted without a word: a student thought they had clipped the gradients."""
    cli._config_from(cli._build_parser().parse_args(["train", *flags]))
    error = capsys.readouterr().err
    assert (said in error) if said else error == "", error


def test_a_listing_piped_into_head_ends_quietly(tmp_path):
    """`gradflow runs | head -1` said "gradflow: Broken pipe" and exited 1."""
    store = RunStore(tmp_path / "runs.db")
    for i in range(400):  # more than a pipe's 64 KiB buffer
        store.create_run({}, name=f"{i} " + "x" * 190)
    lister = subprocess.Popen(
        [sys.executable, "-m", "gradflow", "runs", "--db", str(tmp_path / "runs.db")],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert lister.stdout.readline().split()[:2] == [b"run_id", b"name"]
    lister.stdout.close()  # what `head -1` does
    assert lister.wait(60) == 0
    assert lister.stderr.read() == b""


def _student_store(path, names=("alice relu", "alice sigmoid")):
    """A store of finished runs with a few rows each, made without training."""
    from tests.test_store import tidy_rows

    store = RunStore(path)
    ids = []
    for name in names:
        run_id = store.create_run({}, name=name, status="completed")
        with store.writer(run_id) as writer:
            writer.add_layer_stats(tidy_rows([1, 2]))
            writer.add_metrics(2, {"loss": 0.25})
        ids.append(run_id)
    return store, ids


def test_import_copies_runs_once_and_runs_lists_them(tmp_path, capsys):
    _, ids = _student_store(tmp_path / "alice.db")
    dest = tmp_path / "class.db"
    assert cli.main(["import", str(tmp_path / "alice.db"), "--db", str(dest)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"copied  {ids[0]}  alice relu  (completed, step 2)",
        f"copied  {ids[1]}  alice sigmoid  (completed, step 2)",
    ]
    assert f"2 runs copied into {dest}" in captured.err
    assert cli.main(["import", str(tmp_path / "alice.db"), ids[1], "--db", str(dest)]) == 0
    captured = capsys.readouterr()
    assert (
        captured.out.startswith(f"skipped {ids[1]}  alice sigmoid") and "already in" in captured.out
    )
    assert len(captured.out.splitlines()) == 1
    assert cli.main(["runs", "--db", str(dest)]) == 0
    listed = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[0] for line in listed] == ids[::-1]  # newest first, once each


def test_a_run_deleted_from_the_class_store_stays_deleted_when_imported_again(tmp_path):
    """The teacher's deleted run came back with the student's next store; the line
    that says it stays out gives the command that brings it back, as it must be typed."""

    def gradflow(*argv):
        return subprocess.run(
            [sys.executable, "-m", "gradflow", *argv],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            cwd=tmp_path,
            timeout=120,
        )

    _, ids = _student_store(tmp_path / "alice.db")
    assert gradflow("import", "alice.db", "--label", "Alice", "--db", "class.db").returncode == 0
    RunStore(tmp_path / "class.db").delete(ids[0])
    (new,) = _student_store(tmp_path / "alice.db", names=("alice tanh",))[1]
    result = gradflow("import", "alice.db", "--label", "Alice", "--db", "class.db")
    assert result.returncode == 0, result.stderr
    skipped, already, copied = result.stdout.splitlines()
    command = f"gradflow import alice.db {ids[0]} --label Alice --db class.db --restore-deleted"
    assert re.fullmatch(
        rf"skipped {ids[0]}  Alice: alice relu  \(completed, step 2\) deleted from "
        rf"'class\.db' on \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d: to bring it back, `{command}`",
        skipped,
    ), skipped
    assert already.startswith(f"skipped {ids[1]}  Alice: alice sigmoid") and "already in" in already
    assert copied == f"copied  {new}  Alice: alice tanh  (completed, step 2)"
    assert result.stderr.strip() == (
        "gradflow: 1 run copied into class.db, 1 already there, 1 deleted there "
        "(--restore-deleted brings it back)"
    )
    result = gradflow(*command.split()[1:])
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"copied  {ids[0]}  Alice: alice relu  (completed, step 2)\n"
    assert set(RunStore(tmp_path / "class.db").runs()["run_id"]) == {*ids, new}


def test_a_store_moved_whole_says_it_carried_its_deletions(tmp_path, capsys):
    store, ids = _student_store(tmp_path / "class.db")
    store.delete(ids[0])
    store.close()
    new = tmp_path / "new.db"
    assert cli.main(["import", str(tmp_path / "class.db"), "--db", str(new)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"gradflow: 1 deletion of {tmp_path / 'class.db'} carried into {new}: runs deleted "
        "there stay out of later imports (--restore-deleted brings one back)",
        f"gradflow: 1 run copied into {new}",
    ]


def test_export_store_then_import_round_trips(trained, tmp_path, capsys):
    _, store, run_id = trained
    out = tmp_path / "to-send"
    argv = ["export", run_id, "--format", "store", "--out", str(out), "--db", str(store.path)]
    assert cli.main(argv) == 0
    (written,) = capsys.readouterr().out.split()
    assert pathlib.Path(written) == out / f"cli_demo_{run_id}.db"
    assert [p.name for p in out.iterdir()] == [f"cli_demo_{run_id}.db"]
    assert cli.main(argv) == 1  # not written over
    assert "exists already" in capsys.readouterr().err
    laptop = tmp_path / "laptop.db"
    assert cli.main(["import", written, "--db", str(laptop)]) == 0
    assert capsys.readouterr().out.startswith(f"copied  {run_id}  cli demo  (completed, step 4)")
    copied = RunStore(laptop)
    for read in ("layer_stats", "metrics", "events", "histograms"):
        expected, got = getattr(store, read)(run_id), getattr(copied, read)(run_id)
        assert got.equals(expected), read
    # A FILE.db as --out names the file itself.
    named = tmp_path / "relu.db"
    argv[argv.index(str(out))] = str(named)
    assert cli.main(argv) == 0 and capsys.readouterr().out.strip() == str(named)


@pytest.mark.parametrize(
    ("make", "extra", "said", "code"),
    [
        ("missing", [], "no run store at", 2),
        ("junk", [], "is not a gradflow run store", 2),
        ("folder", [], "got the folder", 2),
        ("store", ["0123456789ab"], "'0123456789ab' is not in the run store", 2),
        ("store", ["not an id"], "must be run id strings", 2),
        ("newer", [], "newer gradflow", 2),
    ],
)
def test_import_of_bad_input_is_one_line(tmp_path, capsys, make, extra, said, code):
    import sqlite3

    source = tmp_path / "source.db"
    if make == "junk":
        source.write_bytes(b"a spreadsheet, maybe" * 20)
    elif make == "folder":
        source = tmp_path
    elif make in ("store", "newer"):
        _student_store(source, names=("one",))
        if make == "newer":
            with sqlite3.connect(source) as conn:
                conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    dest = tmp_path / "dest" / "class.db"
    assert cli.main(["import", str(source), *extra, "--db", str(dest)]) == code
    captured = capsys.readouterr()
    assert said in captured.err and captured.out == "", captured.err
    assert len(captured.err.splitlines()) == 1 and "Traceback" not in captured.err
    assert not dest.exists() or RunStore(dest).runs().empty


def test_export_as_a_store_into_a_folder_it_cannot_write_names_that_file(trained, capsys):
    """It blamed the store it read ("'runs.db' cannot be opened")."""
    _, store, run_id = trained
    out = "/proc/gradflow-cannot-write-here.db"
    assert (
        cli.main(["export", run_id, "--format", "store", "--out", out, "--db", str(store.path)])
        == 1
    )
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(
        f"gradflow export: could not write the new store '{out}'"
    )


def test_export_as_a_store_of_a_damaged_store_says_so_in_one_line(trained, tmp_path, capsys):
    """A traceback ended in the right sentence (SourceStoreError was not caught)."""
    import shutil

    _, store, run_id = trained
    damaged = tmp_path / "damaged.db"
    shutil.copy(store.path, damaged)
    size = damaged.stat().st_size
    with open(damaged, "r+b") as file:
        file.seek(size // 2)
        file.write(b"\xff" * (size - size // 2))
    code = cli.main(
        [
            "export",
            run_id,
            "--format",
            "store",
            "--out",
            str(tmp_path / "x.db"),
            "--db",
            str(damaged),
        ]
    )
    said = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and len(said) == 1 and said[0].startswith("gradflow"), said
    assert "Traceback" not in " ".join(said)
