"""The OpenAPI document is true: generation routes declare their bodies, every route its error responses
(the OpenAI error body), and no route advertises FastAPI's 422 validation shape, which is never sent."""

from __future__ import annotations

import json

from api.app import create_app
from api.settings import ServerSettings


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
