"""Browser sessions and their runs: a reload keeps the run, a closed tab stops it
(once no other tab that started or opened it is open)."""

import re
import time

import pytest

from gradflow.store import RunStore
from tests.browser import streamlit_server

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _start_long_run(page, url):
    # As many steps as a run may have: 20,000 steps of this net took only
    # about 15 s once the runner ran 5 steps per call, and a run that
    # completed before the tab closed failed the test below (thirty-second
    # session's CI). The test stops it long before the end.
    page.goto(f"{url}/?steps=1000000&depth=2&width=8")
    page.get_by_role("button", name="Start training").click()
    page.wait_for_url(re.compile(r"run=[0-9a-f]+"), timeout=60_000)
    return re.search(r"run=([0-9a-f]+)", page.url).group(1)


def _wait_status(store, run_id, wanted, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.status(run_id) in wanted:
            return store.status(run_id)
        time.sleep(0.5)
    return store.status(run_id)


def test_reload_keeps_the_run_and_a_closed_tab_stops_it(chromium, tmp_path, artifacts_dir):
    db = tmp_path / "runs.db"
    env = {"GRADFLOW_SESSION_GRACE": "3", "GRADFLOW_PREWARM": "0"}
    with streamlit_server(db, extra_env=env, log_path=artifacts_dir / "sessions-server.log") as (
        url,
        _,
    ):
        store = RunStore(db)
        context = chromium.new_context()
        page = context.new_page()
        first = _start_long_run(page, url)
        assert _wait_status(store, first, {"running"}, 120) == "running"

        # Start again: the page shows one run, so the one it started before stops
        # (it trained on out of sight, taking a slot of the class's server).
        page.get_by_role("button", name="Start training").click()
        page.wait_for_url(re.compile(rf"run=(?!{first})[0-9a-f]+"), timeout=60_000)
        run_id = re.search(r"run=([0-9a-f]+)", page.url).group(1)
        assert _wait_status(store, first, {"stopped"}, 60) == "stopped"
        assert _wait_status(store, run_id, {"running"}, 120) == "running"

        page.reload()
        page.get_by_text(re.compile(r"Training · step \d+")).first.wait_for(timeout=60_000)
        time.sleep(8)  # longer than the grace period: the reloaded session owns the run now
        assert store.status(run_id) == "running"

        # A student opens the teacher's link to the run, looks, and closes the tab.
        visitor = chromium.new_context()
        look = visitor.new_page()
        look.goto(page.url)
        look.get_by_text(re.compile(r"Training · step \d+")).first.wait_for(timeout=60_000)
        visitor.close()
        time.sleep(8)  # longer than the grace period: the teacher's tab still owns the run
        assert store.status(run_id) == "running"

        context.close()  # the teacher closes the tab
        assert _wait_status(store, run_id, {"stopped", "completed"}, 60) == "stopped"


def test_a_tab_closed_on_another_server_of_the_store_does_not_stop_the_run(
    chromium, tmp_path, artifacts_dir
):
    """Two dashboards on one store (a shared lab server): a student who opened the
    teacher's run on the second server and closed the tab stopped the run the teacher's
    tab still showed; each server knows only its own tabs."""
    db = tmp_path / "runs.db"
    env = {"GRADFLOW_SESSION_GRACE": "3", "GRADFLOW_PREWARM": "0"}
    with (
        streamlit_server(db, extra_env=env, log_path=artifacts_dir / "server-a.log") as (a, _),
        streamlit_server(db, extra_env=env, log_path=artifacts_dir / "server-b.log") as (b, _),
    ):
        store = RunStore(db)
        teacher = chromium.new_context()
        run_id = _start_long_run(teacher.new_page(), a)
        assert _wait_status(store, run_id, {"running"}, 120) == "running"
        student = chromium.new_context()
        look = student.new_page()
        look.goto(f"{b}/?run={run_id}")
        look.get_by_text(re.compile(r"Training · step \d+")).first.wait_for(timeout=60_000)
        student.close()
        time.sleep(12)  # more than the grace period and two reaper ticks
        assert store.status(run_id) == "running"
        teacher.close()  # its own server still stops it once its tab has gone
        assert _wait_status(store, run_id, {"stopped", "completed"}, 60) == "stopped"


def _slider_value(page, label):
    return page.get_by_role("slider", name=label).input_value()


def test_settings_survive_a_visit_to_other_pages(chromium, tmp_path, artifacts_dir):
    """The Compare page draws the training form under the same keys, and Streamlit
    reset every widget the other page drew to its first option: back on Live
    training, Depth 1, Width 1, Learning rate 1e-5 (also in the link), and
    Presentation style off."""
    env = {"GRADFLOW_PREWARM": "0"}
    log = artifacts_dir / "pages-server.log"
    with streamlit_server(tmp_path / "runs.db", extra_env=env, log_path=log) as (url, _):
        page = chromium.new_context(viewport={"width": 1400, "height": 900}).new_page()
        page.goto(f"{url}/?depth=10&activation=sigmoid&learning_rate=0.3")
        page.get_by_role("button", name="Start training").wait_for(timeout=90_000)
        # The first page run of a fresh server ends before the click (a click
        # during a rerun is lost: "Clicking the checkbox did not change its state").
        page.locator('[data-testid="stStatusWidget"]').wait_for(state="hidden", timeout=30_000)
        presentation = page.get_by_role("switch", name="Presentation style")
        presentation.check(force=True)
        # The switch's rerun keeps its value for the other pages (`keep_across_pages`):
        # a link clicked while it ran cut it short, and the switch came back off
        # (once in a full CI run). Let it start, then end.
        page.wait_for_timeout(300)
        page.locator('[data-testid="stStatusWidget"]').wait_for(state="hidden", timeout=30_000)
        for there, shown in (("Compare", "Start comparison"), ("Runs", "Runs started here")):
            page.get_by_role("link", name=there).click()
            page.get_by_text(shown).first.wait_for(timeout=30_000)
            if there == "Compare":
                assert _slider_value(page, "Depth") == "10"
                assert presentation.is_checked()
            page.get_by_role("link", name="Live training").click()
            page.get_by_role("button", name="Start training").wait_for(timeout=30_000)
            page.wait_for_url(re.compile(r"depth=10"), timeout=30_000)
            assert _slider_value(page, "Depth") == "10"
            assert "activation=sigmoid" in page.url and "learning_rate=0.3" in page.url
            assert presentation.is_checked()
        page.screenshot(path=str(artifacts_dir / "settings-after-compare.png"), full_page=True)


def test_a_scripts_run_paused_from_a_tab_that_closed_trains_on(chromium, tmp_path, artifacts_dir):
    """A script's run is never stopped with its tab: it is the user's own. But one paused
    from a tab that then closed waited for ever, in a script no one was watching."""
    from tests.test_script_control import (
        FIT_SCRIPT,
        killed_if_left,
        start_script,
        stop_script,
        wait_for,
    )

    process, store, run_id = start_script(
        tmp_path, FIT_SCRIPT.replace("epochs=100", "epochs=10000")
    )
    env = {"GRADFLOW_SESSION_GRACE": "3", "GRADFLOW_PREWARM": "0"}
    with (
        killed_if_left(process),
        streamlit_server(
            tmp_path / "runs.db", extra_env=env, log_path=artifacts_dir / "script-pause-server.log"
        ) as (url, _),
    ):
        context = chromium.new_context()
        page = context.new_page()
        page.goto(f"{url}/?run={run_id}")
        page.get_by_role("button", name="Take control").click()
        pause = page.get_by_role("button", name="Pause")
        pause.wait_for(timeout=60_000)
        page.wait_for_function(
            "() => [...document.querySelectorAll('button')].some("
            "b => b.innerText.trim() === 'Pause' && !b.disabled)",
            timeout=30_000,
        )
        pause.click()
        assert _wait_status(store, run_id, {"paused"}, 60) == "paused"
        held = store.run_info(run_id)["progress_step"]
        time.sleep(1.0)
        assert store.run_info(run_id)["progress_step"] == held  # held while the tab is open
        context.close()
        assert _wait_status(store, run_id, {"running"}, 60) == "running"
        wait_for(lambda: store.run_info(run_id)["progress_step"] > held + 5, "training on")
        _, err = stop_script(process, store, run_id, timeout=120)
    assert f"gradflow: run {run_id} trains again." in err
    assert store.status(run_id) == "stopped"
