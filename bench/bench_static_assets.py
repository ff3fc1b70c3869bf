"""What serving Plotly.js and the live-chart module costs the server, per page load.

    python3 bench/bench_static_assets.py [--loads 8] [--fetches 20] [--against-full-plotly]
                                         [--out FILE]

One `streamlit run app.py` server on loopback (tests/browser.py, no warm
worker), one headless Chromium. The live page draws its (empty) heatmaps
through the live-chart component even without a run, so opening `/` loads
Plotly.js and `live_chart.js` from `/app/static/gradflow/` (see
`gradflow/ui/live_chart.py`). Measured, never asserted:

- page loads: `--loads` fresh browser contexts (empty HTTP cache, as a new
  student's browser) open `/` one after another and wait until Plotly has
  drawn a chart; for each, the server process's CPU seconds (utime + stime
  from /proc, its threads included, no workers), the wall time until drawn,
  the browser's main-thread CPU seconds for the page (Chrome DevTools
  `Performance.getMetrics`: `TaskDuration`, `ScriptDuration`), and every
  response under `/app/static/gradflow/`: status, encoded body bytes,
  `Content-Encoding`, `Content-Type`, `Cache-Control`. A first page load,
  before the measured ones, warms the server (imports, first script run)
  and is not counted. With `--against-full-plotly`, every second load is
  served the plotly package's full Plotly.js instead of the cartesian
  bundle the dashboard ships (written over the published copy for that load
  and put back after), so the two are compared side by side in one run.
- plain HTTP: `--fetches` sequential GETs of each published file with the
  `Accept-Encoding` a browser sends, and the server's CPU seconds per GET:
  the cost of the files alone, without the page's script runs.
- a class opening the page: `--concurrent` GETs of each Plotly file at once,
  while another thread asks `/_stcore/health` every 20 ms; the health
  answers' latency shows how long the server's event loop (which also
  carries every page's WebSocket) was kept from other work.

Writes bench/results/static_assets.json (or --out).
"""

import argparse
import gzip
import http.client
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import plotly  # noqa: E402

from gradflow.ui import live_chart  # noqa: E402
from tests.browser import CHROMIUM_ARGS, chromium_path, streamlit_server  # noqa: E402

ASSET_PREFIX = "/app/static/gradflow/"
# What Chromium sends for a script; the server picks gzip from it.
ACCEPT_ENCODING = "gzip, deflate, br, zstd"
DRAWN = "() => window.Plotly && document.querySelector('.js-plotly-plot') !== null"
HEADERS = ("content-type", "content-encoding", "content-length", "cache-control", "etag", "vary")


def server_cpu_seconds(pid):
    """CPU seconds of one process so far (all its threads; children not)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    # utime and stime: fields 14 and 15 of proc(5), counted from after the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pid, window_s=0.5, limit_s=30.0):
    """Wait until the server uses (almost) no CPU over `window_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = server_cpu_seconds(pid)
        time.sleep(window_s)
        if server_cpu_seconds(pid) - before < 0.02:
            return
    print(f"warning: the server did not go quiet within {limit_s} s", file=sys.stderr)


PLOTLY_FILES = ("plotly.min.js", "plotly.min.js.gz")


def serve_plotly(files):
    """Write `files` (name -> content) over the published Plotly.js and its gzipped copy."""
    for name in PLOTLY_FILES:
        live_chart.replace_file(ROOT / live_chart.STATIC_FOLDER / name, files[name])


def page_load(browser, url, pid):
    """Open `url` in a fresh context, wait until Plotly drew; CPU, wall time and assets."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    devtools = context.new_cdp_session(page)
    devtools.send("Performance.enable")
    responses = []
    page.on("response", lambda r: responses.append(r) if ASSET_PREFIX in r.url else None)
    wait_quiet(pid)
    cpu = server_cpu_seconds(pid)
    start = time.monotonic()
    page.goto(url)
    page.wait_for_function(DRAWN, timeout=120_000, polling=100)
    drawn_s = time.monotonic() - start
    page.wait_for_load_state("networkidle")
    wait_quiet(pid)
    cpu = server_cpu_seconds(pid) - cpu
    browser_metrics = {
        m["name"]: m["value"] for m in devtools.send("Performance.getMetrics")["metrics"]
    }
    plotly_version = page.evaluate("() => Plotly.version")
    assets = []
    for response in responses:
        headers = response.all_headers()
        assets.append(
            {
                "path": urllib.parse.urlsplit(response.url).path,
                "status": response.status,
                "encoded_body_bytes": response.request.sizes()["responseBodySize"],
                **{name: headers.get(name) for name in HEADERS},
            }
        )
    context.close()
    return {
        "server_cpu_s": round(cpu, 3),
        "drawn_s": round(drawn_s, 2),
        "browser_main_thread_cpu_s": round(browser_metrics["TaskDuration"], 3),
        "browser_script_s": round(browser_metrics["ScriptDuration"], 3),
        "plotly_version": plotly_version,
        "assets": assets,
    }


def fetch(url, path, count, pid):
    """`count` sequential GETs of `path`; server CPU per GET, bytes and headers."""
    parts = urllib.parse.urlsplit(url)
    wait_quiet(pid)
    cpu = server_cpu_seconds(pid)
    start = time.monotonic()
    for _ in range(count):
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        connection.request("GET", path, headers={"Accept-Encoding": ACCEPT_ENCODING})
        response = connection.getresponse()
        body = response.read()
        headers = {name: response.getheader(name) for name in HEADERS}
        status = response.status
        connection.close()
    wall = time.monotonic() - start
    cpu = server_cpu_seconds(pid) - cpu
    return {
        "path": path,
        "status": status,
        "bytes_on_wire": len(body),
        **headers,
        "server_cpu_s_per_get": round(cpu / count, 4),
        "wall_s_per_get": round(wall / count, 4),
    }


def get(url, path):
    """One GET of `path` as a browser asks; the body's bytes and headers."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        connection.request("GET", path, headers={"Accept-Encoding": ACCEPT_ENCODING})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def concurrent_fetch(url, path, count, pid):
    """`count` GETs of `path` at once; the event loop's responsiveness meanwhile."""
    wait_quiet(pid)
    latencies, done = [], threading.Event()

    def probe():
        while not done.is_set():
            start = time.monotonic()
            get(url, "/_stcore/health")
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.2)
    cpu = server_cpu_seconds(pid)
    start = time.monotonic()
    fetchers = [threading.Thread(target=get, args=(url, path)) for _ in range(count)]
    for thread in fetchers:
        thread.start()
    for thread in fetchers:
        thread.join()
    wall = time.monotonic() - start
    cpu = server_cpu_seconds(pid) - cpu
    time.sleep(0.2)
    done.set()
    prober.join()
    ordered = sorted(latencies)
    return {
        "path": path,
        "concurrent_gets": count,
        "wall_s": round(wall, 2),
        "server_cpu_s": round(cpu, 2),
        "health_probes": len(ordered),
        "health_latency_s_median": round(statistics.median(ordered), 4),
        "health_latency_s_p95": round(ordered[int(0.95 * (len(ordered) - 1))], 4),
        "health_latency_s_max": round(ordered[-1], 4),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--fetches", type=int, default=20)
    parser.add_argument("--concurrent", type=int, default=10)
    parser.add_argument(
        "--against-full-plotly",
        action="store_true",
        help="serve every second load the plotly package's full Plotly.js, for a side-by-side "
        "comparison with the cartesian bundle the dashboard ships",
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "static_assets.json"
    )
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    if executable is None:
        sys.exit("no Chromium found (set GRADFLOW_CHROMIUM)")
    with (
        tempfile.TemporaryDirectory() as tmp,
        streamlit_server(pathlib.Path(tmp) / "runs.db", extra_env={"GRADFLOW_PREWARM": "0"}) as (
            url,
            process,
        ),
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        warm = page_load(browser, url, process.pid)
        loads = []
        if args.against_full_plotly:
            # Read and gzipped once; the files are swapped before each load.
            shipped = {
                name: (ROOT / live_chart.STATIC_FOLDER / name).read_bytes() for name in PLOTLY_FILES
            }
            full_js = (
                pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
            ).read_bytes()
            full = dict(
                zip(PLOTLY_FILES, (full_js, gzip.compress(full_js, 9, mtime=0)), strict=True)
            )
            try:
                for index in range(2 * args.loads):
                    bundle = "full" if index % 2 else "shipped"
                    serve_plotly(full if index % 2 else shipped)
                    loads.append({"bundle": bundle, **page_load(browser, url, process.pid)})
            finally:
                serve_plotly(shipped)
        else:
            loads = [
                {"bundle": "shipped", **page_load(browser, url, process.pid)}
                for _ in range(args.loads)
            ]
        browser.close()
        compared = {
            bundle: {
                "loads": len(these),
                "browser_main_thread_cpu_s_median": round(
                    statistics.median(load["browser_main_thread_cpu_s"] for load in these), 3
                ),
                "browser_script_s_median": round(
                    statistics.median(load["browser_script_s"] for load in these), 3
                ),
                "drawn_s_median": round(statistics.median(load["drawn_s"] for load in these), 2),
                "plotly_version": these[0]["plotly_version"],
            }
            for bundle in ("shipped", "full")
            if (these := [load for load in loads if load["bundle"] == bundle])
        }
        loads = [load for load in loads if load["bundle"] == "shipped"]
        paths = sorted(
            {asset["path"] for asset in warm["assets"]}
            | {
                ASSET_PREFIX + name
                for name in ("plotly.min.js", "plotly.min.js.gz", "live_chart.js")
            }
        )
        fetches = [fetch(url, path, args.fetches, process.pid) for path in paths]
        at_once = [
            concurrent_fetch(url, ASSET_PREFIX + name, args.concurrent, process.pid)
            for name in ("plotly.min.js", "plotly.min.js.gz")
        ]

    cpu = [load["server_cpu_s"] for load in loads]
    result = {
        "command": " ".join(["python3", "bench/bench_static_assets.py", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_at_end": os.getloadavg(),
        },
        "page_loads": {
            "count": len(loads),
            "server_cpu_s_median": round(statistics.median(cpu), 3),
            "server_cpu_s_min": min(cpu),
            "server_cpu_s_max": max(cpu),
            "drawn_s_median": round(statistics.median(load["drawn_s"] for load in loads), 2),
            "browser_main_thread_cpu_s_median": round(
                statistics.median(load["browser_main_thread_cpu_s"] for load in loads), 3
            ),
            "by_plotly_bundle": compared,
            "asset_bytes_per_load": sum(a["encoded_body_bytes"] for a in loads[0]["assets"]),
            "assets_of_first_measured_load": loads[0]["assets"],
            "each": [{k: v for k, v in load.items() if k != "assets"} for load in loads],
        },
        "warm_up_load": {k: v for k, v in warm.items() if k != "assets"},
        "http_fetches": fetches,
        "concurrent_fetches": at_once,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("page_loads", "http_fetches", "concurrent_fetches")
    print(json.dumps({k: result[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
