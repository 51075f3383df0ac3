"""`ResponseStore`: the `/v1/responses` answers kept in memory for `previous_response_id` and
`GET /v1/responses/{id}`, bounded by count, by total size (characters of the conversations and
outputs; the oldest go first) and by age.

Each entry remembers its owner (the API key's name, "admin" or None when keys are not required): a
response is found only by the caller that created it or by an admin, so one key cannot read another's
conversation. Nothing survives a restart, and each replica keeps its own.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as returned
    messages: list[dict[str, Any]]  # the conversation up to and including it, as chat turns
    owner: str | None
    stored_at: float
    size: int  # characters it holds (conversation, output, call arguments, instructions, tools)


class ResponseStore:
    def __init__(
        self,
        max_items: int,
        max_age_seconds: float,
        max_chars: int = 64 * 1024**2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_items, self.max_age, self.max_chars, self.clock = (
            max_items,
            max_age_seconds,
            max_chars,
            clock,
        )
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def put(self, response_id: str, body: dict[str, Any], messages: list[dict[str, Any]], owner: str | None):
        """Keep `body` (and its conversation) under `response_id`, dropping the oldest while over the
        count or the size (one bigger than the whole size bound is not kept)."""
        self._expire()
        size = _chars(messages) + _body_chars(body)
        if self.max_items <= 0 or size > self.max_chars:
            return
        self._items[response_id] = StoredResponse(body, messages, owner, self.clock(), size)
        self._chars += size
        while len(self._items) > self.max_items or self._chars > self.max_chars:
            self._pop_oldest()

    def get(self, response_id: str, owner: str | None, admin: bool = False) -> StoredResponse | None:
        """The stored response `response_id` if it is still kept and `owner` (any, when `admin`) may
        read it, else None."""
        self._expire()
        item = self._items.get(response_id)
        if item is None or not (admin or item.owner == owner):
            return None
        return item

    def delete(self, response_id: str, owner: str | None, admin: bool = False) -> bool:
        """Forget `response_id` (only its owner or an admin may); whether it was there."""
        if self.get(response_id, owner, admin) is None:
            return False
        self._chars -= self._items.pop(response_id).size
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        """Drop the entries older than the age bound (the oldest are first in insertion order)."""
        cutoff = self.clock() - self.max_age
        while self._items:
            first = next(iter(self._items.values()))
            if first.stored_at > cutoff:
                return
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, item = self._items.popitem(last=False)
        self._chars -= item.size


def _body_chars(body: dict[str, Any]) -> int:
    """Characters of what a response body holds beside its conversation: instructions and tools."""
    tools = body.get("tools") or []
    return len(body.get("instructions") or "") + (len(json.dumps(tools)) if tools else 0)


def _chars(messages: list[dict[str, Any]]) -> int:
    """Characters of a conversation: its contents and its tool calls' arguments (the response body
    holds the last turn's output again, bounded by the same)."""
    total = 0
    for m in messages:
        total += len(m.get("content") or "")
        for c in m.get("tool_calls") or []:
            total += len(c["function"]["arguments"]) + len(c["function"]["name"])
    return total
