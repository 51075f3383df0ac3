"""`POST /v1/chat/completions` and `POST /v1/adapters/{name}/chat/completions` (OpenAI chat)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.chat_template import render_chat
from api.errors import APIError, error_responses
from api.generation import ChoiceUpdate, Generation, TokenInfo, TokenLogprob
from api.guided import guided_job
from api.openai_protocol import AdapterName, ChatCompletionRequest, ChatCompletionResponse
from api.schema_check import schema_checker
from api.serving import (
    RequestRun,
    check_choices,
    check_prompt_chars,
    finish_reason,
    resolve_target,
    sampling_params,
    usage,
)
from api.sse import sse_response
from api.structured import response_format_job
from api.tool_calls import (
    CallStream,
    ToolMode,
    parse_call,
    prompt_text,
    template_messages,
    template_tools,
    tool_mode,
)

router = APIRouter(tags=["openai"])
ERRORS = error_responses(400, 401, 403, 404, 413, 429, 500, 503) | {
    200: {
        "content": {"text/event-stream": {}},
        "description": "JSON, or with `stream: true` server-sent events",
    }
}


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completion (`stream: true` answers with server-sent `chat.completion.chunk`s)."""
    return await _chat(body, request, None)


@router.post("/v1/adapters/{name}/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def adapter_chat_completions(name: AdapterName, body: ChatCompletionRequest, request: Request):
    """Chat completion on adapter `name` (the body's `model` is ignored)."""
    return await _chat(body, request, name)


@dataclass(slots=True)
class ChatRun:
    """A chat request ready to run: its `RequestRun`, tool handling, prompt size and whether it asked
    for log-probabilities (`top`: the number of top tokens, None when not)."""

    run: RequestRun
    mode: ToolMode
    num_prompt_tokens: int
    top: int | None


async def prepare_chat(body: ChatCompletionRequest, request: Request, adapter: str | None) -> ChatRun:
    """Resolve, check, render and tokenize a chat request (off the event loop) and compile its schemas
    once it is within its limits: everything before generation, shared by `/v1/chat/completions` and
    `/v1/responses`."""
    state = request.app.state.loraplex
    target = await resolve_target(request, body.model, adapter, body.adapters)
    if state.tokenizer is None:
        raise APIError(
            400,
            "chat needs a tokenizer, and this model has none; use /v1/completions with token ids",
            param="messages",
        )
    check_choices(state, 1, body.best_of or body.n)
    fmt = response_format_job(body.response_format)
    mode = tool_mode(body, fmt)
    fmt = guided_job(body, other=mode.spec is not None or fmt is not None) or fmt
    jobs = mode.jobs if mode.spec is not None or fmt is None else [*mode.jobs, fmt]
    spec = mode.spec or (fmt.spec if fmt is not None else None)
    messages = template_messages(body.messages)
    tools = template_tools(body)
    check_prompt_chars(state, [prompt_text(messages, tools)], param="messages")
    ids = await run_in_threadpool(_render_and_encode, state.tokenizer, messages, tools)
    if not ids:
        raise APIError(400, "messages render to an empty prompt", param="messages")
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(state, body, [ids], body.token_limit(), top)
    if spec is not None:
        params = msgspec.structs.replace(params, structured=spec)
    gen = Generation(state.client, state.tokenizer, [ids], params, target.lora, body.priority)
    run = RequestRun(request, target, gen, len(ids))
    if jobs:  # compiled once the request is within its limits, off the event loop
        await run.admit()
        await run.prepare(schema_checker(state).check(jobs))
    return ChatRun(run, mode, len(ids), top)


async def _chat(body: ChatCompletionRequest, request: Request, adapter: str | None):
    chat = await prepare_chat(body, request, adapter)
    run, mode, top, n_prompt, gen = chat.run, chat.mode, chat.top, chat.num_prompt_tokens, chat.run.gen
    head = {"id": f"chatcmpl-{gen.id}", "created": int(time.time()), "model": run.target.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream(run, head, include_usage, n_prompt, top is not None, mode, body.return_token_ids)
    await run.collect()
    choices = [
        reply_message(mode, c.text, finish_reason(c.finish_reason))
        | {
            "index": c.index,
            "logprobs": {"content": _content_logprobs(c.logprobs)} if top is not None else None,
        }
        | ({"token_ids": c.token_ids} if body.return_token_ids else {})
        for c in gen.choices
    ]
    extra = {"prompt_token_ids": gen.prompts[0]} if body.return_token_ids else {}
    return JSONResponse(
        head | {"object": "chat.completion", "choices": choices, "usage": usage(gen, n_prompt)} | extra
    )


def _render_and_encode(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Prompt token ids of `messages` (and `tools`) under the chat template (runs in a worker thread)."""
    return tokenizer.encode(render_chat(tokenizer, messages, tools), add_special_tokens=False)


def reply_message(mode: ToolMode, text: str, finish: str | None) -> dict:
    """`message` and `finish_reason` of a finished choice: a tool call when the tool mode finds one in a
    reply that ended by itself, else the text."""
    call = parse_call(text, mode.tools) if mode.active and finish == "stop" else None
    if call is not None:
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"message": message, "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": text}, "finish_reason": finish}


def _content_logprobs(lps: list[TokenLogprob]) -> list[dict]:
    """Chat logprobs: each token with its own bytes and the k most likely tokens at its position."""

    def entry(token: TokenInfo, lp: float) -> dict:
        return {"token": token.text, "logprob": lp, "bytes": list(token.raw)}

    return [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


async def _stream(
    run: RequestRun,
    head: dict,
    include_usage: bool,
    n_prompt: int,
    logprobs: bool,
    mode: ToolMode,
    token_ids: bool = False,
):
    """`token_ids` (vLLM's return_token_ids): the first chunk of each choice carries `prompt_token_ids`,
    and each chunk's choice the `token_ids` that arrived with it."""
    chunk = head | {"object": "chat.completion.chunk"}
    started: set[int] = set()
    calls: dict[int, CallStream] = {}
    pending_ids: dict[int, list[int]] = {}

    def choice(index: int, delta: dict, lp: dict | None = None, finish: str | None = None) -> dict:
        entry = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if token_ids:
            entry["token_ids"] = pending_ids.pop(index, [])
        return chunk | {"choices": [entry]}

    def render(up: ChoiceUpdate) -> list[dict]:
        c, out = up.choice, []
        if c.index not in started:
            started.add(c.index)
            first = choice(c.index, {"role": "assistant", "content": ""})
            if token_ids:
                first["prompt_token_ids"] = run.gen.prompts[c.prompt_index]
            out.append(first)
        if token_ids:
            pending_ids.setdefault(c.index, []).extend(up.token_ids)
        finish = finish_reason(c.finish_reason) if up.finished else None
        if mode.active:
            stream = calls.setdefault(c.index, CallStream(mode))
            deltas = stream.push(up.text, up.finished, finish)
            if logprobs and up.logprobs:  # the tokens' log-probabilities, whether they end up text or call
                out.append(choice(c.index, {}, {"content": _content_logprobs(up.logprobs)}))
            out.extend(choice(c.index, d) for d in deltas)
            if up.finished:
                out.append(
                    choice(
                        c.index, {}, finish="tool_calls" if stream.is_call and finish == "stop" else finish
                    )
                )
            return out
        if up.text or up.logprobs:
            lp = {"content": _content_logprobs(up.logprobs)} if logprobs else None
            out.append(choice(c.index, {"content": up.text}, lp))
        if up.finished:
            out.append(choice(c.index, {}, finish=finish))
        return out

    def tail() -> list[dict]:
        return [chunk | {"choices": [], "usage": usage(run.gen, n_prompt)}] if include_usage else []

    return await sse_response(run, render, tail)
