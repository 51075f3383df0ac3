"""DoRA / lora_bias epilogue storage and its per-step application: `y[rows, slice] ← y ⊙ f + c`.

`EpilogueStore` (part of the adapter pool) keeps, for each resident adapter that has epilogue vectors
(`engine/lora/dora.py`), one epilogue slot: per module m a float32 tensor `vec[m]`
[layers, 2, capacity, out_m] holds f at `[:, 0, slot]` and c at `[:, 1, slot]`; free slots, layers an
adapter does not adapt and modules it does not target hold f = 1, c = 0. Only DoRA / lora_bias adapters
take a slot, and the capacity doubles when full, so plain-LoRA pools pay nothing. The store's memory is
not counted in the pool's page budget: per DoRA adapter, layers x 2 x (sum of out widths) x 4 bytes.

`RowEpilogue` is a step's application over the runs of rows of such adapters. Per module it records, once
per step, each short run's rows (decode tokens) with their epilogue slots, so one layer's slice costs one
gather of those rows' (f, c) and one fused update however many adapters the batch mixes; long runs
(prefill chunks) are updated in place, their adapter's vectors broadcast. Base rows and plain-LoRA rows
are never touched.
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
        t = torch.zeros(self.num_layers, 2, capacity, self.widths[m], device=self.device)
        t[:, 0] = 1.0
        return t

    def add(self, host: dict[int, torch.Tensor]) -> int:
        """Store an adapter's vectors (per module index: [layers, 2, out] float32); returns its slot."""
        if not self._free:
            grown = max(4, 2 * self.capacity)
            for m, old in enumerate(self.vec):
                if old is not None:
                    new = self._identity(m, grown)
                    new[:, :, : self.capacity] = old
                    self.vec[m] = new
            self._free = list(range(self.capacity, grown))
            self.capacity = grown
        slot = self._free.pop(0)
        for m, t in host.items():
            store = self.vec[m]
            if store is None:
                store = self.vec[m] = self._identity(m, self.capacity)
            store[:, :, slot] = t.to(self.device)
        return slot

    def write(self, slot: int, m: int, layer: int, f: torch.Tensor, c: torch.Tensor) -> None:
        """Set slot `slot`'s (f, c) of module index `m` at `layer` (the module already has vectors)."""
        store = self.vec[m]
        assert store is not None, "the slot's adapter stored this module's vectors"
        store[layer, 0, slot], store[layer, 1, slot] = f.to(self.device), c.to(self.device)

    def remove(self, slot: int) -> None:
        """Reset an evicted adapter's slot to the identity and free it."""
        for t in self.vec:
            if t is not None:
                t[:, 0, slot], t[:, 1, slot] = 1.0, 0.0
        self._free.append(slot)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.vec if t is not None)


# Runs at least this long (prefill chunks) are updated in place with their adapter's vectors broadcast;
# shorter ones (decode rows) are gathered and updated together. Gathering long runs would materialize
# [rows, out] copies of f and c, which costs more than the update itself.
LONG_RUN = 4


class _ModuleRows:
    """One module's rows in a step: long runs (span, slot) updated in place, and the short runs' rows
    with their epilogue slots (updated in place too when they form one block of the batch); per layer,
    whether any of their adapters adapts the module there."""

    def __init__(self, runs: list[tuple[ResidentAdapter, range]], m: int, device: torch.device) -> None:
        layers = len(runs[0][0].layer_ranks)
        self.active = [any(ad.layer_ranks[layer][m] for ad, _ in runs) for layer in range(layers)]
        self.long = [(run, ad.epi_slot) for ad, run in runs if len(run) >= LONG_RUN]
        short = [(ad, run) for ad, run in runs if len(run) < LONG_RUN]
        rows = [r for _, run in short for r in run]
        self.block = (
            range(rows[0], rows[-1] + 1) if rows and rows == list(range(rows[0], rows[-1] + 1)) else None
        )
        self.rows = torch.tensor(rows, dtype=torch.long, device=device) if rows else None
        slots = [ad.epi_slot for ad, run in short for _ in run]
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
                self._modules[m] = _ModuleRows(runs, m, y.device) if runs else None
            mr = self._modules[m]
            vec = self.store.vec[m]
            if mr is not None and vec is not None and mr.active[layer]:
                self._apply_module(mr, vec[layer], y, off, width)
            off += width

    @staticmethod
    def _apply_module(mr: _ModuleRows, vec: torch.Tensor, y: torch.Tensor, off: int, width: int) -> None:
        """`vec`: this layer's [2, capacity, out] (f, c) of every slot."""
        cols = y[:, off : off + width]
        for span, slot in mr.long:
            run = cols[span.start : span.stop]
            torch.addcmul(vec[1, slot].to(y.dtype), run, vec[0, slot].to(y.dtype), out=run)
        if mr.rows is None:
            return
        f = vec[0].index_select(0, mr.slots).to(y.dtype)  # [R, out], contiguous
        c = vec[1].index_select(0, mr.slots).to(y.dtype)
        if mr.block is not None:  # the short rows are one block of the batch (e.g. a decode group)
            block = cols[mr.block.start : mr.block.stop]
            torch.addcmul(c, block, f, out=block)
            return
        cols.index_copy_(0, mr.rows, torch.addcmul(c, cols.index_select(0, mr.rows), f))
