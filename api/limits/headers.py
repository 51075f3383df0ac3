"""The rate-limit headers OpenAI clients read, and the middleware that puts them on answers.

    x-ratelimit-limit-requests      requests per minute of the tightest limit that applies
    x-ratelimit-remaining-requests  requests left in its bucket now
    x-ratelimit-reset-requests      until that bucket is full again, e.g. "6s", "1m30s", "250ms"
    (the same three with -tokens for tokens per minute)

A route's limiter decision stores its headers in the request's state (`ratelimit_headers`); the
middleware adds them when the answer starts. A 429 carries them (and `Retry-After`) itself.
"""

from __future__ import annotations

from starlette.types import Message, Receive, Scope, Send

from api.http_middleware import HTTPMiddleware, with_headers

STATE_KEY = "ratelimit_headers"


def duration(seconds: float) -> str:
    """OpenAI's reset format: "250ms" under a second, else "45s" or "2m5s"."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = round(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def limit_headers(what: str, limit: int, remaining: float, reset_seconds: float) -> dict[str, str]:
    """The three headers of one bucket (`what`: "requests" or "tokens")."""
    return {
        f"x-ratelimit-limit-{what}": str(limit),
        f"x-ratelimit-remaining-{what}": str(max(0, int(remaining))),
        f"x-ratelimit-reset-{what}": duration(reset_seconds),
    }


class RateLimitHeaders(HTTPMiddleware):
    """ASGI middleware: add the headers a limiter decision left in `scope["state"]` to the answer."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = (scope.get("state") or {}).get(STATE_KEY)
                if extra:
                    message = with_headers(message, extra)
            await send(message)

        await self.app(scope, receive, send_with_headers)
