"""Per-client fairness: how many engine sequences one client (API key, else address) may run at once.

A request holds `choices` slots of its client's share (`ServerSettings.client_seq_limit()`) while it runs.
A client over its share waits in line (first come, first served among its own requests) for up to
`wait_seconds`, then gets 429 with `Retry-After`; other clients' requests never wait behind it. With one
request bounded to `max_choices_per_request` choices, no single request or client can fill the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from api.errors import APIError


@dataclass(slots=True)
class _Share:
    used: int = 0
    waiting: int = 0  # requests between taking this share and holding their slots
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class ClientAdmission:
    def __init__(self, limit: int, wait_seconds: float = 30.0) -> None:
        self.limit = max(1, limit)
        self.wait_seconds = wait_seconds
        self._shares: dict[str, _Share] = {}

    def in_use(self, client: str) -> int:
        share = self._shares.get(client)
        return share.used if share is not None else 0

    @contextlib.asynccontextmanager
    async def hold(self, client: str, choices: int) -> AsyncIterator[None]:
        """Hold `choices` of `client`'s slots for the body of the `async with` (429 if none free in time)."""
        need = min(choices, self.limit)
        share = self._shares.setdefault(client, _Share())
        share.waiting += 1  # before any await: a releasing request must not drop this share meanwhile
        try:
            async with share.changed:
                try:
                    await asyncio.wait_for(
                        share.changed.wait_for(lambda: share.used + need <= self.limit), self.wait_seconds
                    )
                except TimeoutError:
                    raise APIError(
                        429,
                        f"this client already runs {share.used} sequences (limit {self.limit}); retry later",
                        code="too_many_requests",
                        headers={"Retry-After": "1"},
                    ) from None
                share.used += need
        finally:
            share.waiting -= 1
            self._forget_if_idle(client, share)
        try:
            yield
        finally:
            async with share.changed:
                share.used -= need
                share.changed.notify_all()
            self._forget_if_idle(client, share)

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
