"""Per-client fair share of engine sequences: one client's flood waits in its own line, others don't;
a lone client borrows idle capacity (work conserving) but always leaves headroom for a newcomer."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from api.admission import ClientAdmission
from api.errors import APIError


def test_a_client_over_its_share_waits_while_others_run():
    async def run() -> list[str]:
        adm = ClientAdmission(limit=4, wait_seconds=5)
        events: list[str] = []
        release = asyncio.Event()

        async def hold(client: str, n: int, name: str, until: asyncio.Event | None = None) -> None:
            async with adm.hold(client, n):
                events.append(f"start {name}")
                if until is not None:
                    await until.wait()
            events.append(f"end {name}")

        flood = asyncio.create_task(hold("attacker", 4, "flood", release))
        await asyncio.sleep(0)
        more = asyncio.create_task(hold("attacker", 1, "more"))
        await asyncio.sleep(0.05)
        await hold("innocent", 4, "innocent")  # not behind the attacker's line
        assert adm.in_use("attacker") == 4 and "start more" not in events
        assert adm.clients() == 1  # the attacker's; the innocent client's share went when it ended
        release.set()
        await asyncio.gather(flood, more)
        assert adm.clients() == 0  # memory follows the clients in flight
        return events

    events = asyncio.run(run())
    assert events.index("end innocent") < events.index("start more")
    assert events.index("end flood") < events.index("start more")


def test_waiting_too_long_is_429_with_retry_after():
    async def run() -> None:
        adm = ClientAdmission(limit=2, wait_seconds=0.05)
        async with adm.hold("c", 2):
            with pytest.raises(APIError) as exc:
                async with adm.hold("c", 1):
                    pass
        assert exc.value.status == 429 and exc.value.headers == {"Retry-After": "1"}
        assert adm.in_use("c") == 0 and adm.clients() == 0

    asyncio.run(run())


def test_a_lone_client_borrows_idle_capacity_and_leaves_headroom():
    async def run() -> None:
        adm = ClientAdmission(limit=4, capacity=16, headroom=2, wait_seconds=0.2)
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(14):  # 4 guaranteed + 10 borrowed = capacity - headroom
                await stack.enter_async_context(adm.hold("lone", 1))
            assert adm.in_use("lone") == 14
            with pytest.raises(APIError) as exc:  # the headroom is not borrowed
                async with adm.hold("lone", 1):
                    pass
            assert exc.value.status == 429
            async with adm.hold("newcomer", 4):  # its guarantee at once, whatever the borrower holds
                assert adm.total_in_use() == 18
        assert adm.total_in_use() == 0 and adm.clients() == 0

    asyncio.run(run())


def test_borrowers_queue_first_come_first_served():
    async def run() -> list[str]:
        adm = ClientAdmission(limit=2, capacity=8, headroom=1, wait_seconds=5)
        events: list[str] = []
        release = asyncio.Event()

        async def hold(client: str, n: int, name: str, until: asyncio.Event | None = None) -> None:
            async with adm.hold(client, n):
                events.append(f"start {name}")
                if until is not None:
                    await until.wait()

        base = [asyncio.create_task(hold(c, 2, f"{c}0", release)) for c in ("a", "b")]
        lent = asyncio.create_task(hold("a", 2, "a-borrow", release))  # 4 + 2 <= 8 - 1: borrowed
        await asyncio.sleep(0.05)
        late = [asyncio.create_task(hold("b", 2, "b-borrow")), asyncio.create_task(hold("a", 1, "a-late"))]
        await asyncio.sleep(0.05)
        assert "start a-borrow" in events  # a lone borrower is not capped at its guarantee
        assert "start b-borrow" not in events and "start a-late" not in events  # 6 + 2 > 7, 1st in line waits
        release.set()
        await asyncio.gather(*base, lent, *late)
        return events

    events = asyncio.run(run())
    assert events.index("start b-borrow") < events.index("start a-late")


def test_a_lone_clients_burst_is_served_in_order_without_a_herd():
    """3,000 requests of one client at once on a small engine (4 guaranteed, 7 lendable): each is
    handed its slot as one frees, so the whole burst drains in well under its wait; before, every
    release woke every waiter (O(n²)) and the tail timed out while slots stood free."""

    async def run() -> tuple[list[int], float, list[str]]:
        adm = ClientAdmission(limit=4, capacity=8, headroom=1, wait_seconds=20)
        order: list[int] = []
        refusals: list[str] = []

        async def request(i: int) -> None:
            try:
                async with adm.hold("lone", 1):
                    order.append(i)
                    assert adm.total_in_use() <= 7
                    await asyncio.sleep(0)
            except APIError as exc:
                refusals.append(exc.message)

        t0 = time.monotonic()
        await asyncio.gather(*(request(i) for i in range(3000)))
        assert adm.total_in_use() == 0 and adm.clients() == 0
        return order, time.monotonic() - t0, refusals

    order, took, refusals = asyncio.run(run())
    assert refusals == [] and sorted(order) == list(range(3000))
    assert order == list(range(3000))  # first come, first served
    assert took < 10, took


def test_a_refusal_tells_the_truth_and_the_wait_counts_from_arrival():
    async def run() -> None:
        adm = ClientAdmission(limit=2, capacity=4, headroom=1, wait_seconds=0.5)
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(3):  # 2 guaranteed + 1 borrowed: all that may be lent
                await stack.enter_async_context(adm.hold("c", 1))
            t0 = time.monotonic()
            with pytest.raises(APIError) as exc:
                async with adm.hold("c", 1, arrived=t0 - 0.4):  # read + tokenized for 0.4 s already
                    pass
            waited = time.monotonic() - t0
            assert 0.05 < waited < 0.3, waited  # the rest of its 0.5 s, not 0.5 s more
            msg = exc.value.message
            assert exc.value.status == 429 and "already runs 3 sequences (guaranteed 2)" in msg, msg
            assert "the engine runs 3 and lends beyond a guarantee only up to 3" in msg, msg
            assert "ahead" not in msg and "within 0.5 s of its arrival" in msg, msg
            # Arriving past its wait, a request is still served when a slot is free for it at once.
            async with adm.hold("other", 1, arrived=t0 - 60):
                assert adm.in_use("other") == 1
        assert adm.clients() == 0

    asyncio.run(run())


def test_a_waiter_that_goes_away_leaves_the_line_and_frees_nothing_twice():
    async def run() -> None:
        adm = ClientAdmission(limit=1, capacity=2, headroom=1, wait_seconds=5)
        first = adm.hold("c", 1)
        await first.__aenter__()
        gone = asyncio.create_task(_enter(adm, "c"))
        behind = asyncio.create_task(_enter(adm, "c"))
        await asyncio.sleep(0.01)
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        await first.__aexit__(None, None, None)
        await asyncio.wait_for(behind, 1)  # the next in line got the slot
        assert adm.total_in_use() == 0 and adm.clients() == 0

    asyncio.run(run())


async def _enter(adm: ClientAdmission, client: str) -> None:
    async with adm.hold(client, 1):
        await asyncio.sleep(0)
