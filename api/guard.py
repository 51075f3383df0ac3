"""`RequestGuard`: the checks every HTTP request passes before a route reads a byte of its body.

1. Credentials first where the body can be big: `/admin/api/*` needs the admin bearer token (401/403)
   before the body is read, so an unauthenticated upload is refused without being received.
2. Body size by route class (413, OpenAI error body): the `Content-Length` header is checked up front and
   the bytes are counted as they stream in (a chunked body is cut off at the limit).
   - upload (`POST /admin/api/adapters`, `POST /admin/adapters`): `max_upload_bytes` + 1 MiB of form
   - inference (`POST /v1/*`, `/tokenize`, `/detokenize`): `max_request_bytes`
   - anything else: 1 MiB
3. `/metrics` and the API docs (`/docs`, `/redoc`, `/openapi.json`) follow `metrics_access` /
   `docs_access`: "public", "api_key" (any valid API key or the admin token) or "admin" (admin token);
   "auto" = public unless API keys are required, then admin-only, so nothing leaks by default.
"""

from __future__ import annotations

import logging
import time

from starlette.types import Message, Receive, Scope, Send

from api.admission import ARRIVED
from api.auth import check_admin_token, static_key_ok, verify_key
from api.errors import APIError, error_response
from api.http_middleware import HTTPMiddleware
from lora_registry.errors import RegistryError

log = logging.getLogger("loraplex.errors")
ADMIN_CHECKED = "loraplex_admin_checked"  # request state: the guard verified the admin token

OTHER_BODY_BYTES = 1024**2
FORM_OVERHEAD_BYTES = 1024**2
UPLOAD_ROUTES = ("/admin/api/adapters", "/admin/adapters")
TOKENIZER_ROUTES = ("/tokenize", "/detokenize")  # inference-sized bodies, like `/v1/*`
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class RequestGuard(HTTPMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})[ARRIVED] = time.monotonic()  # fair-share waits count from here
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._guarded(scope, receive, tracked_send)
        except Exception as exc:
            # Nothing leaves the app as an exception: uvicorn would answer plain text, or (once the
            # error handler has answered) drop the keep-alive connection. Registry errors keep their
            # status (503 when the database is unreachable); anything else is a JSON 500.
            if started:
                raise
            await _unexpected(exc)(scope, receive, send)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(scope["app"].state, "loraplex", None) if "app" in scope else None
        if state is None:  # not started yet (or a bare app in a test): nothing to check against
            await self.app(scope, receive, send)
            return
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = await _credentials(state, path, headers, scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        limit = body_limit(state.settings, path, method)
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _too_large(limit)(scope, receive, send)
            return
        await self._limited(scope, receive, send, limit)

    async def _limited(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        """Run the app, answering 413 (and ending the body for the app) once the body passes `limit`."""
        received = 0
        refused = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not started:
                        await _too_large(limit)(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out already; the app's answer to the cut-off body is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)


def body_limit(settings, path: str, method: str) -> int:
    """Most body bytes a request to `path` may send."""
    if method == "POST" and path in UPLOAD_ROUTES:
        return settings.max_upload_bytes + FORM_OVERHEAD_BYTES
    if method == "POST" and (path.startswith("/v1/") or path in TOKENIZER_ROUTES):
        return settings.max_request_bytes
    return OTHER_BODY_BYTES


async def _credentials(state, path: str, headers: dict[str, str], scope: Scope):
    """A refusal response when the route needs credentials the request lacks, else None.

    Admin-token checks go through the per-client `AuthThrottle` (429 when a guessing client's attempts
    are already waiting); a request that passed is marked in `scope["state"]` for `require_admin`."""
    if path == "/admin/api" or path.startswith("/admin/api/"):
        level = "admin"
    elif path == "/metrics":
        level = state.settings.access("metrics")
    elif path in DOCS_PATHS:
        level = state.settings.access("docs")
    else:
        return None
    if level == "public":
        return None
    scheme, _, secret = headers.get("authorization", "").partition(" ")
    secret = secret.strip() if scheme.lower() == "bearer" else ""
    if not secret:
        what = "admin token" if level == "admin" else "API key or admin token"
        return error_response(
            401,
            f"{what} required: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if level == "admin":
        try:
            await check_admin_token(state, client_address(scope), secret)
        except APIError as exc:
            return error_response(exc.status, exc.message, headers=exc.headers)
        scope.setdefault("state", {})[ADMIN_CHECKED] = True
        return None
    if state.admin_auth.check(secret):
        return None
    if level == "api_key":
        if static_key_ok(state.settings, secret):
            return None
        try:
            key = await verify_key(state, secret)
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)
        if key is not None:
            return None
        return error_response(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
    return error_response(403, "invalid admin token")


def client_address(scope: Scope) -> str:
    """The client's address as the server sees it (a trusted proxy's `X-Forwarded-For` when configured)."""
    client = scope.get("client")
    return str(client[0]) if client else "?"


def _unexpected(exc: Exception):
    """The JSON answer to an exception that escaped the app (see `RequestGuard.__call__`)."""
    if isinstance(exc, RegistryError):
        if exc.status_code >= 500:
            log.warning("registry error: %s", exc)
        return error_response(exc.status_code, str(exc))
    log.error("unhandled error", exc_info=exc)
    return error_response(500, "internal error")


def _too_large(limit: int):
    return error_response(
        413, f"request body exceeds the {limit} byte limit for this route", code="body_too_large"
    )
