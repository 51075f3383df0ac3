"""Request and response schemas of the OpenAI-compatible endpoints (the fields loraplex honours).

The shared field types and limits are api/protocol_fields.py, structured output and tools
api/protocol_tools.py, the response bodies api/protocol_responses.py; every name is importable from
here as before.

Every field has a declared range. The sampling ranges are not restated here: they are read from
`engine.sampling_params.BOUNDS`, the engine's own contract, and `to_sampling_params` is the one place an
OpenAI body becomes `SamplingParams`. Sizes that depend on the server (prompt characters, choices per
request) are checked by `api.serving` against the settings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import ConfigDict, Field, field_validator, model_validator

from api.protocol_adapters import AdapterMix, AdapterWeight, distinct_adapters
from api.protocol_fields import (
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPTS,
    MAX_TEXT_CHARS,
    OPENAI_MAX_TEMPERATURE,
    Name,
    RequestBody,
    StopString,
    StreamOptions,
    Text,
    TokenId,
    bounded,
)
from api.protocol_responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
)
from api.protocol_tools import (
    MAX_GUIDED_CHOICES,
    MAX_TOOLS,
    FunctionCall,
    FunctionDef,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    ToolCall,
    ToolDef,
    ToolName,
)
from api.request_fields import check_fields, model_field_names
from engine.sampling_params import (
    BOUNDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    PRIORITY_BOUND,
    SamplingParams,
)

_bounded = bounded  # the name api/responses_protocol.py imports

__all__ = [
    "MAX_GUIDED_CHOICES",
    "MAX_LOGPROBS",
    "MAX_MESSAGES",
    "MAX_NAME_CHARS",
    "MAX_PROMPTS",
    "MAX_TEXT_CHARS",
    "MAX_TOOLS",
    "OPENAI_MAX_TEMPERATURE",
    "AdapterMix",
    "AdapterName",
    "AdapterWeight",
    "AssistantMessage",
    "BadWord",
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "ChoiceLogprobs",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorDetail",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDef",
    "FunctionName",
    "JsonSchemaFormat",
    "LoadLoRARequest",
    "ModelCard",
    "ModelList",
    "Name",
    "NamedToolChoice",
    "RequestBody",
    "ResponseFormat",
    "SamplingFields",
    "StopString",
    "StreamOptions",
    "StructuredOutputs",
    "Text",
    "TokenId",
    "TokenLogprobEntry",
    "ToolCall",
    "ToolDef",
    "ToolName",
    "TopLogprob",
    "UnloadLoRARequest",
    "Usage",
    "distinct_adapters",
]


BadWord = Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]


class SamplingFields(RequestBody):
    """The fields both generation endpoints share. A top-level field not declared here is refused with a
    400 naming it, unless `api.request_fields` accepts it (see there)."""

    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    max_tokens: int | None = bounded("max_tokens", None)
    temperature: float = Field(default=1.0, ge=0.0, le=OPENAI_MAX_TEMPERATURE)
    top_p: float = bounded("top_p", 1.0)
    top_k: int = bounded("top_k", -1, description="extension: -1 disables, else keep the k most likely")
    n: int = bounded("n", 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = Field(default=None)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = bounded("seed", None)
    ignore_eos: bool = False  # extension
    priority: int = Field(default=0, ge=PRIORITY_BOUND.lo, le=PRIORITY_BOUND.hi)  # extension
    user: Name | None = None
    response_format: ResponseFormat | None = None
    # OpenAI penalties and vLLM sampling extras (ranges: engine.sampling_params.BOUNDS)
    presence_penalty: float = bounded("presence_penalty", 0.0)
    frequency_penalty: float = bounded("frequency_penalty", 0.0)
    repetition_penalty: float = bounded("repetition_penalty", 1.0)
    min_p: float = bounded("min_p", 0.0)
    min_tokens: int = bounded("min_tokens", 0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS)] | None = None
    best_of: int | None = bounded("best_of", None)
    return_token_ids: bool = False  # vLLM: choices carry `token_ids`, and `prompt_token_ids` is returned
    # vLLM's structured-output fields (api/guided.py maps them onto the llguidance path)
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None
    # loraplex extension: a weighted mix of active adapters (api/mix.py; docs/endpoints.md)
    adapters: AdapterMix | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        check_fields(data, model_field_names(cls))
        return data

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bound = BOUNDS["logit_bias"]
        for key, value in (v or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
                raise ValueError(
                    f"keys must be token ids (decimal strings in [0, {MAX_TOKEN_ID}]), got {key!r}"
                )
            if not bound.holds(value):
                raise ValueError(f"values must be in {bound.describe()}, got {value} for token {key}")
        return v

    @field_validator("adapters")
    @classmethod
    def _distinct_adapters(cls, v: list[AdapterWeight] | None) -> list[AdapterWeight] | None:
        return distinct_adapters(v)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be -1 (disabled) or at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stops

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's `SamplingParams` for this request (the one OpenAI -> engine map).

        `max_tokens` is the resolved completion budget and `logprobs` the number of top tokens per
        position (None: no log-probabilities); `n` fans out with `SamplingParams.choices()`.
        """
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            bad_words=list(self.bad_words or []),
        )


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)
        ]
    )
    max_tokens: int | None = bounded("max_tokens", 16)
    logprobs: int | None = bounded("logprobs", None)
    echo: bool = False
    suffix: Text | None = None  # refused when set: no model here has a fill-in-the-middle template

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(RequestBody):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant turns
    tool_call_id: Name | None = None  # tool turns: the call answered
    name: Name | None = None

    def text(self) -> str:
        """Message content as plain text (text parts of multi-part content joined)."""
        if isinstance(self.content, list):
            return "".join(
                p["text"] for p in self.content if p.get("type") == "text" and isinstance(p.get("text"), str)
            )
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = bounded("max_tokens", None)
    logprobs: bool = False
    top_logprobs: int | None = bounded("logprobs", None)
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; at most one call per choice is made

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class LoadLoRARequest(RequestBody):
    lora_name: Name
    lora_path: Annotated[str, Field(max_length=4096)]


class UnloadLoRARequest(RequestBody):
    lora_name: Name


AdapterName = Annotated[str, Path(max_length=MAX_NAME_CHARS, description="an active adapter's name")]
