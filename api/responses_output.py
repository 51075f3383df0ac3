"""The Responses API's answer: the `response` object, its `output` items, and the streamed events.

`output` holds a `message` item (one `output_text` part) for a text reply, or a `function_call` item
when the chat tool-call path found a call. A stream sends, as OpenAI does (and the official client
parses): `response.created`, `response.in_progress`, then per item `response.output_item.added`, for
text `response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, for a call `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`, then `response.output_item.done`, and last
`response.completed` (or `response.incomplete` when `max_output_tokens` cut the reply), each event with
its `sequence_number`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from api.generation import Generation
from api.responses_protocol import ResponsesRequest
from api.tool_calls import CallStream, ToolMode


def response_base(body: ResponsesRequest, response_id: str, created: int, model: str) -> dict[str, Any]:
    """The `response` object of `body` before it has run (`status: in_progress`, no output yet)."""
    choice = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": dict(body.metadata or {}),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else (
            choice or ("auto" if body.tools else "none")
        ),
        "tools": [t.model_dump() for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
    }  # fmt: skip


def finished_response(
    base: dict[str, Any], output: list[dict[str, Any]], finish: str | None, gen: Generation, n_prompt: int
) -> dict[str, Any]:
    """`base` once its generation ended with `finish`: output, status and usage filled in."""
    completion = sum(len(c.token_ids) for c in gen.choices)
    cached = min(max((c.num_cached_tokens for c in gen.choices), default=0), n_prompt)
    cut = finish == "length"
    return base | {
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": {
            "input_tokens": n_prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + completion,
        },
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The `output` items of a chat reply `message` ({"content"} or {"tool_calls"})."""
    if message.get("tool_calls"):
        return [_call_item(c, c["function"]["arguments"], "completed") for c in message["tool_calls"]]
    return [_message_item(message.get("content") or "", "completed")]


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    item_id = item_id or f"msg_{uuid.uuid4().hex}"
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(
    call: dict[str, Any], arguments: str, status: str, item_id: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": arguments,
        "status": status,
    }


def event_text(event: dict[str, Any]) -> str:
    """One server-sent event, named by its type."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class ResponseEvents:
    """The stream events of one response, from its text as it grows (a `CallStream` under the request's
    tool mode decides what is text and what is a call)."""

    def __init__(self, base: dict[str, Any], mode: ToolMode) -> None:
        self.base, self.calls = base, CallStream(mode)
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.item: dict[str, Any] | None = None  # the item streaming now
        self.text = ""  # of the streaming item: its text or arguments
        self.started = False

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        e = {"type": f"response.{kind}", "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def start(self) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress` (once)."""
        if self.started:
            return []
        self.started = True
        return [self.event("created", response=self.base), self.event("in_progress", response=self.base)]

    def push(self, piece: str, finished: bool, finish: str | None) -> list[dict[str, Any]]:
        """The events after `piece` of text arrived (`finished`: the reply ended, with `finish`)."""
        out = self.start()
        for delta in self.calls.push(piece, finished, finish):
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    out += self._close()
                    out += self._open(_call_item(call, "", "in_progress"))
                args = call.get("function", {}).get("arguments", "")
                if args:
                    self.text += args
                    out.append(self.event("function_call_arguments.delta", **self._at(), delta=args))
        if finished:
            if self.item is None and not self.output:
                out += self._text("")  # an empty reply is still a message, as in the JSON answer
            out += self._close()
        return out

    def error(self, status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
        e = self.event("error", code=code or str(status), message=message, param=param)
        e["type"] = "error"
        return e

    def _at(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.item, self.text = item, ""
        return [self.event("output_item.added", output_index=len(self.output), item=item)]

    def _text(self, piece: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.item is None or self.item["type"] != "message":
            out += self._close()
            out += self._open(_message_item("", "in_progress"))
            out.append(self.event("content_part.added", **self._at(), content_index=0, part=_text_part("")))
        if piece:
            self.text += piece
            out.append(
                self.event("output_text.delta", **self._at(), content_index=0, delta=piece, logprobs=[])
            )
        return out

    def _close(self) -> list[dict[str, Any]]:
        item = self.item
        if item is None:
            return []
        at, out = self._at(), []
        if item["type"] == "message":
            done = _message_item(self.text, "completed", item["id"])
            out.append(self.event("output_text.done", **at, content_index=0, text=self.text, logprobs=[]))
            out.append(self.event("content_part.done", **at, content_index=0, part=_text_part(self.text)))
        else:
            done = item | {"arguments": self.text, "status": "completed"}
            out.append(
                self.event("function_call_arguments.done", **at, name=item["name"], arguments=self.text)
            )
        out.append(self.event("output_item.done", output_index=at["output_index"], item=done))
        self.output.append(done)
        self.item, self.text = None, ""
        return out
