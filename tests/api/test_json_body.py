"""Request bodies: a big JSON body is parsed and validated off the event loop, a bad one is a 400 naming the
field, and the OpenAPI document still declares the generation routes' bodies and every route's errors."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, field_validator
from starlette.requests import Request

from api.app import create_app
from api.json_body import OFFLOOP_BYTES, read_json
from api.settings import ServerSettings

_validated_on: dict[str, int] = {}


class _Probe(BaseModel):
    """Records the thread its `ids` were validated on."""

    ids: list[int]

    @field_validator("ids")
    @classmethod
    def _where(cls, v: list[int]) -> list[int]:
        _validated_on["thread"] = threading.get_ident()
        return v


def _request(body: bytes) -> Request:
    chunks = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@pytest.mark.parametrize("count,off_loop", [(10, False), (OFFLOOP_BYTES, True)])
def test_big_bodies_are_validated_off_the_event_loop(count, off_loop):
    body = json.dumps({"ids": list(range(count))}).encode()

    async def run() -> tuple[int, int]:
        probe = await read_json(_request(body), _Probe)
        assert probe.ids[-1] == count - 1
        return _validated_on["thread"], threading.get_ident()

    validated_on, loop_thread = asyncio.run(run())
    assert (validated_on != loop_thread) is off_loop


@pytest.mark.parametrize("body", [b"{not json", b'{"ids": [1, "x"]}', b""])
def test_bad_bodies_are_validation_errors_with_the_field(body):
    with pytest.raises(RequestValidationError) as exc:
        asyncio.run(read_json(_request(body), _Probe))
    loc = exc.value.errors()[0]["loc"]
    assert loc[0] == "body"
    if b"ids" in body:
        assert loc[1:] == ("ids", 1)


def test_openapi_declares_bodies_and_errors():
    schema = create_app(ServerSettings.build(model="demo/base")).openapi()
    components = schema["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/adapters/{name}/completions"):
        op = schema["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in components
        assert {"400", "401", "413", "429", "503"} <= set(op["responses"])
    for path, item in schema["paths"].items():
        for op in item.values():
            assert "HTTPValidationError" not in json.dumps(op), path  # never FastAPI's 422 shape
            if path.startswith("/admin/api"):
                assert {"400", "401", "403", "404", "422", "429"} <= set(op["responses"]), path
    refs = {r.split("/")[-1] for r in _refs(schema)}
    assert refs <= set(components)


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)
