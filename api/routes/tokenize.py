"""`POST /tokenize` and `POST /detokenize` (vLLM's shapes): a prompt or chat messages to token ids, and
token ids back to text, with the served model's tokenizer (an adapter's name is accepted as `model`:
adapters share the base model's tokenizer).

Like the generation routes they need an API key when keys are required (and one that may use the model
named), count against the caller's request-rate limits, check sizes before any tokenizing, and
tokenize in a worker thread.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.chat_template import render_chat
from api.errors import APIError, error_responses
from api.openai_protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatMessage,
    Name,
    RequestBody,
    Text,
    TokenId,
    ToolDef,
)
from api.serving import Target, check_prompt_chars, resolve_target
from api.tool_calls import prompt_text, template_messages
from engine.tokenizer import token_bytes, token_text

router = APIRouter(tags=["tokenizer"])
ERRORS = error_responses(400, 401, 403, 404, 413, 429, 503)


class TokenizeRequest(RequestBody):
    """A `prompt` (completion form) or `messages` (chat form, rendered by the chat template) to tokenize."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None  # chat form only
    add_generation_prompt: bool = True  # chat form: end with the assistant header
    add_special_tokens: bool | None = None  # default: true for `prompt`, false for `messages` (vLLM's)
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: Name | None = None
    tokens: list[TokenId] = Field(max_length=1024**2)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Token ids of `prompt`, or of `messages` under the chat template, with their count and the model's
    context length (`token_strs`: each token's text, when `return_token_strs`)."""
    state = request.app.state.loraplex
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
    if body.tools is not None and body.messages is None:
        raise APIError(400, "'tools' goes with 'messages'", param="tools")
    tokenizer = await _tokenizer(request, body.model)
    if body.prompt is not None:
        check_prompt_chars(state, [body.prompt])
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await run_in_threadpool(_encode, tokenizer, body.prompt, special)
    else:
        assert body.messages is not None
        messages = template_messages(body.messages)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        check_prompt_chars(state, [prompt_text(messages, tools)], param="messages")
        special = bool(body.add_special_tokens)
        ids = await run_in_threadpool(
            _encode_chat, tokenizer, messages, tools, body.add_generation_prompt, special
        )
    strs = await run_in_threadpool(_token_strs, tokenizer, ids) if body.return_token_strs else None
    info = state.client.info
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """The text of the token ids `tokens` (400 for an id outside the vocabulary)."""
    state = request.app.state.loraplex
    tokenizer = await _tokenizer(request, body.model)
    vocab = state.client.info.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}]: token ids must be in [0, {vocab})", param="tokens")
    text = await run_in_threadpool(tokenizer.decode, body.tokens)
    return {"prompt": text}


async def _tokenizer(request: Request, model: str | None) -> Any:
    """The tokenizer for `model` (base or an active adapter the caller may use: 401/403/404 as on the
    generation routes), after charging one request to the caller's limits (429 over one)."""
    state = request.app.state.loraplex
    target = await resolve_target(request, model)
    await _admit(state, request, target)
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="model")
    return state.tokenizer


async def _admit(state, request: Request, target: Target) -> None:
    """Count this request under the caller's and adapter's limits (it uses no generation tokens)."""
    if state.usage is None:
        return
    grant = await state.usage.admit(target.key, target.adapter, 0)
    if grant.headers:
        request.state.ratelimit_headers = grant.headers
    grant.release(0)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> list[int]:
    """Token ids of the chat template's rendering of `messages` (what `/v1/chat/completions` feeds the
    model when `add_generation_prompt` and not `add_special_tokens`)."""
    text = render_chat(tokenizer, messages, tools, add_generation_prompt)
    return _encode(tokenizer, text, add_special_tokens)


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's vocabulary string where the tokenizer has one, else the text of its bytes."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        return [str(t) for t in convert(ids)]
    return [token_text(token_bytes(tokenizer, i)) for i in ids]
