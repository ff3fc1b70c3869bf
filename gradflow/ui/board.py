"""The run board: what a waiting page watches from the browser, not by asking the server.

A page whose run waits in the queue, or whose trainer is still warming up,
has nothing new to show until one small fact changes: its place in the queue,
or whether the spare worker is warm. Asking the server with a fragment tick
costs a script run there and, worse, a render of the whole page in the
browser (Streamlit 1.67's frontend renders every element again at each
script run, the sidebar's settings included). In a class of 30 on one 2-core
machine most pages wait in the queue at first, and every run that starts
changes all of their places (issue #7).

So the server publishes the board, one small JSON file among the app's
static files (`static/gradflow/board-<pid>-<token>.json`):

```json
{"queue": ["3f0c9a1e55d27b10", "..."], "warm": true}
```

and such a page draws `watch_place` or `watch_warm`: a small component that
fetches the file once a second (a queued page three or more places back,
every two or three seconds). A queued page shows its place from it, in
the browser, and asks for a rerun only when its run has left the queue; a
page waiting for the trainer asks when the spare is warm. A look costs the
server a static-file response, with no script run, and the browser no render
of the page. (A first version reran each queued page's fragment when
its place changed: every run that started made all the other queued pages
of a class rerun at once, in bursts.)

- The queue lists keyed digests of the run ids (BLAKE2b with a key made at
  server start), never the ids: a run id in a page's URL lets that page
  control the run, and static files are public.
- The file is rewritten only when the board changes (looked at every
  `interval` seconds), atomically and always the same size (padded to a
  power of two, at least 1 KiB): the server sends a static file with the
  length it found before it opens it, so a file replaced by one of another
  length between the two would end the response early.
- A page that cannot read the board (a restarted server, static serving off,
  a proxy in the way) asks the server every few seconds instead, as the ticks
  did; a page that asked and sees the difference persist (its rerun was lost
  in one of Streamlit's races, `gradflow.ui.fragments`) asks again.
"""

import atexit
import functools
import hashlib
import json
import logging
import os
import pathlib
import re
import secrets
import threading

import streamlit as st

from gradflow.store.store import process_alive
from gradflow.ui import live_chart

_LOG = logging.getLogger(__name__)
_NAME = re.compile(r"board-(\d+)-[0-9a-f]+\.json")
# Once a second: the run leaving the queue is seen within about a second
# (the ticks it replaces came every 2 s).
LOOK_EVERY_S = 1.0
# Further back in the queue a page looks less often: one interval more per
# this many runs ahead of it, up to `SLOWEST_LOOKS` intervals. A run cannot
# leave the queue before the runs ahead of it do, and each look costs the
# browser about 17 ms and the server a static response: in a class of 30 on
# two cores, 28 queued pages looking once a second took half a core while
# the other pages were still opening (`bench/bench_page_states.py`).
PLACES_PER_SLOWER_LOOK = 3
SLOWEST_LOOKS = 3
# A queued page this many runs or fewer from the front loads Plotly.js while
# it waits (`live_chart.preload_assets`). In a class of 30 on two cores its
# evaluation took a starved page 5-15 s; loaded once a worker had the run, it
# stood between the run's steps and the page showing them: the slowest page
# updates of the forty-ninth session's classroom were pages that sent their
# ticks 5-10 s apart just after their run started. Only the pages near the
# front: thirty pages loading it at once stopped their timers for 30-40 s
# (tenth session, docs/reliability.md).
PRELOAD_PLACE = 2
# A difference that persists is asked about again after this long.
ASK_AGAIN_AFTER_S = 3.0
# Looks that failed in a row before the page asks the server instead.
FAILED_LOOKS_BEFORE_ASKING = 3
_MIN_SIZE = 1024


class RunBoard:
    """Publishes a run manager's queue and warm spare for the pages to watch.

    Example:

    ```python
    board = RunBoard(manager, app_dir / "static" / "gradflow", url="/app/static/gradflow")
    board.digest(run_id)  # what the board lists for run_id
    ```

    Args:
        manager: A `gradflow.lab.runner.RunManager` (or anything with
            `queued()` and `wait_warm(timeout)`).
        folder: The static folder to write the board into.
        url: The URL of `folder`, as a browser asks for it.
        interval: Seconds between looks at the manager.
    """

    def __init__(self, manager, folder, url, interval=0.2):
        self.manager = manager
        self.folder = pathlib.Path(folder)
        self.name = f"board-{os.getpid()}-{secrets.token_hex(8)}.json"
        self.path = self.folder / self.name
        self.url = f"{url.rstrip('/')}/{self.name}"
        self.interval = float(interval)
        self._key = secrets.token_bytes(16)
        self._published = None
        self._size = _MIN_SIZE
        self._closed = threading.Event()
        _remove_boards_of_dead_servers(self.folder)
        self.publish()
        self._thread = threading.Thread(target=self._watch, name="gradflow-run-board", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def digest(self, run_id):
        """What the board lists for `run_id`: 16 hex digits, keyed per server."""
        return hashlib.blake2b(str(run_id).encode(), key=self._key, digest_size=8).hexdigest()

    def board(self):
        """The board as it is now: `{"queue": [digest, ...], "warm": bool}`."""
        return {
            "queue": [self.digest(run_id) for run_id in self.manager.queued()],
            "warm": bool(self.manager.wait_warm(0)),
        }

    def publish(self):
        """Writes the board when it changed since the last write; returns it."""
        board = self.board()
        if board != self._published:
            text = json.dumps(board, separators=(",", ":")).encode()
            while len(text) > self._size:
                self._size *= 2
            live_chart.replace_file(self.path, text.ljust(self._size))
            self._published = board
        return board

    def close(self):
        """Stops publishing and removes the file."""
        self._closed.set()
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass

    def _watch(self):
        while not self._closed.wait(self.interval):
            try:
                self.publish()
            except Exception as error:  # A full disk must not end the board; pages fall back.
                _LOG.warning("gradflow: could not publish the run board %s (%s).", self.path, error)


def _remove_boards_of_dead_servers(folder):
    for path in folder.glob("board-*.json"):
        match = _NAME.fullmatch(path.name)
        if match and not process_alive(int(match.group(1))):
            path.unlink(missing_ok=True)


# Inline and small (sent with every redraw). State lives on the element
# Streamlit mounts the component in: Streamlit calls this function again with
# new data on the same element (without the previous call's cleanup), so each
# call starts a generation and an older loop stops at its next look; the
# cleanup runs once, when the element goes.
_WATCH_JS = """export default function ({ data, parentElement, setTriggerValue }) {
  const root = (APP_ROOT)();  // data.url is relative to the app's root
  const at = (path) => { try { return new URL(path, root).href; } catch (error) { return path; } };
  const box = parentElement.host ?? parentElement;
  const line = parentElement.querySelector("span");
  if (data.run === null) box.closest?.('[data-testid="stElementContainer"]')?.style.setProperty("display", "none");
  const show = (place) => {  // only a change touches the DOM (a write costs a style pass)
    const text = place > 0 ? `${place} ahead of it` : "next in line";
    if (line && line.textContent !== text) line.textContent = text;
  };
  if (data.run !== null) show(data.place);
  // Plotly.js through the live charts' own module (one copy a page), once.
  const preload = (place) => {
    const assets = data.preload;
    if (!assets || place > data.preload_place || box.gradflowPreloading) return;
    box.gradflowPreloading = true;
    const u = (name) => root + assets.folder + name;  // as the charts' loader writes it: one module
    import(u(assets.module))
      .then((module) => module.preloadPlotly(u(assets.plotly), u(assets.plotly_gz)))
      .catch(() => { box.gradflowPreloading = false; });
  };
  if (data.run !== null) preload(data.place);
  const generation = (box.gradflowBoardGeneration = (box.gradflowBoardGeneration ?? 0) + 1);
  const current = () => box.gradflowBoardGeneration === generation && !box.gradflowBoardGone;
  box.gradflowBoardGone = false;
  let failed = 0, asked = 0;
  // Runs ahead of this one: look less often (PLACES_PER_SLOWER_LOOK in board.py).
  const pause = (place) =>
    data.every_ms * Math.min(1 + Math.floor(Math.max(place, 0) / data.places_per_slower_look), data.slowest_looks);
  let wait = data.run === null ? data.every_ms : pause(data.place);
  const look = async () => {
    let ask;
    wait = data.every_ms;
    try {
      // A look that hangs (a starved browser or server) must not stop the watch.
      const response = await fetch(at(data.url), { cache: "no-store", signal: AbortSignal.timeout(data.every_ms * 10) });
      if (!response.ok) throw new Error(`${response.status}`);
      const board = await response.json();
      failed = 0;
      if (data.run === null) {
        ask = board.warm !== data.warm;
      } else {
        const place = board.queue.indexOf(data.run);
        ask = place < 0;  // it left the queue: the page shows what it does now
        if (!ask && current()) { show(place); preload(place); }
        if (!ask) wait = pause(place);
      }
    } catch (error) {
      ask = ++failed >= data.failed_looks;  // no board: ask the server, as a tick would
    }
    if (!current()) return;
    if (ask && !document.hidden && Date.now() - asked >= data.ask_again_ms) {
      asked = Date.now();
      try {
        setTriggerValue("changed", asked);
      } catch (error) {
        console.warn("gradflow: the run board could not ask for a rerun", error);
      }
    }
    box.gradflowBoardTimer = setTimeout(look, wait);
  };
  clearTimeout(box.gradflowBoardTimer);
  box.gradflowBoardTimer = setTimeout(look, wait);
  return () => {
    box.gradflowBoardGone = true;
    clearTimeout(box.gradflowBoardTimer);
  };
}""".replace("APP_ROOT", live_chart.APP_ROOT_JS)


@functools.cache
def _component():
    return st.components.v2.component(
        "gradflow.board_watch",
        js=_WATCH_JS,
        html="<span></span>",
        # The place reads like a caption under the queue notice.
        css="span { font-size: 0.875rem; color: var(--st-text-color); opacity: 0.6; }",
    )


def _watch(board, key, **data):
    _component()(
        key=key,
        data={
            "url": board.url,
            "every_ms": round(LOOK_EVERY_S * 1000),
            "places_per_slower_look": PLACES_PER_SLOWER_LOOK,
            "slowest_looks": SLOWEST_LOOKS,
            "ask_again_ms": round(ASK_AGAIN_AFTER_S * 1000),
            "failed_looks": FAILED_LOOKS_BEFORE_ASKING,
            **data,
        },
        # Any rerun does: the page (or fragment) reads the fact again itself.
        on_changed_change=_ignore,
    )


def watch_place(board, run_id, place):
    """Show `run_id`'s place in the queue as it changes; rerun the enclosing fragment when it leaves.

    The place ("2 ahead of it", "next in line") is updated in the browser:
    a class's queued pages do not all rerun each time a run starts. Draw it
    in the fragment that shows the run: that fragment reruns once, when the
    run leaves the queue. Within `PRELOAD_PLACE` of the front, the page
    loads Plotly.js for the charts to come.

    Args:
        board: The server's `RunBoard`.
        run_id: The run the page shows.
        place: Runs ahead of it as the server sees it now (0: next), shown
            until the first look at the board.
    """
    _watch(
        board,
        f"gradflow.board.place.{run_id}",
        run=board.digest(run_id),
        place=int(place),
        preload=live_chart.preload_assets(),
        preload_place=PRELOAD_PLACE,
    )


def watch_warm(board, warm=False):
    """Rerun the page (or the enclosing fragment) when the spare worker's readiness is no longer `warm`.

    Invisible.
    """
    _watch(board, "gradflow.board.warm", run=None, warm=bool(warm))


def _ignore():
    # A trigger needs a callback to be declared; the rerun it causes is what counts.
    pass
