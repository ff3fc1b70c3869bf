"""What one live update of the dashboard sends to the browser, early and late in a run.

    python3 bench/bench_live_payload.py [--steps 100 10000] [--window 10]

Streamlit resends a chart's whole Plotly figure on every rerun of the live
panel (there is no way to append columns to a drawn chart), so the question
is whether that payload stays bounded as the run grows. For each run length
this writes a synthetic "running" run into a fresh store (a depth-8 MLP: 9
layers, kernel and bias, every step recorded), opens it in a real browser
(Debian Chromium through Playwright) on a `streamlit run app.py` server, and
adds up the WebSocket bytes the page receives over `--window` seconds of
polling (one tick a second) while the run gains `--rate` steps a second.
It also reports the size of the two heatmaps'
Plotly JSON, which is what `st.plotly_chart` puts on the wire, decimated to
the live page's `LIVE_MAX_COLUMNS` and to the figures' default of 1,000
columns (what the live page drew before). Writes
bench/results/live_payload.json.
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import threading
import time

import numpy as np
import pandas as pd
import plotly.io as pio

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gradflow import figures  # noqa: E402
from gradflow.store import RunStore  # noqa: E402
from gradflow.ui.live import LIVE_MAX_COLUMNS, POLL_SECONDS  # noqa: E402
from tests.browser import CHROMIUM_ARGS, chromium_path, streamlit_server  # noqa: E402

LAYERS = 9  # 8 hidden Dense layers + the output layer
HEATMAP_COLUMNS = """() => Math.max(0, ...[...document.querySelectorAll('.js-plotly-plot')]
  .flatMap(p => (p.data || [])).filter(t => t.type === 'heatmap' && t.z)
  .map(t => t.z.shape ? Number(String(t.z.shape).split(',').pop()) : t.z[0].length))"""


def synthetic_run(steps, seed=0):
    """Tidy layer statistics and losses of `steps` recorded steps."""
    rng = np.random.default_rng(seed)
    n = steps * LAYERS * 2
    index = np.tile(np.repeat(np.arange(LAYERS), 2), steps)
    stats = pd.DataFrame(
        {
            "step": np.repeat(np.arange(1, steps + 1), LAYERS * 2),
            "layer": [f"dense_{i}" if i < LAYERS - 1 else "output" for i in index],
            "layer_index": index,
            "tensor": np.tile(["kernel", "bias"], steps * LAYERS),
            "max_abs": rng.lognormal(-5, 2, n),
            "l2_norm": rng.lognormal(-3, 2, n),
            "mean_abs": rng.lognormal(-7, 2, n),
        }
    )
    return stats, np.exp(-np.arange(steps) / steps) + 0.1


def spec_bytes(stats, max_columns):
    """Bytes of the two live heatmaps' Plotly JSON (`st.plotly_chart`'s spec)."""
    return sum(
        len(pio.to_json(figures.heatmap(stats, s, "kernel", max_columns=max_columns).figure,
                        validate=False))
        for s in ("max_abs", "l2_norm")
    )


def browser_bytes(url, store, stats, losses, window, rate):
    """WebSocket bytes a live page of a running run receives per second."""
    from playwright.sync_api import sync_playwright

    steps = int(stats["step"].max())
    run_id = store.create_run({"depth": 8}, name=f"{steps} steps", status="running")
    with store.writer(run_id) as writer:
        writer.add_layer_stats(stats)
        for step, loss in enumerate(losses, start=1):
            writer.add_metrics(step, {"loss": loss})
        writer.progress(steps)
    # The run keeps training: new steps arrive while the page polls. (A page
    # whose figures do not change costs little: Streamlit sends a large
    # message the browser already has as a reference to its hash.)
    stop = threading.Event()
    threading.Thread(target=_train_on, args=(store, run_id, steps, rate, stop), daemon=True).start()
    received = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("websocket", lambda ws: ws.on("framereceived", lambda p: received.append(
            (time.monotonic(), len(p)))))
        page.goto(f"{url}/?run={run_id}")
        page.wait_for_function(f"({HEATMAP_COLUMNS})() > 0", timeout=120_000, polling=200)
        # Playwright hands events over only while it waits (not in time.sleep).
        page.wait_for_timeout(2000 * POLL_SECONDS)  # past the first full page
        start = time.monotonic()
        page.wait_for_timeout(1000 * window)
        columns = page.evaluate(HEATMAP_COLUMNS)
        page.close()
        browser.close()
    stop.set()
    total = sum(size for when, size in received if start <= when < start + window)
    store.set_status(run_id, "stopped")
    return total / window, columns


def _train_on(store, run_id, first, rate, stop):
    """Appends about `rate` synthetic steps a second after step `first` until `stop`.

    Slow on purpose: every tick must see new data (so the figures change, as
    in a training run), but the run must stay near the length measured.
    """
    step = first
    with store.writer(run_id) as writer:
        while not stop.wait(1 / rate):
            more, _ = synthetic_run(1, seed=step)
            more["step"] += step
            step = int(more["step"].max())
            writer.add_layer_stats(more)
            writer.progress(step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 10_000])
    parser.add_argument("--window", type=float, default=10.0, help="seconds of polling measured")
    parser.add_argument("--rate", type=float, default=2.0, help="steps a second while measured")
    args = parser.parse_args()
    if chromium_path() is None:
        sys.exit("needs a system Chromium (scripts/ensure_chromium.sh)")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        db = pathlib.Path(tmp) / "runs.db"
        with streamlit_server(db, extra_env={"GRADFLOW_PREWARM": "0"}) as (url, _):
            store = RunStore(db)
            for steps in args.steps:
                stats, losses = synthetic_run(steps)
                per_second, columns = browser_bytes(
                    url, store, stats, losses, args.window, args.rate
                )
                rows[steps] = {
                    "websocket_bytes_per_s": round(per_second),
                    "heatmap_columns_drawn_at_end": columns,
                    "heatmaps_spec_bytes_live": spec_bytes(stats, LIVE_MAX_COLUMNS),
                    "heatmaps_spec_bytes_1000_columns": spec_bytes(stats, 1000),
                }
                print(f"{steps:>7} steps: {rows[steps]}", flush=True)
    result = {
        "command": "python3 bench/bench_live_payload.py " + " ".join(sys.argv[1:]),
        "layers": LAYERS,
        "poll_seconds": POLL_SECONDS,
        "live_max_columns": LIVE_MAX_COLUMNS,
        "window_s": args.window,
        "steps_per_s_while_measured": args.rate,
        "by_steps": rows,
        "python": platform.python_version(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "note": "websocket bytes include every element of the panel (status, buttons, exports)",
    }
    out = ROOT / "bench" / "results" / "live_payload.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
