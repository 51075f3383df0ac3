"""`AdapterResidency`: where loaded adapters live — device pages or host memory — and the step context.

Tiers: device pages (`AdapterPool`) <- host cache (`CpuAdapterCache`, LRU, `max_cpu_loras`) <- disk (the
loader's business). Adapters in the caller's `protected` set (used by a running sequence, or pinned) are
never evicted from the device; adapters of any unfinished request (`held`) keep their host copy, so a
request admitted for an adapter never needs its files again once they were read. Other residents are
evicted least-recently-used first to make room. "Used" is counted
by `step_context`, which stamps every adapter of a step with a logical clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.lora.adapter_checkpoint import AdapterCheckpoint
from engine.lora.cpu_cache import CpuAdapterCache
from engine.lora.mix import Member, mixed_context, needs_mix
from engine.lora.pool import AdapterPool, ResidentAdapter
from engine.lora.step_context import CpuLoRAContext, TritonLoRAContext, token_segments
from engine.model.linear import LoRAStepContext
from engine.scheduler.output import ScheduledSequence


@dataclass(slots=True)
class ResidencyStats:
    device_uploads: int = 0
    evictions: int = 0


class AdapterResidency:
    """The device pool and the host cache of adapters, with pinning, LRU eviction and per-step contexts."""

    def __init__(self, pool: AdapterPool, cpu: CpuAdapterCache, backend: str, device: torch.device) -> None:
        self.pool = pool
        self.cpu = cpu
        self.backend = backend  # how the step context applies LoRA: "native" | "torch" | "triton"
        self.device = device
        self.pinned: set[str] = set()
        self.held: set[str] = set()  # digests of unfinished requests' adapters: host copy never evicted
        self.stats = ResidencyStats()
        self._clock = 0

    def is_resident(self, digest: str) -> bool:
        return digest in self.pool.resident

    def host_copy(self, digest: str) -> AdapterCheckpoint | None:
        return self.cpu.get(digest)

    def has_host_copy(self, digest: str) -> bool:
        """Whether the adapter is in the host cache (without touching its LRU position)."""
        return digest in self.cpu

    def keep_on_host(self, ckpt: AdapterCheckpoint, in_use: set[str]) -> None:
        """Put a loaded adapter in the host cache (evicting LRU entries that are not in use, held or
        pinned; the cache may exceed its capacity while held adapters fill it)."""
        self.cpu.put(ckpt, keep=in_use | self.pinned | self.held)

    def upload(self, ckpt: AdapterCheckpoint, protected: set[str]) -> bool:
        """Copy the adapter into device pages, evicting residents that are neither `protected` nor pinned,
        least recently used first, until it fits; False if it still does not fit."""
        if ckpt.digest in self.pool.resident:
            return True
        keep = protected | self.pinned
        victims = sorted(
            (r for d, r in self.pool.resident.items() if d not in keep), key=lambda r: r.last_used
        )
        while not self.pool.fits(ckpt):
            if not victims:
                return False
            self.pool.evict(victims.pop(0).digest)
            self.stats.evictions += 1
        self.pool.upload(ckpt)
        self.stats.device_uploads += 1
        return True

    def drop(self, digest: str) -> None:
        """Remove the adapter from every tier (and unpin it)."""
        if digest in self.pool.resident:
            self.pool.evict(digest)
        self.cpu.drop(digest)
        self.pinned.discard(digest)
        self.held.discard(digest)

    def step_context(self, items: Sequence[ScheduledSequence]) -> LoRAStepContext | None:
        """The LoRA context for a step's scheduled sequences (flat-batch order); None if none uses one.
        Steps with weighted mixes get one pass per mix position (`engine/lora/mix.py`)."""
        rows = [self._members(it) for it in items]
        if not any(rows):
            return None
        return rows_context(self.pool, self.backend, [it.num_tokens for it in items], rows, self.device)

    def _members(self, it: ScheduledSequence) -> list[Member]:
        """The resident adapters a scheduled sequence's rows apply, with their weights (stamped used)."""
        seq = it.seq
        if seq.lora_key is None:
            return []
        lr = seq.lora_request
        pairs: list[tuple[str, float]] = [(seq.lora_key, 1.0)]
        if lr is not None and lr.mix:
            pairs = list(zip(seq.lora_keys, (w for _, w in lr.mix), strict=True))
        out = []
        for key, weight in pairs:
            res = self.pool.resident.get(key)
            assert res is not None, "scheduled adapter must be resident"
            self._clock += 1
            res.last_used = self._clock
            out.append((res, weight))
        return out


def rows_context(
    pool: AdapterPool,
    backend: str,
    counts: Sequence[int],
    rows: Sequence[Sequence[Member]],
    device: torch.device,
) -> LoRAStepContext:
    """The step context of flat-batch items of `counts[i]` rows applying the members `rows[i]` ((adapter,
    weight), in mix order; empty: the base model): one ordinary context, or one pass per mix position
    when some row mixes (`engine/lora/mix.py`). Tensor-parallel workers build theirs with it too."""

    def make(counts: list[int], adapters: list[ResidentAdapter | None], k: int) -> LoRAStepContext:
        # pass k of a mix (0: each row's first or only adapter)
        return lora_context(pool, backend, counts, adapters, tag=f"#{k}" if k else "")

    if needs_mix(rows):
        return mixed_context(counts, rows, make, device)
    return make(list(counts), [r[0][0] if r else None for r in rows], 0)


def lora_context(
    pool: AdapterPool,
    backend: str,
    counts: Sequence[int],
    adapters: Sequence[ResidentAdapter | None],
    tag: str = "",
) -> LoRAStepContext:
    """The step context of `backend` for flat-batch requests of `counts` rows each using `adapters`
    (None: the base model), in that order; `tag` names the pass in the CPU path's cached plans."""
    if backend != "triton":
        return CpuLoRAContext(pool, token_segments(counts, adapters), native=backend == "native", tag=tag)
    slots = [(-1 if a is None else a.slot) for a, n in zip(adapters, counts, strict=True) for _ in range(n)]
    return TritonLoRAContext(pool, slots)
