"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`, and the app's handlers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lora_registry.errors import RegistryError, RegistryUnavailable

log = logging.getLogger("loraplex.errors")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to return to the client with `status` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server as an OpenAI-style body; validation errors become 400."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return error_response(exc.status, exc.message, exc.param, exc.code, headers or None)

    @app.exception_handler(RegistryError)
    async def _registry_error(_: Request, exc: RegistryError) -> JSONResponse:
        # A registry error a route did not map itself: its own status (503 = database unreachable).
        headers = {"Retry-After": "2"} if isinstance(exc, RegistryUnavailable) else None
        return error_response(exc.status_code, str(exc), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is the character offset, not a field
            return error_response(400, invalid_json_message(first, exc.body))
        loc = [
            str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path") and not _union_tag(p)
        ]
        named = (first.get("ctx") or {}).get("param")  # a model-level check naming its field
        param = named if isinstance(named, str) else ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return error_response(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    _openapi_without_422(app)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "internal error")


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _union_tag(part: object) -> bool:
    """Whether a validation error's loc entry names a member of a union (`str`, `list[str]`,
    `constrained-str`, `function-after[...]`, a model's class name) rather than a field: such entries
    are left out of `param`, so `stop: 1` names `stop`, not `stop.str`."""
    if not isinstance(part, str):
        return False  # a list index
    return part in _TYPE_NAMES or not part.isidentifier() or part[:1].isupper()


def invalid_json_message(error: dict, doc: object) -> str:
    """ "invalid JSON in request body: Expecting value at line 1 column 2" for FastAPI's `json_invalid`
    error (whose loc holds the offset into the body `doc` where the decoder stopped)."""
    reason = str((error.get("ctx") or {}).get("error") or "cannot be decoded")
    loc = error.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    if pos is None or not isinstance(doc, str | bytes):
        return f"invalid JSON in request body: {reason}"
    text = doc if isinstance(doc, str) else doc.decode("utf-8", "replace")
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return f"invalid JSON in request body: {reason} at line {line} column {column}"


def _openapi_without_422(app: FastAPI) -> None:
    """Validation errors are answered 400 with the OpenAI body, so drop FastAPI's generated 422 entries
    from the OpenAPI schema (each route declares its real error responses with `error_responses`)."""
    generate = app.openapi

    def openapi() -> dict:
        cached = app.openapi_schema is not None
        schema = generate()
        if not cached:
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    responses = op.get("responses", {}) if isinstance(op, dict) else {}
                    if "HTTPValidationError" in str(responses.get("422", "")):  # FastAPI's, not declared
                        responses.pop("422")
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI `responses=` entry declaring that a route answers `statuses` with the OpenAI error body."""
    from api.openai_protocol import ErrorResponse

    return {s: {"model": ErrorResponse, "description": _TYPES.get(s, "error")} for s in statuses}
