"""`POST /v1/completions` and `POST /v1/adapters/{name}/completions` (OpenAI text completions)."""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.errors import APIError, error_responses
from api.generation import Choice, ChoiceUpdate, Generation, TokenLogprob
from api.guided import guided_job
from api.openai_protocol import AdapterName, CompletionRequest, CompletionResponse
from api.schema_check import schema_checker
from api.serving import (
    RequestRun,
    check_choices,
    finish_reason,
    resolve_target,
    sampling_params,
    tokenize_prompts,
    usage,
)
from api.sse import sse_response
from api.structured import response_format_job

router = APIRouter(tags=["openai"])
ERRORS = error_responses(400, 401, 403, 404, 413, 429, 500, 503) | {
    200: {
        "content": {"text/event-stream": {}},
        "description": "JSON, or with `stream: true` server-sent events",
    }
}


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion (`stream: true` answers with server-sent events of the same chunks)."""
    return await _complete(body, request, None)


@router.post("/v1/adapters/{name}/completions", response_model=CompletionResponse, responses=ERRORS)
async def adapter_completions(name: AdapterName, body: CompletionRequest, request: Request):
    """Text completion on adapter `name` (the body's `model` is ignored)."""
    return await _complete(body, request, name)


async def _complete(body: CompletionRequest, request: Request, adapter: str | None):
    state = request.app.state.loraplex
    target = await resolve_target(request, body.model, adapter, body.adapters)
    raw_prompts = body.prompts()
    if body.suffix is not None:
        raise APIError(
            400, "suffix is not supported: this model has no fill-in-the-middle template", param="suffix"
        )
    check_choices(state, len(raw_prompts), body.best_of or body.n)
    fmt = response_format_job(body.response_format)
    fmt = guided_job(body, other=fmt is not None) or fmt
    prompts = await tokenize_prompts(state, raw_prompts)
    params = sampling_params(state, body, prompts, body.max_tokens, body.logprobs)
    if fmt is not None:
        params = msgspec.structs.replace(params, structured=fmt.spec)
    gen = Generation(state.client, state.tokenizer, prompts, params, target.lora, body.priority)
    n_prompt = sum(len(p) for p in prompts)
    run = RequestRun(request, target, gen, n_prompt)
    if fmt is not None:  # compiled once the request is within its limits, off the event loop
        await run.admit()
        await run.prepare(schema_checker(state).check([fmt]))
    created = int(time.time())
    head = {
        "id": f"cmpl-{gen.id}",
        "object": "text_completion",
        "created": created,
        "model": target.model_name,
    }
    echo = [p if isinstance(p, str) else _decode(state, p) for p in raw_prompts] if body.echo else None
    prompt_ids = prompts if body.return_token_ids else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream(run, head, echo, include_usage, n_prompt, prompt_ids)
    await run.collect()
    choices = [
        _choice_json(c, echo[c.prompt_index] if echo is not None else "", body.logprobs)
        | ({"prompt_token_ids": prompt_ids[c.prompt_index]} if prompt_ids is not None else {})
        for c in gen.choices
    ]
    return JSONResponse(head | {"choices": choices, "usage": usage(gen, n_prompt)})


def _decode(state, ids: list[int]) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


def _choice_json(c: Choice, echo: str, logprobs: int | None) -> dict:
    out = {
        "index": c.index,
        "text": echo + c.text,
        "logprobs": None,
        "finish_reason": finish_reason(c.finish_reason),
        "token_ids": c.token_ids,
    }
    if logprobs is not None:
        out["logprobs"] = _logprobs_json(c.logprobs, len(echo))
    return out


def _logprobs_json(lps: list[TokenLogprob], offset: int = 0) -> dict:
    """Legacy completions logprobs: per token its text, logprob, the chosen + top-k tokens, and where its
    text starts in the returned text (`offset`: characters before the generated text, e.g. the echo)."""
    return {
        "tokens": [lp.token.text for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{lp.token.text: lp.logprob} | {t.text: v for t, v in lp.top} for lp in lps],
        "text_offset": [offset + lp.text_offset for lp in lps],
    }


async def _stream(
    run: RequestRun,
    head: dict,
    echo: list[str] | None,
    include_usage: bool,
    n_prompt: int,
    prompt_ids: list[list[int]] | None,
):
    echoed: set[int] = set()
    started: set[int] = set()

    def render(up: ChoiceUpdate) -> list[dict]:
        c, text = up.choice, up.text
        prefix = len(echo[c.prompt_index]) if echo is not None else 0
        if echo is not None and c.index not in echoed:
            echoed.add(c.index)
            text = echo[c.prompt_index] + text
        if not text and not up.finished and not up.token_ids:
            return []
        choice = {
            "index": c.index,
            "text": text,
            "logprobs": _logprobs_json(up.logprobs, prefix) if run.gen.params.logprobs is not None else None,
            "finish_reason": finish_reason(c.finish_reason) if up.finished else None,
            "token_ids": up.token_ids,
        }
        if prompt_ids is not None and c.index not in started:  # return_token_ids: once per choice
            choice["prompt_token_ids"] = prompt_ids[c.prompt_index]
        started.add(c.index)
        return [head | {"choices": [choice]}]

    def tail() -> list[dict]:
        return [head | {"choices": [], "usage": usage(run.gen, n_prompt)}] if include_usage else []

    return await sse_response(run, render, tail)
