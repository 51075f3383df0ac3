"""Replay one arrival trace through the engine deployment and measure what the replicas did.

Each request is sent at its arrival time whether or not earlier ones have finished (an open loop), so
when the trace arrives faster than the replicas drain it, requests queue and the throughput is the
system's, not the arrival rate. TTFT counts from the request's scheduled arrival to its first token.
While the trace runs, the requests outstanding (sent, not finished) and the replicas' own waiting
queues are sampled every `SAMPLE_S`; prefix-cache and adapter-pool counters are the replicas' own
(their engine statistics), read before and after.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import Any

from bench.cluster.workload import Arrival

SAMPLE_S = 0.5


@dataclass(slots=True)
class Sent:
    """One request's outcome: seconds from the run's start (arrival, first token, end)."""

    kind: str
    phase: str
    at: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    ok: bool = False

    @property
    def ttft(self) -> float | None:
        return self.first - self.at if self.first is not None else None


@dataclass(slots=True)
class Counters:
    """Replica counters summed over the live replicas."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    host_loads: int = 0
    device_uploads: int = 0

    def minus(self, other: Counters) -> Counters:
        return Counters(
            self.prefix_queries - other.prefix_queries,
            self.prefix_hits - other.prefix_hits,
            self.host_loads - other.host_loads,
            self.device_uploads - other.device_uploads,
        )


@dataclass(slots=True)
class Replayed:
    """What one replay of the trace measured."""

    sent: list[Sent]
    counters: Counters
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, outstanding, waiting)
    replicas: int = 0


def counters(client: Any) -> Counters:
    """The replicas' prefix-cache and adapter-pool counters, summed (from their latest statistics)."""
    c = Counters()
    for _, stats in client.replica_stats():
        c.prefix_queries += int(stats.engine.get("prefix_cache_queries", 0))
        c.prefix_hits += int(stats.engine.get("prefix_cache_hits", 0))
        if stats.lora:
            c.host_loads += int(stats.lora.get("loads", 0))
            c.device_uploads += int(stats.lora.get("device_uploads", 0))
    return c


async def replay(
    client: Any, trace: list[Arrival], digests: list[tuple[str, str]], max_tokens: int
) -> Replayed:
    """Send every arrival of `trace` at its time through `client` (a started `RemoteEngineClient`);
    `digests[k]` is adapter k's (name, content digest)."""
    from api.engine_protocol import AddRequest
    from engine import LoRARequest, SamplingParams

    loop = asyncio.get_running_loop()
    await client.poll()
    before = counters(client)
    start = loop.time() + 0.2
    sent = [Sent(a.kind, a.phase, a.at) for a in trace]
    outstanding = 0

    def now() -> float:
        return loop.time() - start

    async def one(i: int, a: Arrival) -> None:
        nonlocal outstanding
        lora = None
        if a.adapter is not None:
            name, digest = digests[a.adapter]
            lora = LoRARequest(name, "", digest)  # each replica fills in its own path for the digest
        req = AddRequest(
            request_id=f"r{i}",
            prompt_token_ids=list(a.prompt),
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            lora=lora,
        )
        s = sent[i]
        outstanding += 1
        try:
            async for delta in client.generate(req):
                if delta.token_ids and s.first is None:
                    s.first = now()
                s.tokens += len(delta.token_ids)
            s.ok = True
        except Exception as exc:  # counted as not ok
            print(f"request {i} failed: {exc}", file=sys.stderr)
        finally:
            s.end = now()
            outstanding -= 1

    samples: list[tuple[float, int, int]] = []

    async def sample() -> None:
        while True:
            waiting = sum(int(st.engine.get("num_waiting", 0)) for _, st in client.replica_stats())
            samples.append((now(), outstanding, waiting))
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample())
    tasks = []
    try:
        for i, a in enumerate(trace):
            delay = a.at - now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, a)))
        await asyncio.gather(*tasks)
    finally:
        sampler.cancel()
    await asyncio.sleep(1.5)  # the replicas report their counters every poll (0.5 s)
    await client.poll()
    return Replayed(sent, counters(client).minus(before), samples, len(client.replica_stats()))
