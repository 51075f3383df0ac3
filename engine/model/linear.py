"""The one linear layer type every projection goes through — the seam where LoRA plugs in.

A `ProjectionLinear` may pack several logical projections ("slices") along its output, e.g. q|k|v or
gate|up, so the base GEMM runs once. Its forward computes::

    y = x @ W.T (+ b)
    if lora is not None:                  # per-step adapter state; None when no adapter is in the batch
        lora.apply(layer_index, slice_names, x, y)   # y[:, slice s] += scale * (x @ A_s.T) @ B_s.T
    if all_reduce is not None:            # a row-parallel shard under tensor parallel: sum the ranks'
        all_reduce(y)                     # partial outputs (LoRA's partial delta included), in place
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from engine.model.cpu_gemm import pack, packed_linear


class LoRAStepContext(Protocol):
    """Per-step adapter state handed to every projection (implemented by the LoRA layer of the engine)."""

    def apply(self, layer_index: int, slice_names: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each token's adapter delta for the given packed slices into `y` in place."""
        ...


class ProjectionLinear(nn.Module):
    """`y = x @ W.T + b` for the packed slices `slice_names` with output widths `slice_sizes`."""

    def __init__(
        self,
        in_features: int,
        slice_names: tuple[str, ...],
        slice_sizes: tuple[int, ...],
        layer_index: int,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.slice_names = slice_names
        self.slice_sizes = slice_sizes
        self.layer_index = layer_index
        out = sum(slice_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.packed = False  # True: `weight` is in oneDNN's blocked layout (`pack_weight`, CPU float32)
        self._row_sq: torch.Tensor | None = None  # squared row norms (taken before packing), for DoRA
        # tensor parallel, row-parallel shards (o, down): the in-place sum of every rank's partial output
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor, lora: LoRAStepContext | None = None) -> torch.Tensor:
        if self.packed:
            y = packed_linear(x, self.weight, self.bias)
        else:
            y = nn.functional.linear(x, self.weight, self.bias)
        if lora is not None:
            lora.apply(self.layer_index, self.slice_names, x, y)
        if self.all_reduce is not None:
            self.all_reduce(y)
        return y

    def pack_weight(self) -> None:
        """Replace the dense weight by its packed form (`engine/model/cpu_gemm.py`); once, after loading."""
        if not self.packed:
            self.row_sq_norms()  # the packed layout has no rows to read them from later
            self.weight = nn.Parameter(pack(self.weight), requires_grad=False)
            self.packed = True

    def row_sq_norms(self) -> torch.Tensor:
        """float32 [out] on the host: the squared L2 norm of each output row of the (dense) weight."""
        if self._row_sq is None:
            assert not self.packed, "row norms are taken before packing"
            self._row_sq = self.weight.detach().float().pow(2).sum(1).cpu()
        return self._row_sq

    def times_weight_t(self, a: torch.Tensor) -> torch.Tensor:
        """`a @ W.T` (no bias) for `a` [r, in], in the weight's dtype on its device (packed or not)."""
        a = a.to(self.weight.device, self.weight.dtype)
        with torch.no_grad():
            return (
                packed_linear(a, self.weight, None) if self.packed else nn.functional.linear(a, self.weight)
            )

    def slice_offsets(self) -> tuple[int, ...]:
        """Start column of each slice in the packed output."""
        offs, acc = [], 0
        for s in self.slice_sizes:
            offs.append(acc)
            acc += s
        return tuple(offs)
