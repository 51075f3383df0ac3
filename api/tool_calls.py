"""Function calling in the OpenAI shape, built on structured output.

A call is written by the model as the JSON object `{"name": NAME, "arguments": {...}}` (the separators
the grammar fixes: `", "` and `": "`), and returned as `message.tool_calls[0]` with `arguments` as JSON
text, `content: null` and `finish_reason: "tool_calls"`.

- `tool_choice: "required"`: the output is constrained to a call of one of `tools` (any of them);
  a named function (`{"type": "function", "function": {"name"}}`): to a call of that function. The
  arguments match the function's `parameters` schema.
- `"auto"` (the default with `tools`): the output is not constrained; if the whole reply is such a call
  of a known tool it is returned as one, else as text.
- `"none"` (the default without `tools`): text; tools still reach the chat template.
At most one call per choice (`parallel_tool_calls` is accepted and ignored).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from api.errors import APIError
from api.openai_protocol import ChatCompletionRequest, ChatMessage, FunctionDef
from api.schema_refs import hoist
from api.structured import SchemaJob, check_total, dumps, schema_spec
from engine.structured import StructuredSpec, StructuredSpecError

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_CALL_PREFIX = re.compile(r'\{"name": "([a-zA-Z0-9_-]+)", "arguments": ')


@dataclass(slots=True)
class ToolMode:
    """How a chat request treats tools: `spec` constrains the output to a call (`forced`), `detect`
    looks for a call in free text (auto)."""

    tools: dict[str, FunctionDef] = field(default_factory=dict)
    forced: bool = False
    detect: bool = False
    spec: StructuredSpec | None = None
    jobs: list[SchemaJob] = field(default_factory=list)  # to compile before the request runs

    @property
    def active(self) -> bool:
        return self.forced or self.detect


def tool_mode(body: ChatCompletionRequest, extra: SchemaJob | None = None) -> ToolMode:
    """The request's tool handling, cheaply: 400 naming the field for duplicate or unknown names, a
    forced choice without tools, a `parameters` schema that is too big or refers to itself, or schemas
    (with `extra`, the response format's) over the request's total. Compiling is left to `jobs`."""
    tools: dict[str, FunctionDef] = {}
    jobs: list[SchemaJob] = []
    for i, t in enumerate(body.tools or []):
        if t.function.name in tools:
            raise APIError(400, f"tools[{i}]: duplicate function name {t.function.name!r}", param="tools")
        tools[t.function.name] = t.function
        if t.function.parameters is not None:
            param = f"tools[{i}].function.parameters"
            jobs.append(SchemaJob(schema_spec(t.function.parameters, param), param, False))
            check_total(jobs + ([extra] if extra is not None else []))  # stop at the first one over
    check_total(jobs + ([extra] if extra is not None else []))
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return ToolMode(tools, jobs=jobs)
    if not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "auto":
        detect = body.response_format is None or body.response_format.type == "text"
        return ToolMode(tools, detect=detect, jobs=jobs)
    if choice == "required":
        chosen = list(tools.values())
    else:
        name = choice.function.name
        if name not in tools:
            raise APIError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        chosen = [tools[name]]
    try:
        spec = StructuredSpec.json_schema(forced_schema(chosen))
    except (StructuredSpecError, RecursionError) as exc:  # the combined schema is over the size limit
        raise APIError(
            400, f"tools: the schema of the forced call is too large: {exc}", param="tools"
        ) from exc
    jobs.append(SchemaJob(spec, "tools", True))
    return ToolMode(tools, forced=True, spec=spec, jobs=jobs)


def forced_schema(chosen: list[FunctionDef]) -> dict[str, Any]:
    """JSON schema of a call of any of `chosen`, with each one's definitions hoisted to the top-level
    `$defs` (as `NAME.DEF`) so their `$ref`s still resolve once nested."""
    calls: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for fn in chosen:
        args, own = hoist(fn.parameters, fn.name) if fn.parameters is not None else (NO_ARGUMENTS, {})
        calls.append(call_schema(fn, args))
        defs.update(own)
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return schema | {"$defs": defs} if defs else schema


def call_schema(fn: FunctionDef, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON schema of a call of `fn`: its name (constant) then its arguments (`arguments`, default its
    `parameters`)."""
    if arguments is None:
        arguments = fn.parameters or NO_ARGUMENTS
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_call(text: str, tools: dict[str, FunctionDef]) -> dict[str, Any] | None:
    """The OpenAI `tool_call` written in `text` (a whole JSON call of a known tool), else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, args = value["name"], value["arguments"]
    if not isinstance(name, str) or name not in tools or not isinstance(args, dict):
        return None
    return new_call(name, dumps(args))


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


# ---- prompt side --------------------------------------------------------------------------------------


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: assistant `tool_calls` with their arguments as objects,
    tool results with their `tool_call_id`."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _args(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def prompt_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """All the text a chat prompt is made of (contents, call arguments, tool definitions), for the
    prompt-size check before rendering."""
    calls = [
        json.dumps(c["function"]["arguments"], ensure_ascii=False)
        for m in messages
        for c in m.get("tool_calls", [])
    ]
    defs = json.dumps(tools, ensure_ascii=False) if tools else ""
    return "".join(m["content"] for m in messages) + "".join(calls) + defs


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """Tool definitions for the chat template (OpenAI shape), or None."""
    if not body.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---- streaming ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class CallStream:
    """Turns a choice's growing text into OpenAI stream deltas under a `ToolMode`.

    Forced: once `{"name": "...", "arguments": ` is complete, a delta opens the call (id, name), then the
    arguments stream as they grow (the closing `}` of the call held back). Auto: text that may be a call
    (starting with `{`) is held until the end and then sent as a call or as content; other text streams.
    """

    mode: ToolMode
    text: str = ""
    sent: int = 0  # characters of `text` consumed into deltas
    call: dict[str, Any] | None = None
    is_call: bool = False

    def push(self, piece: str, finished: bool, finish_reason: str | None) -> list[dict[str, Any]]:
        """The deltas (each a `delta` object) to send after `piece` arrived."""
        self.text += piece
        if self.mode.forced:
            return self._forced(finished)
        if not self.mode.detect:
            return self._content(finished)
        head = self.text.lstrip()
        if not finished and (not head or head.startswith("{")):
            return []  # may still be a call
        if finished and finish_reason == "stop":
            call = parse_call(self.text, self.mode.tools)
            if call is not None:
                self.is_call = True
                return [{"tool_calls": [{"index": 0} | call]}]
        return self._content(True)

    def _content(self, finished: bool) -> list[dict[str, Any]]:
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return [{"content": out}] if out else []

    def _forced(self, finished: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self.call is None:
            m = _CALL_PREFIX.match(self.text)
            if m is None:
                return self._content(True) if finished else []
            self.call = new_call(m.group(1), "")
            self.is_call = True
            self.sent = m.end()
            deltas.append({"tool_calls": [{"index": 0} | self.call]})
        end = len(self.text)
        if finished and self.text.endswith("}"):
            end -= 1  # the call's own closing brace
        elif not finished:
            end -= 1  # may be that brace
        if end > self.sent:
            args = self.text[self.sent : end]
            self.sent = end
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": args}}]})
        return deltas
