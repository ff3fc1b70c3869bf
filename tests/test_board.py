"""The run board: waiting pages watch the queue from the browser instead of ticking (issue #7).

Unit tests of the file the server publishes, page tests (AppTest) of what a
queued or warming page draws, and a real server with Chromium: a queued
page sends no rerun request until its run leaves the queue, then follows it.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from gradflow.ui.board import RunBoard
from tests.test_pages import full_run_messages, paces, run_page


class FakeManager:
    """`queued()`, `running()`, `wait_warm()` and `warming()` of a RunManager, set by the test."""

    def __init__(self, queue=(), warm=False):
        self.queue, self.warm, self.prewarm = list(queue), warm, True
        self.workers = {}

    def queued(self):
        return list(self.queue)

    def running(self):
        return dict(self.workers)

    def wait_warm(self, timeout=None):
        return self.warm

    def warming(self):
        return not self.warm


def read_board(board):
    return json.loads(board.path.read_bytes())


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def board(tmp_path):
    boards = []

    def make(manager, interval=0.05):
        boards.append(RunBoard(manager, tmp_path, url="app/static/gradflow/", interval=interval))
        return boards[-1]

    yield make
    for made in boards:
        made.close()


def test_the_board_lists_keyed_digests_of_the_queue_and_follows_it(board):
    manager = FakeManager(["run-a", "run-b"])
    published = board(manager)
    assert published.url == f"app/static/gradflow/{published.name}"  # from the app's root
    assert re.fullmatch(r"board-\d+-[0-9a-f]{16}\.json", published.name)
    content = read_board(published)
    assert content == {
        "queue": [published.digest("run-a"), published.digest("run-b")],
        "warm": False,
    }
    # Run ids are not on the (public) board; the digest is keyed per server.
    assert "run-a" not in published.path.read_text()
    assert re.fullmatch(r"[0-9a-f]{16}", published.digest("run-a"))
    assert published.digest("run-a") != board(FakeManager()).digest("run-a")

    manager.queue.pop(0)
    manager.warm = True
    wait_for(lambda: read_board(published) == {"queue": [published.digest("run-b")], "warm": True})


def test_the_file_keeps_its_size_so_a_response_never_ends_early(board):
    # The server sends a static file with the length it stat()ed before
    # opening it: a replaced file of another length would cut the response.
    manager = FakeManager()
    published = board(manager, interval=3600)
    sizes = {published.path.stat().st_size}
    for count in (1, 5, 20):
        manager.queue = [f"run-{n}" for n in range(count)]
        published.publish()
        sizes.add(published.path.stat().st_size)
        assert len(read_board(published)["queue"]) == count
    assert sizes == {1024}
    manager.queue = [f"run-{n}" for n in range(200)]  # 200 digests need more than 1 KiB
    published.publish()
    assert (
        published.path.stat().st_size in (4096, 8192) and len(read_board(published)["queue"]) == 200
    )


def test_a_board_is_written_atomically_while_it_is_read(board):
    manager = FakeManager()
    published = board(manager, interval=0.001)
    seen, stop = [], threading.Event()

    def change():
        n = 0
        while not stop.is_set():
            n += 1
            manager.queue = [f"run-{i}" for i in range(n % 7)]
            manager.warm = bool(n % 2)
            time.sleep(0.0005)

    writer = threading.Thread(target=change)
    writer.start()
    try:
        for _ in range(2000):
            seen.append(json.loads(published.path.read_bytes()))  # never half a file
    finally:
        stop.set()
        writer.join()
    assert len({len(s["queue"]) for s in seen}) > 1, "the board changed while it was read"


def test_closing_removes_the_file_and_boards_of_dead_servers_are_swept(board, tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stale = tmp_path / f"board-{dead}-0123456789abcdef.json"
    stale.write_text("{}")
    alive = tmp_path / f"board-{os.getppid()}-0123456789abcdef.json"
    alive.write_text("{}")
    published = board(FakeManager())
    assert not stale.exists() and alive.exists()
    published.close()
    assert not published.path.exists()


# ------------------------------------------------------------------ the pages (AppTest)


def watchers(messages):
    """The board watchers a run drew: (fragment id, data)."""
    return [
        (m.delta.fragment_id, json.loads(m.delta.new_element.bidi_component.json))
        for m in messages
        if m.WhichOneof("type") == "delta"
        and m.delta.new_element.bidi_component.component_name.endswith("gradflow.board_watch")
    ]


def intervals(messages):
    return [m.auto_rerun.interval for m in messages if m.WhichOneof("type") == "auto_rerun"]


def test_a_queued_page_watches_its_place_instead_of_ticking(page_environment, board, monkeypatch):
    from gradflow.store import RunStore
    from gradflow.ui import live, resources

    store = RunStore(page_environment)
    first = store.create_run({"depth": 3}, name="first in line", status="queued")
    queued = store.create_run({"depth": 3}, name="in line", status="queued")
    manager = FakeManager([first, queued], warm=True)
    published = board(manager)
    monkeypatch.setattr(resources, "run_manager", lambda: manager)
    monkeypatch.setattr(resources, "run_board", lambda: published)
    messages = full_run_messages(monkeypatch)

    app = run_page("live_training.py", run=queued)
    assert intervals(messages) == [] and paces(messages) == [], (
        "nothing polls the server while the run waits"
    )
    assert any("this run starts when a slot frees." in i.value for i in app.info)
    [(fragment, data)] = watchers(messages)
    assert fragment, "in the panel's fragment: the run leaving the queue reruns only the fragment"
    assert data["url"] == published.url
    assert data["run"] == published.digest(queued) and data["place"] == 1
    assert read_board(published)["queue"].index(data["run"]) == data["place"]

    # The run leaves the manager's queue for a worker, which has not marked
    # it running yet: the fragment's rerun ticks fast until its first step.
    manager.queue = [first]
    manager.workers[queued] = 1234
    run_page("live_training.py", run=queued)
    assert paces(messages) == [live.FIRST_POLL_SECONDS] and watchers(messages) == []


def test_a_page_waits_for_the_warm_trainer_on_the_board(page_environment, board, monkeypatch):
    from gradflow.ui import resources

    manager = FakeManager(warm=False)
    published = board(manager)
    monkeypatch.setattr(resources, "run_manager", lambda: manager)
    monkeypatch.setattr(resources, "run_board", lambda: published)
    messages = full_run_messages(monkeypatch)
    app = run_page("live_training.py")
    assert any("Warming up the trainer" in c.value for c in app.caption)
    assert intervals(messages) == []
    [(fragment, data)] = watchers(messages)
    assert fragment and data["run"] is None and data["warm"] is False, (
        "a change reruns the page's fragment"
    )
    assert paces(messages) == [], "no ticks while the board is watched"

    manager.warm = True
    messages = full_run_messages(monkeypatch)
    app = run_page("live_training.py")
    assert any("Trainer ready" in c.value for c in app.caption) and watchers(messages) == []


# ------------------------------------------------------------------ a real server and browser


def _start(context, url, steps):
    page = context.new_page()
    sent = []
    page.on(
        "websocket",
        lambda socket: socket.on("framesent", lambda payload: sent.append(time.monotonic())),
    )
    page.goto(f"{url}/?steps={steps}&depth=2&width=8")
    page.get_by_role("button", name="Start training").click()
    return page, sent


@pytest.mark.browser
@pytest.mark.slow
def test_queued_pages_follow_their_place_without_asking_the_server(
    chromium, tmp_path, artifacts_dir
):
    # One training slot, three students: the second and third wait. Their
    # pages show their place from the board and send the server nothing
    # until their own run leaves the queue; then they follow it to the end.
    from gradflow.store import RunStore
    from tests.browser import streamlit_server

    db = tmp_path / "runs.db"
    env = {"GRADFLOW_MAX_RUNNING": "1", "GRADFLOW_PREWARM": "0"}
    with streamlit_server(db, extra_env=env, log_path=artifacts_dir / "board-server.log") as (
        url,
        _,
    ):
        store = RunStore(db)
        first, _ = _start(chromium.new_context(), url, 20000)
        first.get_by_text("Training").first.wait_for(timeout=120_000)
        second, second_sent = _start(chromium.new_context(), url, 30)
        second.get_by_text("next in line").wait_for(timeout=60_000)
        third, third_sent = _start(chromium.new_context(), url, 30)
        third.get_by_text("1 ahead of it").wait_for(timeout=60_000)
        assert third.get_by_text("Waiting in the queue").count() == 1

        time.sleep(1.0)  # the clicks' own messages
        quiet_since = time.monotonic()
        time.sleep(5.0)  # two and a half ticks at the old pace
        assert [t for t in second_sent + third_sent if t > quiet_since] == [], (
            "queued pages sent messages"
        )
        looks = third.evaluate(
            "() => performance.getEntriesByType('resource').filter(e => e.name.includes('/board-')).length"
        )
        assert looks >= 4, "the page looks at the board from the browser"

        # Near the front of the queue, it loads Plotly.js while it waits
        # (`board.PRELOAD_PLACE`), through the live charts' own module.
        third.wait_for_function("() => window.Plotly !== undefined", timeout=60_000)
        assert third.get_by_text("Waiting in the queue").count() == 1

        first.get_by_role("button", name="Stop").click()
        second.get_by_text("Training").first.wait_for(timeout=60_000)
        # The third page moved up in the browser, without a rerun.
        third.get_by_text("next in line").wait_for(timeout=30_000)
        assert [t for t in third_sent if t > quiet_since] == []

        for page in (second, third):
            page.get_by_text("Completed").first.wait_for(timeout=180_000)
            run_id = re.search(r"run=([0-9a-f]+)", page.url).group(1)
            assert store.status(run_id) == "completed"
            page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
        assert third_sent, "the third page asked once its run left the queue"


def test_a_board_that_cannot_be_written_leaves_the_pages_ticking(tmp_path, monkeypatch):
    from gradflow.ui import resources

    monkeypatch.setattr(resources, "run_manager", lambda: FakeManager())
    not_a_folder = tmp_path / "static-file"
    not_a_folder.write_text("")
    assert resources._run_board(str(not_a_folder), "/app/static/gradflow") is None


# The watch script alone in Chromium, with `fetch` answering a board the test sets.
_WATCH_SETUP = """async (source) => {
  const url = URL.createObjectURL(new Blob([source], {type: "text/javascript"}));
  window.watch = (await import(url)).default;
  window.board = {queue: [], warm: true};
  window.looks = [];
  window.asked = [];
  window.fetch = async (url) => {
    window.looks.push(performance.now());
    return new Response(JSON.stringify(window.board), {status: 200});
  };
}"""
_WATCH_START = """(data) => {
  const element = document.createElement("div");
  element.appendChild(document.createElement("span"));
  document.body.appendChild(element);
  window.watch({data, parentElement: element, setTriggerValue: (name, value) => window.asked.push(value)});
  return element;
}"""


@pytest.mark.browser
def test_a_page_far_back_in_the_queue_looks_at_the_board_less_often(chromium):
    # A run cannot leave the queue before the runs ahead of it: a page looks
    # every 1, 2 or 3 intervals as it is 0-2, 3-5 or 6+ places back, and at
    # once every interval again when it moves up, and asks when its run leaves.
    from gradflow.ui import board as board_module

    page = chromium.new_page()
    try:
        page.evaluate(_WATCH_SETUP, board_module._WATCH_JS)
        every_ms = 200
        data = {
            "url": "/board.json",
            "every_ms": every_ms,
            "ask_again_ms": 3000,
            "failed_looks": 3,
            "places_per_slower_look": board_module.PLACES_PER_SLOWER_LOOK,
            "slowest_looks": board_module.SLOWEST_LOOKS,
            "run": "mine",
            "place": 7,
        }

        def gaps_at(place, looks=4):
            page.evaluate(
                "(place) => { window.board.queue = [...Array(place).fill('other'), 'mine']; "
                "window.looks = []; }",
                place,
            )
            page.wait_for_function(f"() => window.looks.length >= {looks}", timeout=20_000)
            times = page.evaluate("() => window.looks")
            return [
                b - a for a, b in zip(times[1:], times[2:], strict=False)
            ]  # after the first look

        page.evaluate(
            "(place) => { window.board.queue = [...Array(place).fill('other'), 'mine']; }", 7
        )
        page.evaluate(_WATCH_START, data)
        far, middle, near = gaps_at(7), gaps_at(4), gaps_at(1)
        assert all(2.7 * every_ms <= gap < 4.5 * every_ms for gap in far), far
        assert all(1.7 * every_ms <= gap < 3.0 * every_ms for gap in middle), middle
        assert all(0.8 * every_ms <= gap < 1.8 * every_ms for gap in near), near
        assert page.evaluate("() => document.querySelector('span').textContent") == "1 ahead of it"
        assert page.evaluate("() => window.asked") == []

        page.evaluate("() => { window.board.queue = []; }")  # the run left the queue
        page.wait_for_function("() => window.asked.length === 1", timeout=10_000)
    finally:
        page.close()


@pytest.mark.browser
def test_a_page_near_the_front_of_the_queue_loads_plotly_while_it_waits(chromium):
    # Far back it only looks at the board; two places from the front it
    # imports the live charts' module from the app's static files and asks it
    # for Plotly.js, once.
    from gradflow.ui import board as board_module

    module = "export function preloadPlotly(src, gzipSrc) { window.preloads.push([src, gzipSrc]); }"

    def answer(route):
        if "/app/static/gradflow/live_chart.js" in route.request.url:
            route.fulfill(body=module, content_type="text/javascript")
        else:
            route.fulfill(body="<html><body></body></html>", content_type="text/html")

    page = chromium.new_page()
    try:
        page.route("http://gradflow.test/**", answer)
        page.goto("http://gradflow.test/")
        page.evaluate(_WATCH_SETUP, board_module._WATCH_JS)
        page.evaluate(
            "() => { window.preloads = []; "
            "window.board.queue = [...Array(5).fill('other'), 'mine']; }"
        )
        page.evaluate(
            _WATCH_START,
            {
                "url": "/board.json",
                "every_ms": 200,
                "ask_again_ms": 3000,
                "failed_looks": 3,
                "places_per_slower_look": board_module.PLACES_PER_SLOWER_LOOK,
                "slowest_looks": board_module.SLOWEST_LOOKS,
                "run": "mine",
                "place": 5,
                "preload": {
                    "folder": "app/static/gradflow/",
                    "module": "live_chart.js?v=1",
                    "plotly": "plotly.min.js?v=2",
                    "plotly_gz": "plotly.min.js.gz?v=3",
                },
                "preload_place": board_module.PRELOAD_PLACE,
            },
        )
        page.wait_for_function("() => window.looks.length >= 3", timeout=20_000)
        assert page.evaluate("() => window.preloads") == []

        page.evaluate(
            "(place) => { window.board.queue = [...Array(place).fill('other'), 'mine']; }",
            board_module.PRELOAD_PLACE,
        )
        page.wait_for_function("() => window.preloads.length > 0", timeout=20_000)
        looks = page.evaluate("() => window.looks.length")
        page.wait_for_function(f"() => window.looks.length >= {looks + 3}", timeout=20_000)
        root = "http://gradflow.test/app/static/gradflow/"
        assert page.evaluate("() => window.preloads") == [
            [root + "plotly.min.js?v=2", root + "plotly.min.js.gz?v=3"]
        ]
        assert page.evaluate("() => window.asked") == []
    finally:
        page.close()
