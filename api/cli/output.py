"""Console output for the CLI: results on stdout, errors as one line on stderr, progress bars."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from lora_registry.errors import RegistryError

F = TypeVar("F", bound=Callable[..., Any])


class CliError(Exception):
    """An error to show the user as one line (the CLI exits with status 1)."""


def stdout() -> Console:
    return Console(soft_wrap=True)


def stderr() -> Console:
    return Console(stderr=True, soft_wrap=True)


def fail(message: str) -> NoReturn:
    stderr().print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    raise typer.Exit(1)


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def handle_errors(fn: F) -> F:
    """Wrap a command so any failure becomes `error: <message>` on stderr and exit status 1.

    Set `LORAPLEX_DEBUG=1` to see the traceback of an unexpected error.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except (CliError, RegistryError) as exc:
            fail(str(exc))
        except (OSError, ValueError) as exc:  # includes AdapterError and bad settings
            fail(str(exc))
        except KeyboardInterrupt:
            fail("interrupted")
        except Exception as exc:
            if os.environ.get("LORAPLEX_DEBUG"):
                raise
            fail(f"unexpected {type(exc).__name__}: {exc} (set LORAPLEX_DEBUG=1 for a traceback)")

    return wrapper  # type: ignore[return-value]


class RichProgress:
    """A `ProgressReporter` that draws one Rich bar per phase (copying, hashing) on stderr."""

    def __init__(self, enabled: bool = True) -> None:
        self._progress = Progress(
            TextColumn("{task.description:>18}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=stderr(),
            transient=False,
            disable=not enabled,
        )

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def phase(self, description: str, total: int) -> Callable[[int], None]:
        task = self._progress.add_task(description, total=max(total, 1))
        return lambda n: self._progress.advance(task, n)
