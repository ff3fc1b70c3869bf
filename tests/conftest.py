"""Shared test set-up: quiet, small, deterministic TensorFlow on 2 cores."""

import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest  # noqa: E402

ARTIFACTS = pathlib.Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="session")
def artifacts_dir():
    """Folder for screenshots and exported files that tests keep for people to look at."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def store_path(tmp_path):
    """A fresh SQLite run-store path in a temporary folder."""
    return tmp_path / "runs.db"


# Several TF processes share 2 cores in CI; keep each one modest.
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "2")
