"""`/admin/playground`: one prompt against several adapters (and the base model), streamed side by side.

The page's script opens one `POST /admin/playground/generate` per chosen target at once; each answers an
SSE stream of `{"text": ...}` events, then `{"done": true, ...}` (or `{"error": ...}`). The proxy runs
the generation in-process through the API's serving code (so it shows in metrics and traffic), with the
admin session standing in for an API key.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from admin_ui.session import CsrfSession, Session
from admin_ui.templating import render
from api.deps import StateDep
from api.errors import APIError
from api.generation import ChoiceUpdate, Generation
from api.openai_protocol import CompletionRequest
from api.serving import RequestRun, Target, adapter_target, sampling_params, tokenize_prompts
from api.sse import sse
from api.state import AppState

router = APIRouter(prefix="/admin/playground", include_in_schema=False)


class PlaygroundRun(BaseModel):
    """One column of the playground: `adapter` None means the base model."""

    adapter: str | None = None
    prompt: str = Field(min_length=1, max_length=20000)
    max_tokens: int = Field(default=64, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)


@router.get("")
async def playground_page(request: Request, state: StateDep, session: Session) -> Response:
    adapters = sorted(state.follower.snapshot())
    context = {"title": "Playground", "adapters": adapters, "base": state.settings.served_model_name}
    return render(request, "playground.html", context, session, active="playground")


async def _target(state: AppState, adapter: str | None) -> Target:
    """The base model, or the active adapter `adapter` (404 when unknown or inactive)."""
    if adapter is None:
        return Target(state.settings.served_model_name, None, "admin")
    target = await adapter_target(state, adapter)
    target.key = "admin"
    return target


@router.post("/generate")
async def generate(request: Request, state: StateDep, _: CsrfSession) -> Response:
    """Stream one completion of `prompt` by `adapter` (or the base model) as server-sent events."""
    try:
        run_req = PlaygroundRun.model_validate(await request.json())
    except (ValidationError, ValueError) as exc:
        return JSONResponse({"error": {"message": f"invalid playground request: {exc}"}}, 400)
    try:
        target = await _target(state, run_req.adapter)
        body = CompletionRequest(
            prompt=run_req.prompt, max_tokens=run_req.max_tokens, temperature=run_req.temperature
        )
        prompt = (await tokenize_prompts(state, [run_req.prompt]))[0]
        params = sampling_params(state, body, [prompt], body.max_tokens, None)
    except APIError as exc:
        return JSONResponse({"error": {"message": exc.message}}, exc.status)
    gen = Generation(state.client, state.tokenizer, [prompt], params, target.lora)
    run = RequestRun(request, target, gen, len(prompt))

    async def events() -> AsyncIterator[str]:
        t0 = time.monotonic()
        updates = cast(AsyncGenerator[ChoiceUpdate, None], run.updates())  # an async generator
        try:
            async for up in updates:
                if up.text:
                    yield sse({"text": up.text})
                if up.finished:
                    seconds = time.monotonic() - t0
                    tokens = len(up.choice.token_ids)
                    yield sse(
                        {
                            "done": True,
                            "finish_reason": up.choice.finish_reason,
                            "tokens": tokens,
                            "seconds": round(seconds, 3),
                        }
                    )
        except APIError as exc:
            yield sse({"error": exc.message})
        finally:
            await updates.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
