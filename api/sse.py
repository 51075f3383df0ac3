"""Server-sent events for streamed completions: one `data: {json}` event per chunk, then `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import cast

from fastapi.responses import StreamingResponse

from api.errors import APIError, error_body
from api.generation import ChoiceUpdate
from api.serving import RequestRun


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def sse_response(
    run: RequestRun,
    render: Callable[[ChoiceUpdate], Iterable[dict]],
    tail: Callable[[], Iterable[dict]],
    encode: Callable[[dict], str] = sse,
    on_error: Callable[[APIError], dict] | None = None,
    done: bool = True,
) -> StreamingResponse:
    """Stream `render(update)` chunks for every update, then `tail()` chunks and `[DONE]`.

    `encode` writes one chunk as an event (default: `sse`), `on_error` the chunk a mid-stream error
    becomes (default: the OpenAI error body), and `done=False` leaves out `[DONE]` (the Responses API
    ends with its `response.completed` event instead).

    The first update is awaited before the response starts, so an error before the first token (bad
    adapter, engine down) still gets a proper status code; a later error becomes an error event.
    Closing the stream (client gone) closes the generation, which aborts its engine requests.
    """
    updates = cast("AsyncGenerator[ChoiceUpdate, None]", run.updates())  # an async generator: aclose()
    try:
        first: ChoiceUpdate | None = await anext(updates)
    except StopAsyncIteration:
        first = None

    async def events() -> AsyncIterator[str]:
        try:
            if first is not None:
                for obj in render(first):
                    yield encode(obj)
                async for up in updates:
                    for obj in render(up):
                        yield encode(obj)
            for obj in tail():
                yield encode(obj)
        except APIError as exc:
            yield encode(on_error(exc) if on_error is not None else error_body(exc.status, exc.message))
        finally:
            await updates.aclose()
        if done:
            yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
