"""The OpenAI Responses API request (`POST /v1/responses`) and its translation to the chat path.

A request becomes a `ChatCompletionRequest`: `instructions` a leading system message, the stored
conversation of `previous_response_id` (its inputs and outputs, not its instructions) next, then
`input` (a string is one user message; message items keep their role; `function_call` items become an
assistant turn's tool call and `function_call_output` items tool results). Function tools and
`tool_choice` map onto the chat tool-call path, `text.format` onto `response_format`,
`max_output_tokens` onto `max_completion_tokens`. Fields loraplex does not implement are refused with
a 400 naming the field (`extra="forbid"`), never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from api.errors import APIError
from api.openai_protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    OPENAI_MAX_TEMPERATURE,
    AdapterMix,
    AdapterWeight,
    ChatCompletionRequest,
    Name,
    RequestBody,
    Text,
    ToolName,
    _bounded,
    distinct_adapters,
)

MAX_METADATA = 16
# OpenAI fields loraplex does not implement, accepted only at the value that means "not used" (a client
# that sends every field with its default is not refused); any other value is a 400 naming the field.
UNUSED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "include": (None, []),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "prompt_cache_key": (None,),
    "reasoning": (None,),
    "safety_identifier": (None,),
    "service_tier": (None, "auto", "default"),
    "stream_options": (None,),
    "top_logprobs": (None, 0),
}


class Strict(RequestBody):
    """Responses bodies: every field is known, an unknown one is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list[Any] | None = None  # output_text parts echoed back from an earlier response
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)]
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: Name
    name: ToolName
    arguments: Text
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: Name
    output: Text
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(Strict):
    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: ToolName


class TextFormat(Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: ToolName | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: Name | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: int | None = _bounded("max_tokens", None)
    temperature: float | None = Field(default=None, ge=0.0, le=OPENAI_MAX_TEMPERATURE)
    top_p: float | None = _bounded("top_p", None)
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; at most one call per response is made
    previous_response_id: Name | None = None
    store: bool = True
    metadata: Annotated[dict[Name, Name], Field(max_length=MAX_METADATA)] | None = None
    user: Name | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping context) is not implemented
    # loraplex extension: a weighted mix of active adapters, as on chat (api/mix.py; docs/endpoints.md)
    adapters: AdapterMix | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_unused_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            k: v
            for k, v in data.items()
            if not (k in UNUSED_DEFAULTS and any(v == d and type(v) is type(d) for d in UNUSED_DEFAULTS[k]))
        }

    @field_validator("adapters")
    @classmethod
    def _distinct_adapters(cls, v: list[AdapterWeight] | None) -> list[AdapterWeight] | None:
        return distinct_adapters(v)

    def chat_messages(self) -> list[dict[str, Any]]:
        """This request's `input` as chat messages (the part stored for the next turn)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                out.append(assistant_call(item.call_id, item.name, item.arguments))
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response runs as, after the earlier turns `history`."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.chat_messages(),
            "max_completion_tokens": self.max_output_tokens,
            "user": self.user,
        }
        if self.adapters is not None:
            body["adapters"] = [a.model_dump() for a in self.adapters]
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.name is None:
                raise APIError(400, "text.format.name: required for json_schema", param="text.format.name")
            schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(400, f"input: {where}: {first.get('msg')}", param="input") from exc


def assistant_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """An assistant chat turn that makes one tool call."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's `output` items as the chat turns a follow-up's history holds."""
    out: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            out.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            out.append(assistant_call(item["call_id"], item["name"], item["arguments"]))
    return out
