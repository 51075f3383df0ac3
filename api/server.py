"""Run the server with uvicorn: `loraplex serve` calls `serve(settings)`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn

from api.app import create_app
from api.settings import ServerSettings


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT that led to a clean, graceful shutdown ends the
    process with status 0 instead of being re-raised (which would kill it before stdio is flushed)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def serve(settings: ServerSettings, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; on shutdown, in-flight requests get up to 30 s to finish."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=30,
        lifespan="on",
        **settings.uvicorn_proxy_options(),  # type: ignore[arg-type]
    )
    _Server(config).run()
