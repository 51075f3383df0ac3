"""vLLM's structured-output request fields -> the engine's `StructuredSpec` (the llguidance path).

`guided_json` (a JSON schema, as an object or its text), `guided_regex`, `guided_choice` (the output is
exactly one of the strings), `guided_grammar` (GBNF/EBNF as vLLM's xgrammar backend takes, e.g.
`root ::= "yes" | "no"`, converted by llguidance; or Lark, llguidance's own dialect) and `structured_outputs`
(vLLM's newer object with `json`, `regex`, `choice`, `grammar`, `json_object`) each give one constraint.
At most one constraint per request: two of these, or one with a `response_format` or forced tool call, is
a 400 naming the field. Like `response_format`, the constraint is only built and bounded here: it is a
`SchemaJob` that `api.schema_check.SchemaChecker` compiles off the event loop once the request is within
its limits.
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import APIError
from api.openai_protocol import SamplingFields
from api.structured import SchemaJob, schema_spec
from engine.structured import MAX_SPEC_CHARS, StructuredSpec

_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def regex_literal(text: str) -> str:
    """A regex (Rust/llguidance syntax) matching exactly `text`."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(ch)
    return "".join(out)


def guided_job(body: SamplingFields, other: bool) -> SchemaJob | None:
    """The constraint the request's vLLM fields ask for, as a job to compile with the request's others,
    or None when they ask for none; 400 naming the field for two constraints, or for one when `other`
    (the request also has a `response_format` or a forced tool call)."""
    found: list[tuple[str, StructuredSpec]] = []
    so = body.structured_outputs
    candidates: list[tuple[str, str, Any]] = [
        ("guided_json", "json", body.guided_json),
        ("guided_regex", "regex", body.guided_regex),
        ("guided_choice", "choice", body.guided_choice),
        ("guided_grammar", "grammar", body.guided_grammar),
    ]
    if so is not None:
        candidates += [
            ("structured_outputs.json", "json", so.json_),
            ("structured_outputs.regex", "regex", so.regex),
            ("structured_outputs.choice", "choice", so.choice),
            ("structured_outputs.grammar", "grammar", so.grammar),
            ("structured_outputs.json_object", "json_object", so.json_object or None),
        ]
    for param, kind, value in candidates:
        if value is not None:
            found.append((param, _spec(param, kind, value)))
    if not found:
        return None
    if len(found) > 1 or other:
        extra = found[1][0] if len(found) > 1 else found[0][0]
        raise APIError(
            400,
            f"{extra}: a request takes one output constraint (guided_*, structured_outputs, "
            "response_format or a forced tool call), this one has more",
            param=extra,
        )
    param, spec = found[0]
    return SchemaJob(spec, param, True)


def _spec(param: str, kind: str, value: Any) -> StructuredSpec:
    if kind == "json":
        schema = value
        if isinstance(value, str):
            if len(value) > MAX_SPEC_CHARS:
                raise _too_large(param, "schema")
            try:
                schema = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise APIError(400, f"{param}: not valid JSON ({exc})", param=param) from exc
        if not isinstance(schema, dict):
            raise APIError(400, f"{param}: a JSON schema must be an object", param=param)
        return schema_spec(schema, param)
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "choice":
        if any(not c for c in value):
            raise APIError(400, f"{param}: choices must be non-empty strings", param=param)
        text = "(" + "|".join(regex_literal(c) for c in value) + ")"
        return _checked(param, "regex", text)
    if kind == "grammar":
        if len(value) > MAX_SPEC_CHARS:  # bounded before the (Python) GBNF conversion runs
            raise _too_large(param, "grammar")
        return _checked(param, kind, _lark(param, value))
    return _checked(param, kind, value)


def _too_large(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: the {what} is larger than {MAX_SPEC_CHARS} characters", param=param)


def _lark(param: str, grammar: str) -> str:
    """`grammar` in Lark syntax: as given when it is Lark already, else converted from GBNF."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as exc:  # the converter raises plain exceptions for malformed GBNF
        raise APIError(400, f"{param}: not a valid GBNF or Lark grammar ({exc})", param=param) from exc


def _checked(param: str, kind: str, text: str) -> StructuredSpec:
    """The spec of `kind` over `text` (bounded, not compiled yet); 400 with `param` when it is refused."""
    try:
        return StructuredSpec(kind, text)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from exc
