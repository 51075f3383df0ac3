"""`StructuredSpec`: what a request's output must match, as it crosses the API -> engine boundary.

A spec is plain text plus a kind, bounded in size and checked on construction (also when msgspec decodes
it from the wire, since `__post_init__` runs then too):

- `json_object`: any JSON object (`spec` must be empty),
- `json_schema`: a JSON document matching the JSON schema in `spec` (a JSON object, as text),
- `regex`: text matching the regular expression `spec` (whole output),
- `grammar`: text of the Lark grammar `spec` (llguidance's Lark dialect, which may embed `%json{...}`).

Whether the grammar compiles (supported schema keywords, valid regex) is checked by the engine's
`GrammarCompiler` (and earlier by the API, which names the offending field).
"""

from __future__ import annotations

import hashlib
import json

import msgspec

KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar larger than this is refused


class StructuredSpecError(ValueError):
    """A structured-output spec is malformed or cannot be compiled; `field` names the offending part."""

    def __init__(self, message: str, field: str = "structured") -> None:
        super().__init__(message)
        self.field = field


class StructuredSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """The constraint of one request's output (see the module docstring for the kinds)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredSpecError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise StructuredSpecError(f"the spec must be text of at most {MAX_SPEC_CHARS} characters")
        if self.kind == "json_object" and self.spec:
            raise StructuredSpecError("a json_object spec carries no text")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise StructuredSpecError(f"a {self.kind} spec needs its text")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
                raise StructuredSpecError(f"the JSON schema is not valid JSON: {exc!r}") from exc
            if not isinstance(schema, dict):
                raise StructuredSpecError("the JSON schema must be a JSON object")

    @property
    def key(self) -> str:
        """Cache key: sha256 over kind and text."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: dict) -> StructuredSpec:
        """The spec for a JSON schema given as a dict (serialized compactly)."""
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
