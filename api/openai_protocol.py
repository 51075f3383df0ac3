"""Request and response schemas of the OpenAI-compatible endpoints (the fields loraplex honours).

Every field has a declared range. The sampling ranges are not restated here: they are read from
`engine.sampling_params.BOUNDS`, the engine's own contract, and `to_sampling_params` is the one place an
OpenAI body becomes `SamplingParams`. Sizes that depend on the server (prompt characters, choices per
request) are checked by `api.serving` against the settings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api.request_fields import check_fields, model_field_names
from engine.lora_request import MAX_MIX_ADAPTERS, MAX_MIX_WEIGHT
from engine.sampling_params import (
    BOUNDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    PRIORITY_BOUND,
    SamplingParams,
)

_LOGPROBS_HI = BOUNDS["logprobs"].hi
assert _LOGPROBS_HI is not None
MAX_LOGPROBS = int(_LOGPROBS_HI)
MAX_PROMPTS = 64  # entries of a list `prompt` (prompts × n is bounded again by the server's settings)
MAX_MESSAGES = 1024
MAX_NAME_CHARS = 256
# A generous static cap on any one string; the server's `max_prompt_chars` is the real prompt limit.
MAX_TEXT_CHARS = 16 * 1024 * 1024
OPENAI_MAX_TEMPERATURE = 2.0


def _bounded(name: str, default: Any, **extra: Any) -> Any:
    """A pydantic Field with the range `BOUNDS[name]` declares."""
    b = BOUNDS[name]
    lo: dict[str, Any] = {"gt": b.lo} if b.lo_open else {"ge": b.lo}
    return Field(default=default, le=b.hi, **lo, **extra)


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class RequestBody(BaseModel):
    """Base of every request body: JSON types are taken strictly, so `true` is not 1, `"10"` is not 10,
    `1` is not `true` and `2.0` is not the integer 2 (400 naming the field). An integer where a float is
    expected stays valid (`"temperature": 1` is how JSON writes 1.0)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(RequestBody):
    include_usage: bool = False


# ---- structured output and tools (api/structured.py and api/tool_calls.py give them meaning) -------------

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
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]


class StructuredOutputs(RequestBody):
    """vLLM's `structured_outputs` (exactly one of these); `json` is a JSON schema (object or its text)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)] | None = None
    grammar: Text | None = None  # GBNF (converted) or Lark (api/guided.py)
    json_object: bool | None = None


class AdapterWeight(RequestBody):
    """One member of a weighted adapter mix (the loraplex `adapters` extension)."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
    weight: float = Field(ge=-MAX_MIX_WEIGHT, le=MAX_MIX_WEIGHT, allow_inf_nan=False)

    @field_validator("weight")
    @classmethod
    def _nonzero(cls, v: float) -> float:
        if v == 0.0:
            raise ValueError("must be non-zero (leave the adapter out instead)")
        return v


AdapterMix = Annotated[list[AdapterWeight], Field(min_length=1, max_length=MAX_MIX_ADAPTERS)]


def distinct_adapters(v: list[AdapterWeight] | None) -> list[AdapterWeight] | None:
    """The `adapters` field unchanged, or `ValueError` naming the first adapter that is listed twice."""
    names = [a.name for a in v or []]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"adapter {dup!r} appears twice; list each adapter once with its weight")
    return v


class SamplingFields(RequestBody):
    """The fields both generation endpoints share. A top-level field not declared here is refused with a
    400 naming it, unless `api.request_fields` accepts it (see there)."""

    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    max_tokens: int | None = _bounded("max_tokens", None)
    temperature: float = Field(default=1.0, ge=0.0, le=OPENAI_MAX_TEMPERATURE)
    top_p: float = _bounded("top_p", 1.0)
    top_k: int = _bounded("top_k", -1, description="extension: -1 disables, else keep the k most likely")
    n: int = _bounded("n", 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = Field(default=None)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = _bounded("seed", None)
    ignore_eos: bool = False  # extension
    priority: int = Field(default=0, ge=PRIORITY_BOUND.lo, le=PRIORITY_BOUND.hi)  # extension
    user: Name | None = None
    response_format: ResponseFormat | None = None
    # OpenAI penalties and vLLM sampling extras (ranges: engine.sampling_params.BOUNDS)
    presence_penalty: float = _bounded("presence_penalty", 0.0)
    frequency_penalty: float = _bounded("frequency_penalty", 0.0)
    repetition_penalty: float = _bounded("repetition_penalty", 1.0)
    min_p: float = _bounded("min_p", 0.0)
    min_tokens: int = _bounded("min_tokens", 0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS)] | None = None
    best_of: int | None = _bounded("best_of", None)
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
    max_tokens: int | None = _bounded("max_tokens", 16)
    logprobs: int | None = _bounded("logprobs", None)
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
    max_completion_tokens: int | None = _bounded("max_tokens", None)
    logprobs: bool = False
    top_logprobs: int | None = _bounded("logprobs", None)
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


# ---- responses (declared so the OpenAPI schema says what the routes return) -----------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body every 4xx/5xx carries."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


AdapterName = Annotated[str, Path(max_length=MAX_NAME_CHARS, description="an active adapter's name")]
