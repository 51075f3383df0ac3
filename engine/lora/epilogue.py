"""DoRA / lora_bias epilogue storage and its per-step application: `y[rows, slice] ← y ⊙ f + c`.

`EpilogueStore` (part of the adapter pool) keeps, for each resident adapter that has epilogue vectors
(`engine/lora/dora.py`), one epilogue slot: per module m a float32 tensor `vec[m]`
[layers, capacity, 2, out_m] holds (f, c) at `[:, slot]`; slots of other adapters, layers an adapter does
not adapt and modules it does not target hold f = 1, c = 0. Only DoRA / lora_bias adapters take a slot,
and the capacity doubles when full, so plain-LoRA pools pay nothing.

`RowEpilogue` is a step's application over the runs of rows of such adapters: per module it records each
row's epilogue slot once, so one layer's slice costs one gather of the rows' (f, c) and one fused update,
however many adapters the batch mixes; a single run (a prefill chunk) is updated in place. Base rows and
plain-LoRA rows are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.lora.pool import ResidentAdapter


class EpilogueStore:
    """Per-module (f, c) vectors of the resident DoRA / lora_bias adapters, one slot per adapter."""

    def __init__(self, num_layers: int, widths: Sequence[int], device: torch.device) -> None:
        self.num_layers, self.widths, self.device = num_layers, list(widths), device
        self.vec: list[torch.Tensor | None] = [None] * len(widths)
        self.capacity = 0
        self._free: list[int] = []

    def _identity(self, m: int, capacity: int) -> torch.Tensor:
        t = torch.zeros(self.num_layers, capacity, 2, self.widths[m], device=self.device)
        t[:, :, 0] = 1.0
        return t

    def add(self, host: dict[int, torch.Tensor]) -> int:
        """Store an adapter's vectors (per module index: [layers, 2, out] float32); returns its slot."""
        if not self._free:
            grown = max(4, 2 * self.capacity)
            for m, old in enumerate(self.vec):
                if old is not None:
                    new = self._identity(m, grown)
                    new[:, : self.capacity] = old
                    self.vec[m] = new
            self._free = list(range(self.capacity, grown))
            self.capacity = grown
        slot = self._free.pop(0)
        for m, t in host.items():
            store = self.vec[m]
            if store is None:
                store = self.vec[m] = self._identity(m, self.capacity)
            store[:, slot] = t.to(self.device)
        return slot

    def remove(self, slot: int) -> None:
        """Reset an evicted adapter's slot to the identity and free it."""
        for t in self.vec:
            if t is not None:
                t[:, slot, 0], t[:, slot, 1] = 1.0, 0.0
        self._free.append(slot)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.vec if t is not None)


class _ModuleRows:
    """One module's rows in a step: their epilogue slots (or the single run's slot and span)."""

    def __init__(self, runs: list[tuple[ResidentAdapter, range]], device: torch.device) -> None:
        self.adapters = [ad for ad, _ in runs]
        self.span: tuple[range, int] | None = (runs[0][1], runs[0][0].epi_slot) if len(runs) == 1 else None
        self.rows = torch.tensor([r for _, run in runs for r in run], dtype=torch.long, device=device)
        slots = [ad.epi_slot for ad, run in runs for _ in run]
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)


class RowEpilogue:
    """The step's epilogue over `runs`: (adapter with epilogue vectors, the flat-batch rows it owns)."""

    def __init__(self, store: EpilogueStore, runs: Sequence[tuple[ResidentAdapter, range]]) -> None:
        self.store = store
        self._runs = list(runs)
        self._modules: dict[int, _ModuleRows | None] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def apply(self, layer: int, mods: range, y: torch.Tensor) -> None:
        """`y[rows, slice m] ← y ⊙ f + c` for every module m of the packed projection (in place)."""
        off = 0
        for m in mods:
            width = self.store.widths[m]
            if m not in self._modules:
                runs = [(ad, rows) for ad, rows in self._runs if m in ad.epi_modules]
                self._modules[m] = _ModuleRows(runs, y.device) if runs else None
            mr = self._modules[m]
            vec = self.store.vec[m]
            if mr is not None and vec is not None and any(ad.layer_ranks[layer][m] for ad in mr.adapters):
                self._apply_module(mr, vec[layer], y, off, width)
            off += width

    @staticmethod
    def _apply_module(mr: _ModuleRows, vec: torch.Tensor, y: torch.Tensor, off: int, width: int) -> None:
        if mr.span is not None:
            span, slot = mr.span
            fc = vec[slot].to(y.dtype)
            y[span.start : span.stop, off : off + width].mul_(fc[0]).add_(fc[1])
            return
        fc = vec.index_select(0, mr.slots).to(y.dtype)  # [R, 2, out]
        part = y[:, off : off + width].index_select(0, mr.rows)
        y[mr.rows, off : off + width] = torch.addcmul(fc[:, 1], part, fc[:, 0])
