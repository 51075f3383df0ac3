"""HTTP requests in flight on an ingress replica, for the drain on SIGTERM (`loraplex serve --replicas`).

Counted by an ASGI middleware around the whole app, so a request waiting for admission or still writing
its body counts as much as one waiting for tokens. Process-wide: one ingress app per replica process.
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from api.http_middleware import HTTPMiddleware


class _Counter:
    active = 0


def http_in_flight() -> int:
    """HTTP requests this process's ingress app is serving now."""
    return _Counter.active


class InFlightMiddleware(HTTPMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        _Counter.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            _Counter.active -= 1
