"""Headless Debian Chromium for the UI tests, driven by Playwright (never `playwright install`).

Without Chromium or the `playwright` package the browser tests are skipped locally, and fail under
`CI=true`, where `.ci/run` installs the Debian package.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOT_DIR = Path(__file__).resolve().parents[2] / "docs" / "screenshots"


def require(condition: bool, why: str) -> None:
    """Skip the test when `condition` is false, or fail loudly under CI."""
    if condition:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why} (CI=true: the browser tests must run)")
    pytest.skip(why)


def screenshot_dir(tmp: Path) -> Path:
    """docs/screenshots when `LORAPLEX_UPDATE_SCREENSHOTS=1` (to commit them), else a temp dir."""
    if os.environ.get("LORAPLEX_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
        return SCREENSHOT_DIR
    return tmp


# Element boxes measured in the page, for the layout checks at phone width.
PAGE_WIDTH_JS = "document.documentElement.scrollWidth"
CLIPPED_JS = "els => els.filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.outerHTML.slice(0, 80))"
LABEL_BOXES_JS = """form => Array.from(form.querySelectorAll('label[for]')).map(label => {
    const box = el => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    return [label.htmlFor, box(label), box(document.getElementById(label.htmlFor))];
})"""
CHART_VIEW_JS = """box => {
    const view = box.getBoundingClientRect();
    const latest = [...box.querySelectorAll('circle'),
                    ...[...box.querySelectorAll('text.axis')].filter(t => t.textContent === 'now')];
    return {
        atEnd: box.scrollLeft + box.clientWidth >= box.scrollWidth - 1,
        latest: latest.length,
        hidden: latest.filter(el => { const r = el.getBoundingClientRect();
                                      return r.left < view.left - 1 || r.right > view.right + 1; }).length,
    };
}"""


def label_sits_with_input(label: list[float], field: list[float], stacked: bool) -> bool:
    """Whether a label's box (left, top, right, bottom) is just above its input's box, left edges
    aligned (`stacked`), or, when not `stacked`, either that or just left of it, centred on it."""
    above = 0 <= field[1] - label[3] <= 12 and abs(field[0] - label[0]) <= 2
    centred = abs((field[1] + field[3]) / 2 - (label[1] + label[3]) / 2) <= 3
    beside = 0 <= field[0] - label[2] <= 16 and centred
    return above or (beside and not stacked)


@contextmanager
def chromium() -> Iterator:
    """A fresh headless Chromium (Playwright `Browser`), closed afterwards; skipped (or failed under CI)
    when Chromium or the playwright package is missing."""
    require(CHROMIUM.exists(), f"{CHROMIUM} is missing: apt-get install -y chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, "the playwright package is not installed")
        raise
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def chromium_page(base_url: str, viewport: dict | None = None, timeout_ms: int = 30_000) -> Iterator:
    """A page of a fresh headless Chromium on `base_url` (for tests outside this package, which have no
    `browser` fixture); skipped (or failed under CI) like the UI tests when Chromium is missing."""
    with chromium() as browser:
        size = viewport or {"width": 1280, "height": 860}
        context = browser.new_context(viewport=size, base_url=base_url)
        context.set_default_timeout(timeout_ms)
        yield context.new_page()


def log_in(page, token: str, path: str = "/admin") -> None:
    """Log `page` in with the admin token through the login form, landing on `path`."""
    page.goto(path)
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"**{path}")
