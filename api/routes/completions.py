"""`POST /v1/completions` and `POST /v1/adapters/{name}/completions` (OpenAI text completions)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.errors import APIError
from api.generation import Choice, ChoiceUpdate, Generation, TokenLogprob
from api.openai_protocol import CompletionRequest
from api.serving import RequestRun, finish_reason, resolve_target, sampling_spec, tokenize, usage
from api.sse import sse_response

router = APIRouter(tags=["openai"])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _complete(body, request, None)


@router.post("/v1/adapters/{name}/completions")
async def adapter_completions(name: str, body: CompletionRequest, request: Request):
    return await _complete(body, request, name)


async def _complete(body: CompletionRequest, request: Request, adapter: str | None):
    state = request.app.state.loraplex
    target = await resolve_target(request, body.model, adapter)
    raw_prompts = body.prompts()
    if not raw_prompts:
        raise APIError(400, "prompt is empty", param="prompt")
    prompts = [tokenize(state, p) for p in raw_prompts]
    spec = sampling_spec(state, body, prompts, body.max_tokens, body.logprobs)
    gen = Generation(state.client, state.tokenizer, prompts, spec, body.n, target.lora)
    n_prompt = sum(len(p) for p in prompts)
    run = RequestRun(request, target, gen, n_prompt)
    created = int(time.time())
    head = {
        "id": f"cmpl-{gen.id}",
        "object": "text_completion",
        "created": created,
        "model": target.model_name,
    }
    echo = [p if isinstance(p, str) else _decode(state, p) for p in raw_prompts] if body.echo else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream(run, head, echo, include_usage, n_prompt)
    await run.collect()
    choices = [
        _choice_json(c, c.text if echo is None else echo[c.prompt_index] + c.text, body.logprobs)
        for c in gen.choices
    ]
    return JSONResponse(head | {"choices": choices, "usage": usage(gen, n_prompt)})


def _decode(state, ids: list[int]) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


def _choice_json(c: Choice, text: str, logprobs: int | None) -> dict:
    out = {
        "index": c.index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason(c.finish_reason),
        "token_ids": c.token_ids,
    }
    if logprobs is not None:
        out["logprobs"] = _logprobs_json(c.logprobs)
    return out


def _logprobs_json(lps: list[TokenLogprob], offset: int = 0) -> dict:
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{lp.token: lp.logprob} | dict(lp.top) for lp in lps],
        "text_offset": offsets,
    }


async def _stream(run: RequestRun, head: dict, echo: list[str] | None, include_usage: bool, n_prompt: int):
    echoed: set[int] = set()

    def render(up: ChoiceUpdate) -> list[dict]:
        c, text = up.choice, up.text
        if echo is not None and c.index not in echoed:
            echoed.add(c.index)
            text = echo[c.prompt_index] + text
        if not text and not up.finished and not up.token_ids:
            return []
        choice = {
            "index": c.index,
            "text": text,
            "logprobs": _logprobs_json(up.logprobs) if run.gen.spec.logprobs is not None else None,
            "finish_reason": finish_reason(c.finish_reason) if up.finished else None,
            "token_ids": up.token_ids,
        }
        return [head | {"choices": [choice]}]

    def tail() -> list[dict]:
        return [head | {"choices": [], "usage": usage(run.gen, n_prompt)}] if include_usage else []

    return await sse_response(run, render, tail)
