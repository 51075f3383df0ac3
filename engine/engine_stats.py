"""The engine's counters and the `EngineStats` snapshot built from them, the scheduler, the KV cache
and speculative decoding (`LLMEngine.get_stats`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv_cache.manager import KVCacheStats
from engine.metrics import EngineStats
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.spec import SpecDecoder


@dataclass(slots=True)
class StepCounters:
    """Totals since the engine started: steps run, tokens the last step computed, prompt tokens admitted
    and output tokens generated."""

    steps: int = 0
    last_step_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


def engine_stats(
    scheduler: Scheduler, kv: KVCacheStats, counters: StepCounters, spec: SpecDecoder | None
) -> EngineStats:
    """The engine's state now: queue lengths, KV cache use, counters and, with speculative decoding,
    its proposed/accepted totals overall and per adapter."""
    stats = EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_blocks_total=kv.num_blocks,
        kv_blocks_used=kv.num_used,
        kv_blocks_cached_free=kv.num_cached_free,
        kv_blocks_free=kv.num_free,
        kv_usage=kv.usage,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.stats.num_preemptions,
        last_step_tokens=counters.last_step_tokens,
        num_steps=counters.steps,
        prompt_tokens_total=counters.prompt_tokens,
        generation_tokens_total=counters.generation_tokens,
        running_loras=adapter_names(scheduler.running),
        waiting_loras=adapter_names(scheduler.waiting),
    )
    if spec is not None:
        total = spec.stats.total()
        stats.spec_proposed_tokens = total.proposed
        stats.spec_accepted_tokens = total.accepted
        stats.spec_verifications = total.verifications
        stats.spec_by_adapter = {
            name: [s.proposed, s.accepted, s.verifications] for name, s in spec.stats.by_adapter.items()
        }
    return stats


def adapter_names(requests: Iterable[Sequence]) -> list[str]:
    """Distinct adapter names of `requests` (a weighted mix's members), sorted (the base model is left
    out)."""
    return sorted(
        {lr.name for r in requests if r.lora_request is not None for lr, _ in r.lora_request.members()}
    )
