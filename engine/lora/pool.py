"""The paged adapter pool: LoRA weights of resident adapters in fixed-size device pages.

For each projection module m (q, k, v, o, gate, up, down) the pool holds::

    A[m]: [num_pages, num_layers, page_rank, in_m]     rank-rows of lora_A, all layers in one page
    B[m]: [num_pages, num_layers, out_m, page_rank]    rank-columns of lora_B

An adapter whose largest rank on module m is r takes ceil(r / page_rank) pages of m (none if it does not
target m), so adapters of mixed ranks share the pool without padding to the largest rank, and how many
fit depends on their ranks. Each resident adapter has a slot; per slot the pool keeps::

    page_table[m, slot, j]   page holding rank-rows [j*page_rank, (j+1)*page_rank) of module m
    ranks[layer, m, slot]    true rank at that layer (0 = layer/module not adapted)
    scalings[layer, m, slot] alpha/r (or alpha/sqrt(r) with rsLoRA)

Rows of a page beyond the adapter's rank are zero, so whole pages may be multiplied safely.

DoRA and LoRA-bias adapters also keep, per adapted (layer, module), the two float32 vectors of their
per-row epilogue `y ← y ⊙ f + c` (`engine/lora/dora.py`), computed at upload from the adapter and the
pool's `base` weights (host side, float32; cached with the host copy, so once per load) and held in the
pool's `epilogues` store (`engine/lora/epilogue.py`) under the adapter's `epi_slot`.

LoRA on a mixture-of-experts model's routed experts lives in the pool's `experts` store
(`engine/lora/expert_pages.py`: pages of per-expert A/B rows, grown as expert adapters arrive);
`ResidentAdapter.memory_bytes` is an adapter's device bytes in both kinds of pages.

An adapter with LoRA on embed_tokens / lm_head, or trainable tokens, keeps its device copy of those
(at vocabulary width) in `ResidentAdapter.vocab` (`engine/lora/vocab_step.py`), outside the pages;
dropped on eviction.

Under tensor parallel each rank has its own pool over its shard's widths (`cfg` is the rank's local
config) and `shard` cuts every adapter to the rank's part (`engine/distributed/shard.py`; its epilogue
vectors: `engine/distributed/shard_adapters.py`). Rank 0 decides slots and pages; with `journal` set, its
pool records every upload and eviction, which the worker group replays on the other ranks with `place`
at the same slot and pages, each followed on every rank by `finish_upload` (the one all-reduce of a
row-parallel DoRA norm, when the adapter has one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.distributed.shard_adapters import finish_row_norms, needs_norm_reduce, rank_epilogues
from engine.lora.adapter_checkpoint import PROJECTIONS, AdapterCheckpoint, module_features
from engine.lora.dora import BaseWeights, row_epilogue
from engine.lora.epilogue import EpilogueStore
from engine.lora.expert_pages import ExpertPageStore, ExpertResident
from engine.lora.side_memory import check_side_budget, page_pool_bytes, side_bytes
from engine.lora.vocab_step import VocabLoRA, device_vocab_lora
from engine.model_config import ModelConfig
from kernels.intmath import cdiv

if TYPE_CHECKING:
    from engine.distributed.shard import TensorShard

MODULE_INDEX = {m: i for i, m in enumerate(PROJECTIONS)}


@dataclass(slots=True)
class ResidentAdapter:
    digest: str
    slot: int
    pages: list[list[int]]  # per module: page ids (empty if the module is not targeted)
    layer_ranks: list[list[int]]  # [layer][module] true rank (0 = not adapted)
    layer_scalings: list[list[float]]  # [layer][module] scaling
    num_pages: int = 0
    last_used: int = 0
    names: set[str] = field(default_factory=set)
    epi_slot: int = -1  # slot in the pool's epilogue store (DoRA / lora_bias adapters), -1: none
    epi_modules: frozenset[int] = frozenset()  # module indices with epilogue vectors
    vocab: VocabLoRA | None = None  # its embed_tokens / lm_head LoRA on the device (`vocab_step.py`)
    experts: ExpertResident | None = None  # its pages of LoRA on a MoE model's experts (`expert_pages.py`)
    memory_bytes: int = 0  # device bytes of its pages (projections and experts)
    side_bytes: int = 0  # device bytes beside its pages (vocab copy, epilogue vectors; `side_memory.py`)


class AdapterPool:
    """Fixed-size paged storage for adapter weights on the engine's device, with slot bookkeeping."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_rank: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        base: BaseWeights | None = None,
        shard: TensorShard | None = None,
        side_budget: int | None = None,
    ) -> None:
        if page_rank < 1:
            raise ValueError(f"lora page_rank must be >= 1, got {page_rank}")
        self.max_pages_per_adapter = cdiv(max_lora_rank, page_rank)
        if num_pages < self.max_pages_per_adapter:
            raise ValueError(
                f"lora pool has {num_pages} pages per module; one rank-{max_lora_rank} adapter needs "
                f"{self.max_pages_per_adapter}"
            )
        self.cfg, self.page_rank, self.num_pages = cfg, page_rank, num_pages
        self.dtype, self.device = dtype, device
        self.base = base  # the base model's weights (DoRA norms, base biases); None: DoRA refused
        self.shard = shard  # tensor parallel: this rank's part of each adapter (None: all of it)
        # fully-sharded tensor parallel: the group's all-gather (`engine/lora/sharded_shrink.py`)
        self.all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        # tensor parallel: the group's all-reduce, for row-parallel DoRA norms (`finish_upload`)
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        # rank 0 under tensor parallel: ("upload", ckpt, slot, pages) / ("evict", digest) in order
        self.journal: list[tuple] | None = None
        layers = cfg.num_layers
        self.a: list[torch.Tensor] = []
        self.b: list[torch.Tensor] = []
        for m in PROJECTIONS:
            fin, fout = module_features(cfg, m)
            # fully-sharded tensor parallel: this rank's share of each page's A rows (`shard.a_page_rows`)
            a_rows = page_rank // shard.world if shard is not None and shard.splits_a(m) else page_rank
            self.a.append(torch.zeros(num_pages, layers, a_rows, fin, dtype=dtype, device=device))
            self.b.append(torch.zeros(num_pages, layers, fout, page_rank, dtype=dtype, device=device))
        self.max_slots = num_pages
        n_mod = len(PROJECTIONS)
        self.page_table = torch.zeros(
            n_mod, self.max_slots, self.max_pages_per_adapter, dtype=torch.int32, device=device
        )
        self.ranks = torch.zeros(layers, n_mod, self.max_slots, dtype=torch.int32, device=device)
        self.scalings = torch.zeros(layers, n_mod, self.max_slots, dtype=torch.float32, device=device)
        self.epilogues = EpilogueStore(layers, [module_features(cfg, m)[1] for m in PROJECTIONS], device)
        self._free_pages = [list(range(num_pages)) for _ in PROJECTIONS]
        self._free_slots = list(range(self.max_slots))
        self.resident: dict[str, ResidentAdapter] = {}
        # LoRA on a MoE model's routed experts (pages allocated as expert adapters arrive)
        self.experts = (
            ExpertPageStore(cfg, num_pages, page_rank, dtype, device, shard) if cfg.extra.get("moe") else None
        )
        # Data the compute paths derive from the current residents (e.g. the CPU path's gather indices),
        # keyed by what it depends on; cleared on every upload and eviction so it never goes stale.
        self.step_cache: dict[str, object] = {}
        # what residents keep beside their pages, bounded like the pages (engine/lora/side_memory.py)
        self.side_budget = side_budget or page_pool_bytes(cfg, num_pages, page_rank, dtype.itemsize)
        self.side_used = 0

    # ---- capacity ---------------------------------------------------------------------------------
    def pages_needed(self, ckpt: AdapterCheckpoint) -> list[int]:
        """Pages per module that `ckpt` takes: ceil(max rank on that module / page_rank)."""
        need = [0] * len(PROJECTIONS)
        for w in ckpt.modules:
            i = MODULE_INDEX[w.module]
            need[i] = max(need[i], cdiv(w.rank, self.page_rank))
        return need

    def side_need(self, ckpt: AdapterCheckpoint) -> int:
        """Device bytes `ckpt` keeps beside its pages when resident (`side_memory.side_bytes`)."""
        if "side_bytes" not in ckpt.derived:
            ckpt.derived["side_bytes"] = side_bytes(ckpt, self.cfg, self.dtype.itemsize)
        return int(ckpt.derived["side_bytes"])

    def check_side_budget(self, ckpt: AdapterCheckpoint) -> None:
        """`AdapterError` (naming both numbers) when `ckpt` alone exceeds the side budget."""
        check_side_budget(ckpt, self.cfg, self.dtype.itemsize, self.side_budget)

    def fits(self, ckpt: AdapterCheckpoint) -> bool:
        experts_fit = not ckpt.experts or (self.experts is not None and self.experts.fits(ckpt))
        return (
            bool(self._free_slots)
            and experts_fit
            and self.side_used + self.side_need(ckpt) <= self.side_budget
            and all(n <= len(free) for n, free in zip(self.pages_needed(ckpt), self._free_pages, strict=True))
        )

    def pages_used(self) -> int:
        return sum(self.num_pages - len(f) for f in self._free_pages)

    def pages_total(self) -> int:
        return self.num_pages * len(PROJECTIONS)

    # ---- load / evict -----------------------------------------------------------------------------
    def upload(self, ckpt: AdapterCheckpoint) -> ResidentAdapter:
        """Copy an adapter's weights into free pages and give it a slot. Caller checks `fits` first."""
        if ckpt.digest in self.resident:
            return self.resident[ckpt.digest]
        if not self.fits(ckpt):
            raise RuntimeError("adapter pool has no room; evict first")
        need = self.pages_needed(ckpt)
        pages = [self._free_pages[m][:n] for m, n in enumerate(need)]
        return self.place(ckpt, self._free_slots[0], pages)

    def place(self, ckpt: AdapterCheckpoint, slot: int, pages: list[list[int]]) -> ResidentAdapter:
        """Copy an adapter's weights (this rank's part of them) into the free `pages` (per module) and
        give it the free `slot`: `upload`'s choice, or on another tensor-parallel rank rank 0's."""
        self.step_cache.clear()
        self._free_slots.remove(slot)
        for m, plist in enumerate(pages):
            for page in plist:
                self._free_pages[m].remove(page)
        need = [len(p) for p in pages]
        layer_ranks = [[0] * len(PROJECTIONS) for _ in range(self.cfg.num_layers)]
        layer_scalings = [[0.0] * len(PROJECTIONS) for _ in range(self.cfg.num_layers)]
        pr = self.page_rank
        with torch.no_grad():
            for m, plist in enumerate(pages):
                if plist:
                    idx = torch.tensor(plist, device=self.device)
                    self.a[m][idx] = 0
                    self.b[m][idx] = 0
                    self.page_table[m, slot, : len(plist)] = idx.to(torch.int32)
            for w in ckpt.modules:
                m = MODULE_INDEX[w.module]
                assert w.lora_a is not None and w.lora_b is not None, "uploading an adapter needs its weights"
                a, b = w.lora_a, w.lora_b
                if self.shard is not None:
                    a, b = self.shard.lora(w.module, a, b)
                a, b = a.to(self.device, self.dtype), b.to(self.device, self.dtype)
                split = self.shard is not None and self.shard.splits_a(w.module)
                for j, page in enumerate(pages[m]):
                    lo, hi = j * pr, min((j + 1) * pr, w.rank)
                    if lo >= hi:
                        break
                    self.b[m][page, w.layer, :, : hi - lo] = b[:, lo:hi]
                    if split:  # this rank's rows of the page (zero beyond the rank)
                        assert self.shard is not None
                        rows = self.shard.a_page_rows(j, pr)
                        alo, ahi = rows.start, min(rows.stop, w.rank)
                        if alo < ahi:
                            self.a[m][page, w.layer, : ahi - alo] = a[alo:ahi]
                    else:
                        self.a[m][page, w.layer, : hi - lo] = a[lo:hi]
                self.ranks[w.layer, m, slot] = w.rank
                self.scalings[w.layer, m, slot] = w.scaling
                layer_ranks[w.layer][m] = w.rank
                layer_scalings[w.layer][m] = w.scaling
        entry = ResidentAdapter(ckpt.digest, slot, pages, layer_ranks, layer_scalings, num_pages=sum(need))
        entry.memory_bytes = sum(
            len(plist) * (self.a[m][0].nbytes + self.b[m][0].nbytes) for m, plist in enumerate(pages)
        )
        if ckpt.experts and self.experts is not None:
            entry.experts = self.experts.upload(ckpt)
            entry.memory_bytes += entry.experts.memory_bytes
        epi = self._epilogues(ckpt)
        if epi:
            entry.epi_slot, entry.epi_modules = self.epilogues.add(epi), frozenset(epi)
        entry.vocab = device_vocab_lora(ckpt, self.cfg.vocab_size, self.dtype, self.device)
        entry.side_bytes = self.side_need(ckpt)
        self.side_used += entry.side_bytes
        self.resident[ckpt.digest] = entry
        if self.journal is not None:
            self.journal.append(("upload", ckpt, slot, pages))
        return entry

    def _epilogues(self, ckpt: AdapterCheckpoint) -> dict[int, torch.Tensor]:
        """The DoRA / lora_bias epilogue vectors of `ckpt` per module index ([layers, 2, out], host
        float32), computed on its first upload and cached with its host copy."""
        if not (ckpt.use_dora or ckpt.lora_bias):
            return {}
        if "epilogue" in ckpt.derived:
            return ckpt.derived["epilogue"]
        if self.shard is not None:  # this rank's part (row-parallel DoRA rows: `finish_upload`)
            ckpt.derived["epilogue"] = rank_epilogues(ckpt, self.cfg.num_layers, self.base, self.shard)
            return ckpt.derived["epilogue"]
        host: dict[int, torch.Tensor] = {}
        for w in ckpt.modules:
            fc = row_epilogue(w, self.base)
            if fc is None:
                continue
            m = MODULE_INDEX[w.module]
            if m not in host:
                host[m] = torch.zeros(self.cfg.num_layers, 2, len(fc[0]))
                host[m][:, 0] = 1.0
            host[m][w.layer, 0], host[m][w.layer, 1] = fc
        ckpt.derived["epilogue"] = host
        return host

    def finish_upload(self, ckpt: AdapterCheckpoint) -> None:
        """Under tensor parallel, after `ckpt`'s upload reached every rank: the one all-reduce that
        completes its row-parallel DoRA norms (`engine/distributed/shard_adapters.py`), on every rank in
        the same order; nothing for other adapters or at one rank."""
        if not needs_norm_reduce(self.shard, ckpt):
            return
        assert self.shard is not None and self.all_reduce is not None, "a tensor-parallel pool has both"
        entry = self.resident.get(ckpt.digest)
        slot = entry.epi_slot if entry is not None else None
        finish_row_norms(ckpt, self.base, self.shard, self.all_reduce, self.device, self.epilogues, slot)

    def evict(self, digest: str) -> None:
        """Return an adapter's pages and slot to the free lists (its weights are no longer served)."""
        entry = self.resident.pop(digest)
        if self.journal is not None:
            self.journal.append(("evict", digest))
        self.step_cache.clear()
        self.side_used -= entry.side_bytes
        self.ranks[:, :, entry.slot] = 0
        self.scalings[:, :, entry.slot] = 0
        self.page_table[:, entry.slot] = 0
        if entry.epi_slot >= 0:
            self.epilogues.remove(entry.epi_slot)
        if entry.experts is not None and self.experts is not None:
            self.experts.evict(entry.experts)
        for m, plist in enumerate(entry.pages):
            self._free_pages[m].extend(plist)
        self._free_slots.append(entry.slot)
