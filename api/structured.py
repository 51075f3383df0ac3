"""OpenAI `response_format` -> the engine's `StructuredSpec`, checked so a bad schema is a 400 that names
its field.

Checking is two steps, so nothing costly runs before a request's size checks and rate limits:
`response_format_job` / `schema_spec` only serialize and bound the schema (and refuse a `$ref` that leads
back to itself), and the resulting `SchemaJob`s are compiled later by `api.schema_check.SchemaChecker`,
off the event loop, with llguidance and the model's own tokenizer exactly as the engine compiles them.

Limits: a schema serializes to at most `MAX_SPEC_CHARS` characters, all of a request's schemas to at
most `MAX_REQUEST_SCHEMA_CHARS`, and it may only use the JSON-schema features llguidance implements
(unsupported keywords such as `not` are refused, never ignored).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from api.errors import APIError
from api.openai_protocol import ResponseFormat
from api.schema_refs import self_reference
from engine.structured import MAX_SPEC_CHARS, StructuredSpec, StructuredSpecError

MAX_REQUEST_SCHEMA_CHARS = 256 * 1024  # all the schemas of one request (tools + response_format)


@dataclass(frozen=True, slots=True)
class SchemaJob:
    """A spec to check before the request runs; `constrains`: the output is constrained by it (checked
    with the tokenizer, including a dry run of its first tokens), else it only has to compile."""

    spec: StructuredSpec
    param: str
    constrains: bool


def response_format_job(fmt: ResponseFormat | None) -> SchemaJob | None:
    """The constraint `response_format` asks for (None for absent or `text`); 400 naming the field when
    the schema is missing, too large or refers to itself."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return SchemaJob(StructuredSpec("json_object"), "response_format", True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            400,
            "response_format of type json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    param = "response_format.json_schema.schema"
    return SchemaJob(schema_spec(fmt.json_schema.schema_, param), param, True)


def schema_spec(schema: dict[str, Any], param: str) -> StructuredSpec:
    """The spec of JSON schema `schema` (not compiled yet); 400 with `param` when it is too big, cannot
    be serialized, or has a `$ref` that leads back to itself."""
    try:
        ref = self_reference(schema)
        spec = StructuredSpec.json_schema(schema)
    except (TypeError, ValueError, RecursionError) as exc:  # unserializable, too deep, too big
        raise APIError(400, f"{param}: {_reason(exc)}", param=param) from exc
    if ref is not None:
        raise APIError(
            400,
            f"{param}: the $ref {ref!r} refers to itself with no base case, so no output can match it",
            param=param,
        )
    return spec


def check_total(jobs: Sequence[SchemaJob]) -> None:
    """400 when the request's schemas together exceed `MAX_REQUEST_SCHEMA_CHARS`."""
    total = sum(len(j.spec.spec) for j in jobs)
    if total > MAX_REQUEST_SCHEMA_CHARS:
        param = "tools" if any(j.param.startswith("tools") for j in jobs) else "response_format"
        raise APIError(
            400,
            f"the request's schemas have {total} characters in all; at most {MAX_REQUEST_SCHEMA_CHARS}",
            param=param,
        )


def _reason(exc: Exception) -> str:
    if isinstance(exc, StructuredSpecError) and "characters" in str(exc):
        return f"the schema is larger than {MAX_SPEC_CHARS} characters"
    return str(exc)


def dumps(value: Any) -> str:
    """JSON text as the constrained output writes it (`", "` and `": "` separators)."""
    return json.dumps(value, ensure_ascii=False)
