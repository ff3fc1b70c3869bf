"""`gradflow.quick_exit`: a program's exit without Python's teardown, and what it keeps."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

PROGRAM = """
import atexit, sys
from gradflow.quick_exit import quick_exit
atexit.register(lambda: print("handler ran", file=sys.stderr))
print("unflushed line", end="")  # a pipe buffers it until a flush
quick_exit(None if sys.argv[1] == "none" else int(sys.argv[1]))
print("never")
"""


@pytest.mark.parametrize("code,status", [("0", 0), ("3", 3), ("none", 0)])
def test_the_status_output_and_exit_handlers_survive(code, status):
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=60,
    )
    assert done.returncode == status
    assert done.stdout == "unflushed line"
    assert done.stderr == "handler ran\n"


def test_the_command_lines_exit_codes_and_table_are_kept(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    db = str(tmp_path / "runs.db")
    command = [sys.executable, "-m", "gradflow", "train", "--db", db, "--no-progress"]
    trained = subprocess.run(
        [*command, "--steps", "3", "--depth", "1", "--width", "4", "--name", "quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr
    assert "dense" in trained.stdout  # the final per-layer table, flushed before the exit
    listed = subprocess.run(
        [sys.executable, "-m", "gradflow", "runs", "--db", db],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert listed.returncode == 0 and "quick" in listed.stdout and "completed" in listed.stdout
    refused = subprocess.run(
        [*command, "--depth", "0"], capture_output=True, text=True, env=env, timeout=300
    )
    assert refused.returncode == 2
    assert "depth" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
