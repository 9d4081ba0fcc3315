"""The chapter runs in JupyterLab as a reader would run it.

Starts `jupyter lab` (headless, 127.0.0.1, a token, the project's own kernel) on a temp
copy of the first chapter notebook that uses ipywidgets, with its outputs cleared; opens
it in headless Chromium; runs every cell through the Run menu; checks that no cell
errs, that the widget appears and that its output changes when the slider is dragged.
Until such a chapter exists it runs a small slider notebook of its own instead.
"""
import json
import os
import re
import secrets
import signal
import subprocess
import time
import urllib.request

import nbformat
import pytest

from browser_helpers import (SCREENSHOTS, VENV_BIN, OfflineRecorder, free_port, launch,
                             skip_without_browser, source_of, toc_pages)

RUN_ALL_TIMEOUT_S = 240  # a chapter takes at most 2 minutes on 2 cores, by design
SLIDER = ".widget-slider, .widget-hslider"

DEMO_SOURCE = """\
import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np

def plot_error(m):
    d_k = np.arange(1, 65)
    plt.figure(figsize=(4, 3))
    plt.plot(d_k, np.minimum(1.0, m / d_k))
    plt.xlabel("d_k"); plt.ylabel("recall error")
    plt.show()
    print(f"m = {m}")

m = widgets.IntSlider(value=8, min=1, max=64, description="m")
display(m, widgets.interactive_output(plot_error, {"m": m}))
"""


def chapter_with_widget():
    """The first notebook of _toc.yml whose code uses ipywidgets, or None."""
    for doc in toc_pages():
        src = source_of(doc)
        if src is not None and src.suffix == ".ipynb" and "ipywidgets" in src.read_text():
            return src
    return None


def fresh_copy(dest_dir):
    """A copy of the chapter (or the demo) with outputs and stored widget state removed."""
    src = chapter_with_widget()
    if src is None:
        print("no chapter with ipywidgets yet: running the demo slider notebook")
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell("# Slider demo"),
                    nbformat.v4.new_code_cell(DEMO_SOURCE)]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        name = "demo_slider.ipynb"
    else:
        nb = nbformat.read(src, as_version=4)
        name = src.name
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    path = dest_dir / name
    nbformat.write(nb, path)
    return path


def lab_settings(settings_dir):
    """User settings for a quiet, fully rendered Lab: no news prompt, no cell windowing."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
    }
    for rel, value in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


@pytest.fixture
def lab(tmp_path, request):
    """(base_url, token, notebook_path): a private JupyterLab server, shut down afterwards."""
    skip_without_browser(request.config)
    work = tmp_path / "work"
    work.mkdir()
    notebook = fresh_copy(work)
    lab_settings(tmp_path / "settings")
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ,
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "PYDEVD_DISABLE_FILE_VALIDATION": "1", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [str(VENV_BIN / "jupyter"), "lab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(base, token, proc, tmp_path / "lab.log")
        yield base, token, notebook
    finally:
        stop_server(base, token, proc)
        log.close()


def wait_for_server(base, token, proc, log_path, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"jupyter lab exited early:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"jupyter lab did not answer in {timeout} s:\n{log_path.read_text()[-3000:]}")


def stop_server(base, token, proc):
    """Ask the server to shut down (it stops its kernels), then make sure it is gone."""
    try:
        req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
        urllib.request.urlopen(req, timeout=5).close()
        proc.wait(timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # our own session: the server and its kernels
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


PROMPTS_JS = """
() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
        .map(p => p.textContent.trim())
"""

OUTPUT_SNAPSHOT_JS = """
cell => {
  const area = cell.querySelector('.jp-Cell-outputWrapper') || cell;
  const copy = area.cloneNode(true);
  // the slider and its readout change by themselves; what matters is the rest
  copy.querySelectorAll('.widget-slider, .widget-hslider, .widget-readout')
      .forEach(e => e.remove());
  return copy.innerHTML;
}
"""


def run_all_cells(page):
    """Run > Run All Cells; once more if the first click came before the kernel was ready."""
    for attempt in range(2):
        page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()
        deadline = time.time() + 20
        while time.time() < deadline:
            if any(p != "[ ]:" for p in page.evaluate(PROMPTS_JS)):
                return
            page.wait_for_timeout(250)
    pytest.fail("Run > Run All Cells started no cell")


def wait_until_executed(page, timeout_s):
    """Every code cell has a number in its prompt and none is still running."""
    deadline = time.time() + timeout_s
    prompts = []
    while time.time() < deadline:
        prompts = page.evaluate(PROMPTS_JS)
        if prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return prompts
        page.wait_for_timeout(500)
    running = [i for i, p in enumerate(prompts) if p == "[*]:"]
    pytest.fail(f"Run All did not finish in {timeout_s} s (a chapter should run in 2 minutes "
                f"on 2 cores); code cell {running} still running; prompts {prompts}")


def drag_slider(page, slider):
    """Drag the slider's handle to three quarters of its track, as a reader would."""
    handle = slider.locator(".noUi-handle").first
    track = slider.locator(".noUi-base, .noUi-target").first
    hb, tb = handle.bounding_box(), track.bounding_box()
    assert hb and tb, "the slider is not visible"
    page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
    page.mouse.down()
    page.mouse.move(tb["x"] + 0.75 * tb["width"], hb["y"] + hb["height"] / 2, steps=8)
    page.mouse.up()


def test_chapter_runs_in_jupyterlab_and_its_widget_responds(lab):
    from playwright.sync_api import sync_playwright

    base, token, notebook = lab
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with sync_playwright() as pw:
        browser = launch(pw, skip_without_browser())
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        recorder = OfflineRecorder()
        recorder.attach(context)
        page = context.new_page()
        recorder.watch(page)
        page.goto(f"{base}/lab/tree/{notebook.name}?token={token}")
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
        # The status bar says "<kernel> | Idle" once the kernel is started and connected.
        page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle")).first.wait_for(
            timeout=90_000)
        t_open = time.time() - t0

        run_all_cells(page)
        prompts = wait_until_executed(page, RUN_ALL_TIMEOUT_S)
        t_run = time.time() - t0 - t_open
        page.screenshot(path=str(SCREENSHOTS / "lab-after-run-all.png"))

        # Errors: in the page, and in the saved notebook (the kernel's own record).
        page.keyboard.press("Control+s")
        page.wait_for_timeout(1500)
        saved = nbformat.read(notebook, as_version=4)
        errors = [f"cell {i}: {o.get('ename')}: {o.get('evalue')}"
                  for i, c in enumerate(saved.cells) if c.cell_type == "code"
                  for o in c.outputs if o.output_type == "error"]
        assert not errors, f"cells raised errors: {errors}"
        text = page.locator(".jp-Notebook").inner_text()
        assert "Traceback" not in text, "a traceback is shown in the notebook"
        assert "Error displaying widget" not in text

        # The widget renders ...
        slider = page.locator(SLIDER).first
        slider.wait_for(timeout=30_000)
        cell = page.locator(".jp-CodeCell").filter(has=page.locator(SLIDER)).first
        cell.scroll_into_view_if_needed()
        page.wait_for_function("c => c.querySelector('.widget-output, .jp-OutputArea-child')",
                               arg=cell.element_handle(), timeout=30_000)
        before = cell.evaluate(OUTPUT_SNAPSHOT_JS)
        readout_before = slider.locator(".widget-readout").inner_text()
        cell.screenshot(path=str(SCREENSHOTS / "lab-widget-before.png"))

        # ... and its output follows the slider.
        drag_slider(page, slider)
        readout_after = slider.locator(".widget-readout").inner_text()
        assert readout_after != readout_before, "dragging did not move the slider"
        deadline = time.time() + 60
        after = before
        while after == before and time.time() < deadline:
            page.wait_for_timeout(500)
            after = cell.evaluate(OUTPUT_SNAPSHOT_JS)
        cell.screenshot(path=str(SCREENSHOTS / "lab-widget-after.png"))
        assert after != before, (f"the widget's output did not change when the slider moved "
                                 f"from {readout_before} to {readout_after}")
        page.wait_for_timeout(500)  # let the last update settle before reading errors
        assert "Traceback" not in cell.inner_text(), "the slider's update raised an error"
        print(f"JupyterLab: {notebook.name} opened in {t_open:.0f} s, ran {len(prompts)} cells "
              f"in {t_run:.0f} s; slider {readout_before} -> {readout_after}; "
              f"blocked off-site requests: {sorted(set(recorder.blocked)) or 'none'}")
        context.close()
        browser.close()

