"""Rotary position embeddings (rotate-half / NeoX layout, as in HF Llama), with llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d), optionally rescaled by the llama3 rule.

    freq_factors (from a GGUF file's `rope_freqs`): inv_freq[i] / factors[i].
    llama3: wavelengths longer than `original_max_position_embeddings / low_freq_factor` are divided by
    `factor`, those shorter than `.../high_freq_factor` are kept, and the band between is interpolated.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq.float()
    if scaling.get("rope_type") == "freq_factors":  # llama.cpp's `rope_freqs` tensor: one divisor each
        factors = torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
        return (inv_freq.float() / factors).float()
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    orig = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, scaled).float()


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables for positions `[0, max_positions)`; `forward` rotates q and k in place."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.cos: torch.Tensor  # [P, D/2] float32 (buffers, not parameters)
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | None = None) -> None:
        """(Re)compute the float32 cos/sin tables, e.g. after the module was materialized from meta."""
        device = device or self.cos.device
        if device.type == "meta":
            device = torch.device("cpu")
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token factors `(cos2, sin2)`, each [T, 1, D] float32, computed once per forward pass::

        cos2 = [cos, cos],  sin2 = [-sin, sin]   so that   rope(x) = x * cos2 + swap_halves(x) * sin2
        """
        cos = self.cos[positions]
        sin = self.sin[positions]
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated copies: x*cos + rotate_half(x)*sin at each position."""
        cs = self.tables(positions)
        return apply_rope(q, cs), apply_rope(k, cs)


def apply_rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, H, D] -> x * cos2 + swap_halves(x) * sin2 (= HF's `x*cos + rotate_half(x)*sin`), in float32.

    Returns a new contiguous tensor in x's dtype.
    """
    cos2, sin2 = tables
    half = x.shape[-1] // 2
    xf = x.float()
    out = torch.cat((xf[..., half:], xf[..., :half]), dim=-1).mul_(sin2)
    return out.add_(xf * cos2).to(x.dtype)  # separate multiply and add: HF's rounding, no FMA
