"""Per-client fairness: how many engine sequences one client (API key, else address) may run at once.

A request holds `choices` slots of its client's share while it runs. The share has two parts:

- **guaranteed**: up to `limit` slots (`ServerSettings.client_seq_limit()`) are granted at once, whatever
  other clients hold; no client's requests ever wait behind another client's.
- **borrowed**: beyond `limit`, a client may use capacity nobody else uses (work conserving: a lone client
  is not capped at its guarantee). Borrowers queue first come, first served across clients, and a borrow
  is granted only while the slots in use stay at most `capacity - headroom`, so a client that arrives
  next still finds `headroom` slots free at once; borrowed slots return as their requests finish.

A request that is granted nothing within `wait_seconds` gets 429 with `Retry-After`. With one request
bounded to `max_choices_per_request` choices, no single request or client can fill the engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from api.errors import APIError


@dataclass(slots=True)
class _Share:
    used: int = 0
    waiting: int = 0  # requests between taking this share and holding their slots


class ClientAdmission:
    def __init__(
        self, limit: int, capacity: int | None = None, headroom: int | None = None, wait_seconds: float = 30.0
    ) -> None:
        """`limit`: guaranteed slots per client; `capacity`: the engine's sequences (None: no borrowing);
        `headroom`: slots borrowing keeps free for newcomers (default: an eighth of `capacity`)."""
        self.limit = max(1, limit)
        self.capacity = capacity if capacity is not None else self.limit
        self.headroom = headroom if headroom is not None else max(1, self.capacity // 8)
        self.wait_seconds = wait_seconds
        self._shares: dict[str, _Share] = {}
        self._total = 0
        self._borrowers: collections.deque[object] = collections.deque()  # FIFO tickets
        self._changed = asyncio.Condition()

    def in_use(self, client: str) -> int:
        share = self._shares.get(client)
        return share.used if share is not None else 0

    def total_in_use(self) -> int:
        return self._total

    @contextlib.asynccontextmanager
    async def hold(self, client: str, choices: int) -> AsyncIterator[None]:
        """Hold `choices` of `client`'s slots for the body of the `async with` (429 if none free in time)."""
        need = min(choices, self.limit)
        share = self._shares.setdefault(client, _Share())
        share.waiting += 1  # before any await: a releasing request must not drop this share meanwhile
        ticket = object()
        try:
            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self._grant(share, need, ticket)), self.wait_seconds
                    )
                except TimeoutError:
                    raise APIError(
                        429,
                        f"this client already runs {share.used} sequences (limit {self.limit}); retry later",
                        code="too_many_requests",
                        headers={"Retry-After": "1"},
                    ) from None
                finally:
                    if ticket in self._borrowers:
                        self._borrowers.remove(ticket)
                        self._changed.notify_all()  # the next borrower may be at the head now
                share.used += need
                self._total += need
        finally:
            share.waiting -= 1
            self._forget_if_idle(client, share)
        try:
            yield
        finally:
            async with self._changed:
                share.used -= need
                self._total -= need
                self._changed.notify_all()
            self._forget_if_idle(client, share)

    def _grant(self, share: _Share, need: int, ticket: object) -> bool:
        """Whether `need` slots may be taken now: within the guarantee, or borrowed at the head of the
        borrowers' line with `headroom` left free (the ticket joins the line on the first refusal)."""
        if share.used + need <= self.limit:
            return True
        if ticket not in self._borrowers:
            self._borrowers.append(ticket)
        return self._borrowers[0] is ticket and self._total + need <= self.capacity - self.headroom

    def clients(self) -> int:
        """Clients with a share in memory (holding or waiting for slots)."""
        return len(self._shares)

    def _forget_if_idle(self, client: str, share: _Share) -> None:
        """Drop an idle client's share, so that memory follows the clients in flight, not all ever seen."""
        if share.used == 0 and share.waiting == 0 and self._shares.get(client) is share:
            del self._shares[client]


def client_id(key, request) -> str:
    """Who a request counts against: its API key's prefix, "admin", or the peer address."""
    if key == "admin":
        return "admin"
    if key is not None:
        return f"key:{key.prefix}"
    return f"addr:{request.client.host if request.client else '?'}"
