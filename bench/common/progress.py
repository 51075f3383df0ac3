"""Rich progress bars for the benchmarks (silent when `quiet`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class _Silent:
    """The subset of `rich.progress.Progress` the benchmarks use, doing nothing."""

    def add_task(self, description: str, total: float | None = None) -> int:
        return 0

    def advance(self, task: int, advance: float = 1) -> None:
        pass

    def update(self, task: int, **kwargs) -> None:
        pass


@contextmanager
def progress(quiet: bool = False) -> Iterator[Progress | _Silent]:
    """A progress display on stderr (description, bar, done/total, elapsed), or a silent stand-in."""
    if quiet:
        yield _Silent()
        return
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True)) as bar:
        yield bar
