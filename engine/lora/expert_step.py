"""A step's LoRA on a mixture-of-experts model's routed experts (`ExpertLoRAStep`), read by the MoE block.

Built once per step from the runs of flat-batch rows whose adapter has expert pages
(`engine/lora/expert_pages.py`). The MoE block (`engine/model/moe_experts.py`) sorts its (token, expert)
pairs by (expert, `row_adapter[token]`) once, so within each expert's rows every adapter's rows are one
run, and for each run adds that adapter's delta for that expert::

    out[run] += scaling[a, layer, p] * (x[run] @ A[a, layer, p, e].T) @ B[a, layer, p, e].T

one GEMM pair per page the adapter's rank on p covers (pages are zero beyond the rank). A layer's runs
of one adapter are multiplied together (`add_runs`: runs of similar length padded to one length, their
pages gathered, a `bmm` and a `baddbmm_` per page: a prefill over many experts is a few batched GEMMs
instead of two small GEMMs per run); short runs (decode rows) of a layer are applied together instead,
their pages gathered into two row-vector `bmm`s (`add_pairs`). Rows of base
requests and of adapters without expert LoRA have `row_adapter` = `num_adapters` and are never touched.
On CUDA the Triton fused-MoE kernel reads the same pages through `kernel_lora` (one layer's page tables
and scalings, `kernels/moe_lora_meta.py`; every layer's built at once per step) and adds the deltas inside
its grouped GEMMs; so does the CPU's fused decode call (`kernels/moe_fused_cpu.py`) for decode-sized
steps, which then skip `add` / `add_pairs`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from engine.lora.expert_pages import EXPERT_PROJS, ExpertPageStore, ExpertResident
from engine.lora.pool import AdapterPool, ResidentAdapter
from kernels.intmath import cdiv
from kernels.moe_lora_meta import ExpertLoRAWeights, MoELoRA


class ExpertLoRAStep:
    """The step's expert adapters and each row's index among them (module docstring)."""

    def __init__(self, store: ExpertPageStore, runs: Sequence[tuple[ResidentAdapter, range]]) -> None:
        self.store = store
        self.adapters: list[ExpertResident] = []
        index: dict[int, int] = {}
        self._runs: list[tuple[int, range]] = []
        for ad, rows in runs:
            assert ad.experts is not None, "expert runs are of adapters with expert pages"
            if ad.slot not in index:
                index[ad.slot] = len(self.adapters)
                self.adapters.append(ad.experts)
            self._runs.append((index[ad.slot], rows))
        self.num_adapters = len(self.adapters)
        self._rows: torch.Tensor | None = None
        self._kernel: dict[tuple[int, int], MoELoRA] = {}
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor, list[bool]]] | None = None

    def __bool__(self) -> bool:
        return self.num_adapters > 0

    @property
    def page_dtype(self) -> torch.dtype:
        """The dtype of the pool's expert pages (the CPU's fused MoE call takes them in the model's)."""
        return self.store.dtype

    def row_adapter(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """int64 [num_rows]: each flat-batch row's adapter index, `num_adapters` for rows without one."""
        if self._rows is None or self._rows.shape[0] != num_rows:
            rows = torch.full((num_rows,), self.num_adapters, dtype=torch.long)
            for j, run in self._runs:
                rows[run.start : run.stop] = j
            self._rows = rows.to(device)
        return self._rows

    def adapts(self, layer: int) -> bool:
        """Whether any adapter of the step has expert LoRA in `layer`."""
        return any(ad.ranks[layer] for ad in self.adapters)

    def kernel_lora(self, layer: int, num_rows: int, device: torch.device) -> MoELoRA:
        """Layer `layer`'s expert LoRA as the fused-MoE kernel reads it (built once per step and layer):
        each row's adapter, and per projection the layer's view of the pages, each adapter's page ids
        (ceil(rank / page_rank) of them, -1 after) and scaling (0 where it does not adapt it)."""
        key = (layer, num_rows)
        lora = self._kernel.get(key)
        if lora is not None:
            return lora
        store = self.store
        weights: dict[str, ExpertLoRAWeights | None] = {}
        for proj, (table, scale, adapted) in self._layer_tables(device).items():
            weights[proj] = None
            if adapted[layer]:
                a, b = store.a[proj][:, layer], store.b[proj][:, layer]
                weights[proj] = ExpertLoRAWeights(a, b, table[layer], scale[layer])
        lora = MoELoRA(
            self.row_adapter(num_rows, device), self.num_adapters, weights["gate_up"], weights["down"]
        )
        self._kernel[key] = lora
        return lora

    def _layer_tables(self, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor, list[bool]]]:
        """Per projection, for every layer at once (built once per step): each adapter's page ids (int32
        [layers, adapters, width], ceil(rank / page_rank) of them, -1 after), its scaling (float32
        [layers, adapters], 0 where it does not adapt), and whether any adapter adapts the layer."""
        if self._tables is None:
            pr, layers = self.store.page_rank, self.store.cfg.num_layers
            self._tables = {}
            for proj in EXPERT_PROJS:
                counts = [[cdiv(ad.ranks[i].get(proj, 0), pr) for ad in self.adapters] for i in range(layers)]
                width = max([1, *(max(c, default=0) for c in counts)])
                rows = [
                    [ad.pages[proj][:n] + [-1] * (width - n) for ad, n in zip(self.adapters, c, strict=True)]
                    for c in counts
                ]
                scales = [[ad.scalings[i].get(proj, 0.0) for ad in self.adapters] for i in range(layers)]
                self._tables[proj] = (
                    torch.tensor(rows, dtype=torch.int32).to(device),
                    torch.tensor(scales, dtype=torch.float32).to(device),
                    [any(c) for c in counts],
                )
        return self._tables

    def add(
        self, layer: int, proj: str, expert: int, adapter: int, x: torch.Tensor, out: torch.Tensor
    ) -> None:
        """`out += scaling * (x @ A_e.T) @ B_e.T` for adapter index `adapter`'s expert `expert` (in place)."""
        ad = self.adapters[adapter]
        rank = ad.ranks[layer].get(proj, 0)
        if not rank:
            return
        scale = ad.scalings[layer][proj]
        a, b = self.store.a[proj], self.store.b[proj]
        for page in ad.pages[proj][: cdiv(rank, self.store.page_rank)]:
            v = x @ a[page, layer, expert].to(x.dtype).T
            out.addmm_(v, b[page, layer, expert].to(x.dtype).T, alpha=scale)

    def _flat_pages(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`proj`'s A and B pages as [pages * layers * experts, pr, in] and [..., out, pr] views, the rows
        `_page_row` numbers."""
        a, b, pr = self.store.a[proj], self.store.b[proj], self.store.page_rank
        return a.view(-1, pr, a.shape[-1]), b.view(-1, b.shape[-2], pr)

    def _page_row(self, page: int, layer: int, expert: int) -> int:
        """The row of `_flat_pages` holding `page`'s slice for `layer` and `expert`."""
        return (page * self.store.cfg.num_layers + layer) * self.store.num_experts + expert

    def add_runs(
        self,
        layer: int,
        proj: str,
        runs: Sequence[tuple[int, int, int, int]],
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """`add` for every run (expert e, adapter index j, first row lo, rows n) of x and out, batched: per
        adapter, its runs in chunks of similar length (`_run_chunks`); per chunk and page, the runs' pages
        gathered into [G, pr, in] and [G, out, pr] and their rows into zero-padded [G, n_max, ...], one
        `bmm` and one `baddbmm_` with the adapter's scaling (what `add`'s `addmm_` computes, one rounding of
        out per page), and the rows written back. A chunk of one run is `add` itself."""
        by_adapter: dict[int, list[tuple[int, int, int]]] = {}
        for e, j, lo, n in runs:
            by_adapter.setdefault(j, []).append((e, lo, n))
        pr = self.store.page_rank
        a_pages, b_pages = self._flat_pages(proj)
        device = out.device
        for j, mine in by_adapter.items():
            ad = self.adapters[j]
            rank = ad.ranks[layer].get(proj, 0)
            if not rank:
                continue
            for chunk in _run_chunks(mine):
                if len(chunk) == 1:
                    e, lo, n = chunk[0]
                    self.add(layer, proj, e, j, x[lo : lo + n], out[lo : lo + n])
                    continue
                g, n_max = len(chunk), chunk[0][2]
                pos = torch.tensor(
                    [i * n_max + r for i, (_, _, n) in enumerate(chunk) for r in range(n)], device=device
                )
                rows = torch.tensor([lo + r for _, lo, n in chunk for r in range(n)], device=device)
                xp = x.new_zeros(g * n_max, x.shape[1]).index_copy_(0, pos, x.index_select(0, rows))
                op = out.new_zeros(g * n_max, out.shape[1]).index_copy_(0, pos, out.index_select(0, rows))
                for page in ad.pages[proj][: cdiv(rank, pr)]:
                    rows_of = [self._page_row(page, layer, e) for e, _, _ in chunk]
                    idx = torch.tensor(rows_of, dtype=torch.long, device=device)
                    a = a_pages.index_select(0, idx).to(x.dtype)  # [G, pr, in]
                    b = b_pages.index_select(0, idx).to(x.dtype)  # [G, out, pr]
                    v = torch.bmm(xp.view(g, n_max, -1), a.transpose(1, 2))
                    op.view(g, n_max, -1).baddbmm_(v, b.transpose(1, 2), alpha=ad.scalings[layer][proj])
                out.index_copy_(0, rows, op.index_select(0, pos))

    def add_pairs(
        self,
        layer: int,
        proj: str,
        rows: list[int],
        experts: list[int],
        adapters: list[int],
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """For every pair k: `out[rows[k]] += s * (x[rows[k]] @ A.T) @ B.T` with adapter `adapters[k]`'s
        pages of expert `experts[k]` (short runs: decode rows). On the CPU in float32 the native kernel
        reads the pages in place (`kernels/moe_lora_pairs_cpu.py`); elsewhere the pages of all pairs are
        gathered into `[K, page_rank, in]` and `[K, out, page_rank]`, two row-vector `bmm`s and one
        `index_add_`."""
        pr = self.store.page_rank
        index, entry, scale = [], [], []
        for row, e, j in zip(rows, experts, adapters, strict=True):
            ad = self.adapters[j]
            rank = ad.ranks[layer].get(proj, 0)
            for page in ad.pages[proj][: cdiv(rank, pr)]:
                index.append(self._page_row(page, layer, e))
                entry.append(row)
                scale.append(ad.scalings[layer][proj])
        if not index:
            return
        device = out.device
        idx = torch.tensor(index, dtype=torch.long, device=device)
        at = torch.tensor(entry, dtype=torch.long, device=device)
        a_pages, b_pages = self._flat_pages(proj)
        if _native_pairs(x, a_pages, b_pages, out):  # the pages read in place, no gathered copies
            from kernels.moe_lora_pairs_cpu import lora_pairs_cpu

            lora_pairs_cpu(x, a_pages, b_pages, idx, at, torch.tensor(scale, dtype=torch.float32), out)
            return
        a = a_pages.index_select(0, idx).to(x.dtype)  # [K, pr, in]
        b = b_pages.index_select(0, idx).to(x.dtype)  # [K, out, pr]
        v = torch.bmm(x.index_select(0, at).unsqueeze(1), a.transpose(1, 2))  # [K, 1, pr]
        v.mul_(torch.tensor(scale, dtype=x.dtype, device=device).view(-1, 1, 1))
        out.index_add_(0, at, torch.bmm(v, b.transpose(1, 2)).squeeze(1))


# `add_runs`: a chunk's padded rows (its longest run times its runs) stay within this share of its rows,
# and a chunk holds at most CHUNK_MAX_ROWS padded rows (its gathered copies of x and out)
CHUNK_PAD = 1.5
CHUNK_MAX_ROWS = 2048


def _run_chunks(runs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """`runs` (expert, first row, rows) longest first, cut into chunks whose zero-padded size (the first's
    rows times the chunk's runs) is at most `CHUNK_PAD` times their rows and `CHUNK_MAX_ROWS`."""
    chunks: list[list[tuple[int, int, int]]] = []
    rows = 0
    for run in sorted(runs, key=lambda r: -r[2]):
        if chunks:
            cur, n_max = chunks[-1], chunks[-1][0][2]
            padded = (len(cur) + 1) * n_max
            if padded <= CHUNK_PAD * (rows + run[2]) and padded <= CHUNK_MAX_ROWS:
                cur.append(run)
                rows += run[2]
                continue
        chunks.append([run])
        rows = run[2]
    return chunks


# False: add_pairs always takes the torch path (tests compare the two)
NATIVE_PAIRS = True


def _native_pairs(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `add_pairs` runs the native kernel: CPU float32 throughout, contiguous pages and rows, and
    the kernel builds here."""
    if not NATIVE_PAIRS or x.device.type != "cpu":
        return False
    if any(t.dtype != torch.float32 for t in (x, a, b, out)) or not (a.is_contiguous() and b.is_contiguous()):
        return False
    return x.stride(-1) == 1 and out.stride(-1) == 1 and _pairs_build()


@functools.cache
def _pairs_build() -> bool:
    """Whether the native pair kernel builds here (once per process)."""
    from kernels.moe_lora_pairs_cpu import supported_dtypes
    from kernels.native_build import NativeBuildError

    try:
        return torch.float32 in supported_dtypes()
    except NativeBuildError:
        return False


def expert_step(pool: AdapterPool, runs: Sequence[tuple[ResidentAdapter, range]]) -> ExpertLoRAStep | None:
    """The step's expert LoRA over `runs` (adapter, flat-batch rows), or None when none has expert pages."""
    if pool.experts is None:
        return None
    runs = [(ad, rows) for ad, rows in runs if ad.experts is not None]
    return ExpertLoRAStep(pool.experts, runs) if runs else None
