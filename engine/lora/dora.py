"""DoRA and LoRA-bias as a per-row epilogue of the LoRA pass: `row_epilogue`, and the base weights it needs.

PEFT's DoRA forward (`peft/tuners/lora/dora.py`, `DoraLinearLayer.forward`), for a module with base weight
W, base bias b0 (or none), magnitude m, and lora_B's bias bB (`lora_bias`, else 0), computes::

    y = b0 + f ⊙ (W x + s (B A x + bB)),    f = m / ‖W + s B A‖_row    (the norm is detached)

where the norm is the L2 norm of each output row of `W + s·B·A` (`torch.linalg.norm(·, dim=1)`). The
engine's LoRA pass leaves `y = b0 + W x + s B A x` in a row of the adapter, so the rest is one per-row
affine map on that adapter's rows of the slice::

    y ← y ⊙ f + c,    c = f ⊙ s bB + (1 − f) ⊙ b0

Plain LoRA with `lora_bias` is the case f = 1, c = s bB. f and c depend only on the adapter and the base
weights, so they are computed once when the adapter is uploaded to the pool (host side, float32) and kept
beside its pages. The norm is computed without forming `W + s B A`, which also works on weights packed for
oneDNN: with G = A Wᵀ ([r, out], one small matmul through the projection itself)::

    ‖W_i + s (BA)_i‖² = ‖W_i‖² + 2 s Σ_k B_ik G_ki + s² B_i (A Aᵀ) B_iᵀ

A fused PEFT target (Phi-3's `qkv_proj`) needs no special case: every quantity is per output row, and the
checkpoint splits m and bB by rows exactly as it splits B (`adapter_checkpoint.py`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from engine.lora.adapter_checkpoint import LoRAModuleWeights
from engine.model.linear import ProjectionLinear


class BaseWeights(Protocol):
    """The base model's projection weights, per (layer, engine slice), as the epilogue needs them."""

    def row_sq_norms(self, layer: int, module: str) -> torch.Tensor:
        """float32 [out]: the squared L2 norm of each output row of the slice's base weight."""
        ...

    def times_weight_t(self, layer: int, module: str, a: torch.Tensor) -> torch.Tensor:
        """float32 [r, out] on the host: `a @ W_slice.T` for `a` [r, in] (no bias)."""
        ...

    def bias(self, layer: int, module: str) -> torch.Tensor | None:
        """float32 [out] on the host: the slice's base bias, or None when the projection has none."""
        ...


def dora_sq_norm(w: LoRAModuleWeights, base: BaseWeights) -> torch.Tensor:
    """float32 [out]: ‖W + s·B·A‖² per output row of the slice, by the expansion of the module docstring,
    host side. Every term is a sum over the input columns, so for a slice whose columns are split over
    tensor-parallel ranks (o, down: each rank's W and A columns) the ranks' results sum to the whole."""
    assert w.lora_a is not None and w.lora_b is not None, "the DoRA norm needs the adapter's weights"
    a, b = w.lora_a.float().cpu(), w.lora_b.float().cpu()
    g = base.times_weight_t(w.layer, w.module, a)  # [r, out]
    cross = (b * g.T).sum(1)
    lora_sq = ((b @ (a @ a.T)) * b).sum(1)
    return base.row_sq_norms(w.layer, w.module) + 2 * w.scaling * cross + w.scaling**2 * lora_sq


def dora_weight_norm(w: LoRAModuleWeights, base: BaseWeights) -> torch.Tensor:
    """float32 [out]: ‖W + s·B·A‖ per output row of the slice (PEFT's DoRA weight norm), host side."""
    return dora_sq_norm(w, base).clamp_min(0).sqrt()


def row_epilogue(
    w: LoRAModuleWeights, base: BaseWeights | None, norm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(f, c), float32 [out] each on the host, such that `y ⊙ f + c` turns the LoRA pass's rows of this
    slice into PEFT's output (see the module docstring); None for a plain LoRA slice (nothing to do).
    `norm`: the DoRA weight norm when the caller has it (tensor parallel sums it over the ranks), else it
    is computed from `base`."""
    if w.magnitude is None and w.bias_b is None:
        return None
    out = w.lora_b.shape[0] if w.lora_b is not None else 0
    c = torch.zeros(out) if w.bias_b is None else w.scaling * w.bias_b.float().cpu()
    if w.magnitude is None:
        return torch.ones(out), c
    if base is None:
        raise ValueError("a DoRA adapter needs the base weights (the pool was made without them)")
    f = w.magnitude.float().cpu() / (dora_weight_norm(w, base) if norm is None else norm)
    c = f * c
    b0 = base.bias(w.layer, w.module)
    if b0 is not None:
        c = c + (1 - f) * b0
    return f, c


class ProjectionBaseWeights:
    """`BaseWeights` read from a loaded model's `ProjectionLinear`s (packed or not), by layer and slice."""

    def __init__(self, model: nn.Module) -> None:
        self._where: dict[tuple[int, str], tuple[ProjectionLinear, int, int]] = {}
        for module in model.modules():
            if isinstance(module, ProjectionLinear):
                offs = module.slice_offsets()
                for name, off, width in zip(module.slice_names, offs, module.slice_sizes, strict=True):
                    self._where[(module.layer_index, name)] = (module, off, width)

    def row_sq_norms(self, layer: int, module: str) -> torch.Tensor:
        proj, off, width = self._where[(layer, module)]
        return proj.row_sq_norms()[off : off + width]

    def times_weight_t(self, layer: int, module: str, a: torch.Tensor) -> torch.Tensor:
        proj, off, width = self._where[(layer, module)]
        return proj.times_weight_t(a)[:, off : off + width].float().cpu()

    def bias(self, layer: int, module: str) -> torch.Tensor | None:
        proj, off, width = self._where[(layer, module)]
        return None if proj.bias is None else proj.bias.detach()[off : off + width].float().cpu()
