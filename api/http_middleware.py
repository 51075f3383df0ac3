"""`HTTPMiddleware`: the base of the app's raw ASGI middlewares (request guard, rate-limit headers, replica
header). Other scopes (lifespan, websockets) pass through untouched; `handle` sees every HTTP request.
Raw ASGI rather than Starlette's `BaseHTTPMiddleware`, so streamed answers are never buffered."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HTTPMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one HTTP request (subclasses wrap `self.app`)."""
        await self.app(scope, receive, send)


def with_headers(message: Message, headers: dict[str, str]) -> Message:
    """`message` (an `http.response.start`) with `headers` appended, except names it already has."""
    present = {k.lower() for k, _ in message.get("headers", [])}
    added = [(k.encode(), v.encode()) for k, v in headers.items() if k.encode().lower() not in present]
    return {**message, "headers": [*message.get("headers", []), *added]} if added else message
