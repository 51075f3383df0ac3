"""The `x-loraplex-replica` response header: which engine replica(s) served the request.

An ASGI middleware gives every HTTP request a fresh holder in a context variable; the remote engine
client notes each replica that answers into it (tasks started by the request copy the context, so they
share the holder); the middleware adds the header when the response starts. Streamed responses start
after their first token, so the header is known by then.
"""

from __future__ import annotations

from contextvars import ContextVar

from starlette.types import Message, Receive, Scope, Send

from api.http_middleware import HTTPMiddleware, with_headers

HEADER = "x-loraplex-replica"
_replicas: ContextVar[list[str] | None] = ContextVar("loraplex_replicas", default=None)


def note_replica(replica: str) -> None:
    """Record that `replica` serves (part of) the current HTTP request."""
    seen = _replicas.get()
    if seen is not None and replica not in seen:
        seen.append(replica)


class ReplicaHeaderMiddleware(HTTPMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen: list[str] = []
        token = _replicas.set(seen)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start" and seen:
                message = with_headers(message, {HEADER: ",".join(seen)})
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            _replicas.reset(token)
