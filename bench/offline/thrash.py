"""The LRU-thrash workload of benchmark 2: more adapters than the device pool holds, each used by several
requests, in cyclic (request i on adapter i mod count) or random order; resident-first admission
(`lora_resident_first`) on vs off, interleaved in one run, each pass in a fresh engine."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.offline.pool_pass import PoolPass, measure_pass
from bench.offline.step_bytes import StepBytesMeter

ORDERS = ("cyclic", "random")


@dataclass(slots=True)
class ThrashPoint:
    order: str
    resident_first: bool
    adapters: int
    per_adapter: int  # requests per adapter
    run: PoolPass


def adapter_order(adapters: int, per_adapter: int, order: str, seed: int = 0) -> list[int]:
    """The adapter index of each request: every adapter `per_adapter` times, cyclic or shuffled."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    idx = [i % adapters for i in range(adapters * per_adapter)]
    if order == "random":
        random.Random(seed).shuffle(idx)
    return idx


def run_thrash(
    make_llm,
    loras: list,
    prompts: list[list[int]],
    params,
    per_adapter: int,
    orders: tuple[str, ...],
    repeats: int,
    read_gb_s: float,
    advance=lambda: None,
) -> list[ThrashPoint]:
    """For each order, admission on and off: `repeats` passes (interleaved on/off), the fastest kept.

    `make_llm(resident_first)` builds a fresh `LLM`; it is warmed up with one request per mode (kernels,
    threads) before the measured pass. `prompts` has one prompt per request (`len(loras) * per_adapter`)."""
    best: dict[tuple[str, bool], ThrashPoint] = {}
    for r in range(repeats):
        for order in orders:
            idx = adapter_order(len(loras), per_adapter, order, seed=r)
            per_req = [loras[i] for i in idx]
            for resident_first in (True, False) if r % 2 == 0 else (False, True):
                llm = make_llm(resident_first)
                eng = llm.engine
                meter = StepBytesMeter(eng)
                eng.add_request("warm", prompts[0], params, None)
                while eng.has_unfinished_requests():
                    eng.step()
                tag = f"thrash-{order}-{resident_first}-{r}"
                run = measure_pass(eng, meter, prompts, params, per_req, tag, read_gb_s)
                eng.lora.shutdown()
                point = ThrashPoint(order, resident_first, len(loras), per_adapter, run)
                key = (order, resident_first)
                if key not in best or run.total_s < best[key].run.total_s:
                    best[key] = point
                advance()
    return [best[(o, m)] for o in orders for m in (True, False)]


def thrash_markdown(points: list[ThrashPoint]) -> str:
    """Table of the thrash passes, with the on/off throughput ratio per order."""
    lines = [
        "| order | resident-first | requests | output tok/s | decode tok/s | decode floor tok/s "
        "| decode of floor | run of floor | adapters/step | pool hit rate | uploads | host loads "
        "| evictions | on / off tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(p.order, p.resident_first): p for p in points}
    for p in points:
        r = p.run
        off = by.get((p.order, False))
        ratio = f"{r.tokens_per_s / off.run.tokens_per_s:.2f}" if p.resident_first and off else ""
        lines.append(
            f"| {p.order} | {'on' if p.resident_first else 'off'} | {r.requests} "
            f"({p.adapters} × {p.per_adapter}) | {r.tokens_per_s:.0f} | {r.decode_tokens_per_s:.0f} | "
            f"{r.decode_floor_tokens_per_s:.0f} | {r.decode_of_floor:.0%} | {r.of_floor:.0%} | "
            f"{r.mean_distinct_adapters:.1f} | {r.pool_hit_rate:.0%} | {r.device_uploads} | "
            f"{r.host_loads} | {r.evictions} | {ratio} |"
        )
    return "\n".join(lines)
