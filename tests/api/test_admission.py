"""Per-client fair share of engine sequences: one client's flood waits in its own line, others don't."""

from __future__ import annotations

import asyncio

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
