"""A real browser runs a lab: JupyterLab headless on a free port, Debian's Chromium driven by
Playwright, "Run All", then no cell may have errored and a figure and a widget must have rendered.

nbval proves the notebooks execute; this proves what a learner sees in JupyterLab: outputs render,
widgets have their front end, figures appear. The lab runs in a copy of the repository (JupyterLab would
autosave outputs into the repository otherwise), rooted at the copy as `make lab` roots JupyterLab at
the repository; after Run All it presses the control panel's Run button (the live view must reach
its final frame inside the panel) and asks the server for every file the lab links to. The
screenshots go to build/browser/.

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


# What `make lab` serves: the repository as JupyterLab's root (so the labs' links into the code
# open), the labs folder open, and JupyterLab's news prompt off (binder/jupyterlab-overrides.json).
REPO_PARTS = ("labs", "minserve", "kernels", "datasets", "benchmarks", "README.md")


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory):
    """JupyterLab serving a copy of the repository's parts, with the app object exposed to page
    scripts and notebooks rendered whole (no virtual scrolling, so every output is in the DOM)."""
    home = tmp_path_factory.mktemp("browser")
    repo = home / "repo"
    skip = shutil.ignore_patterns("results", ".ipynb_checkpoints", "__pycache__")
    for part in REPO_PARTS:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, repo / part, ignore=skip)
        else:
            repo.mkdir(exist_ok=True)
            shutil.copy(src, repo / part)
    settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    app_settings = home / "app_settings"   # where `make lab` puts the overrides: <venv>/share/jupyter/lab/settings
    app_settings.mkdir()
    shutil.copy(ROOT / "binder" / "jupyterlab-overrides.json", app_settings / "overrides.json")
    port, token = _free_port(), "minserve-browser-test"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={repo}",
           "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={home / 'settings'}",
           f"--LabApp.app_settings_dir={app_settings}", f"--LabApp.workspaces_dir={home / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(home / "jupyter.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=repo)
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


PANEL_JS = """() => {
  const panels = [...document.querySelectorAll('.jp-OutputArea-output .widget-vbox')]
      .filter(p => [...p.querySelectorAll('button')].some(b => b.textContent.trim() === 'Run'));
  if (!panels.length) return null;
  const p = panels[0];
  return {text: p.innerText, images: p.querySelectorAll('img').length,
          busy: [...p.querySelectorAll('button')].some(b => b.disabled)};
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
            page.goto(f"{base}/lab/tree/labs/{LAB}?token={token}")
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
            _press_run_in_the_panel(page, out_dir)
            assert page.get_by_text("get notified", exact=False).count() == 0, \
                "JupyterLab's news prompt is showing: the overrides did not apply"
        finally:
            browser.close()
    _links_open(base, token)


def _press_run_in_the_panel(page, out_dir: Path) -> None:
    """The control panel's Run button: its live view must reach its final frame inside the panel
    (the figure once stayed at its first frame, "0/6 requests done", with empty axes)."""
    if page.evaluate(PANEL_JS) is None:
        return  # this lab has no control panel
    page.locator(".jp-OutputArea-output .widget-vbox button", has_text="Run").first.click()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    panel = page.evaluate(PANEL_JS)
    while time.monotonic() < deadline:
        panel = page.evaluate(PANEL_JS)
        if panel and not panel["busy"] and panel["images"]:
            break
        time.sleep(1.0)
    page.screenshot(path=str(out_dir / f"{Path(LAB).stem}-panel.png"))
    assert panel and panel["images"] >= 1, f"the panel drew no figure: {panel}"
    import re
    done = re.findall(r"(\d+)/(\d+) requests done", panel["text"])
    assert done and done[-1][0] == done[-1][1], f"the panel's progress did not reach n/n: {panel['text'][-300:]}"


def _links_open(base: str, token: str) -> None:
    """Every relative link of the lab names a file JupyterLab serves (a 403/404 here is a dead
    link for the learner: the server's root must be the repository)."""
    import httpx
    import jupytext
    import re
    nb = jupytext.read(str(ROOT / "labs" / LAB))
    targets = {t.partition("#")[0] for c in nb.cells if c.cell_type == "markdown"
               for t in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", c.source) if not re.match(r"[a-z]+:", t)}
    dead = []
    for t in sorted(x for x in targets if x):
        path = os.path.normpath(os.path.join("labs", t))
        r = httpx.get(f"{base}/api/contents/{path}?content=0&token={token}", timeout=10)
        if r.status_code != 200:
            dead.append(f"{t} -> {r.status_code}")
    assert targets and not dead, f"links that do not open in JupyterLab: {dead}"


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
