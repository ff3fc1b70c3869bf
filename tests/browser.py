"""Real-browser helpers: a `streamlit run` server on a free port and headless Chromium.

Playwright cannot download its own browser here, so we launch Debian's
`chromium` through `executable_path`.
"""

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path():
    """Path of the system Chromium, or None."""
    for name in (
        os.environ.get("GRADFLOW_CHROMIUM"),
        "chromium",
        "chromium-browser",
        "google-chrome",
    ):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, seconds=40.0):
    """Poll `condition` every 0.1 s for up to `seconds`; its last value."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def wait_healthy(url, timeout=90.0, process=None):
    """Wait until Streamlit's health endpoint answers `ok`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"streamlit exited early with code {process.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read().strip() == b"ok":
                    return
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not become healthy within {timeout} s")


@contextlib.contextmanager
def streamlit_server(db_path, extra_env=None, log_path=None, script=None, niceness=0):
    """Run `streamlit run app.py` (or `script`) on a free loopback port; yield its URL.

    `niceness` runs the server under `nice -n niceness` (below 0 needs root).
    """
    port = free_port()
    env = dict(os.environ, GRADFLOW_DB=str(db_path), PYTHONUNBUFFERED="1")
    env.update(extra_env or {})
    log = open(log_path or os.devnull, "wb")
    process = subprocess.Popen(
        (["nice", "-n", str(niceness)] if niceness else [])
        + [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(script or REPO / "app.py"),
            "--server.port",
            str(port),
            "--server.address",
            "127.0.0.1",
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
            "--server.fileWatcherType",
            "none",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process=process)
        yield url, process
    finally:
        # The whole process group: the server and any worker it spawned.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def new_elements(frames):
    """`(time, frame bytes, element)` of each new element among recorded WebSocket frames.

    Args:
        frames: `(time, payload bytes)` pairs of the frames a page received.
    """
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    for when, payload in frames:
        message = ForwardMsg()
        message.ParseFromString(payload)
        if (
            message.WhichOneof("type") == "delta"
            and message.delta.WhichOneof("type") == "new_element"
        ):
            yield when, len(payload), message.delta.new_element
