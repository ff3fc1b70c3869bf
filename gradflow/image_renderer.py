"""One headless Chromium kept open for image exports, shared by every export in the process.

Starting Chromium is most of an image export's time: on this 2-core VM
kaleido took 2.5-3 s to open its browser and 0.25-0.4 s to render a heatmap
once it ran (`python3 bench/bench_figures.py`: "PNG export, 1 heatmap, fresh
browser" against "browser kept open"). A teacher exporting a lesson's charts one by one
waited those seconds at every click. So the renderer keeps one kaleido
browser (one tab) open between exports, in a thread with an asyncio loop
of its own (Streamlit's script threads and Jupyter may run a loop already),
and:

- renders one call at a time (a lock), so concurrent sessions of the
  dashboard wait in line instead of sharing a tab;
- closes the browser after `IDLE_SECONDS` without an export, so an idle
  server does not hold Chromium's memory, and at interpreter exit;
- starts a fresh browser, and tries once more, when the one it kept has died
  or stopped answering.

A `kill -9` of the process takes the browser with it: choreographer talks to
Chromium over pipes, and Chromium exits when their other end goes
(`tests/test_export.py::test_killed_owner_leaves_no_browser`).
"""

import asyncio
import atexit
import threading

# Seconds without an export after which the browser is closed.
IDLE_SECONDS = 180.0
# Seconds a browser may take to start, and each figure to render, before the
# browser is taken for hung.
START_SECONDS = 60.0
FIGURE_SECONDS = 60.0


class ImageRenderer:
    """Renders plotly figure specs to image bytes in a browser kept open between calls.

    Example:

    ```python
    renderer = ImageRenderer()
    png, = renderer.render("/usr/bin/chromium", [(figure.to_dict(), {"format": "png"})])
    renderer.close()
    ```

    Args:
        idle_seconds: Seconds without a render after which the browser is
            closed. Defaults to `IDLE_SECONDS`.
    """

    def __init__(self, idle_seconds=IDLE_SECONDS):
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._loop = None
        self._thread = None
        self._kaleido = None
        self._browser = None
        self._idle_timer = None
        self._renders = 0  # also tells a stale idle timer from the current one
        self._timed_out = False
        self.starts = 0  # browsers started so far (for tests and benches)
        atexit.register(self.close)

    @property
    def browser_pid(self):
        """The process id of the open browser, or None when none is open."""
        process = getattr(self._kaleido, "subprocess", None)
        return None if process is None or process.poll() is not None else process.pid

    def render(self, browser, specs):
        """Render `(figure_dict, opts)` pairs with the browser at path `browser`.

        Args:
            browser: The Chromium executable (`gradflow.export.find_browser()`).
            specs: A list of `(figure_dict, opts)`, `opts` as kaleido's
                `calc_fig` takes them (`format`, `width`, `height`, `scale`).

        Returns:
            A list of `bytes`, one per spec.

        Raises:
            Whatever kaleido raises for a figure it cannot render, or
            `TimeoutError` when a fresh browser does not answer in time.
        """
        with self._lock:
            self._renders += 1
            self._cancel_idle_timer()
            try:
                return self._render(browser, specs)
            finally:
                self._start_idle_timer()

    def close(self):
        """Close the browser and stop the renderer's thread (a later render starts them again)."""
        with self._lock:
            self._cancel_idle_timer()
            self._shut_down()

    def _render(self, browser, specs):
        kept = self._kaleido is not None and self._browser == browser
        if not kept:
            self._shut_down()
            self._start(browser)
        try:
            return self._run(self._render_all(specs), FIGURE_SECONDS * max(1, len(specs)))
        except Exception:
            if self.browser_pid is not None and not self._timed_out:
                raise  # the browser is fine: the figure is at fault
            # The browser died or hung: a fresh one, and once more if the
            # one that failed had served earlier exports.
            self._shut_down()
            if not kept:
                raise
            self._start(browser)
            return self._run(self._render_all(specs), FIGURE_SECONDS * max(1, len(specs)))

    async def _render_all(self, specs):
        return [await self._kaleido.calc_fig(spec, opts=opts) for spec, opts in specs]

    def _start(self, browser):
        import kaleido  # deferred: only image export needs it

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="gradflow-image-renderer", daemon=True
        )
        self._thread.start()

        async def open_browser():
            # mathjax=False: the default loads MathJax from a CDN, which fails
            # offline and is not needed (gradflow figures use no LaTeX).
            renderer = kaleido.Kaleido(path=browser, mathjax=False, n=1)
            await renderer.__aenter__()
            return renderer

        try:
            self._kaleido = self._run(open_browser(), START_SECONDS)
        except BaseException:
            self._shut_down()
            raise
        self._browser = browser
        self.starts += 1
        # Exit hooks run last-registered first: the browser's temporary profile
        # folder registered its removal as the browser started, and was
        # removed under a running browser ("Directory not empty" tracebacks).
        atexit.unregister(self.close)
        atexit.register(self.close)

    def _run(self, coroutine, timeout):
        """Run `coroutine` on the renderer's loop; `TimeoutError` after `timeout` seconds."""
        self._timed_out = False
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            self._timed_out = True
            future.cancel()
            raise

    def _shut_down(self):
        """Close the browser (killing it if it will not close) and end the loop's thread."""
        renderer, self._kaleido, self._browser = self._kaleido, None, None
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return
        if renderer is not None:
            try:
                asyncio.run_coroutine_threadsafe(renderer.__aexit__(None, None, None), loop).result(
                    START_SECONDS
                )
            except Exception:  # a dead or hung browser: make sure it is gone
                process = getattr(renderer, "subprocess", None)
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(START_SECONDS)
        if not thread.is_alive():
            loop.close()

    def _start_idle_timer(self):
        if self._kaleido is None:
            return
        renders = self._renders
        self._idle_timer = threading.Timer(self.idle_seconds, self._close_if_idle, [renders])
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _cancel_idle_timer(self):
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _close_if_idle(self, renders):
        with self._lock:
            if renders == self._renders:  # no render since this timer started
                self._idle_timer = None
                self._shut_down()
