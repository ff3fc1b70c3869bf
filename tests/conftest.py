"""Shared test set-up: quiet, small, deterministic TensorFlow on 2 cores."""

import contextlib
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


@contextlib.contextmanager
def pages_on(db):
    """Dashboard pages (AppTest) in this process read the run store `db`, with no warm worker.

    Pages share `st.cache_resource` singletons in this process: the caches are
    cleared before and after, and the environment is restored.
    """
    import streamlit as st

    saved = {k: os.environ.get(k) for k in ("GRADFLOW_DB", "GRADFLOW_PREWARM")}
    os.environ.update(GRADFLOW_DB=str(db), GRADFLOW_PREWARM="0")
    st.cache_resource.clear()
    try:
        yield db
    finally:
        st.cache_resource.clear()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def page_environment(tmp_path_factory):
    """A fresh run store for the dashboard pages of one test module (`pages_on`)."""
    with pages_on(tmp_path_factory.mktemp("pages") / "runs.db") as db:
        yield db


@pytest.fixture(scope="session")
def chromium():
    """A headless Debian Chromium driven by Playwright (skipped only when none is installed)."""
    from tests.browser import CHROMIUM_ARGS, chromium_path

    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(
                "CI must have Chromium: scripts/ensure_chromium.sh should have installed it."
            )
        pytest.skip("no system Chromium; run scripts/ensure_chromium.sh")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=path, headless=True, args=CHROMIUM_ARGS
        )
        yield browser
        browser.close()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Let fixtures see whether the test body failed (for failure screenshots)."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
