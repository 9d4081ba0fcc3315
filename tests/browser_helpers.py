"""Shared pieces of the book tests: build once, serve on 127.0.0.1, drive headless Chromium.

The browser is Debian's Chromium (`make browser` installs it), driven through the
`playwright` package with `executable_path` (Playwright's own browser download is never
used). Every request that does not go to the local server is blocked and recorded, so
a page that needs the network fails its test instead of quietly loading from a CDN.
"""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

# ATLAS_BOOK_ROOT points the tests at another checkout of the book (for working on them).
ROOT = Path(os.environ.get("ATLAS_BOOK_ROOT") or Path(__file__).resolve().parents[1])
VENV_BIN = Path(sys.executable).parent
SCREENSHOTS = ROOT / "_build" / "screenshots"
MATHJAX_ENTRY = ROOT / "book" / "_static" / "mathjax" / "tex-chtml.js"

# Flags that work in this container (no GPU, no sandbox, no background traffic).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


# ---------------------------------------------------------------------------------------
# Which pages the book has: read from _toc.yml, in reading order.
# ---------------------------------------------------------------------------------------
def _toc_files(node) -> list[str]:
    """Every `file:` entry below a _toc.yml node, depth first (the reading order)."""
    files = []
    if isinstance(node, dict):
        if "file" in node:
            files.append(str(node["file"]))
        for key in ("parts", "chapters", "sections"):
            for child in node.get(key, []) or []:
                files.extend(_toc_files(child))
    return files


def toc_pages() -> list[str]:
    """Document names (no suffix) in reading order: root first, then the chapters."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [str(toc["root"])] + _toc_files(toc)


def source_of(doc: str) -> Path | None:
    """The source file of a toc entry (.md or .ipynb), or None if it is not written yet."""
    for suffix in (".md", ".ipynb"):
        path = ROOT / f"{doc}{suffix}"
        if path.exists():
            return path
    return None


# ---------------------------------------------------------------------------------------
# Build the book once per test session.
# ---------------------------------------------------------------------------------------
def ensure_mathjax() -> None:
    """The site serves its own MathJax; fetch it (npm registry) if this checkout lacks it."""
    if not MATHJAX_ENTRY.exists():
        subprocess.run(["make", "-s", "mathjax"], cwd=ROOT, check=True)


@functools.lru_cache(maxsize=None)
def build_book() -> tuple[Path, int, str]:
    """Build the book exactly as `make book` does, from scratch, into _build/test/ (_build/test-gw0/ ...
    in a pytest-xdist process, so that two processes never build into the same folder).

    Returns (html_dir, exit_code, log). Set ATLAS_BOOK_HTML to an existing _build/html to
    reuse it (handy while editing the tests; then exit_code is 0 and log empty).
    """
    reuse = os.environ.get("ATLAS_BOOK_HTML")
    if reuse:
        return Path(reuse), 0, ""
    ensure_mathjax()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    out = ROOT / "_build" / (f"test-{worker}" if worker else "test")   # not _build/html: a reader's book stays
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(VENV_BIN / "jupyter-book"), "build", "-W", "-n", "--keep-going",
           "--path-output", str(out), "."]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    print(f"book built in {time.time() - t0:.0f} s (exit {proc.returncode}) into {out}")
    return out / "_build" / "html", proc.returncode, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------
# A local static server for the built site.
# ---------------------------------------------------------------------------------------
class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output readable
        pass


class StaticServer:
    """http.server on 127.0.0.1 (a free port) in a daemon thread."""

    def __init__(self, directory: Path):
        handler = functools.partial(_QuietHandler, directory=str(directory))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------
# Chromium.
# ---------------------------------------------------------------------------------------
def find_chromium() -> str | None:
    """Debian's Chromium, or $CHROMIUM if set."""
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


_announced: set[str] = set()


def _skip(reason: str, config) -> None:
    """Skip, and say why once on the terminal (pytest -q would otherwise hide it)."""
    if reason not in _announced:
        _announced.add(reason)
        reporter = config.pluginmanager.get_plugin("terminalreporter") if config else None
        capture = config.pluginmanager.get_plugin("capturemanager") if config else None
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():  # past pytest's output capture
                reporter.write_line(f"\n{reason}", yellow=True)
        else:
            print(reason)
    pytest.skip(reason)


def skip_without_browser(config=None) -> str:
    """Return Chromium's path, or skip with one clear line saying why."""
    path = find_chromium()
    if path is None:
        _skip("browser tests skipped: Chromium is not installed "
              "(run `make browser` as root on a Debian machine to install it)", config)
    try:
        import playwright  # noqa: F401
    except ImportError:
        _skip("browser tests skipped: the `playwright` package is missing (make venv)", config)
    return path


class OfflineRecorder:
    """Blocks every request that leaves 127.0.0.1 and records what a page did wrong."""

    def __init__(self):
        self.blocked: list[str] = []
        self.failed: list[str] = []
        self.console_errors: list[str] = []

    def reset(self):
        self.blocked.clear()
        self.failed.clear()
        self.console_errors.clear()

    def attach(self, context) -> None:
        context.route("**/*", self._route)

    def watch(self, page) -> None:
        page.on("console", lambda m: m.type == "error" and self.console_errors.append(
            f"{m.text} ({m.location.get('url', '')})"))
        page.on("pageerror", lambda e: self.console_errors.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url} ({r.failure})"))
        page.on("response", lambda r: r.status >= 400 and self.failed.append(
            f"{r.url} (HTTP {r.status})"))

    def _route(self, route):
        host = urlparse(route.request.url).hostname
        if host in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort("blockedbyclient")


def launch(playwright, executable: str):
    return playwright.chromium.launch(executable_path=executable, headless=True,
                                      args=CHROMIUM_ARGS)
