"""`POST /v1/responses` (the OpenAI Responses API, run on the chat path), `GET` and `DELETE
/v1/responses/{id}` (stored answers), and `POST /v1/adapters/{name}/responses`.

A response is stored (unless `store: false`) in this server's memory, bounded by
`responses_max_stored`, `responses_max_stored_chars` and `responses_max_age_seconds`, so a follow-up
can name it as `previous_response_id`; only the API key that created it (or an admin) can read or continue it.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse

from api.auth import authenticate
from api.errors import APIError, error_responses
from api.openai_protocol import MAX_NAME_CHARS, AdapterName
from api.response_store import ResponseStore
from api.responses_output import (
    ResponseEvents,
    event_text,
    finished_response,
    output_items,
    response_base,
)
from api.responses_protocol import ResponsesRequest, output_messages
from api.routes.chat import ChatRun, prepare_chat, reply_message
from api.serving import finish_reason
from api.sse import sse_response
from api.usage.service import key_name

router = APIRouter(tags=["openai"])
ERRORS = error_responses(400, 401, 403, 404, 413, 429, 500, 503) | {
    200: {
        "content": {"text/event-stream": {}},
        "description": "the `response` object, or with `stream: true` server-sent events",
    }
}
ResponseId = Path(max_length=MAX_NAME_CHARS, description="a stored response's id")


@router.post("/v1/responses", responses=ERRORS)
async def create_response(body: ResponsesRequest, request: Request):
    """OpenAI Responses API: text or message `input`, `instructions`, function tools, streaming events,
    `previous_response_id` (a stored answer this one continues)."""
    return await _respond(body, request, None)


@router.post("/v1/adapters/{name}/responses", responses=ERRORS)
async def adapter_create_response(name: AdapterName, body: ResponsesRequest, request: Request):
    """A response from adapter `name` (the body's `model` is ignored)."""
    return await _respond(body, request, name)


@router.get("/v1/responses/{response_id}", responses=error_responses(401, 404))
async def get_response(request: Request, response_id: str = ResponseId) -> JSONResponse:
    """A stored response (404 once it is no longer kept, or for another API key's)."""
    owner, admin = await _caller(request)
    item = response_store(request).get(response_id, owner, admin)
    if item is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(item.body)


@router.delete("/v1/responses/{response_id}", responses=error_responses(401, 404))
async def delete_response(request: Request, response_id: str = ResponseId) -> JSONResponse:
    """Forget a stored response."""
    owner, admin = await _caller(request)
    if not response_store(request).delete(response_id, owner, admin):
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def response_store(request: Request) -> ResponseStore:
    """This server's store of responses (made on first use, bounded by the settings)."""
    app = request.app.state
    store = getattr(app, "response_store", None)
    if store is None:
        settings = app.loraplex.settings
        store = app.response_store = ResponseStore(
            settings.responses_max_stored,
            settings.responses_max_age_seconds,
            settings.responses_max_stored_chars,
        )
    return store


async def _caller(request: Request) -> tuple[str | None, bool]:
    """Who asks (the API key's name, "admin" or None) and whether they may read every response
    (401 without a valid key when keys are required)."""
    key = await authenticate(request)
    admin = key == "admin" or (key is not None and bool(key.is_admin))
    return key_name(key), admin


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")


async def _respond(body: ResponsesRequest, request: Request, adapter: str | None):
    store = response_store(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        owner, admin = await _caller(request)
        previous = store.get(body.previous_response_id, owner, admin)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.messages
    chat = await prepare_chat(body.chat_request(history), request, adapter)
    run, gen = chat.run, chat.run.gen
    base = response_base(body, f"resp_{gen.id}", int(time.time()), run.target.model_name)
    turns = history + body.chat_messages()

    def keep(response: dict[str, Any]) -> None:
        if body.store:
            store.put(
                response["id"],
                response,
                turns + output_messages(response["output"]),
                key_name(run.target.key),
            )

    if body.stream:
        return await _stream(chat, base, keep)
    await run.collect()
    c = gen.choices[0]
    finish = finish_reason(c.finish_reason)
    output = output_items(reply_message(chat.mode, c.text, finish)["message"])
    response = finished_response(base, output, finish, gen, chat.num_prompt_tokens)
    keep(response)
    return JSONResponse(response)


async def _stream(chat: ChatRun, base: dict[str, Any], keep):
    events = ResponseEvents(base, chat.mode)
    finish: list[str | None] = [None]

    def render(up) -> list[dict[str, Any]]:
        if up.finished:
            finish[0] = finish_reason(up.choice.finish_reason)
        return events.push(up.text, up.finished, finish[0])

    def tail() -> list[dict[str, Any]]:
        out = events.start()
        response = finished_response(base, events.output, finish[0], chat.run.gen, chat.num_prompt_tokens)
        keep(response)
        kind = "incomplete" if response["status"] == "incomplete" else "completed"
        return [*out, events.event(kind, response=response)]

    def on_error(exc: APIError) -> dict[str, Any]:
        return events.error(exc.status, exc.message, exc.param, exc.code)

    return await sse_response(chat.run, render, tail, encode=event_text, on_error=on_error, done=False)
