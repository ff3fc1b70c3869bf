"""The server's memory per browser tab that shows one long run.

    python3 bench/bench_viewers_memory.py [--steps 40000] [--layers 6] [--tabs 6]
        [--root CHECKOUT] [--out FILE]

A class watching the teacher's long run opens the same `?run=` link in
thirty tabs. The bench writes one completed run of `--steps` recorded steps
and `--layers` dense layers (kernel and bias rows, the loss at every step)
into a fresh store, starts a server on it (this checkout, or `--root`'s
`app.py` and `gradflow` for a paired baseline), opens one tab with no run
(the server's floor: Plotly and the pages loaded), then `--tabs` tabs on the
run, each in its own browser context (its own Streamlit session), one after
another. After each tab has drawn its heatmaps it reads the server's RSS.
The figure is the RSS added per tab after the first one on the run (which
reads the run in any case), and the bench also reports what each tab cost.
Writes bench/results/viewers-memory.json (or --out).
"""

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time

import numpy as np
import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playwright.async_api import async_playwright  # noqa: E402

from bench.bench_classroom import rss_mib  # noqa: E402
from gradflow.store import RunStore  # noqa: E402
from tests.browser import CHROMIUM_ARGS, chromium_path, streamlit_server  # noqa: E402

HEATMAP_DRAWN = """() => [...document.querySelectorAll('.js-plotly-plot')]
  .filter(p => ((p.gradflowWhole || p).data || []).some(t => t.type === 'heatmap' && t.z && t.z.length)).length >= 2"""


def write_run(store, steps, layers):
    """One completed run of `steps` recorded steps of `layers` layers; returns its id."""
    run_id = store.create_run(
        {"depth": layers, "steps": steps}, name="a long run", status="running"
    )
    rng = np.random.default_rng(0)
    chunk = 5_000
    with store.writer(run_id) as writer:
        for first in range(1, steps + 1, chunk):
            step = np.arange(first, min(first + chunk, steps + 1))
            for index in range(layers):
                for tensor in ("kernel", "bias"):
                    writer.add_layer_stats(
                        pd.DataFrame(
                            {
                                "step": step,
                                "layer": f"dense_{index}",
                                "layer_index": index,
                                "tensor": tensor,
                                "max_abs": rng.lognormal(-2, 1, len(step)),
                                "l2_norm": rng.lognormal(-1, 1, len(step)),
                                "mean_abs": rng.lognormal(-3, 1, len(step)),
                                "std": rng.lognormal(-3, 1, len(step)),
                                "zero_fraction": 0.0,
                                "nonfinite": 0,
                                "weight_norm": 1.0,
                                "update_ratio": 1e-3,
                            }
                        )
                    )
            for s in step:
                writer.add_metrics(int(s), {"loss": 1.0 / s})
        writer.progress(steps)
    store.set_status(run_id, "completed")
    return run_id


async def open_tab(browser, url, timeout_s=180):
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    began = time.perf_counter()
    await page.goto(url)
    await page.wait_for_function(HEATMAP_DRAWN, timeout=timeout_s * 1000)
    return context, time.perf_counter() - began


async def measure(url, run_id, tabs, server_pid):
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
        )
        contexts = []
        floor_context = await browser.new_context()
        floor = await floor_context.new_page()
        await floor.goto(url)
        await floor.get_by_role("button", name="Start training").wait_for(timeout=180_000)
        await asyncio.sleep(2)
        rss = [rss_mib(server_pid)]
        opened = []
        for _ in range(tabs):
            context, seconds = await open_tab(browser, f"{url}/?run={run_id}")
            contexts.append(context)
            await asyncio.sleep(2)  # the page's last reruns end
            rss.append(rss_mib(server_pid))
            opened.append(seconds)
            print(f"tab {len(opened)}: drawn in {seconds:.1f} s, server RSS {rss[-1]:.0f} MiB")
        await browser.close()
    return rss, opened


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40_000)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tabs", type=int, default=6)
    parser.add_argument(
        "--root", type=pathlib.Path, default=ROOT, help="checkout whose app to serve"
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench/results/viewers-memory.json"
    )
    args = parser.parse_args()
    root = args.root.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        db = pathlib.Path(tmp) / "runs.db"
        began = time.perf_counter()
        run_id = write_run(RunStore(db), args.steps, args.layers)
        print(
            f"wrote {args.steps} steps x {args.layers} layers in {time.perf_counter() - began:.1f} s"
        )
        env = {"PYTHONPATH": str(root), "GRADFLOW_PREWARM": "0"}
        with streamlit_server(db, extra_env=env, script=root / "app.py") as (url, process):
            rss, opened = asyncio.run(measure(url, run_id, args.tabs, process.pid))
    added = np.diff(rss)
    result = {
        "command": "python3 bench/bench_viewers_memory.py " + " ".join(sys.argv[1:]),
        "root": str(root),
        "steps": args.steps,
        "layers": args.layers,
        "layer_stats_rows": args.steps * args.layers * 2,
        "server_rss_mib": [round(r, 1) for r in rss],
        "first_tab_mib": round(float(added[0]), 1),
        "each_later_tab_mib": [round(float(a), 1) for a in added[1:]],
        "median_later_tab_mib": round(float(np.median(added[1:])), 1) if len(added) > 1 else None,
        "seconds_to_draw": [round(s, 2) for s in opened],
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
