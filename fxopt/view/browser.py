"""A served view in headless Chromium (the ``playwright`` package driving the system's Chromium):
the page test's driver, and the README's screenshot.

    python -m fxopt.view.browser DIR OUT.png [--expand] [--search REGEX]

renders a view written with ``fxopt view ... -o DIR`` (served on a free local port) and saves a
screenshot. Playwright's own browser downloads are never used: ``CHROMIUM`` (default
``/usr/bin/chromium``) is started with a fresh profile and no network services.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> Optional[str]:
    """The system Chromium (``$CHROMIUM``, /usr/bin/chromium, or one on PATH), or None."""
    for path in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if path and os.path.exists(path):
            return path
    return None


def render(url: str, screenshot: Optional[str] = None, search: Optional[str] = None, expand: bool = False,
           size: tuple = (1400, 900), timeout_s: float = 60.0) -> dict:
    """Loads ``url`` (a Model Explorer page) and waits for the graph's canvas; ``search``: a regex
    typed into Model Explorer's node search; ``expand``: expand every layer first. Returns
    {"canvas": bool, "webgl": bool, "search_matches": int | None, "title": str}."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise RuntimeError("no Chromium found (apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="fxopt-chromium-")
    try:
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(profile, executable_path=exe, headless=True,
                                                       args=CHROMIUM_FLAGS, viewport={"width": size[0], "height": size[1]})
            try:
                page = ctx.new_page()
                page.goto(url, timeout=timeout_s * 1e3)
                page.wait_for_selector("canvas", timeout=timeout_s * 1e3)
                page.wait_for_timeout(3000)  # layout and first frames
                webgl = page.evaluate("() => [...document.querySelectorAll('canvas')].some("
                                      "c => !!(c.getContext('webgl2') || c.getContext('webgl')))")
                if expand:
                    page.get_by_text("unfold_more_double", exact=True).first.click()
                    page.wait_for_timeout(3000)
                matches = _search(page, search) if search else None
                if screenshot:
                    page.screenshot(path=screenshot)
                return {"canvas": True, "webgl": bool(webgl), "search_matches": matches, "title": page.title()}
            finally:
                ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _search(page, regex: str) -> int:
    """Types ``regex`` into Model Explorer's search box; the number of matches it reports."""
    box = page.get_by_placeholder("Search nodes/layers by regex")
    box.fill(regex)
    box.press("Enter")
    page.wait_for_timeout(1500)
    text = page.evaluate("() => document.body.innerText")
    import re

    m = re.search(r"(\d+) results?\b", text)
    return int(m.group(1)) if m else 0


def screenshot_dir(view_dir: str, out: str, expand: bool = False, search: Optional[str] = None,
                   size: tuple = (1400, 900)) -> dict:
    """Serves a written view on a free local port (a child process) and saves a screenshot of it."""
    from fxopt.view.serve import free_port, url_for, wait_until_up

    port = free_port(start=8090)
    server = subprocess.Popen([sys.executable, "-c", "import sys, fxopt.view as v; "
                               "v.serve(sys.argv[1], port=int(sys.argv[2]), open_browser=False)", view_dir, str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not wait_until_up("localhost", port, 60):
            raise RuntimeError("Model Explorer's server did not start")
        return render(url_for(view_dir, "localhost", port), screenshot=out, search=search, expand=expand, size=size)
    finally:
        server.terminate()
        server.wait(10)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxopt.view.browser", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("view_dir")
    p.add_argument("output", help="PNG path")
    p.add_argument("--expand", action="store_true", help="expand all layers")
    p.add_argument("--search", help="a regex for Model Explorer's search")
    p.add_argument("--size", default="1400,900", help="viewport WIDTH,HEIGHT")
    args = p.parse_args(argv)
    size = tuple(int(v) for v in args.size.split(","))
    print(screenshot_dir(args.view_dir, args.output, args.expand, args.search, size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
