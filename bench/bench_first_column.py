"""One user on a quiet server: seconds from pressing Start training to the first heatmap column.

    python3 bench/bench_first_column.py [--runs 3] [--out FILE]

One `streamlit run app.py` server (warm spare worker) and one headless
Chromium. Each run opens the live page in a new browser context, waits for
"Trainer ready", presses **Start training** on a small MLP and times until
the page's max-|gradient| heatmap has a column (the browser's own Plotly
figure, polled every 50 ms); then it stops the run. The page loads Plotly
at open on a quiet server (`gradflow/ui/live.py`); this measures that the
first column does not wait for it. Writes bench/results/first-column.json
(or --out).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playwright.sync_api import sync_playwright  # noqa: E402

from tests.browser import CHROMIUM_ARGS, chromium_path, streamlit_server  # noqa: E402
from tests.test_browser_e2e import HEATMAP_COLUMNS  # noqa: E402

LINK = "/?steps=3000&depth=4&width=32"


def measure(url, browser, runs):
    seconds = []
    for _ in range(runs):
        context = browser.new_context()
        page = context.new_page()
        page.goto(url + LINK)
        page.get_by_text("Trainer ready").wait_for(timeout=240_000)
        time.sleep(1.0)  # the page settles, as a user reads the form
        clicked = time.monotonic()
        page.get_by_role("button", name="Start training").click()
        page.wait_for_function(f"({HEATMAP_COLUMNS})() > 0", timeout=120_000, polling=50)
        seconds.append(round(time.monotonic() - clicked, 2))
        print(f"click -> first column {seconds[-1]:.2f} s", flush=True)
        page.get_by_role("button", name="Stop").click()
        page.get_by_text("Stopped").first.wait_for(timeout=60_000)
        context.close()
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if chromium_path() is None:
        sys.exit("bench_first_column needs Chromium (scripts/ensure_chromium.sh)")
    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as folder:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
        )
        with streamlit_server(pathlib.Path(folder) / "runs.db") as (url, _):
            seconds = measure(url, browser, args.runs)
        browser.close()
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / "first-column.json")
    out.write_text(
        json.dumps(
            {
                "command": "python3 bench/bench_first_column.py " + " ".join(sys.argv[1:]),
                "load_average_1min": os.getloadavg()[0],
                "cpus": os.cpu_count(),
                "link": LINK,
                "click_to_first_column_s": seconds,
                "median_s": statistics.median(seconds),
            },
            indent=2,
        )
    )
    print(f"median {statistics.median(seconds):.2f} s; wrote {out}")


if __name__ == "__main__":
    main()
