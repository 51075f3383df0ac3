"""The memory floor of a decode step: the bytes it must read, over the read bandwidth measured in the run.

A decode step of a small batch reads every base weight once (shared by the batch) and, for LoRA, every
page of every *distinct* adapter in the batch (each decode row reads its own adapter's pages). On a CPU
those reads dominate the step, so the LoRA overhead can go no lower than

    floor = (base weight bytes + distinct adapter page bytes) / base weight bytes

and a decode step no faster than its bytes / read bandwidth. The embedding table is left out (a step
reads only the rows of its tokens) unless the LM head shares it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.intmath import cdiv


@dataclass(slots=True)
class ByteFloor:
    base_bytes: int  # weights one decode step reads
    adapter_bytes: int  # pages of the distinct adapters of the mixed batch
    read_gb_s: float  # `torch.sum` over a 100 MB buffer, same threads, same run

    @property
    def lora_overhead(self) -> float:
        """The smallest mixed / base decode-step ratio the bytes allow."""
        return (self.base_bytes + self.adapter_bytes) / self.base_bytes

    def step_s(self, with_adapters: bool) -> float:
        """The fastest a decode step can be at the measured bandwidth."""
        return (self.base_bytes + (self.adapter_bytes if with_adapters else 0)) / (self.read_gb_s * 1e9)


def base_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter a decode step reads (the embedding table only if it is the LM head)."""
    tied = getattr(model, "lm_head", None) is None
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if tied or not name.startswith("embed_tokens")
    )


def adapter_page_bytes(pool, digests) -> int:
    """Bytes the LoRA of one decode row per adapter reads, summed over the resident adapters `digests`: per
    layer and module, the rank rows of A (`rank x in`) and, of B (`out x page_rank` per page), the cache
    lines holding its first `rank` columns."""
    total = 0
    for digest in set(digests):
        for ranks in pool.resident[digest].layer_ranks:
            for m, r in enumerate(ranks):
                if r:
                    size = pool.a[m].element_size()
                    fin, fout, pr = pool.a[m].shape[3], pool.b[m].shape[2], pool.page_rank
                    full, rest = divmod(r, pr)
                    b_row = full * pr * size + cdiv(rest * size, 64) * 64  # bytes of B read per output row
                    total += r * fin * size + fout * b_row
    return total


def read_bandwidth_gb_s(repeats: int = 5) -> float:
    """Best-of-`repeats` read rate of `torch.sum` over 100 MB of float32, on torch's current threads."""
    t = torch.ones(25_000_000)
    t.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - start)
    return t.numel() * 4 / best / 1e9
