"""What a live page's ticks cost its browser: main-thread CPU of one Chromium page.

    python3 bench/bench_page_tick.py [--seconds 20] [--out FILE]

One server with one training slot (`GRADFLOW_MAX_RUNNING=1`) and three pages
in one Chromium: a page whose run trains (it ticks every second), a page
whose run waits in the queue behind it, and a page with no run (nothing
polls: the floor). For each, Chrome's sampling profiler (CDP `Profiler`,
0.5 ms) records the page's main thread for `--seconds`, one page at a time;
the bench reports the time it was not idle, per second, and the part spent in
native code (`(program)`: style, layout, paint). In a classroom 30 such pages
share the server's machine (`bench_classroom.py`); issue #7.
Writes bench/results/page-tick.json (or --out).
"""

import argparse
import asyncio
import collections
import json
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import chromium_path, streamlit_server  # noqa: E402
from playwright.async_api import async_playwright  # noqa: E402

BROWSER_ARGS = [
    "--disable-gpu",
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
]
# A run long enough to keep training through every profile.
LINK = "/?steps=50000&depth=3&width=16"


async def main_thread_seconds(page, seconds):
    """`(busy, native)` seconds of the page's main thread over `seconds`."""
    cdp = await page.context.new_cdp_session(page)
    await cdp.send("Profiler.enable")
    await cdp.send("Profiler.setSamplingInterval", {"interval": 500})
    await cdp.send("Profiler.start")
    await asyncio.sleep(seconds)
    profile = (await cdp.send("Profiler.stop"))["profile"]
    await cdp.detach()
    names = {node["id"]: node["callFrame"]["functionName"] for node in profile["nodes"]}
    spent = collections.Counter()
    for sample, delta in zip(profile["samples"], profile["timeDeltas"], strict=True):
        spent[names[sample]] += delta
    total = sum(spent.values())
    return (total - spent["(idle)"]) / 1e6, spent["(program)"] / 1e6


async def open_page(browser, url, start):
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    await page.goto(url + LINK)
    button = page.get_by_role("button", name="Start training")
    await button.wait_for(timeout=120_000)
    if start:
        await button.click()
    return page


async def measure(url, seconds):
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=BROWSER_ARGS
        )
        running = await open_page(browser, url, start=True)
        await running.get_by_text("Training").first.wait_for(timeout=120_000)
        queued = await open_page(browser, url, start=True)
        await queued.get_by_text("Waiting in the queue").first.wait_for(timeout=60_000)
        idle = await open_page(browser, url, start=False)
        await asyncio.sleep(5)  # past the first fast ticks and page loads
        results = {}
        for name, page in (("running run", running), ("queued run", queued), ("no run", idle)):
            busy, native = await main_thread_seconds(page, seconds)
            results[name] = {"busy_s_per_s": busy / seconds, "native_s_per_s": native / seconds}
            print(
                f"{name:<12} main thread busy {busy / seconds:.3f} s/s (native {native / seconds:.3f})",
                flush=True,
            )
        still_queued = await queued.get_by_text("Waiting in the queue").count() > 0
        await browser.close()
        return results, still_queued


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if chromium_path() is None:
        sys.exit("bench_page_tick needs Chromium (scripts/ensure_chromium.sh)")
    with tempfile.TemporaryDirectory() as folder:
        db = pathlib.Path(folder) / "runs.db"
        with streamlit_server(db, extra_env={"GRADFLOW_MAX_RUNNING": "1"}) as (url, _):
            results, still_queued = asyncio.run(measure(url, args.seconds))
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / "page-tick.json")
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_page_tick.py " + " ".join(sys.argv[1:]),
                "seconds": args.seconds,
                "load_average_1min": os.getloadavg()[0],
                "cpus": os.cpu_count(),
                "queued_page_still_queued_at_the_end": still_queued,
                "pages": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
