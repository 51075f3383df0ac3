"""Run the server with uvicorn: `loraplex serve` calls `serve(settings)`."""

from __future__ import annotations

import uvicorn

from api.app import create_app
from api.settings import ServerSettings


def serve(settings: ServerSettings, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; on shutdown, in-flight requests get up to 30 s to finish."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=30,
        lifespan="on",
    )
    uvicorn.Server(config).run()
