"""Engine counters a server exports (a snapshot after each step)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    kv_blocks_free: int
    kv_usage: float
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were found cached
    num_preemptions: int  # total so far
    last_step_tokens: int  # tokens computed by the last step
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
    running_loras: list[str] = field(default_factory=list)  # adapter names of running requests
    waiting_loras: list[str] = field(default_factory=list)  # adapter names of waiting requests
    # speculative decoding, totals so far (0 when off): proposed tokens verified, of which accepted, and
    # sequence-steps that verified any; per adapter name ("" = base): [proposed, accepted, verifications]
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    spec_by_adapter: dict[str, list[int]] = field(default_factory=dict)
