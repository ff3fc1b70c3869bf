"""The image renderer keeps one real Chromium open between exports, and never leaves one behind."""

import io
import os
import pathlib
import signal
import subprocess
import sys
import threading

import PIL.Image
import plotly.graph_objects as go
import pytest

from gradflow import export
from gradflow.image_renderer import ImageRenderer
from tests.browser import wait_until

BROWSER = export.find_browser()
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium/Chrome installed")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def png_spec(width, points=(1, 3, 2)):
    figure = go.Figure(go.Scatter(y=list(points)))
    return figure.to_dict(), {"format": "png", "width": width, "height": 200, "scale": 1}


def png_width(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return PIL.Image.open(io.BytesIO(data)).size[0]


def parents():
    """{pid: parent pid} of every process now running (Linux /proc)."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def process_tree(pid):
    """`pid` and every process below it."""
    parent_of = parents()
    tree, grew = {pid}, True
    while grew:
        below = {child for child, parent in parent_of.items() if parent in tree} - tree
        grew = bool(below)
        tree |= below
    return tree & set(parent_of)


def alive(pids):
    return {pid for pid in pids if pathlib.Path(f"/proc/{pid}").exists() and not zombie(pid)}


def zombie(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def renderer():
    renderer = ImageRenderer()
    yield renderer
    renderer.close()


def test_exports_share_one_browser(renderer):
    first = renderer.render(BROWSER, [png_spec(300)])
    pid = renderer.browser_pid
    second = renderer.render(BROWSER, [png_spec(400), png_spec(500)])
    assert [png_width(b) for b in first + second] == [300, 400, 500]
    assert renderer.starts == 1 and renderer.browser_pid == pid


def test_close_ends_the_browser_and_its_thread(renderer):
    renderer.render(BROWSER, [png_spec(300)])
    tree = process_tree(renderer.browser_pid)
    assert len(tree) > 1  # the wrapper and Chromium's own processes
    thread = renderer._thread
    renderer.close()
    assert renderer.browser_pid is None
    assert wait_until(lambda: not alive(tree))
    assert not thread.is_alive()
    # A later export starts a fresh browser.
    assert png_width(renderer.render(BROWSER, [png_spec(320)])[0]) == 320
    assert renderer.starts == 2


def test_idle_browser_closes_by_itself():
    renderer = ImageRenderer(idle_seconds=0.5)
    try:
        renderer.render(BROWSER, [png_spec(300)])
        tree = process_tree(renderer.browser_pid)
        assert wait_until(lambda: renderer.browser_pid is None and not alive(tree))
    finally:
        renderer.close()


def test_a_crashed_browser_is_replaced(renderer):
    renderer.render(BROWSER, [png_spec(300)])
    tree = process_tree(renderer.browser_pid)
    for pid in alive(tree):  # Chromium crashes, every process of it
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not alive(tree))
    assert png_width(renderer.render(BROWSER, [png_spec(360)])[0]) == 360
    assert renderer.starts == 2


def test_concurrent_exports_each_get_their_own_image(renderer):
    widths = [300, 340, 380, 420]
    results = {}

    def export_one(width):
        results[width] = png_width(renderer.render(BROWSER, [png_spec(width)])[0])

    threads = [threading.Thread(target=export_one, args=(w,)) for w in widths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == {w: w for w in widths}
    assert renderer.starts == 1


def test_a_render_kaleido_refuses_keeps_the_browser(renderer):
    renderer.render(BROWSER, [png_spec(300)])
    pid = renderer.browser_pid
    with pytest.raises(ValueError, match="Invalid format"):
        renderer.render(BROWSER, [({"data": []}, {"format": "bmp"})])
    assert renderer.browser_pid == pid and renderer.starts == 1
    assert png_width(renderer.render(BROWSER, [png_spec(300)])[0]) == 300


def test_killed_owner_leaves_no_browser():
    """`kill -9` of a process that exported: its Chromium goes too (no orphans)."""
    script = (
        "import sys, time, plotly.graph_objects as go\n"
        "from gradflow import export\n"
        "export.to_image(go.Figure(go.Scatter(y=[1, 2])), 'png')\n"
        "print(export.RENDERER.browser_pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        pid = int(owner.stdout.readline())
        tree = process_tree(pid)
        assert len(alive(tree)) > 1
        owner.kill()
        owner.wait(30)
        assert wait_until(lambda: not alive(tree)), f"left running: {sorted(alive(tree))}"
    finally:
        if owner.poll() is None:
            owner.kill()


def test_at_exit_the_browser_closes_before_its_profile_folder_goes():
    """The profile folder was removed under a running browser: now and then a
    traceback, "OSError: [Errno 39] Directory not empty", after an export."""
    script = (
        "import os, shutil, plotly.graph_objects as go\n"
        "from gradflow import export\n"
        "removing = shutil.rmtree\n"
        "pid, profile = None, None\n"
        "def state():\n"
        "    try:\n"
        "        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]\n"
        "    except OSError:\n"
        "        return 'gone'\n"
        "def rmtree(path, *args, **kwargs):\n"
        "    if str(path) == profile:\n"
        "        print('profile removed, browser', state(), flush=True)\n"
        "    return removing(path, *args, **kwargs)\n"
        "shutil.rmtree = rmtree\n"
        "export.to_image(go.Figure(go.Scatter(y=[1, 2])), 'png')\n"
        "pid = export.RENDERER.browser_pid\n"
        "flags = open(f'/proc/{pid}/cmdline').read().split('\\0')\n"
        "profile = next(f for f in flags if f.startswith('--user-data-dir=')).split('=', 1)[1]\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    removals = done.stdout.splitlines()
    assert removals and set(removals) <= {"profile removed, browser gone"}, removals
    assert "Traceback" not in done.stderr
