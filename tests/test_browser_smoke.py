"""The dashboard starts under `streamlit run` and renders in a real browser."""

import pytest

from tests.browser import streamlit_server

pytestmark = pytest.mark.browser


def test_dashboard_renders_in_chromium(chromium, tmp_path, artifacts_dir):
    with streamlit_server(tmp_path / "runs.db", log_path=artifacts_dir / "smoke-server.log") as (
        url,
        _,
    ):
        page = chromium.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url)
        # The home page is Live training, with the pages of the dashboard in the sidebar.
        page.get_by_role("heading", name="Live training").first.wait_for(timeout=60_000)
        body = page.inner_text("body")
        assert "Per-layer gradient maxima and norms" in body
        for name in ("Compare", "Inspect your model", "Split backprop", "Runs"):
            assert page.get_by_role("link", name=name).count() == 1, name
        assert "gradflow" in page.title()
        # Streamlit shows uncaught exceptions in an element of this test id.
        assert page.locator("[data-testid='stException']").count() == 0
        page.screenshot(path=str(artifacts_dir / "smoke-home.png"), full_page=True)
        page.close()
