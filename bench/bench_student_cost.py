"""What one classroom student costs the machine, from opening the page to a drawn heatmap.

    python3 bench/bench_student_cost.py [--students 3] [--rounds 2] [--baseline DIR] [--out FILE]

One `streamlit run app.py` server (the dashboard's defaults: a fresh worker
per run, a warm spare) and one headless Chromium, on an otherwise quiet
machine. Students come one at a time: each opens the classroom's shared link
(`bench_classroom.SHARED_LINK`, a 60-step 3 x 16 MLP), presses **Start
training**, waits for `Completed` and a heatmap column, and closes its page;
then the bench waits until the server and its workers are quiet again (the
next spare worker has started and warmed up). CPU seconds over
each student's whole life are counted from `/proc` by process kind:
Chromium's renderer, browser, GPU and network processes, the Playwright
driver, the Streamlit server alone and its workers (the run's worker and the
spare that replaces it, which imports TensorFlow).

In `bench_classroom.py` thirty of these share two cores at once, so this is
where the class's CPU goes, without the noise of thirty pages starving each
other (issue #7). `--baseline DIR` (e.g. `git worktree add /tmp/base
<commit>`) measures another checkout's server the same way, round by round
in turn, so both see the same drift of this VM. Reports the median of every
kind over the students of each checkout. Writes
bench/results/student-cost.json (or --out).
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _kind(pid, own_pid, server_tree):
    """Which part of the class a process is: a Chromium process type, the driver, server or worker."""
    if pid == own_pid:
        return "bench"
    if pid in server_tree:
        return "server" if pid == server_tree[0] else "workers"
    try:
        command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
    except OSError:
        return "gone"
    # Chromium rewrites its command line into one string: read the flags from it.
    kind = re.search(rb"--utility-sub-type=([a-z]+)", command) or re.search(
        rb"--type=([a-z-]+)", command
    )
    if kind:
        # A closed page's renderer is reaped by Chromium's zygote: its time is counted there.
        name = kind.group(1).decode()
        return "chromium " + ("renderers" if name in ("renderer", "zygote") else name)
    if b"chrom" in command.split(b" ")[0]:
        return "chromium browser"
    return "playwright driver" if b"node" in command.split(b" ")[0] else "other"


def snapshot(server_pid):
    """CPU seconds so far of every process in this bench's tree, by pid, with its kind."""
    from bench_classroom import process_tree

    ticks = os.sysconf("SC_CLK_TCK")
    server_tree = process_tree(server_pid)
    taken = {}
    for pid in process_tree(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # Own time and that of reaped children (a finished worker, a closed page's renderer).
        seconds = sum(int(value) for value in fields[11:15]) / ticks
        taken[pid] = (_kind(pid, os.getpid(), server_tree), seconds)
    return taken


def by_kind(before, after):
    """CPU seconds spent between two snapshots, summed by kind.

    A process that ended in between is counted in its parent's reaped-children
    time (for a worker, the server's: its kind is "server"; `workers` covers
    the live ones). Both are reported together as `server + workers`.
    """
    spent = {}
    for pid, (kind, seconds) in after.items():
        spent[kind] = spent.get(kind, 0.0) + seconds - before.get(pid, (kind, 0.0))[1]
    spent["server + workers"] = spent.pop("server", 0.0) + spent.pop("workers", 0.0)
    spent["chromium (all)"] = sum(v for k, v in spent.items() if k.startswith("chromium "))
    return {kind: round(seconds, 2) for kind, seconds in sorted(spent.items())}


def quiet(server_pid, timeout_s=60.0):
    """Waits until the server and its workers use under 5% of a core over a second."""
    from bench_classroom import cpu_seconds

    deadline = time.monotonic() + timeout_s
    last = cpu_seconds(server_pid)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = cpu_seconds(server_pid)
        if now - last < 0.05:
            return
        last = now


def students(count):
    """Run `count` students one at a time on this checkout; print one JSON line per student."""
    from bench_classroom import (
        BROWSER_ARGS,
        FINAL_WORDS,
        LAST_STATUS,
        PAGE_RECORDER,
        SHARED_LINK,
        own_cpu_seconds,
        status_of,
    )
    from playwright.sync_api import sync_playwright

    from tests.browser import chromium_path, streamlit_server

    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        with streamlit_server(pathlib.Path(folder) / "runs.db") as (url, server):
            browser = playwright.chromium.launch(
                executable_path=chromium_path(), headless=True, args=BROWSER_ARGS
            )
            teacher = browser.new_page()
            teacher.goto(url)
            teacher.get_by_text("Trainer ready").wait_for(timeout=180_000)
            teacher.close()
            quiet(server.pid)
            for _ in range(count):
                before, server_before, began = (
                    snapshot(server.pid),
                    own_cpu_seconds(server.pid),
                    time.monotonic(),
                )
                context = browser.new_context(viewport={"width": 1280, "height": 900})
                page = context.new_page()
                page.add_init_script(PAGE_RECORDER)
                page.goto(url + SHARED_LINK)
                start = page.get_by_role("button", name="Start training")
                start.wait_for(timeout=180_000)
                opened = time.monotonic() - began
                start.click()
                while status_of(page.evaluate(LAST_STATUS)) not in FINAL_WORDS:
                    time.sleep(0.2)
                while page.evaluate("() => window.__classroom.firstChart") is None:
                    time.sleep(0.2)
                done = time.monotonic() - began
                # The renderer's last second or two of work, then its end.
                time.sleep(2.0)
                context.close()
                # The spare that replaces the run's worker imports TensorFlow
                # and traces its warm-up fits: counted too, until all is quiet.
                quiet(server.pid)
                spent = by_kind(before, snapshot(server.pid))
                spent["server alone"] = round(own_cpu_seconds(server.pid) - server_before, 2)
                spent["open -> button s"] = round(opened, 2)
                spent["open -> heatmap s"] = round(done, 2)
                print("STUDENT " + json.dumps(spent), flush=True)
            browser.close()


def run_checkout(checkout, count):
    """One process serving `checkout`'s dashboard; its students' costs."""
    child = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", str(count)],
        cwd=checkout,
        env=dict(os.environ, GRADFLOW_BENCH_CHECKOUT=str(checkout)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith("STUDENT ")]
    if child.returncode or not lines:
        raise SystemExit(f"{checkout}: the students failed\n{child.stderr[-3000:]}")
    return [json.loads(line.split(" ", 1)[1]) for line in lines]


def medians(rows):
    kinds = sorted({kind for row in rows for kind in row})
    return {kind: round(statistics.median(row.get(kind, 0.0) for row in rows), 2) for kind in kinds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=3, help="students a round (one at a time)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", default=None, help="another checkout, measured in turn")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        # The checkout whose server, tests.browser and bench_classroom this process uses.
        checkout = pathlib.Path(os.environ.get("GRADFLOW_BENCH_CHECKOUT", ROOT))
        sys.path[:0] = [str(checkout), str(checkout / "bench")]
        students(args.child)
        return
    checkouts = {"this checkout": ROOT}
    if args.baseline:
        checkouts["baseline"] = pathlib.Path(args.baseline).resolve()
    rows = {name: [] for name in checkouts}
    for round_number in range(args.rounds):
        for name, checkout in checkouts.items():
            measured = run_checkout(checkout, args.students)
            rows[name] += measured
            print(f"round {round_number + 1} {name}: {measured}", flush=True)
    report = {
        "command": " ".join(["python3", "bench/bench_student_cost.py"] + sys.argv[1:]),
        "baseline": args.baseline,
        "medians": {name: medians(measured) for name, measured in rows.items()},
        "students": rows,
    }
    for name, values in report["medians"].items():
        print(f"{name}: " + ", ".join(f"{kind} {value}" for kind, value in values.items()))
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / "student-cost.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
