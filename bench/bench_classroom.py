"""A classroom on one dashboard: N students start a small run at the same time.

    python3 bench/bench_classroom.py [--students 30] [--cycles 100] [--timeout 540] [--out FILE]

One `streamlit run app.py` server on loopback (tests/browser.py), one headless
Chromium with one browser context per student (the async Playwright API, so
30 students are 30 pages, not 30 browsers). Each student opens a shared link
with small settings (`/?steps=60&depth=3&width=16`), waits for the
**Start training** button, presses it, and watches until the run is
`Completed`; runs beyond the server's training slots must wait visibly
("Waiting in the queue"). Then pages are opened and closed `--cycles` times to
look for leaked processes and threads in the server.

Measured (reported, never asserted here):
- every run completed; statuses each page showed; `stException` blocks seen;
  pages whose frontend closed its WebSocket (it does so for good after an
  error handling a message: the frozen page of issue #7) and their console
  errors;
- click -> first status line, click -> first heatmap column, click -> Completed;
- page update latency (target p95 <= 2 s): for every new step a page shows,
  the time since the store first had that step (the store is read every
  0.1 s by this bench); also the time between successive changes of the
  "step N / M" counter while the run trains (short runs give few of these);
- whether each page drew a heatmap of its run (within 30 s of the run ending), and
  for a page that did not, what its charts were doing (`without_a_chart`);
- CPU seconds of the server alone, of the server with its workers, and of
  this bench with its Chromium (they share the same cores here; in a real
  classroom every student's browser runs on their own machine);
- peak memory: the sum of VmRSS over the server and all its descendant
  processes (workers), sampled every 0.5 s, and the largest VmHWM seen;
- processes in the server's tree and the server's threads before and after the
  open/close cycles.

With `--count-dropped-events` the server's Streamlit is patched by
`bench/streamlit_drops/sitecustomize.py` to log each script-run message it
drops (the runs that a rerun request overtook, issue #7); the report counts
them.

A teacher's page opens first and waits for "Trainer ready" (the warm spare
worker), as before a class. Writes bench/results/classroom.json (or --out).
"""

import argparse
import asyncio
import collections
import itertools
import json
import os
import pathlib
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.browser import CHROMIUM_ARGS, chromium_path, streamlit_server  # noqa: E402

SHARED_LINK = "/?steps=60&depth=3&width=16"
STATUS_WORDS = (
    "Waiting in the queue",
    "Training",
    "Paused",
    "Completed",
    "Stopped",
    "Diverged",
    "Interrupted",
    "Failed",
)
FINAL_WORDS = ("Completed", "Stopped", "Diverged", "Interrupted", "Failed")
# Thirty pages in one headless browser: no page may be throttled as "hidden".
BROWSER_ARGS = CHROMIUM_ARGS + [
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
]

# Runs in every page from its first instant: records each change of the run's
# status line ("**name** — Training · step 12 / 60 · loss 2.1") with the
# browser's clock, the first time a heatmap has a column, and the most
# exception blocks ever on screen (an exception that a rerun later removes
# still counts).
# A MutationObserver looks when the DOM changes, and reads `textContent`
# (no layout). Until the eighth session this polled every 100 ms with
# `innerText`, which forces a layout: 30 pages x 10 a second of work that a
# student's browser never does, on the same 2 cores as the server, and up to
# 100 ms late on top.
PAGE_RECORDER = r"""
(() => {
  const record = {changes: [], firstChart: null, exceptions: 0};
  window.__classroom = record;
  let last = null;
  const look = () => {
    const lines = document.querySelectorAll('[data-testid="stMarkdownContainer"]');
    let text = null;
    for (const line of lines) {
      const value = line.textContent;
      if (/ — /.test(value) && /step \d+/.test(value)) { text = value; break; }
    }
    if (text !== null && text !== last) { record.changes.push([Date.now(), text]); last = text; }
    record.exceptions = Math.max(record.exceptions,
      document.querySelectorAll('[data-testid="stException"]').length);
    if (record.firstChart === null) {
      for (const plot of document.querySelectorAll('.js-plotly-plot')) {
        for (const trace of ((plot.gradflowWhole || plot).data || [])) {
          if (trace.type === 'heatmap' && trace.z &&
              (trace.z.shape ? Number(String(trace.z.shape).split(',').pop()) > 0 : trace.z.length > 0)) {
            record.firstChart = Date.now();
          }
        }
      }
    }
  };
  new MutationObserver(look).observe(document, {childList: true, subtree: true, characterData: true});
  // Stretches of more than 2 s in which this page ran no timer (its main thread
  // or its whole renderer held up): [when it began, how long], page clock.
  record.stalls = [];
  let beat = Date.now();
  setInterval(() => {
    const now = Date.now();
    if (now - beat > 2000) record.stalls.push([beat, now - beat]);
    beat = now;
  }, 500);
  // A waiting page's looks at the run board (gradflow/ui/board.py), asked and answered, in the page's clock.
  record.boardLooks = [];
  record.boardFailures = 0;
  const fetchOnce = window.fetch;
  window.fetch = async function (resource, options) {
    if (!String(resource?.url ?? resource).includes('/board-')) return fetchOnce.call(this, resource, options);
    const asked = Date.now();
    try {
      const response = await fetchOnce.call(this, resource, options);
      record.boardLooks.push([asked, Date.now()]);
      return response;
    } catch (error) {
      record.boardFailures += 1;
      throw error;
    }
  };
})();
"""
LAST_STATUS = "() => { const c = window.__classroom; return c && c.changes.length ? c.changes[c.changes.length - 1][1] : null; }"


def status_of(text):
    """The status word of a status line, or None."""
    if not text:
        return None
    return next((word for word in STATUS_WORDS if word in text), None)


def step_of(text):
    match = re.search(r"step (\d+)", text or "")
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------- processes (no psutil)


def _proc_status(pid):
    """Fields of /proc/<pid>/status as a dict of strings, or None if gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def process_tree(root_pid):
    """The pids of `root_pid` and all its descendants (workers start new sessions,
    so the process group would miss them; the parent links do not)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            status = _proc_status(entry)
            if status:
                children.setdefault(int(status["PPid"]), []).append(int(entry))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_seconds(root_pid):
    """CPU time used by a process tree so far, including its reaped children."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in process_tree(root_pid):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # utime, stime, cutime, cstime (fields 14-17 of proc(5)).
        total += sum(int(value) for value in fields[11:15])
    return total / ticks


def own_cpu_seconds(pid):
    """CPU time of one process alone (threads included, children not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kib(value):
    return int(value.split()[0]) if value else 0


def threads_of(pid):
    status = _proc_status(pid)
    return int(status["Threads"]) if status else None


def thread_census(pid):
    """The server's Python threads by name, numbers dropped ("AnyIO worker thread": 12),
    from `py-spy dump` when it is installed (None otherwise): tells a pool that
    grew to its size from threads that pile up."""
    if not shutil.which("py-spy"):
        return None
    try:
        dump = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        names = [thread.get("thread_name") or "?" for thread in json.loads(dump)]
    except (subprocess.SubprocessError, OSError, ValueError):
        return None
    return dict(collections.Counter(re.sub(r"[-_]?\d+", "", name) for name in names).most_common())


def dropped_events(log):
    """What `bench/streamlit_drops` logged: dropped script runs and messages, and the sessions hit."""
    lines = [line.split() for line in log.splitlines() if line.startswith("DROP ")]
    return {
        "whole_runs (their start dropped)": sum(line[3] == "SCRIPT_STARTED" for line in lines),
        "run_ends": sum(
            line[3].endswith(
                ("STOPPED_WITH_SUCCESS", "STOPPED_WITH_COMPILE_ERROR", "STOPPED_FOR_RERUN")
            )
            for line in lines
        ),
        "fragment_deltas": sum(line[4:] == ["delta:fragment"] for line in lines),
        "main_deltas": sum(line[4:] == ["delta:main"] for line in lines),
        "auto_rerun_messages": sum(line[4:] == ["auto_rerun"] for line in lines),
        "sessions": len({line[2] for line in lines}),
    }


def rss_mib(pid):
    status = _proc_status(pid)
    return _kib(status.get("VmRSS")) / 1024 if status else 0.0


class Sampler:
    """Calls `_sample()` every `self.interval` seconds in a thread, inside a `with` block."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)
        self._close()

    def _sample(self):
        raise NotImplementedError

    def _close(self):
        pass


class MemorySampler(Sampler):
    """Samples the memory of a process tree every `interval` seconds in a thread."""

    def __init__(self, root_pid, interval=0.5):
        self.root_pid = root_pid
        self.interval = interval
        self.peak_total_rss_mib = 0.0
        self.peak_processes = 0
        self.peak_hwm_mib = {}  # pid -> (name, VmHWM MiB)
        super().__init__()

    def _sample(self):
        total, count = 0.0, 0
        for pid in process_tree(self.root_pid):
            status = _proc_status(pid)
            if not status:
                continue
            count += 1
            total += _kib(status.get("VmRSS")) / 1024
            hwm = _kib(status.get("VmHWM")) / 1024
            if hwm > self.peak_hwm_mib.get(pid, ("", 0.0))[1]:
                self.peak_hwm_mib[pid] = (status.get("Name", "?"), hwm)
        self.peak_total_rss_mib = max(self.peak_total_rss_mib, total)
        self.peak_processes = max(self.peak_processes, count)

    def summary(self, server_pid):
        workers = [hwm for pid, (_, hwm) in self.peak_hwm_mib.items() if pid != server_pid]
        return {
            "peak_total_rss_mib": round(self.peak_total_rss_mib, 1),
            "peak_processes_in_tree": self.peak_processes,
            "server_vm_hwm_mib": round(self.peak_hwm_mib.get(server_pid, ("", 0.0))[1], 1),
            "largest_worker_vm_hwm_mib": round(max(workers, default=0.0), 1),
            "workers_seen": len(workers),
        }


class StoreSampler(Sampler):
    """Reads every run's status and progress step from the store every
    `interval` seconds (plain sqlite3, read only), remembering when each step
    and each status was first seen: the reference for the page latencies."""

    def __init__(self, db_path, interval=0.1):
        self.db_path = db_path
        self.interval = interval
        self.first_step = {}  # (run_id, step) -> time first seen
        self.first_status = {}  # (run_id, status) -> time first seen
        self._conn = None
        super().__init__()

    def _sample(self):
        import sqlite3

        try:
            if self._conn is None:
                self._conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=5)
            rows = self._conn.execute("SELECT run_id, progress_step, status FROM runs").fetchall()
        except sqlite3.Error:
            rows = []  # the server has not made the file yet
        now = time.time()
        for run_id, step, status in rows:
            self.first_step.setdefault((run_id, int(step or 0)), now)
            self.first_status.setdefault((run_id, status), now)

    def _close(self):
        if self._conn is not None:
            self._conn.close()

    def step_available_at(self, run_id, step):
        """When the store first had `progress_step >= step` for `run_id`, or None."""
        times = [t for (rid, s), t in self.first_step.items() if rid == run_id and s >= step]
        return min(times) if times else None


# ---------------------------------------------------------------- one student


async def student(browser, url, number, deadline, stagger_s=2.0, linger_s=30.0):
    """Open the shared link, press Start training, follow the run to its end.

    Returns a dict of what the page showed and when (seconds, bench clock).
    """
    result = {"student": number, "error": None, "statuses": [], "final": None}
    # A page whose frontend hit an error handling a message closes its
    # WebSocket for good and freezes (issue #7): record both.
    result["console_errors"], result["websocket_closed_at"] = [], []
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        page = await context.new_page()
        page.on("console", lambda m: _console_error(result, m))
        page.on("websocket", lambda ws: _watch_socket(ws, result))
        # A waiting page watches the run board (gradflow/ui/board.py) from the browser.
        await page.add_init_script(PAGE_RECORDER)
        opened = time.time()
        await page.goto(url + SHARED_LINK, timeout=remaining_ms(deadline))
        start = page.get_by_role("button", name="Start training")
        await start.wait_for(timeout=remaining_ms(deadline))
        result["open_to_button_s"] = time.time() - opened
        # Students do not all click in the same millisecond.
        await asyncio.sleep(random.uniform(0, stagger_s))
        clicked = time.time()
        await start.click(timeout=remaining_ms(deadline))
        result["clicked_at"] = clicked
        # The page puts its run in the URL (?run=<id>), so a reload keeps it.
        while time.time() < deadline and "run=" not in page.url:
            await asyncio.sleep(0.2)
        match = re.search(r"[?&]run=([0-9a-f]+)", page.url)
        result["run_id"] = match.group(1) if match else None
        while time.time() < deadline:
            text = await page.evaluate(LAST_STATUS)
            if status_of(text) in FINAL_WORDS:
                break
            await asyncio.sleep(0.5)
        # A finished run's page reruns once more and draws its charts. A page
        # that only then loads Plotly (4.8 MB of JavaScript) evaluates it on
        # these loaded cores for many seconds (twelfth session: 10 s was too
        # short for one or two pages a run; they were loading it, not stuck).
        linger = min(deadline, time.time() + linger_s)
        while (
            time.time() < linger
            and await page.evaluate("() => window.__classroom.firstChart") is None
        ):
            await asyncio.sleep(0.5)
        result["final_text"] = await page.evaluate(LAST_STATUS)
        if await page.evaluate("() => window.__classroom.firstChart") is None:
            result["without_a_chart"] = await page.evaluate(CHART_STATE)
        record = await page.evaluate("() => window.__classroom")
        result.update(_timeline(record, clicked))
    except Exception as error:  # noqa: BLE001 - a bench reports every failure, it never stops on one
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        try:
            record = await page.evaluate("() => window.__classroom")
            result.update(_timeline(record, result.get("clicked_at", time.time())))
        except Exception:  # noqa: BLE001
            pass
    finally:
        result["disconnected"] = bool(result["websocket_closed_at"])
        await context.close()
    return result


# A status line in a WebSocket frame: "... Training · step 120 / 300" (UTF-8 middle dot).
_STEP_IN_FRAME = re.compile(rb"\xc2\xb7 step (\d+) / ")


def _watch_socket(socket, result):
    """Note when the page's WebSocket closes, and when each step first reached the
    browser: the time between that and the page showing it is the page's own."""
    result.setdefault("frame_steps", {})
    requests = result.setdefault("rerun_requests", [])
    socket.on("close", lambda _: result["websocket_closed_at"].append(time.time()))

    def sent(payload):
        # The live panel's 1 s tick is a timer in the browser (Streamlit's
        # `run_every`): each tick is a rerun request the page sends.
        kind = _rerun_request_kind(payload) if isinstance(payload, (bytes, bytearray)) else None
        if kind:
            requests.append(time.time())
            result.setdefault("rerun_kinds", []).append(kind)

    socket.on("framesent", sent)

    def received(payload):
        if isinstance(payload, (bytes, bytearray)):
            arrived = time.time()
            for match in _STEP_IN_FRAME.finditer(payload):
                result["frame_steps"].setdefault(int(match.group(1)), arrived)

    socket.on("framereceived", received)


def _rerun_request_kind(payload):
    """ "page" or "fragment" for a rerun request the page sent, else None."""
    from streamlit.proto.BackMsg_pb2 import BackMsg

    message = BackMsg()
    try:
        message.ParseFromString(bytes(payload))
    except Exception:  # noqa: BLE001  (not a BackMsg: count nothing)
        return None
    if message.WhichOneof("type") != "rerun_script":
        return None
    return "fragment" if message.rerun_script.fragment_id else "page"


def board_look_summary(results, began):
    """How regularly the waiting pages looked at the board: slowest answers, longest gaps."""
    durations = sorted((b - a for r in results for a, b in r.get("board_looks", [])), reverse=True)
    slow = sorted(
        (round(a - began, 1), round(b - a, 1), r["student"])
        for r in results
        for a, b in r.get("board_looks", [])
        if b - a > 5
    )
    gaps = []
    for result in results:
        starts = sorted(a for a, _ in result.get("board_looks", []))
        gaps += [b - a for a, b in itertools.pairwise(starts)]
    gaps.sort(reverse=True)
    return {
        "looks": len(durations),
        "answer_s": distribution(durations),
        "slowest_answers_s": [round(d, 2) for d in durations[:10]],
        "longest_gaps_s": [round(g, 2) for g in gaps[:10]],
        "failures": sum(r.get("board_failures", 0) for r in results),
        "slower_than_5s": slow[:40],  # (asked, seconds, student)
    }


# What a page that drew no heatmap of its run shows where its charts should be.
CHART_STATE = r"""() => ({
  plotly: window.Plotly !== undefined,
  live_chart_divs: [...document.querySelectorAll('.gradflow-live-chart')].map(d => ({
    pending: Boolean(d.gradflowPending), drawing: d.gradflowDrawn !== undefined})),
  components: [...document.querySelectorAll('[data-testid^="stBidiComponent"]')].map(e => e.dataset.testid)
    .join(' '),
  // gradflow's static files (module, Plotly.js, board) as the page fetched them, page clock
  // (ms since it opened).
  now_ms: Math.round(performance.now()),
  fetched: performance.getEntriesByType('resource').filter(e => e.name.includes('/static/gradflow/'))
    .map(e => ({name: e.name.split('/').pop(), start_ms: Math.round(e.startTime),
                end_ms: Math.round(e.responseEnd), bytes: e.transferSize})),
  scripts: [...document.querySelectorAll('script[src^="blob:"], script[src*="plotly"]')].length,
  plots: [...document.querySelectorAll('.js-plotly-plot')].map(p => ({
    title: String(p.layout?.title?.text ?? ''),
    traces: ((p.gradflowWhole || p).data || []).map(t => t.type + ':' + (t.z ? (t.z.length ?? '?') : '-')),
  })),
  chart_texts: [...document.querySelectorAll('.gradflow-live-chart')].map(d => d.textContent.slice(0, 200))
    .filter(Boolean),
  view: [...document.querySelectorAll('[data-testid="stMarkdownContainer"]')].map(e => e.textContent)
    .filter(t => t.length < 200).slice(-12),
})"""


def _console_error(result, message):
    if message.type == "debug" and message.text.startswith("gradflow: chart "):
        # A live chart that got an update it could not apply asked for its whole figure.
        result["chart_resends"] = result.get("chart_resends", 0) + 1
    # Fonts from the internet fail to load here (no network); not the app's errors.
    if message.type == "error" and "ERR_NAME_NOT_RESOLVED" not in message.text:
        if len(result["console_errors"]) < 5:
            result["console_errors"].append(message.text[:300])


def _timeline(record, clicked):
    changes = [(ms / 1000.0, text) for ms, text in (record or {}).get("changes", [])]
    after = [(t, text) for t, text in changes if t >= clicked - 0.05]
    statuses = []
    for _, text in after:
        word = status_of(text)
        if word and (not statuses or statuses[-1] != word):
            statuses.append(word)
    # Intervals between successive step-counter changes while the run trains.
    training = [(t, step_of(text)) for t, text in after if status_of(text) == "Training"]
    # The first change after step 0 waits for the worker to start; leave it out.
    intervals = [b[0] - a[0] for a, b in itertools.pairwise(training) if b[1] != a[1] and a[1]]
    first_status = after[0][0] - clicked if after else None
    completed = next((t - clicked for t, text in after if status_of(text) in FINAL_WORDS), None)
    first_chart = (record or {}).get("firstChart")
    return {
        "statuses": statuses,
        "final": statuses[-1] if statuses else None,
        "queued": "Waiting in the queue" in statuses,
        "click_to_status_s": first_status,
        "click_to_first_chart_s": None if first_chart is None else first_chart / 1000.0 - clicked,
        "click_to_final_s": completed,
        "update_intervals_s": intervals,
        "step_changes": [(t, step_of(text), status_of(text)) for t, text in after],
        "exceptions": (record or {}).get("exceptions", 0),
        "board_looks": [(a / 1000.0, b / 1000.0) for a, b in (record or {}).get("boardLooks", [])],
        "board_failures": (record or {}).get("boardFailures", 0),
        "stalls": [(a / 1000.0, b / 1000.0) for a, b in (record or {}).get("stalls", [])],
    }


def remaining_ms(deadline):
    return max(1000, int((deadline - time.time()) * 1000))


async def classroom(url, students, timeout_s):
    """All students at once in one Chromium; returns their results."""
    from playwright.async_api import async_playwright

    deadline = time.time() + timeout_s
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=BROWSER_ARGS
        )
        try:
            return await asyncio.gather(
                *(student(browser, url, number, deadline) for number in range(students))
            )
        finally:
            await browser.close()


async def open_close_cycles(url, cycles, concurrency=4, timeout_s=600):
    """Open a page, wait for Start training, close it; `cycles` times.

    Returns:
        A dict: cycles done, failures, median and p95 seconds per cycle.
    """
    from playwright.async_api import async_playwright

    deadline = time.time() + timeout_s
    durations, failures = [], []
    todo = list(range(cycles))

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=BROWSER_ARGS
        )

        async def one(number):
            began = time.time()
            context = await browser.new_context()
            try:
                page = await context.new_page()
                await page.goto(url + SHARED_LINK, timeout=remaining_ms(deadline))
                await page.get_by_role("button", name="Start training").wait_for(
                    timeout=remaining_ms(deadline)
                )
                durations.append(time.time() - began)
            except Exception as error:  # noqa: BLE001
                failures.append(f"cycle {number}: {type(error).__name__}")
            finally:
                await context.close()

        async def lane():
            while todo and time.time() < deadline:
                await one(todo.pop())

        try:
            await asyncio.gather(*(lane() for _ in range(concurrency)))
        finally:
            await browser.close()
    return {
        "cycles_done": len(durations),
        "failures": failures,
        "median_s": round(statistics.median(durations), 2) if durations else None,
        "p95_s": round(percentile(durations, 95), 2) if durations else None,
    }


# AnyIO, under Streamlit's Starlette server, runs file serving on a pool of
# worker threads that grows to the largest number of requests at once (up to
# 40) and lets a worker that has been idle for 10 s go only when a later
# request reaches the pool. A count taken right after a burst of page loads
# therefore sees the pool at its high-water mark, not a leak.
_ANYIO_IDLE_S = 10


def trim_server_pool(url):
    """Let the server's AnyIO thread pool drop its idle workers, as it does itself:
    wait past their idle time, then send one request that goes through the pool."""
    import urllib.request

    time.sleep(_ANYIO_IDLE_S + 1)
    try:
        with urllib.request.urlopen(
            f"{url}/app/static/gradflow/live_chart.js", timeout=30
        ) as reply:
            reply.read()
    except OSError:
        pass  # the count is then taken untrimmed, which errs towards reporting a leak


def settle(server_pid, baseline_threads, timeout_s=60):
    """Wait until the server's threads come back down to `baseline_threads`
    (Streamlit ends script threads after each rerun) or `timeout_s` passes."""
    deadline = time.time() + timeout_s
    threads = threads_of(server_pid)
    while time.time() < deadline and threads is not None and threads > baseline_threads:
        time.sleep(1)
        threads = threads_of(server_pid)
    return threads


def percentile(values, q):
    values = sorted(values)
    if not values:
        return None
    index = (len(values) - 1) * q / 100
    low, high = int(index), min(int(index) + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (index - low)


def wait_idle_workers(server_pid, timeout_s=120):
    """Wait until only the server and at most one warm spare are in its tree."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and len(process_tree(server_pid)) > 2:
        time.sleep(1)
    return len(process_tree(server_pid))


def shown_steps(result, store):
    """Each new step the page showed while training or once completed:
    `(shown_at, step, available_at)`, the last when the store first had it."""
    run_id, shown = result.get("run_id"), 0
    if run_id is None:
        return
    for t, step, status in result.get("step_changes", []):
        if step is None or step <= shown or status not in ("Training", "Completed"):
            continue
        shown = step
        available = store.step_available_at(run_id, step)
        if available is not None:
            yield t, step, available


def store_to_page_latencies(results, store):
    """For every new step a page showed: seconds since the store first had it."""
    return [max(0.0, t - available) for r in results for t, _, available in shown_steps(r, store)]


def latency_split(results, store):
    """Store -> page latency in three parts, for every new step a page showed:

    - store -> the page's next rerun request (the browser's share: the live
      panel's tick is a timer in the page, so this is the wait for the next
      tick, up to 1 s, plus how late a busy page fires it);
    - that request -> the WebSocket frame carrying the step (the server's
      share: its queue, the fragment run and the send; an upper bound, see
      below);
    - that frame -> the page showing it (the page's renderer again).

    Times are taken when this process handles Playwright's events, so the
    split is only as sharp as this process is idle. `store_to_frame_s` is the
    first two parts together (as reported before the requests were noted).
    """
    tick, server, both, page = [], [], [], []
    for result in results:
        frames = result.get("frame_steps", {})
        requests = result.get("rerun_requests", [])
        for t, step, available in shown_steps(result, store):
            arrived = frames.get(step)
            if arrived is None:
                continue
            both.append(max(0.0, arrived - available))
            page.append(max(0.0, t - arrived))
            # The first request once the step was stored; with none before
            # the frame, a run asked for earlier read it. Requests that pile
            # up behind a slow run are not told apart, so the server's share
            # is an upper bound.
            asked = [r for r in requests if available <= r <= arrived]
            started = asked[0] if asked else available
            tick.append(started - available)
            server.append(max(0.0, arrived - started))
    return {
        "store_to_frame_s": distribution(both),
        "store_to_rerun_request_s": distribution(tick),
        "rerun_request_to_frame_s": distribution(server),
        "frame_to_page_s": distribution(page),
    }


def latency_samples(results, store, began):
    """Every new step a page showed, slowest first, for reading the tail:
    seconds since the class began when the store had it, the page's next
    rerun request, its frame and the page showing it; the run's own times
    (running, ended) and what the page showed before."""
    samples = []
    for result in results:
        run_id, frames = result.get("run_id"), result.get("frame_steps", {})
        requests = result.get("rerun_requests", [])
        kinds = result.get("rerun_kinds", [])
        looks = [a for a, _ in result.get("board_looks", [])]
        changes = result.get("step_changes", [])
        for t, step, available in shown_steps(result, store):
            arrived = frames.get(step)
            asked = [r for r in requests if available <= r <= (arrived or t)]
            before = [c for c in changes if c[0] < t]
            started = store.first_status.get((run_id, "running"))
            ended = min(
                (
                    when
                    for (rid, status), when in store.first_status.items()
                    if rid == run_id and status not in ("queued", "running", "paused")
                ),
                default=None,
            )
            samples.append(
                {
                    "student": result["student"],
                    "step": step,
                    "latency_s": round(max(0.0, t - available), 2),
                    "stored_at": round(available - began, 2),
                    "first_request_after_s": round(asked[0] - available, 2) if asked else None,
                    "requests_between": len(asked),
                    "frame_after_s": None if arrived is None else round(arrived - available, 2),
                    "shown_after_s": round(t - available, 2),
                    "run_started_at": _since(store.first_status.get((run_id, "running")), began),
                    "run_ended_at": _since(ended, began),
                    "shown_before": [round(before[-1][0] - began, 2), before[-1][1], before[-1][2]]
                    if before
                    else None,
                    # Since the run started: the page's rerun requests (kind, time) and its looks at the board.
                    "requests_since_start": [
                        (kind, round(r - began, 2))
                        for r, kind in zip(requests, kinds, strict=False)
                        if started is not None and started <= r <= t
                    ],
                    "board_looks_since_start": sum(
                        started is not None and started <= look <= t for look in looks
                    ),
                    "last_board_look_at": _since(
                        max((look for look in looks if look <= t), default=None), began
                    ),
                }
            )
    return sorted(samples, key=lambda sample: -sample["latency_s"])


def _since(when, began):
    return None if when is None else round(when - began, 2)


def _with_target(values):
    empty = {"median": None, "p95": None, "max": None, "n": 0}
    return {**(distribution(values) or empty), "target_p95": 2.0}


def distribution(values):
    """Median, p95, max and count of `values` (seconds), or None when empty."""
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 2),
        "p95": round(percentile(values, 95), 2),
        "max": round(max(values), 2),
        "n": len(values),
    }


def _queued_after_shown(result, store):
    run_id, clicked, shown = (
        result.get("run_id"),
        result.get("clicked_at"),
        result.get("click_to_status_s"),
    )
    if run_id is None or clicked is None or shown is None:
        return 0.0
    started = store.first_status.get((run_id, "running"))
    return 0.0 if started is None else started - (clicked + shown)


def summarize(results, wall_s, store):
    intervals = [i for r in results for i in r.get("update_intervals_s", [])]

    def stats(key):
        return distribution([r[key] for r in results if r.get(key) is not None])

    latencies = store_to_page_latencies(results, store)
    # Runs still queued in the store more than 2 s after their page first
    # showed a status line: those pages must have said "Waiting in the queue".
    long_waits = [r for r in results if _queued_after_shown(r, store) > 2.0]
    return {
        "students": len(results),
        "store_to_page_latency_s": _with_target(latencies),
        "store_to_page_split": latency_split(results, store),
        "runs_queued_over_2s": len(long_waits),
        "of_those_shown_waiting": sum(bool(r.get("queued")) for r in long_waits),
        "pages_with_a_chart": sum(r.get("click_to_first_chart_s") is not None for r in results),
        # Requests for a whole figure (an update lost on the way, gradflow/ui/live_chart.py).
        "live_chart_resends": {
            "pages": sum(bool(r.get("chart_resends")) for r in results),
            "requests": sum(r.get("chart_resends", 0) for r in results),
        },
        "completed": sum(r.get("final") == "Completed" for r in results),
        # What the store says, whatever the pages showed.
        "completed_in_store": sum(
            (r.get("run_id"), "completed") in store.first_status for r in results
        ),
        "seen_waiting_in_queue": sum(bool(r.get("queued")) for r in results),
        "final_statuses": {
            w: sum(r.get("final") == w for r in results) for w in {r.get("final") for r in results}
        },
        "pages_with_exceptions": sum(r.get("exceptions", 0) > 0 for r in results),
        # The frontend closed its WebSocket before the bench closed the page.
        "pages_disconnected": sum(bool(r.get("disconnected")) for r in results),
        "pages_with_console_errors": sum(bool(r.get("console_errors")) for r in results),
        "errors": [f"student {r['student']}: {r['error']}" for r in results if r.get("error")],
        "open_to_button_s": stats("open_to_button_s"),
        "click_to_status_s": stats("click_to_status_s"),
        "click_to_first_chart_s": stats("click_to_first_chart_s"),
        "click_to_final_s": stats("click_to_final_s"),
        "update_interval_s": _with_target(intervals),
        "wall_s": round(wall_s, 1),
    }


async def teacher_opens(url, timeout_s=300):
    """Open the app once and wait for "Trainer ready"; returns the seconds it took."""
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=BROWSER_ARGS
        )
        try:
            page = await browser.new_page()
            began = time.time()
            await page.goto(url)
            await page.get_by_text("Trainer ready").wait_for(timeout=timeout_s * 1000)
            return round(time.time() - began, 1)
        finally:
            await browser.close()


def run(
    students,
    cycles,
    timeout_s,
    log_path=None,
    db_dir=None,
    warmup_cycles=8,
    teacher_first=True,
    count_dropped_events=False,
    worker_niceness=None,
    server_niceness=0,
):
    """The whole bench on one fresh server; returns the results dict.

    Args:
        students: pages that each start one run at the same time.
        cycles: page open/close cycles for the leak check (0: none).
        timeout_s: hard limit of the classroom phase, seconds.
        log_path: file for the server's output, default `server.log` beside the store.
        db_dir: folder for the run store, default a new temporary one.
        warmup_cycles: open/close cycles before the leak baseline is taken.
        teacher_first: open the app once and wait for "Trainer ready" before
            the students arrive (as a teacher would before class).
        count_dropped_events: count the script-run messages Streamlit drops
            (`bench/streamlit_drops/sitecustomize.py`, on the server only).
        worker_niceness: `GRADFLOW_WORKER_NICENESS` for the server, default
            the dashboard's own (10).
        server_niceness: run the server under `nice -n server_niceness`.
            Below 0 (root only) it goes ahead of this bench's Chromium, as
            when every browser runs on its student's own machine; the
            workers start from the server's niceness.
    """
    db_dir = pathlib.Path(db_dir or tempfile.mkdtemp(prefix="classroom-"))
    report = {
        "students": students,
        "link": SHARED_LINK,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "load_average_at_start": os.getloadavg(),
    }
    log_path = log_path or db_dir / "server.log"
    report["server_log"] = str(log_path)
    extra_env = {}
    if worker_niceness is not None:
        extra_env["GRADFLOW_WORKER_NICENESS"] = str(worker_niceness)
    report["worker_niceness"] = worker_niceness if worker_niceness is not None else "default (10)"
    report["server_niceness"] = server_niceness
    # Read by the server from the environment (gradflow/ui/resources.py).
    report["runs_per_worker"] = os.environ.get("GRADFLOW_RUNS_PER_WORKER", "default (1)")
    if count_dropped_events:
        drops = pathlib.Path(__file__).resolve().parent / "streamlit_drops"
        extra_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(drops), os.environ.get("PYTHONPATH")])
        )
    with streamlit_server(
        db_dir / "runs.db", log_path=log_path, extra_env=extra_env, niceness=server_niceness
    ) as (url, server):
        pid = server.pid
        # The teacher opens the dashboard before class: the spare worker is warm.
        if teacher_first:
            report["teacher_open_to_trainer_ready_s"] = asyncio.run(teacher_opens(url))
        report["server_threads_at_start"] = threads_of(pid)
        with MemorySampler(pid) as memory, StoreSampler(db_dir / "runs.db") as store:
            began = time.time()
            server_cpu, browser_cpu = cpu_seconds(pid), cpu_seconds(os.getpid())
            server_alone, bench_alone = own_cpu_seconds(pid), own_cpu_seconds(os.getpid())
            results = asyncio.run(classroom(url, students, timeout_s))
            report["classroom"] = summarize(results, time.time() - began, store)
            report["store_to_page_samples"] = latency_samples(results, store, began)
            report["board_looks"] = board_look_summary(results, began)
            stalls = sorted(
                (round(a - began, 1), round(b, 1), r["student"])
                for r in results
                for a, b in r.get("stalls", [])
            )
            report["page_stalls"] = {
                "count": len(stalls),
                "seconds": round(sum(b for _, b, _ in stalls), 1),
                "longest": sorted(stalls, key=lambda s: -s[1])[:20],
            }
            # Who used the 2 cores: the server and its workers, or the browser (this bench)?
            report["classroom"]["cpu_s"] = {
                "server_and_workers": round(cpu_seconds(pid) - server_cpu, 1),
                "bench_and_chromium": round(cpu_seconds(os.getpid()) - browser_cpu, 1),
                "server_process_alone": round(own_cpu_seconds(pid) - server_alone, 1),
                "bench_process_alone": round(own_cpu_seconds(os.getpid()) - bench_alone, 1),
            }
            for result in results:  # summarized above; thousands of entries
                result.pop("frame_steps", None)
                result.pop("rerun_requests", None)
                result.pop("rerun_kinds", None)
                result.pop("board_looks", None)
            report["pages"] = results
            report["processes_after_runs"] = wait_idle_workers(pid)
            if cycles:
                # Streamlit's thread pools grow to their size with the first
                # sessions; a few cycles first, so growth is not taken for a leak.
                if warmup_cycles:
                    asyncio.run(open_close_cycles(url, warmup_cycles))
                trim_server_pool(url)
                before_threads = threads_of(pid)
                report["server_thread_names_before_cycles"] = thread_census(pid)
                before_processes = len(process_tree(pid))
                before_rss = rss_mib(pid)
                report["open_close"] = asyncio.run(open_close_cycles(url, cycles))
                after_processes = wait_idle_workers(pid, timeout_s=30)
                trim_server_pool(url)
                after_threads = settle(pid, before_threads, timeout_s=60)
                report["server_thread_names_after_cycles"] = thread_census(pid)
                report["leaks"] = {
                    "processes_before": before_processes,
                    "processes_after": after_processes,
                    "server_threads_before": before_threads,
                    "server_threads_after": after_threads,
                    "server_rss_mib_before": round(before_rss, 1),
                    "server_rss_mib_after": round(rss_mib(pid), 1),
                }
        report["memory"] = memory.summary(pid)
    # Pages that had stopped polling and were restarted (gradflow/ui/fragments.py).
    log = pathlib.Path(log_path).read_text(errors="replace")
    report["fragment_watchdog_restarts"] = log.count("had not been redrawn")
    report["fragment_watchdog_alarms_left_alone"] = log.count("slow, not stopped")
    if count_dropped_events:
        report["dropped_by_streamlit"] = dropped_events(log)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument(
        "--timeout", type=float, default=540.0, help="hard limit of the classroom phase, s"
    )
    parser.add_argument("--out", default=None, help="default bench/results/classroom.json")
    parser.add_argument(
        "--count-dropped-events",
        action="store_true",
        help="count the script-run messages Streamlit drops (patches the server's Streamlit)",
    )
    parser.add_argument(
        "--worker-niceness",
        type=int,
        default=None,
        help="the server's GRADFLOW_WORKER_NICENESS, default the dashboard's (10)",
    )
    parser.add_argument(
        "--server-niceness",
        type=int,
        default=0,
        help="run the server under nice -n K; K < 0 (root only) puts it ahead of the browsers, "
        "as when they run on the students' own machines",
    )
    args = parser.parse_args(argv)
    if chromium_path() is None:
        sys.exit("bench_classroom needs Chromium (scripts/ensure_chromium.sh)")
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    report = run(
        args.students,
        args.cycles,
        args.timeout,
        count_dropped_events=args.count_dropped_events,
        worker_niceness=args.worker_niceness,
        server_niceness=args.server_niceness,
    )
    out = pathlib.Path(args.out) if args.out else results_dir / "classroom.json"
    out.write_text(json.dumps(report, indent=2, default=str))

    c = report["classroom"]
    rows = [
        ("students", c["students"]),
        ("runs completed", c["completed"]),
        ("pages with an exception", c["pages_with_exceptions"]),
        (
            "pages whose WebSocket closed / with console errors",
            f"{c['pages_disconnected']} / {c['pages_with_console_errors']}",
        ),
        ("page errors (timeouts ...)", len(c["errors"])),
        ("open -> Start button, median / p95 s", _pair(c["open_to_button_s"])),
        ("click -> status line, median / p95 s", _pair(c["click_to_status_s"])),
        ("click -> first heatmap column, median / p95 s", _pair(c["click_to_first_chart_s"])),
        ("click -> Completed, median / p95 s", _pair(c["click_to_final_s"])),
        (
            "store -> page latency of a new step, median / p95 s (target p95 <= 2)",
            _pair(c["store_to_page_latency_s"]),
        ),
        (
            "  of which store -> its frame reaching the browser, median / p95 s",
            _pair(c["store_to_page_split"]["store_to_frame_s"]),
        ),
        (
            "    = store -> the page's next rerun request (its tick), median / p95 s",
            _pair(c["store_to_page_split"]["store_to_rerun_request_s"]),
        ),
        (
            "    + that request -> the frame (the server, upper bound), median / p95 s",
            _pair(c["store_to_page_split"]["rerun_request_to_frame_s"]),
        ),
        (
            "  and that frame -> the page showing it, median / p95 s",
            _pair(c["store_to_page_split"]["frame_to_page_s"]),
        ),
        ("step counter update interval, median / p95 s", _pair(c["update_interval_s"])),
        (
            "runs queued > 2 s after the page showed a status / of those shown 'Waiting'",
            f"{c['runs_queued_over_2s']} / {c['of_those_shown_waiting']}",
        ),
        ("pages that drew a heatmap", c["pages_with_a_chart"]),
        (
            "live charts that asked for their whole figure: pages / requests",
            f"{c['live_chart_resends']['pages']} / {c['live_chart_resends']['requests']}",
        ),
        (
            "fragment watchdog: pages restarted / slow pages left alone",
            f"{report['fragment_watchdog_restarts']} / {report['fragment_watchdog_alarms_left_alone']}",
        ),
        (
            "Streamlit dropped (--count-dropped-events)",
            report.get("dropped_by_streamlit", "not counted"),
        ),
        ("peak RSS server + workers, MiB", report["memory"]["peak_total_rss_mib"]),
        (
            "server VmHWM / largest worker VmHWM, MiB",
            f"{report['memory']['server_vm_hwm_mib']} / {report['memory']['largest_worker_vm_hwm_mib']}",
        ),
        ("classroom wall time, s", c["wall_s"]),
        (
            "CPU s: server alone / server + workers / bench + Chromium",
            f"{c['cpu_s']['server_process_alone']} / {c['cpu_s']['server_and_workers']}"
            f" / {c['cpu_s']['bench_and_chromium']}",
        ),
    ]
    if "leaks" in report:
        leaks, cycles = report["leaks"], report["open_close"]
        rows += [
            (
                f"open/close cycles done (of {args.cycles}), failures",
                f"{cycles['cycles_done']}, {len(cycles['failures'])}",
            ),
            (
                "processes in server tree before / after",
                f"{leaks['processes_before']} / {leaks['processes_after']}",
            ),
            (
                "server threads before / after",
                f"{leaks['server_threads_before']} / {leaks['server_threads_after']}",
            ),
            (
                "server RSS MiB before / after",
                f"{leaks['server_rss_mib_before']} / {leaks['server_rss_mib_after']}",
            ),
            (
                "server threads by name before / after (py-spy)",
                f"{report['server_thread_names_before_cycles']} / {report['server_thread_names_after_cycles']}",
            ),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for error in c["errors"][:10]:
        print("  ", error)


def _pair(stats):
    return (
        "n/a" if not stats or stats.get("median") is None else f"{stats['median']} / {stats['p95']}"
    )


if __name__ == "__main__":
    main()
