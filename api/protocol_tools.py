"""Request schemas for structured output and tool calling (api/structured.py, api/guided.py and
api/tool_calls.py give them meaning): `response_format`, vLLM's `structured_outputs`, tool definitions,
tool choices and the tool calls of an assistant turn."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from api.protocol_fields import Name, RequestBody, Text

MAX_TOOLS = 128
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]


class JsonSchemaFormat(RequestBody):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: ToolName
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced


class ResponseFormat(RequestBody):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (matching `json_schema`)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(RequestBody):
    model_config = ConfigDict(extra="ignore")

    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDef(RequestBody):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(RequestBody):
    name: ToolName


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(RequestBody):
    name: ToolName
    arguments: Text  # JSON text


class ToolCall(RequestBody):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


MAX_GUIDED_CHOICES = 256


class StructuredOutputs(RequestBody):
    """vLLM's `structured_outputs` (exactly one of these); `json` is a JSON schema (object or its text)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)] | None = None
    grammar: Text | None = None  # GBNF (converted) or Lark (api/guided.py)
    json_object: bool | None = None
