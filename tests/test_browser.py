"""A real browser runs a lab: JupyterLab headless on a free port, Debian's Chromium driven by
Playwright, "Run All", then no cell may have errored and a figure and a widget must have rendered.

nbval proves the notebooks execute; this proves what a learner sees in JupyterLab: outputs render,
widgets have their front end, figures appear. The lab runs in a copy of labs/ (JupyterLab would
autosave outputs into the repository otherwise); the screenshot goes to build/browser/.

Needs /usr/bin/chromium (`apt-get install chromium`; .ci/run installs it) and the `playwright`
package (the `browser` extra), which drives a browser it did not download.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A lab with a figure and a control panel (an ipywidget), and one of the quickest to run.
LAB = os.environ.get("MINSERVE_BROWSER_LAB", "03_kv_cache_detective.ipynb")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# What the probe of this workplace found necessary: no sandbox as root, no GPU, and none of the
# background connections a closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT_S = 600

pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="no chromium on this machine (apt-get install chromium); CI installs it")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """JupyterLab serving a copy of labs/, with the app object exposed to page scripts and
    notebooks rendered whole (no virtual scrolling, so every output is in the DOM)."""
    home = tmp_path_factory.mktemp("browser")
    labs = home / "labs"
    shutil.copytree(ROOT / "labs", labs, ignore=shutil.ignore_patterns("results", ".ipynb_checkpoints"))
    settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    news = home / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)  # no "get notified about news?" toast over the screenshot
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    port, token = _free_port(), "minserve-browser-test"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={labs}",
           "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={home / 'settings'}",
           f"--LabApp.workspaces_dir={home / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(home / "jupyter.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=labs)
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/api/status?token={token}", proc, home / "jupyter.log")
    yield base, token
    proc.terminate()
    proc.wait(30)


def _wait_http(url: str, proc, log_path: Path, timeout_s: float = 120) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"jupyter lab exited:\n{log_path.read_text()[-3000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"jupyter lab did not answer within {timeout_s} s")


# Read from the notebook model, not the DOM: an error output is type "error" there, whatever CSS.
CELLS_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const cells = nb.content.model.cells, out = [];
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    const types = [];
    for (let j = 0; j < c.outputs.length; j++) types.push(c.outputs.get(j).type);
    out.push({index: i, count: c.executionCount, outputs: types,
              source: c.sharedModel.getSource().slice(0, 80)});
  }
  return {cells: out, kernel: nb.sessionContext.session?.kernel?.status ?? 'none'};
}"""
KERNEL_READY_JS = """() => {
  const nb = window.jupyterapp?.shell?.currentWidget;
  return nb?.sessionContext?.session?.kernel?.status === 'idle';
}"""


def test_lab_runs_in_a_real_browser(jupyter):
    pw = pytest.importorskip("playwright.sync_api", reason="pip install playwright (browser extra)")
    assert CHROMIUM, "chromium is missing: .ci/run installs it with apt-get"
    base, token = jupyter
    out_dir = ROOT / "build" / "browser"
    out_dir.mkdir(parents=True, exist_ok=True)
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{base}/lab/tree/{LAB}?token={token}")
            page.wait_for_function(KERNEL_READY_JS, timeout=120_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            state = _wait_all_run(page)
            errors = [c for c in state["cells"] if "error" in c["outputs"]]
            figures = page.locator(".jp-OutputArea-output img")
            if figures.count():
                figures.first.scroll_into_view_if_needed()
            page.screenshot(path=str(out_dir / f"{Path(LAB).stem}.png"))
            assert not errors, f"cells with errors: {errors}"
            assert figures.count() > 0, "no figure rendered"
            assert page.locator(".jp-OutputArea-output .jupyter-widgets").count() > 0, \
                "no ipywidget rendered (is the jupyterlab_widgets extension installed?)"
        finally:
            browser.close()


def _wait_all_run(page) -> dict:
    """Until every code cell has an execution count and the kernel is idle again."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        state = page.evaluate(CELLS_JS)
        if state["kernel"] == "idle" and all(c["count"] is not None for c in state["cells"]):
            return state
        if any("error" in c["outputs"] for c in state["cells"]):
            return state  # Run All stops at the first error: report it now
        time.sleep(1.0)
    pending = [c for c in state["cells"] if c["count"] is None]
    raise AssertionError(f"{len(pending)} cells did not run within {RUN_TIMEOUT_S} s: {pending[:3]}")
