"""OpenAI `response_format` -> the engine's `StructuredSpec`, checked here so a bad schema is a 400 that
names its field (the engine compiles it again with the model's tokenizer).

Limits: a schema serializes to at most `MAX_SPEC_CHARS` characters and may only use the JSON-schema
features llguidance implements (unsupported keywords such as `not` are refused, never ignored).
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import APIError
from api.openai_protocol import ResponseFormat
from engine.structured import MAX_SPEC_CHARS, StructuredSpec, StructuredSpecError
from engine.structured.compiler import check_spec


def response_format_spec(fmt: ResponseFormat | None) -> StructuredSpec | None:
    """The constraint `response_format` asks for (None for absent or `text`); 400 naming the field when
    the schema is missing, too large or unsupported."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredSpec("json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            400,
            "response_format of type json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    return schema_spec(fmt.json_schema.schema_, "response_format.json_schema.schema")


def schema_spec(schema: dict[str, Any], param: str) -> StructuredSpec:
    """The checked spec of JSON schema `schema`; 400 with `param` when it is too big or unsupported."""
    try:
        spec = StructuredSpec.json_schema(schema)
    except (TypeError, ValueError, RecursionError) as exc:  # unserializable, too deep, too big
        raise APIError(400, f"{param}: {_reason(exc)}", param=param) from exc
    check(spec, param)
    return spec


def check(spec: StructuredSpec, param: str) -> None:
    """400 with `param` unless `spec` compiles."""
    try:
        check_spec(spec)
    except StructuredSpecError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from exc


def _reason(exc: Exception) -> str:
    if isinstance(exc, StructuredSpecError) and "characters" in str(exc):
        return f"the schema is larger than {MAX_SPEC_CHARS} characters"
    return str(exc)


def dumps(value: Any) -> str:
    """JSON text as the constrained output writes it (`", "` and `": "` separators)."""
    return json.dumps(value, ensure_ascii=False)
