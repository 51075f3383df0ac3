"""Rotary position embeddings (rotate-half / NeoX layout, as in HF Llama): llama3 frequency scaling,
partial rotary (the first `rotary_dim` values of each head) and Phi-3's LongRoPE.

LongRoPE has two frequency sets, short and long; transformers picks the long one for a forward pass
whose longest sequence exceeds `original_max_position_embeddings`. With a KV cache that means: a prompt
longer than that rotates every token with the long set, a shorter prompt uses the short set, and each
token generated after it uses the long set once its position reaches the limit (tokens already in the
cache keep theirs). The tables hold both sets (short at rows [0, P), long at [P, 2P)) and
`long_rope_positions` gives each token its row, so every token keeps what transformers gave it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.model_config import ModelConfig


def rotary_dim(cfg: ModelConfig) -> int:
    """How many leading values of each head RoPE rotates: head_dim * partial_rotary_factor (as HF)."""
    return int(cfg.head_dim * float(cfg.extra.get("partial_rotary_factor", 1.0)))


def longrope_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """LongRoPE's cos/sin multiplier: `attention_factor`, or sqrt(1 + ln(f) / ln(original)) with
    f = `factor` (default: max_position_embeddings / original), 1 when f <= 1 (as transformers)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = max_positions / orig if factor is None else float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d), optionally rescaled by the llama3 rule (or linear: / factor).

    freq_factors (from a GGUF file's `rope_freqs`): inv_freq[i] / factors[i].
    llama3: wavelengths longer than `original_max_position_embeddings / low_freq_factor` are divided by
    `factor`, those shorter than `.../high_freq_factor` are kept, and the band between is interpolated.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq.float()
    if scaling.get("rope_type") == "longrope":  # `ext_factors`: the "short_factor" or "long_factor" list
        ext = torch.tensor(scaling["ext_factors"], dtype=torch.float32, device="cpu")
        return (1.0 / (ext * theta**exponents)).float()
    if scaling.get("rope_type") == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        return (inv_freq / float(scaling["factor"])).float()
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
    """Precomputed cos/sin tables for positions `[0, max_positions)` (LongRoPE: twice, module docstring)
    over the first `rotary_dim` (default: all) of `head_dim` values; `forward` rotates q and k."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        # LongRoPE: a token whose sequence is longer than `long_from` reads rows `position + long_offset`
        self.long_from: int | None = None
        self.long_offset = 0
        if scaling and scaling.get("rope_type") == "longrope":
            self.long_from, self.long_offset = int(scaling["original_max_position_embeddings"]), max_positions
        self.cos: torch.Tensor  # [P, D/2] float32 (buffers, not parameters); D = rotary_dim
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | None = None) -> None:
        """(Re)compute the float32 cos/sin tables, e.g. after the module was materialized from meta."""
        device = device or self.cos.device
        if device.type == "meta":
            device = torch.device("cpu")
        pos = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        if self.long_from is None:
            freqs = torch.outer(pos, rope_inv_freq(self.rotary_dim, self.theta, self.scaling))
            self.cos = freqs.cos().to(device)
            self.sin = freqs.sin().to(device)
            return
        assert self.scaling is not None, "LongRoPE has its scaling parameters"
        factor = longrope_attention_factor(self.scaling, int(self.scaling["max_position_embeddings"]))
        cos, sin = [], []
        for key in ("short_factor", "long_factor"):
            scaling = self.scaling | {"ext_factors": self.scaling[key]}
            freqs = torch.outer(pos, rope_inv_freq(self.rotary_dim, self.theta, scaling))
            cos.append(freqs.cos() * factor)
            sin.append(freqs.sin() * factor)
        self.cos = torch.cat(cos).to(device)
        self.sin = torch.cat(sin).to(device)

    def long_rope_positions(self, positions: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
        """The table rows of tokens at `positions` whose sequences' prompts have `prompt_lens` tokens:
        the position itself, plus `long_offset` where transformers uses the long LongRoPE factors (the
        prompt, or the sequence up to this token, is longer than `long_from`). Positions as is without
        LongRoPE."""
        if self.long_from is None:
            return positions
        long = np.maximum(prompt_lens, positions + 1) > self.long_from
        return positions + self.long_offset * long

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
