"""Headless Debian Chromium for the UI tests, driven by Playwright (never `playwright install`).

Without Chromium or the `playwright` package the browser tests are skipped locally, and fail under
`CI=true`, where `.ci/run` installs the Debian package.
"""

from __future__ import annotations

import os
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
