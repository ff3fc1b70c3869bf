"""The dashboard starts under `streamlit run` and renders in a real browser."""

import pytest

from tests.browser import streamlit_server

pytestmark = pytest.mark.browser


def test_dashboard_renders_in_chromium(chromium, tmp_path, artifacts_dir):
    with streamlit_server(tmp_path / "runs.db", log_path=artifacts_dir / "smoke-server.log") as (url, _):
        page = chromium.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url)
        page.get_by_role("heading", name="gradflow").first.wait_for(timeout=60_000)
        assert "gradients flow" in page.inner_text("body")
        # Streamlit shows uncaught exceptions in an element of this test id.
        assert page.locator("[data-testid='stException']").count() == 0
        page.screenshot(path=str(artifacts_dir / "smoke-home.png"), full_page=True)
        page.close()
