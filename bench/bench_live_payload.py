"""What one live update of the dashboard sends to the browser, early and late in a run.

    python3 bench/bench_live_payload.py [--steps 100 10000] [--window 10] [--rate 2]

The live heatmaps are drawn by gradflow's live-chart component
(`gradflow/ui/live_chart.py`): the browser keeps each figure, and a tick
sends only the new and changed columns. For each run length this writes a
synthetic "running" run into a fresh store (a depth-8 MLP: 9 layers, kernel
and bias, every step recorded), opens it in a real browser (Debian Chromium
through Playwright) on a `streamlit run app.py` server, and, over `--window`
seconds of polling (one tick a second) while the run gains `--rate` steps a
second, adds up

- the WebSocket bytes the page receives (every element of the panel), and
- the bytes of the two heatmaps' own messages (the component's
  `ForwardMsg`s, parsed from the frames), per tick.

The same is measured with `server.enableStaticServing` off, where the live
charts fall back to `st.plotly_chart` and send their whole figure every tick
(the previous behaviour, with the same power-of-two decimation). Without a
browser, it also reports the JSON sizes: both heatmaps as `st.plotly_chart`
specs (what a tick sent before, decimated as before), as one whole-figure
update (a first tick, a reload), and as the update after `--rate` new steps.
Writes bench/results/live_payload.json.
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
from gradflow.ui.figure_delta import figure_update  # noqa: E402
from gradflow.ui.live import LIVE_MAX_COLUMNS, POLL_SECONDS  # noqa: E402
from tests.browser import CHROMIUM_ARGS, chromium_path, new_elements, streamlit_server  # noqa: E402

LAYERS = 9  # 8 hidden Dense layers + the output layer
STATISTICS = ("max_abs", "l2_norm")
HEATMAP_KEYS = ("live.max", "live.norm")
HEATMAP_COLUMNS = """() => Math.max(0, ...[...document.querySelectorAll('.js-plotly-plot')]
  .flatMap(p => ((p.gradflowWhole || p).data || [])).filter(t => t.type === 'heatmap' && t.z)
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


def live_heatmap(stats, statistic):
    return figures.heatmap(
        stats, statistic, "kernel", max_columns=LIVE_MAX_COLUMNS, power_of_two_blocks=True
    )


def json_bytes(steps, new_steps):
    """Sizes of the two heatmaps as they go over the wire, without a browser."""
    stats, _ = synthetic_run(steps)
    later = pd.concat([stats, _steps_after(steps, new_steps)], ignore_index=True)
    before = whole = delta = 0
    for statistic in STATISTICS:
        # What st.plotly_chart sent every tick before: decimated as before (no power-of-two blocks).
        old = figures.heatmap(stats, statistic, "kernel", max_columns=LIVE_MAX_COLUMNS)
        before += len(pio.to_json(old.figure, validate=False))
        first, sent = figure_update(live_heatmap(stats, statistic).figure)
        update, _ = figure_update(live_heatmap(later, statistic).figure, sent)
        whole += len(json.dumps(first))
        delta += len(json.dumps(update))
    return {
        "heatmaps_plotly_chart_spec_bytes_before": before,
        "heatmaps_whole_update_bytes": whole,
        f"heatmaps_update_bytes_after_{new_steps}_new_steps": delta,
    }


def _steps_after(last, count):
    rows = []
    for step in range(last + 1, last + count + 1):
        more, _ = synthetic_run(1, seed=step)
        more["step"] += step - 1
        rows.append(more)
    return pd.concat(rows, ignore_index=True)


def browser_bytes(url, store, stats, losses, window, rate):
    """Per second: WebSocket bytes of the page, and the heatmaps' share of them, per tick."""
    from playwright.sync_api import sync_playwright

    steps = int(stats["step"].max())
    run_id = store.create_run({"depth": 8}, name=f"{steps} steps", status="running")
    with store.writer(run_id) as writer:
        writer.add_layer_stats(stats)
        for step, loss in enumerate(losses, start=1):
            writer.add_metrics(step, {"loss": loss})
        writer.progress(steps)
    # The run keeps training: new steps arrive while the page polls.
    stop = threading.Event()
    threading.Thread(target=_train_on, args=(store, run_id, steps, rate, stop), daemon=True).start()
    frames = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on(
            "websocket",
            lambda ws: ws.on(
                "framereceived",
                lambda p: frames.append(
                    (time.monotonic(), p if isinstance(p, bytes) else p.encode())
                ),
            ),
        )
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
    store.set_status(run_id, "stopped")
    in_window = [(when, payload) for when, payload in frames if start <= when < start + window]
    heatmaps = heatmap_messages(in_window)
    ticks = window / POLL_SECONDS
    return {
        "websocket_bytes_per_s": round(sum(len(p) for _, p in in_window) / window),
        "heatmap_messages_bytes_per_tick": round(sum(size for size, _ in heatmaps) / ticks),
        "heatmap_messages_in_window": len(heatmaps),
        "heatmap_whole_figures_in_window": sum(whole for _, whole in heatmaps),
        "heatmap_columns_drawn_at_end": columns,
    }


def heatmap_messages(frames):
    """(bytes, whole figure?) of each heatmap element message among WebSocket frames."""
    found = []
    for _, size, element in new_elements(frames):
        kind = element.WhichOneof("type")
        if kind == "bidi_component" and element.bidi_component.json:
            update = json.loads(element.bidi_component.json)
            if update.get("key") in HEATMAP_KEYS:
                found.append((size, update["base"] is None))
        elif kind == "plotly_chart" and '"type":"heatmap"' in element.plotly_chart.spec:
            found.append((size, True))
    return found


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
    new_steps = max(1, round(args.rate * POLL_SECONDS))
    rows = {steps: json_bytes(steps, new_steps) for steps in args.steps}
    servers = {
        "live_chart": {},
        # The fallback: st.plotly_chart, the whole figure every tick.
        "plotly_chart_static_serving_off": {"STREAMLIT_SERVER_ENABLE_STATIC_SERVING": "false"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in servers.items():
            db = pathlib.Path(tmp) / f"{name}.db"
            with streamlit_server(db, extra_env={"GRADFLOW_PREWARM": "0", **env}) as (url, _):
                store = RunStore(db)
                for steps in args.steps:
                    stats, losses = synthetic_run(steps)
                    measured = browser_bytes(url, store, stats, losses, args.window, args.rate)
                    rows[steps][name] = measured
                    print(f"{steps:>7} steps, {name}: {measured}", flush=True)
    for steps, row in rows.items():
        print(f"{steps:>7} steps: { ({k: v for k, v in row.items() if not isinstance(v, dict)}) }")
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
        "note": (
            "websocket bytes include every element of the panel (status, buttons, exports); "
            "heatmap_messages_bytes_per_tick counts only the two heatmaps' element messages"
        ),
    }
    out = ROOT / "bench" / "results" / "live_payload.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
