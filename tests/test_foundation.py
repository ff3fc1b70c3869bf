"""The ground everything stands on: packaging, container, server settings, boundaries."""

import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _dockerfile_instructions():
    """Parse the Dockerfile into (INSTRUCTION, argument) pairs, joining continued lines."""
    text = (REPO / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, argument = line.partition(" ")
        pairs.append((keyword.upper(), argument.strip()))
    return pairs


def test_dockerfile_is_slim_pinned_non_root_and_healthchecked():
    instructions = _dockerfile_instructions()
    keywords = [k for k, _ in instructions]
    base = dict(instructions)["FROM"]
    # A slim Python base pinned to an exact version, not `latest`.
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", base), base
    runs = " ".join(arg for k, arg in instructions if k == "RUN")
    assert "chromium" in runs, "Chromium is needed for static image export"
    users = [arg for k, arg in instructions if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "the app must not run as root"
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")
    assert ("EXPOSE", "8501") in instructions
    health = dict(instructions)["HEALTHCHECK"]
    assert "/_stcore/health" in health
    command = dict(instructions)["CMD"]
    assert "streamlit" in command and "app.py" in command and "headless=true" in command
    assert (REPO / ".dockerignore").is_file()
    assert ".git" in (REPO / ".dockerignore").read_text().split()


def test_streamlit_config_is_safe_for_a_shared_server():
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert config["server"]["enableXsrfProtection"] is True
    assert 0 < config["server"]["maxUploadSize"] <= 50
    assert config["browser"]["gatherUsageStats"] is False
    # Static serving is on for the live charts' files only (SECURITY.md): nothing
    # else of the repository is under static/.
    assert config["server"]["enableStaticServing"] is True
    static = REPO / "static"
    assert not static.exists() or [p.name for p in static.iterdir()] == ["gradflow"]
    # A full gc.collect() after every fragment tick stalled a classroom's pages (issue #7).
    assert config["runner"]["postScriptGC"] is False


@pytest.fixture
def published_here(monkeypatch):
    # publish_assets records what it published for this process; a temporary
    # folder must not outlive the test as the pages' static folder.
    from gradflow.ui import live_chart

    for name in ("versions", "folder", "failed"):
        monkeypatch.setattr(live_chart._Assets, name, getattr(live_chart._Assets, name))


def test_the_static_files_are_plotly_and_the_live_chart_module_copied_not_linked(
    tmp_path, published_here
):
    import gzip

    from gradflow.ui import live_chart

    assert live_chart.publish_assets(tmp_path)
    folder = tmp_path / "static" / "gradflow"
    assert sorted(p.name for p in folder.iterdir()) == [
        "live_chart.js",
        "plotly.min.js",
        "plotly.min.js.gz",
    ]
    # Plotly's cartesian bundle, vendored (gradflow/ui/vendor/README.md).
    plotly_js = REPO / "gradflow" / "ui" / "vendor" / "plotly-cartesian.min.js"
    assert plotly_js.read_bytes().startswith(b"/**\n* plotly.js (cartesian - minified) v3.")
    assert (folder / "plotly.min.js").read_bytes() == plotly_js.read_bytes()
    assert gzip.decompress((folder / "plotly.min.js.gz").read_bytes()) == plotly_js.read_bytes()
    assert (folder / "live_chart.js").read_bytes() == (
        REPO / "gradflow" / "ui" / "live_chart.js"
    ).read_bytes()
    # Streamlit serves a static file only if its real path is inside static/.
    assert not any(p.is_symlink() for p in folder.iterdir())


def test_published_gzip_is_kept_when_current_and_rewritten_when_not(tmp_path, published_here):
    # A later server start keeps the .gz it finds when it unpacks to this
    # Plotly (no gzip at every start), and replaces a broken one.
    import gzip

    from gradflow.ui import live_chart

    folder = tmp_path / "static" / "gradflow"
    plotly_js = REPO / "gradflow" / "ui" / "vendor" / "plotly-cartesian.min.js"
    current = gzip.compress(plotly_js.read_bytes(), compresslevel=1)  # not the bytes we would write
    folder.mkdir(parents=True)
    (folder / "plotly.min.js.gz").write_bytes(current)
    assert live_chart.publish_assets(tmp_path / ".")
    assert (folder / "plotly.min.js.gz").read_bytes() == current

    (folder / "plotly.min.js.gz").write_bytes(current[: len(current) // 2])  # truncated
    assert live_chart.publish_assets(tmp_path / "static" / "..")  # another cache key, same folder
    assert gzip.decompress((folder / "plotly.min.js.gz").read_bytes()) == plotly_js.read_bytes()


def test_requirements_pin_exact_versions():
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"requirements.txt must pin exact versions: {line!r}"
            pins[name.lower()] = version
    assert pins["tensorflow"].startswith("2.21")
    assert pins["keras"].startswith("3.15")
    assert pins["streamlit"].startswith("1.67")
    for needed in ("plotly", "pandas", "scikit-learn", "kaleido"):
        assert needed in pins
    test_reqs = (REPO / "requirements-test.txt").read_text()
    assert "pytest" in test_reqs and "playwright" in test_reqs
    assert "pytest" not in (REPO / "requirements.txt").read_text()


def test_pyproject_declares_console_script_and_tools():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["gradflow"] == "gradflow.cli:run"
    assert "pytest" in project["tool"] and "ruff" in project["tool"]


def test_readme_requirements_and_pyproject_name_the_same_pythons():
    """The Pythons gradflow is tested on, said alike in the three places a person reads them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    prefix = "Programming Language :: Python :: 3."
    minors = sorted(int(c[len(prefix) :]) for c in project["classifiers"] if c.startswith(prefix))
    assert minors == list(range(minors[0], minors[-1] + 1)), minors
    # Not capped: a cap keeps resolvers from ever trying a newer Python.
    assert project["requires-python"] == f">=3.{minors[0]}"
    named = [f"3.{minor}" for minor in minors]
    said = ", ".join(named[:-1]) + f" or {named[-1]}" if len(named) > 1 else named[0]
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"On a fresh machine with Python {said} (" in readme
    first_line = (REPO / "requirements.txt").read_text().splitlines()[0]
    assert first_line.endswith(said.replace(" or ", " and ")), first_line


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in ci
    assert "bash scripts/serve.sh" in readme


def _modules_loaded_by(statement):
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize(
    "statement, forbidden",
    [
        ("import gradflow", {"streamlit", "tensorflow"}),
        ("import gradflow.figures", {"streamlit", "tensorflow"}),
        ("import gradflow.export", {"streamlit", "tensorflow"}),
        ("import gradflow.store", {"streamlit", "tensorflow"}),
        ("import gradflow.diagnosis", {"streamlit", "tensorflow"}),
        ("from gradflow.lab.config import RunConfig", {"streamlit", "tensorflow"}),
        ("import gradflow.probe.snapshot, gradflow.monitor", {"streamlit"}),
    ],
)
def test_import_boundaries(statement, forbidden):
    loaded = _modules_loaded_by(statement)
    assert not (forbidden & loaded), f"`{statement}` loaded {sorted(forbidden & loaded)}"


def test_core_sources_never_import_streamlit():
    offenders = []
    for path in (REPO / "gradflow").rglob("*.py"):
        if "ui" in path.relative_to(REPO / "gradflow").parts:
            continue
        if re.search(r"^\s*(import|from)\s+streamlit", path.read_text(), re.M):
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"only gradflow/ui, app.py and pages/ may import streamlit: {offenders}"
