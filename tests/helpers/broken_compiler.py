"""A C compiler that always fails, for tests of the native kernels' torch fallbacks."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest


def use_broken_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Point `$CC` at a script that fails and the build cache at an empty folder, so the next native
    library load must compile and cannot (the caller drops the already loaded library)."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\necho "cc: not today" >&2\nexit 1\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
