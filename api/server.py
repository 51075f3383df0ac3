"""Run the server with uvicorn: `loraplex serve` calls `serve(settings)`.

The listening socket is bound first (`bind_socket`), before the model loads, so an address already in
use fails in a second with `PortUnavailable` instead of after the whole start-up; `on_serving` runs once
uvicorn is accepting connections (the CLI stores and prints a newly generated admin token there).

Shutdown (SIGTERM or Ctrl-C): stop accepting connections, give the requests in flight
`settings.shutdown_grace_seconds` to finish, then end the rest with a retryable 503 (an SSE error
event and `[DONE]` for streams), stop the engine, close the registry, and leave the process at once
(`os._exit` after the orderly clean-up: interpreter teardown of torch & co. took seconds and had nothing
left to flush).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

from api.app import create_app
from api.settings import ServerSettings

log = logging.getLogger("uvicorn.error")

CUT_MARGIN_SECONDS = 5.0  # after the grace: time for cut requests to write their 503s and close


class PortUnavailable(Exception):
    """The server's address cannot be listened on (in use, not permitted, no such interface)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` as uvicorn binds one (SO_REUSEADDR), not listening yet.

    `PortUnavailable`, with the system's reason, when the address is taken or cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PortUnavailable(f"cannot listen on {host}:{port}: {reason}") from exc
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a SIGTERM/SIGINT that led to a clean, graceful shutdown ends the process
    with status 0 instead of being re-raised (which would kill it before stdio is flushed), and requests
    still running at the end of the grace period are ended with a 503 rather than cancelled mid-body."""

    def __init__(
        self, config: uvicorn.Config, app: FastAPI, grace: float, on_serving: Callable[[], None] | None
    ) -> None:
        super().__init__(config)
        self.app, self.grace, self.on_serving = app, grace, on_serving

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        config = self.config
        log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", config.host, config.port)
        if self.on_serving is not None:
            self.on_serving()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        cut = asyncio.create_task(self._cut_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def _cut_after_grace(self) -> None:
        await asyncio.sleep(self.grace)
        state = getattr(self.app.state, "loraplex", None)
        if state is not None:
            n = state.client.end_in_flight()
            log.warning(
                "shutdown grace of %gs is over: ended %d request(s) still in flight with 503", self.grace, n
            )


def serve(
    settings: ServerSettings,
    log_level: str = "info",
    on_stopped: Callable[[], None] | None = None,
    *,
    sock: socket.socket | None = None,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Serve on `sock` (default: `bind_socket(settings.host, settings.port)`, before anything loads)
    until SIGINT/SIGTERM (see the module docstring for the shutdown). `on_serving()` runs once
    connections are accepted; after a server that started has shut down, `on_stopped()` runs and the
    process exits with status 0."""
    if sock is None:
        sock = bind_socket(settings.host, settings.port)
    app = create_app(settings)
    grace = settings.shutdown_grace_seconds
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=int(grace + CUT_MARGIN_SECONDS + 0.999),
        lifespan="on",
        **settings.uvicorn_proxy_options(),  # type: ignore[arg-type]
    )
    server = _Server(config, app, grace, on_serving)
    server.run(sockets=[sock])
    if not server.started:
        return
    if on_stopped is not None:
        on_stopped()
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Leave the process without interpreter teardown: flush logs and stdio first (the engine process,
    registry and sockets were closed by the app's lifespan)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
