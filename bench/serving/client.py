"""The online benchmarks' streaming client: a seeded Poisson workload planned up front, sent to one server.

`plan_rate` fixes every request of one arrival rate (arrival time, model index, prompt token ids,
max_tokens) before anything is sent, so two servers (`bench.peer.online`) receive the same workload;
`send_planned` sends it to one OpenAI-compatible `/v1/completions` endpoint with streaming and
`summarise` turns the per-request times into throughput, TTFT and TPOT percentiles.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import httpx

MAX_REQUESTS_PER_RATE = 2000


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    tpot: float = 0.0
    tokens: int = 0


@dataclass(slots=True)
class RateResult:
    rate: float
    sent: int
    ok: int
    duration: float
    output_tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values` by nearest rank; 0 for an empty list."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a rate's workload, fixed before anything is sent (so two servers get the same)."""

    at: float  # seconds after the rate's start
    model: int  # index into the target's model names
    prompt: list[int]
    max_tokens: int


def plan_rate(
    weights: list[float],
    rate: float,
    duration: float,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[PlannedRequest]:
    """The seeded workload of one rate: Poisson arrivals (mean `rate`/s) over `duration` seconds (at most
    MAX_REQUESTS_PER_RATE), model k with probability ∝ weights[k], prompt and output lengths uniform in
    the given ranges, prompt token ids uniform in [3, 100)."""
    if rate <= 0 or duration <= 0:
        raise ValueError("rate and duration must be > 0")
    rng = random.Random(seed)
    models = range(len(weights))
    planned: list[PlannedRequest] = []
    next_at = 0.0
    while next_at < duration and len(planned) < MAX_REQUESTS_PER_RATE:
        model = rng.choices(models, weights)[0]
        prompt = [rng.randrange(3, 100) for _ in range(rng.randint(*prompt_len))]
        planned.append(PlannedRequest(next_at, model, prompt, rng.randint(*output_len)))
        next_at += rng.expovariate(rate)
    return planned


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    """A streaming greedy completion of exactly `max_tokens` tokens (`ignore_eos`) on token-id `prompt`.
    `return_token_ids` makes vLLM stream the ids (loraplex always does and ignores the field), so tokens
    are counted the same way on both without a tokenizer."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int):
    t0 = time.perf_counter()
    first = None
    tokens = 0
    try:
        body = request_body(model, prompt, max_tokens)
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(False)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False)
                new = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if new:
                    first = first or time.perf_counter()
                    tokens += new
    except httpx.HTTPError:
        return RequestResult(False)
    end = time.perf_counter()
    if first is None:
        return RequestResult(False)
    return RequestResult(True, first - t0, (end - first) / max(tokens - 1, 1), tokens)


async def send_planned(
    url: str,
    models: list[str],
    planned: list[PlannedRequest],
    rate: float,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RateResult:
    """Send each planned request at its arrival time (streaming, concurrently) to `url`, naming model
    `models[p.model]`; wait for all and summarise them as the result of offered `rate`."""
    tasks = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits, transport=transport) as client:
        t0 = time.perf_counter()
        for p in planned:
            await asyncio.sleep(max(0.0, t0 + p.at - time.perf_counter()))
            tasks.append(
                asyncio.create_task(one_request(client, url, models[p.model], p.prompt, p.max_tokens))
            )
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return summarise(rate, results, elapsed)


def summarise(rate: float, results: list[RequestResult], elapsed: float) -> RateResult:
    """Throughput (output tokens of the successful requests / `elapsed`) and TTFT/TPOT percentiles."""
    good = [r for r in results if r.ok]
    ttft = [r.ttft for r in good]
    tpot = [r.tpot for r in good]
    return RateResult(
        rate,
        len(results),
        len(good),
        elapsed,
        sum(r.tokens for r in good) / elapsed if elapsed > 0 else 0.0,
        statistics.median(ttft) if ttft else 0,
        pct(ttft, 0.99),
        statistics.median(tpot) if tpot else 0,
        pct(tpot, 0.99),
    )
