"""JupyterLab in a real browser: a lab opened in headless Chromium, run top to bottom, shows its plotly figures
and its ipywidgets controls, moving a control redraws the figure, and no cell errors.

Needs Debian's Chromium (/usr/bin/chromium) and the Python playwright package (which drives that Chromium; it
never downloads a browser). `make test` installs both first (`make browser`). Run alone, without them, the
test is skipped and says why; with MHC_LAB_BROWSER_TEST=required (set by `make test`) it fails instead.
The screenshot lands in build/test-artifacts/lab00.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "build" / "test-artifacts"
CHROMIUM = os.environ.get("MHC_LAB_CHROMIUM", "/usr/bin/chromium")
# This machine's network is closed: keep Chromium from reaching out (sync, updates, field trials, QUIC).
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LAB = "00_setup.ipynb"
RUN_TIMEOUT_S = 180


def _require_browser():
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"Chromium at {CHROMIUM} (apt-get install chromium chromium-driver)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package (pip install playwright; no browser download needed)")
    if missing:
        message = "browser test needs " + " and ".join(missing) + "; `make browser` installs them"
        if os.environ.get("MHC_LAB_BROWSER_TEST") == "required":
            pytest.fail(message)
        pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_copy(source: Path, target: Path) -> None:
    """The solution notebook without stored outputs or widget state: what the browser shows must come from
    this run."""
    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, target)


def _write_settings(settings: Path) -> None:
    """JupyterLab user settings for the test: render every cell (no windowing, so every output is in the page)
    and no news prompt."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
    }
    for name, value in files.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """JupyterLab from this environment, on loopback, with a token, in fresh config/settings/runtime dirs."""
    _require_browser()
    base = tmp_path_factory.mktemp("jupyterlab")
    work = base / "notebooks"
    work.mkdir()
    _fresh_copy(ROOT / "solutions" / LAB, work / LAB)
    _write_settings(base / "settings")
    token, port = secrets.token_hex(16), _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_RUNTIME_DIR=str(base / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(base / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"),
               IPYTHONDIR=str(base / "ipython"), PYTHONPATH=str(ROOT))
    log = open(base / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False"]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as reply:
                if reply.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"JupyterLab did not start; its log:\n{(base / 'jupyterlab.log').read_text()[-3000:]}")
        time.sleep(0.5)
    try:
        yield {"url": url, "token": token, "dir": work, "base": base}
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


_PROMPTS = "[...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')].map(p => p.textContent)"


def _prompts(page) -> list[str]:
    return page.evaluate(f"() => {_PROMPTS}")


@contextlib.contextmanager
def _capture_on_failure(page, name: str):
    try:
        yield
    except BaseException:
        page.screenshot(path=str(ARTIFACTS / f"{name}-failure.png"))
        (ARTIFACTS / f"{name}-failure.html").write_text(page.content())
        raise


@pytest.fixture(scope="module")
def lab_page(jupyterlab):
    """The lab opened in headless Chromium and run with Run > Run All Cells; yields (page, page errors)."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("lab00*.png"):
        old.unlink()
    profile = jupyterlab["base"] / "chromium-profile"  # a new, empty user-data-dir
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000},
        )
        page = context.pages[0] if context.pages else context.new_page()
        page_errors: list[str] = []
        page.on("pageerror", lambda error: page_errors.append(str(error)))
        try:
            with _capture_on_failure(page, "lab00-run"):
                page.goto(f"{jupyterlab['url']}/lab/tree/{LAB}?token={jupyterlab['token']}")
                page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=60_000)
                # The kernel is connected when the status bar says so (the toolbar's indicator is idle earlier).
                page.wait_for_selector('.jp-StatusBar-TextItem:has-text("| Idle")', timeout=90_000)
                # Run > Run All Cells, through the menu as a learner would (again if no cell started).
                for attempt in range(3):
                    page.click('.lm-MenuBar-itemLabel:text-is("Run")')
                    page.click('.lm-Menu-item[data-command="runmenu:run-all"]')
                    try:
                        page.wait_for_function(f"() => {_PROMPTS}.some(t => /\\[(\\*|\\d+)\\]/.test(t))",
                                               timeout=15_000)
                        break
                    except Exception:
                        assert attempt < 2, "Run All Cells did not start any cell"
                # Finished when nothing is queued or running any more (an error stops Run All early).
                page.wait_for_function(f"() => !{_PROMPTS}.some(t => t.includes('[*]'))",
                                       timeout=RUN_TIMEOUT_S * 1000)
                page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=60_000)
            yield page, page_errors
        finally:
            context.close()


def _read_when_saved(path):
    """The notebook at ``path`` once it is complete JSON with every code cell executed, else None."""
    try:
        nb = nbformat.reads(path.read_text(), as_version=4)
    except Exception:  # empty or half-written while JupyterLab saves
        return None
    return nb if all(c.execution_count for c in nb.cells if c.cell_type == "code") else None


def test_lab_runs_in_jupyterlab(jupyterlab, lab_page):
    page, page_errors = lab_page
    screenshot = ARTIFACTS / "lab00.png"
    with _capture_on_failure(page, "lab00"):
        prompts = [t for t in _prompts(page) if t.strip()]
        assert all(re.search(r"\[\d+\]", t) for t in prompts), f"cells that did not run: {prompts}"

        # Plotly figures drawn by JupyterLab's plotly extension; ipywidgets controls by the widget manager.
        page.wait_for_selector(".jp-OutputArea-output.js-plotly-plot .main-svg", timeout=30_000)
        page.wait_for_selector(".jp-OutputArea-output .widget-slider [role='slider']", timeout=30_000)
        figures = page.locator(".jp-OutputArea-output.js-plotly-plot")
        sliders = page.locator(".jp-OutputArea-output .widget-slider")
        assert figures.count() >= 2, "expected the roofline figure and the explorer's figure"
        assert sliders.count() == 3, "expected the explorer's three sliders"
        assert figures.last.locator(".gtitle").text_content().startswith("intensity")
        assert page.locator("text=No renderer could be found").count() == 0
        assert page.locator("text=Error displaying widget").count() == 0

        # Screenshot: the explorer's figure with its controls below it.
        page.evaluate("el => el.scrollIntoView({block: 'start'})", figures.last.element_handle())
        page.wait_for_timeout(500)
        page.screenshot(path=str(screenshot))

        # Save, then read what the notebook recorded: every code cell ran, none has an error output.
        page.click('.lm-MenuBar-itemLabel:text-is("File")')
        page.click('.lm-Menu-item[data-command="docmanager:save"]')
        saved = jupyterlab["dir"] / LAB
        deadline = time.monotonic() + 30
        nb = _read_when_saved(saved)
        while nb is None:  # JupyterLab writes the file some time after the click; it may be half-written
            assert time.monotonic() < deadline, "no saved notebook with every code cell run within 30 s"
            page.wait_for_timeout(250)
            nb = _read_when_saved(saved)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "a code cell did not run"
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb.cells) for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors, f"cells errored: {errors}"
    checks = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert checks.count(": passed") == 3, checks
    assert not page_errors, f"errors in the page: {page_errors}"
    assert screenshot.stat().st_size > 20_000


def test_explorer_redraws_when_a_control_moves(lab_page):
    page, _ = lab_page
    figures = page.locator(".jp-OutputArea-output.js-plotly-plot")
    title = figures.last.locator(".gtitle")
    before = title.text_content()
    page.locator(".jp-OutputArea-output .widget-slider").nth(1).locator("[role='slider']").focus()
    for _ in range(4):  # log2 n: 5 -> 9
        page.keyboard.press("ArrowRight")
    deadline = time.monotonic() + 10
    while title.text_content() == before:
        assert time.monotonic() < deadline, f"moving a slider did not redraw the explorer's figure ({before!r})"
        page.wait_for_timeout(250)
    page.evaluate("el => el.scrollIntoView({block: 'start'})", figures.last.element_handle())
    page.screenshot(path=str(ARTIFACTS / "lab00-redrawn.png"))
