"""What a live page costs the whole browser and the server, by the state of its run.

    python3 bench/bench_page_states.py [--pages 6] [--seconds 20] [--out FILE]

One server with one training slot (`GRADFLOW_MAX_RUNNING=1`) and one
headless Chromium. Pages are added state by state and, after each step, the
CPU of every Chromium process (and of this bench's Playwright driver) and of
the server process is counted from `/proc` over `--seconds`:

1. the browser alone;
2. one page whose run trains;
3. plus `--pages` pages whose runs wait in the queue behind it;
4. plus `--pages` pages without a run.

Differences between steps, divided by `--pages`, are the cost of one page
in that state. `bench_page_tick.py` profiles one page's main thread instead,
which misses the other processes and counts the profiler itself (its idle
"floor", 0.035 s a second, is that). In a classroom 30 pages share the
server's machine (`bench_classroom.py`); issue #7.
Writes bench/results/page-states.json (or --out).
"""

import argparse
import asyncio
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_classroom import BROWSER_ARGS, cpu_seconds, own_cpu_seconds  # noqa: E402
from bench_page_tick import open_page  # noqa: E402
from playwright.async_api import async_playwright  # noqa: E402

from tests.browser import chromium_path, streamlit_server  # noqa: E402


async def window(name, server_pid, seconds):
    """CPU seconds a second of the browser (this bench's tree less the server's) and of the server."""

    def sample():
        return (
            cpu_seconds(os.getpid()) - cpu_seconds(server_pid),
            own_cpu_seconds(server_pid),
            time.monotonic(),
        )

    browser0, server0, t0 = sample()
    await asyncio.sleep(seconds)
    browser1, server1, t1 = sample()
    result = {
        "chromium_s_per_s": round((browser1 - browser0) / (t1 - t0), 4),
        "server_s_per_s": round((server1 - server0) / (t1 - t0), 4),
    }
    print(
        f"{name:<34} Chromium {result['chromium_s_per_s']:.3f} s/s   server {result['server_s_per_s']:.3f} s/s",
        flush=True,
    )
    return result


async def measure(url, server_pid, pages, seconds):
    steps = {}
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=BROWSER_ARGS
        )
        steps["browser alone"] = await window("browser alone", server_pid, seconds)
        running = await open_page(browser, url, start=True)
        await running.get_by_text("Training").first.wait_for(timeout=120_000)
        await asyncio.sleep(5)
        steps["1 running"] = await window("1 running", server_pid, seconds)
        for _ in range(pages):
            queued = await open_page(browser, url, start=True)
            await queued.get_by_text("Waiting in the queue").first.wait_for(timeout=60_000)
        await asyncio.sleep(5)
        steps["+ queued"] = await window(f"1 running + {pages} queued", server_pid, seconds)
        for _ in range(pages):
            await open_page(browser, url, start=False)
        await asyncio.sleep(5)
        steps["+ idle"] = await window(
            f"1 running + {pages} queued + {pages} idle", server_pid, seconds
        )
        await browser.close()

    def per_page(later, earlier, count):
        return {
            key: round((steps[later][key] - steps[earlier][key]) / count, 4) for key in steps[later]
        }

    return steps, {
        "running page": per_page("1 running", "browser alone", 1),
        "queued page": per_page("+ queued", "1 running", pages),
        "page without a run": per_page("+ idle", "+ queued", pages),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if chromium_path() is None:
        sys.exit("bench_page_states needs Chromium (scripts/ensure_chromium.sh)")
    with tempfile.TemporaryDirectory() as folder:
        db = pathlib.Path(folder) / "runs.db"
        with streamlit_server(db, extra_env={"GRADFLOW_MAX_RUNNING": "1"}) as (url, process):
            steps, pages = asyncio.run(measure(url, process.pid, args.pages, args.seconds))
    for name, cost in pages.items():
        print(
            f"one {name:<20} Chromium {cost['chromium_s_per_s']:.4f} s/s   server {cost['server_s_per_s']:.4f} s/s"
        )
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / "page-states.json")
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_page_states.py " + " ".join(sys.argv[1:]),
                "seconds": args.seconds,
                "pages": args.pages,
                "load_average_1min": os.getloadavg()[0],
                "cpus": os.cpu_count(),
                "steps": steps,
                "per_page": pages,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
