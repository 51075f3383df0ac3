"""Progress reporting for long registry operations (copying and hashing large files)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Advance = Callable[[int], None]  # called with the number of bytes just processed


class ProgressReporter(Protocol):
    def phase(self, description: str, total: int) -> Advance:
        """Start a phase of `total` bytes; return the function that advances it."""
        ...


class NoProgress:
    """A reporter that reports nothing."""

    def phase(self, description: str, total: int) -> Advance:
        return _ignore


def _ignore(_n: int) -> None:
    return None
