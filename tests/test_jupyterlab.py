"""A chapter as a learner runs it: opened in a real JupyterLab, run, in Debian's chromium.

The learner's copy of chapter 3 (``make learner``'s; the chapter has a recorded panel) goes
into a temporary folder; a ``jupyter lab``
server started there (a free port, a token, its own config, data and runtime folders, a kernel
spec that runs this interpreter) serves it to headless chromium driven by playwright. The test
checks, before the cells run, that the stored panel says in words what it is (JupyterLab shows
an untrusted widget output as its text/plain), then runs every cell from the Run menu and
checks that the panel, its controls and its "Run on real ranks" button are drawn and stay drawn
once the cell has finished (the panel used to vanish there: ``labs/viz/recorded.py``).

A sentence that depends on a result must read right in JupyterLab too, where myst-nb's
``{glue:text}`` roles stay raw text: a code cell that shows Markdown must be rendered as HTML.

The server, its kernels (and their ranks) and the browser are always shut down. Slow-marked:
about 40 s on the course's 2-core machine, most of it chapter 3's cells.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import nbformat
import pytest

from tools.learner_copy import learner_notebook

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "notebooks" / "03_reduce_scatter.ipynb"
PANEL_SOURCE = "widgets.collective_panel"  # the chapter's panel cell holds this call
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PANEL = ".labs-recorded-panel"
START_TIMEOUT_S = 60
RUN_ALL_TIMEOUT_MS = 150_000  # about 25 s alone on 2 cores; a busy machine is slower
UI_TIMEOUT_MS = 60_000

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@dataclass(frozen=True)
class Lab:
    """A running JupyterLab server: where it serves, and the folder it serves."""

    url: str
    token: str
    root: Path

    def api(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}/api/{path}?token={self.token}",
                                    timeout=10) as reply:
            return json.load(reply)

    def open(self, page: Any, name: str) -> None:
        """Open notebook ``name`` (in ``root``) and wait until its kernel is idle and the page
        is connected to it. (The page says idle a moment before: a cell run then is lost.)"""
        page.goto(f"{self.url}/lab/tree/{name}?token={self.token}")
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                               timeout=UI_TIMEOUT_MS)
        deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
        while not any(k["connections"] > 0 and k["execution_state"] == "idle"
                      for k in self.api("kernels")):
            if time.monotonic() > deadline:
                pytest.fail(f"the kernel of {name} never became idle: {self.api('kernels')}")
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lab_environment(tmp: Path) -> dict[str, str]:
    """Folders of its own for the server (no learner's settings, workspaces or kernels leak
    in), a kernel spec ``python3`` that runs this interpreter, and no news or update pop-ups."""
    env = dict(os.environ)
    for key in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        env[key] = str(tmp / key.lower())
        Path(env[key]).mkdir()
    kernel = tmp / "jupyter_path" / "kernels" / "python3"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    env["JUPYTER_PATH"] = str(tmp / "jupyter_path")  # searched before the environment's own
    settings = (Path(env["JUPYTER_CONFIG_DIR"]) / "lab" / "user-settings" / "@jupyterlab"
                / "apputils-extension")
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    return env


def _stop(server: subprocess.Popen[bytes], lab: Lab, procs: Any) -> list[str]:
    """Shut the server down (it shuts its kernels down first), then kill whatever of it, its
    kernels and their ranks is still running; what had to be killed, by name."""
    family = procs.descendants(server.pid)  # kernels run in sessions of their own
    try:
        request = urllib.request.Request(f"{lab.url}/api/shutdown?token={lab.token}",
                                         method="POST")
        urllib.request.urlopen(request, timeout=10).close()
        server.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    killed = []
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        killed.append("jupyter lab")
    for pid, proc in family.items():
        if procs.running(pid):
            os.kill(pid, signal.SIGKILL)
            killed.append(proc.name)
    return killed


@pytest.fixture
def lab(tmp_path: Path, procs: Any) -> Iterator[Lab]:
    """A ``jupyter lab`` server over a folder of the test's own; always shut down."""
    if find_spec("jupyterlab") is None:
        pytest.skip("needs JupyterLab: pip install -r requirements.lock (make env)")
    root = tmp_path / "work"
    root.mkdir()
    lab = Lab(f"http://127.0.0.1:{_free_port()}", os.urandom(16).hex(), root)
    log = tmp_path / "jupyter-lab.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={lab.url.rsplit(':', 1)[1]}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={lab.token}",
             f"--ServerApp.root_dir={root}",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            cwd=root, env=_lab_environment(tmp_path), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{lab.url}/api/status?token={lab.token}",
                                       timeout=2).close()
                break
            except (urllib.error.URLError, OSError):
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
        yield lab
    finally:
        killed = _stop(server, lab, procs)
    assert not killed, f"left running after JupyterLab's shutdown, killed: {killed}"


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    """A page of headless chromium; the browser is closed after the test."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="pip install playwright (requirements.lock has it)")
    if shutil.which(CHROMIUM) is None:
        pytest.skip("install Debian's chromium: apt-get install chromium")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            opened = browser.new_page(viewport={"width": 1400, "height": 1000})
            opened.set_default_timeout(UI_TIMEOUT_MS)
            yield opened
        finally:
            browser.close()


def _every_cell_ran(page: Any, code_cells: int) -> None:
    """Wait until each of the notebook's code cells shows an execution count, then for an idle
    kernel. (Cells outside the view are in the page but not painted: read textContent.)"""
    page.wait_for_function(
        """n => {
            const prompts = [...document.querySelectorAll(
                '.jp-Notebook .jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim());
            return prompts.length === n && prompts.every(p => /^\\[\\d+\\]:$/.test(p));
        }""", arg=code_cells, timeout=RUN_ALL_TIMEOUT_MS)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")


def test_a_chapter_s_panel_is_drawn_and_stays_after_its_cell_ran(lab: Lab, page: Any,
                                                                  tmp_path: Path) -> None:
    (lab.root / CHAPTER.name).write_bytes(learner_notebook(CHAPTER))  # what make learner writes
    code_cells = sum(c.cell_type == "code" for c in nbformat.read(CHAPTER, as_version=4).cells)
    lab.open(page, CHAPTER.name)
    cell = page.locator(".jp-CodeCell", has_text=PANEL_SOURCE)
    cell.wait_for()
    assert cell.count() == 1

    # Before it runs: JupyterLab cannot draw the stored widgets and shows their text.
    stored = (cell.locator(".jp-OutputArea-output").first.text_content() or "").strip()
    assert stored.startswith("Recorded panel (6 settings): run this cell"), stored

    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
    _every_cell_ran(page, code_cells)
    tracebacks = [t for t in page.locator(".jp-OutputArea-output").all_text_contents()
                  if "Traceback (most recent call last)" in t]
    assert not tracebacks, f"a cell failed:\n{tracebacks[0][-2000:]}"

    panel = cell.locator(PANEL)
    page.wait_for_timeout(3000)  # the old panel vanished as soon as its progress bar closed
    cell.scroll_into_view_if_needed()
    page.screenshot(path=tmp_path / "panel.png")
    assert panel.count() == 1, "the panel's cell ran but shows no panel"
    assert panel.is_visible(), (f"the panel is in the page but hidden (see "
                                f"{tmp_path / 'panel.png'})")
    assert panel.locator(".widget-toggle-buttons").count() == 2  # world size, size S
    buttons = panel.locator(".widget-toggle-button")
    assert buttons.count() == 5 and all(b.is_visible() for b in buttons.all())
    assert panel.get_by_role("button", name="Run on real ranks").is_visible()
    assert cell.locator(".widget-hprogress").count() == 0, "the progress bar is still shown"

    # The kernel's widgets switch the recorded runs, as the book's page does without one.
    before = panel.inner_text()
    panel.locator(".widget-toggle-buttons").first.get_by_role("button", name="8").click()
    page.wait_for_function("([el, text]) => el.innerText !== text",
                           arg=[panel.element_handle(), before], timeout=10_000)
    assert panel.is_visible()


def test_markdown_shown_by_a_code_cell_is_rendered(lab: Lab, page: Any) -> None:
    """How a chapter's sentence that depends on a run reads right in JupyterLab: a cell that
    shows it as Markdown (a ``{glue:text}`` role would stay raw text here)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        'from IPython.display import Markdown\nMarkdown("**bold** claim")')])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, lab.root / "claim.ipynb")
    lab.open(page, "claim.ipynb")
    page.locator(".jp-CodeCell .jp-InputArea-editor").first.click()
    page.keyboard.press("Shift+Enter")
    strong = page.locator(".jp-OutputArea-output.jp-RenderedMarkdown strong")
    strong.wait_for()
    assert strong.inner_text() == "bold"
    assert "**" not in page.locator(".jp-OutputArea-output").first.inner_text()
