"""Per-client fairness: how many engine sequences one client (API key, else address) may run at once.

A request holds `choices` slots of its client's share while it runs. The share has two parts:

- **guaranteed**: up to `limit` slots (`ServerSettings.client_seq_limit()`) are granted at once, whatever
  other clients hold; no client's requests ever wait behind another client's.
- **borrowed**: beyond `limit`, a client may use capacity nobody else uses (work conserving: a lone client
  is not capped at its guarantee). Borrowers queue first come, first served across clients, and a borrow
  is granted only while the slots in use stay at most `capacity - headroom`, so a client that arrives
  next still finds `headroom` slots free at once; borrowed slots return as their requests finish.

Slots are handed over, not raced for: a request that cannot be granted at once waits in line (its
client's own line for a guaranteed slot, the borrowers' line for a borrowed one), and every release
grants the waiters that now fit, in order, directly. So a burst of any size costs O(1) work per
release (no thundering herd of waiters re-checking), and a waiter is only ever refused while nothing it
could take is free. A request granted nothing within `wait_seconds` of its arrival at the server (the
guard stamps it, so time spent reading the body or tokenizing counts) gets 429 with `Retry-After`;
the message gives the real numbers at that moment. With one request bounded to
`max_choices_per_request` choices, no single request or client can fill the engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from api.errors import APIError

ARRIVED = "loraplex_arrived"  # request state: time.monotonic() when the request reached the server


@dataclass(slots=True, eq=False)
class _Waiter:
    share: _Share
    need: int
    granted: asyncio.Future[None]
    gone: bool = False  # timed out or cancelled: skipped by the lines


@dataclass(slots=True)
class _Share:
    used: int = 0
    waiting: int = 0  # requests between taking this share and holding their slots
    line: collections.deque[_Waiter] = field(default_factory=collections.deque)  # this client's waiters


class ClientAdmission:
    def __init__(
        self, limit: int, capacity: int | None = None, headroom: int | None = None, wait_seconds: float = 30.0
    ) -> None:
        """`limit`: guaranteed slots per client; `capacity`: the engine's sequences (None: no borrowing);
        `headroom`: slots borrowing keeps free for newcomers (default: an eighth of `capacity`);
        `wait_seconds`: how long after its arrival a request may wait for its slots."""
        self.limit = max(1, limit)
        self.capacity = capacity if capacity is not None else self.limit
        self.headroom = headroom if headroom is not None else max(1, self.capacity // 8)
        self.wait_seconds = wait_seconds
        self._shares: dict[str, _Share] = {}
        self._total = 0
        self._borrowers: collections.deque[_Waiter] = collections.deque()  # every waiter, FIFO

    def in_use(self, client: str) -> int:
        share = self._shares.get(client)
        return share.used if share is not None else 0

    def total_in_use(self) -> int:
        return self._total

    @contextlib.asynccontextmanager
    async def hold(self, client: str, choices: int, arrived: float | None = None) -> AsyncIterator[None]:
        """Hold `choices` of `client`'s slots for the body of the `async with`; 429 if none came free
        within `wait_seconds` of `arrived` (`time.monotonic()`, default now)."""
        need = min(choices, self.limit)
        share = self._shares.setdefault(client, _Share())
        share.waiting += 1  # before any await: a releasing request must not drop this share meanwhile
        try:
            await self._acquire(share, need, arrived if arrived is not None else time.monotonic())
        finally:
            share.waiting -= 1
            self._forget_if_idle(client, share)
        try:
            yield
        finally:
            self._release(share, need)
            self._forget_if_idle(client, share)

    async def _acquire(self, share: _Share, need: int, arrived: float) -> None:
        own_turn = not self._skip_gone(share.line)  # first come, first served within a client too
        if own_turn and (
            self._fits_guarantee(share, need) or (not self._line_ahead() and self._fits_borrow(need))
        ):
            self._take(share, need)
            return
        waiter = _Waiter(share, need, asyncio.get_running_loop().create_future())
        share.line.append(waiter)
        self._borrowers.append(waiter)
        remaining = arrived + self.wait_seconds - time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), max(0.0, remaining))
        except TimeoutError:
            if waiter.granted.done():  # granted in the same instant: keep it
                return
            refusal = self._refusal(waiter, time.monotonic() - arrived)
            self._leave(waiter)
            raise refusal from None
        except BaseException:  # the client went away (cancelled) while waiting
            if waiter.granted.done():
                self._release(share, need)
            else:
                self._leave(waiter)
            raise

    def _refusal(self, waiter: _Waiter, waited: float) -> APIError:
        """The 429 of `waiter`, refused now: what its client runs, what the engine holds and who waits
        ahead of it, as they are at this moment."""
        ahead = 0
        for w in self._borrowers:
            if w is waiter:
                break
            ahead += not w.gone
        message = (
            f"this client already runs {waiter.share.used} sequences (guaranteed {self.limit}) and needs "
            f"{waiter.need} more; the engine runs {self._total} and lends beyond a guarantee only up to "
            f"{self.capacity - self.headroom} ({self.headroom} stay free for other clients)"
        )
        if ahead:
            message += f"; {ahead} earlier requests still wait ahead of this one"
        message += (
            f"; nothing it may take came free within {self.wait_seconds:g} s of its arrival "
            f"({waited:.1f} s ago); retry later"
        )
        return APIError(429, message, code="too_many_requests", headers={"Retry-After": "1"})

    def _fits_guarantee(self, share: _Share, need: int) -> bool:
        return share.used + need <= self.limit

    def _fits_borrow(self, need: int) -> bool:
        return self._total + need <= self.capacity - self.headroom

    def _line_ahead(self) -> bool:
        """Whether a borrower is already waiting (a newcomer must not borrow past it)."""
        self._skip_gone(self._borrowers)
        return bool(self._borrowers)

    def _take(self, share: _Share, need: int) -> None:
        share.used += need
        self._total += need

    def _release(self, share: _Share, need: int) -> None:
        share.used -= need
        self._total -= need
        self._grant_waiters(share)

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter gives up: out of both lines (lazily), and the line may move past it."""
        waiter.gone = True
        self._grant_waiters(waiter.share)

    def _grant_waiters(self, share: _Share) -> None:
        """Hand free slots to the waiters that fit now: `share`'s own line within its guarantee, then
        the borrowers' line from its head while borrowing fits (in order: a head that does not fit
        blocks those behind it, so a large request is not starved by small ones)."""
        line = share.line
        while self._skip_gone(line) and self._fits_guarantee(share, line[0].need):
            self._grant(line.popleft())
        while self._skip_gone(self._borrowers):
            head = self._borrowers[0]
            if not (self._fits_guarantee(head.share, head.need) or self._fits_borrow(head.need)):
                break
            self._grant(head)

    def _grant(self, waiter: _Waiter) -> None:
        waiter.gone = True  # out of the lines: they drop it lazily
        self._take(waiter.share, waiter.need)
        waiter.granted.set_result(None)

    @staticmethod
    def _skip_gone(line: collections.deque[_Waiter]) -> bool:
        """Drop the gone waiters at the head of `line`; whether a live one is left at its head."""
        while line and line[0].gone:
            line.popleft()
        return bool(line)

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
