"""JSON request bodies read off the event loop: a body of up to `max_request_bytes` (16 MiB) takes a
second or more to parse and validate (e.g. millions of token ids), time in which no other request of the
API process would run. The generation routes therefore read their body with `read_json` (parsed and
validated in a worker thread once it is larger than `OFFLOOP_BYTES`) and declare its schema with
`json_body_schema`, so the OpenAPI document stays true.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

OFFLOOP_BYTES = 64 * 1024
M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, model: type[M]) -> M:
    """The request's body validated as `model`; invalid JSON or fields raise `RequestValidationError`
    (answered 400 with the OpenAI body naming the field), as FastAPI's own body parameters do."""
    raw = await request.body()
    try:
        if len(raw) > OFFLOOP_BYTES:
            return await run_in_threadpool(model.model_validate_json, raw)
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = [e | {"loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def json_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route that reads a `model` body with `read_json`."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the schemas of the `models` that routes read with `read_json` (and the models they nest) into
    the app's OpenAPI components."""
    generate = app.openapi

    def openapi() -> dict:
        cached = app.openapi_schema is not None
        schema = generate()
        if not cached:
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in js.pop("$defs", {}).items():
                    components.setdefault(name, sub)
                components[model.__name__] = js
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
