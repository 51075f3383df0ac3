"""The adapter pool's pages for LoRA on a mixture-of-experts model's routed experts.

For each expert projection p ("gate_up": the packed gate|up rows, "down") the store holds::

    A[p]: [capacity, num_layers, num_experts, page_rank, in_p]     rank-rows of every expert's lora_A
    B[p]: [capacity, num_layers, num_experts, out_p, page_rank]    rank-columns of every expert's lora_B

A page holds `page_rank` rank-rows of one projection for every layer and every expert, so an adapter
whose largest rank on p is r takes ceil(r / page_rank) pages of p, as the projections' pages do
(`engine/lora/pool.py`). Rows beyond an adapter's rank (and experts it leaves out) are zero, so whole
pages are multiplied safely. An expert page is num_layers x num_experts times larger than a projection
page (e.g. ~0.4 GiB for gate_up of Qwen3-30B-A3B at page_rank 16 in bfloat16), so the store is not
allocated up front: its capacity grows (doubling, at most `max_pages` per projection) when an expert
adapter is uploaded, and models without experts, or serving no expert adapter, pay nothing.

Under tensor parallel each rank's store holds its part only: its experts (expert parallel), or its rows
of every expert's gate_up B and columns of its down A (`engine/distributed/moe_shard.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.lora.adapter_checkpoint import AdapterCheckpoint
from engine.lora.expert_targets import expert_features
from engine.model_config import ModelConfig
from kernels.intmath import cdiv

if TYPE_CHECKING:
    from engine.distributed.shard import TensorShard

EXPERT_PROJS = ("gate_up", "down")


@dataclass(slots=True)
class ExpertResident:
    """A resident adapter's expert pages: per projection its page ids, per layer its rank and scaling."""

    pages: dict[str, list[int]]
    ranks: list[dict[str, int]]  # [layer] -> {proj: rank} (absent: not adapted)
    scalings: list[dict[str, float]]
    memory_bytes: int


class ExpertPageStore:
    """Growable paged storage of expert LoRA weights on the engine's device (module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_pages: int,
        page_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        shard: TensorShard | None = None,
    ) -> None:
        """`cfg`: the rank's (local) config; `shard`: tensor parallel, this rank's part of every adapter's
        expert LoRA (`engine/distributed/moe_shard.py`: its experts, or its rows of each)."""
        self.cfg, self.max_pages, self.page_rank = cfg, max_pages, page_rank
        self.dtype, self.device, self.shard = dtype, device, shard
        moe = cfg.extra["moe"]
        local = moe.get("local_experts")
        self.num_experts = int(moe["num_experts"]) if local is None else len(local)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.capacity = dict.fromkeys(EXPERT_PROJS, 0)
        self._free: dict[str, list[int]] = {p: [] for p in EXPERT_PROJS}
        self._used = dict.fromkeys(EXPERT_PROJS, 0)

    def page_bytes(self, proj: str) -> int:
        """Device bytes of one page of `proj` (its A and B rows for every layer and expert)."""
        fin, fout = expert_features(self.cfg, proj)
        per = self.cfg.num_layers * self.num_experts * self.page_rank * (fin + fout)
        return per * torch.empty((), dtype=self.dtype).element_size()

    def pages_needed(self, ckpt: AdapterCheckpoint) -> dict[str, int]:
        """Pages per projection that `ckpt` takes: ceil(largest rank on it / page_rank)."""
        need = dict.fromkeys(EXPERT_PROJS, 0)
        for w in ckpt.experts:
            need[w.proj] = max(need[w.proj], cdiv(w.rank, self.page_rank))
        return need

    def fits(self, ckpt: AdapterCheckpoint) -> bool:
        need = self.pages_needed(ckpt)
        return all(self._used[p] + n <= self.max_pages for p, n in need.items())

    def upload(self, ckpt: AdapterCheckpoint) -> ExpertResident:
        """Copy `ckpt`'s expert LoRA into free pages (growing the store as needed); caller checks `fits`."""
        need = self.pages_needed(ckpt)
        pages = {p: self._take(p, n) for p, n in need.items()}
        layers = self.cfg.num_layers
        ranks: list[dict[str, int]] = [{} for _ in range(layers)]
        scalings: list[dict[str, float]] = [{} for _ in range(layers)]
        pr = self.page_rank
        with torch.no_grad():
            for p, plist in pages.items():
                for page in plist:
                    self.a[p][page].zero_()
                    self.b[p][page].zero_()
            for w in ckpt.experts:
                assert w.lora_a is not None and w.lora_b is not None, "uploading an adapter needs its weights"
                a, b = w.lora_a, w.lora_b
                if self.shard is not None and self.shard.world > 1:
                    from engine.distributed.moe_shard import expert_lora

                    a, b = expert_lora(self.shard, w.proj, a, b)
                a, b = a.to(self.device, self.dtype), b.to(self.device, self.dtype)
                for j, page in enumerate(pages[w.proj]):
                    lo, hi = j * pr, min((j + 1) * pr, w.rank)
                    if lo >= hi:
                        break
                    self.a[w.proj][page, w.layer, :, : hi - lo] = a[:, lo:hi]
                    self.b[w.proj][page, w.layer, :, :, : hi - lo] = b[:, :, lo:hi]
                ranks[w.layer][w.proj] = w.rank
                scalings[w.layer][w.proj] = w.scaling
        memory = sum(len(plist) * self.page_bytes(p) for p, plist in pages.items())
        return ExpertResident(pages, ranks, scalings, memory)

    def evict(self, entry: ExpertResident) -> None:
        """Return an evicted adapter's expert pages to the free lists."""
        for p, plist in entry.pages.items():
            self._free[p].extend(plist)
            self._used[p] -= len(plist)

    def memory_bytes(self) -> int:
        """Device bytes the store has allocated (all pages, used or free)."""
        return sum(self.capacity[p] * self.page_bytes(p) for p in EXPERT_PROJS)

    def _take(self, proj: str, n: int) -> list[int]:
        if n > len(self._free[proj]):
            self._grow(proj, min(self.max_pages, max(self.capacity[proj] + n, 2 * self.capacity[proj])))
        taken = [self._free[proj].pop(0) for _ in range(n)]
        self._used[proj] += n
        return taken

    def _grow(self, proj: str, capacity: int) -> None:
        fin, fout = expert_features(self.cfg, proj)
        shape = (self.cfg.num_layers, self.num_experts)
        old = self.capacity[proj]
        a = torch.zeros(capacity, *shape, self.page_rank, fin, dtype=self.dtype, device=self.device)
        b = torch.zeros(capacity, *shape, fout, self.page_rank, dtype=self.dtype, device=self.device)
        if old:
            a[:old], b[:old] = self.a[proj], self.b[proj]
        self.a[proj], self.b[proj] = a, b
        self._free[proj].extend(range(old, capacity))
        self.capacity[proj] = capacity
