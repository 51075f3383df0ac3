"""The sampler's noise as a function of the position: `q[v] ~ Exp(1)` for every vocabulary entry `v`.

The sampler picks `argmax(p / q)` with `q` i.i.d. Exp(1), which is a draw from `p`. A request with a
`seed` s takes the noise of its output position t (0 = its first generated token) from a counter-based
stream: each `q[v]` is a fixed function of (s, t, v), a splitmix64 hash computed in torch over the
vocabulary, so one row's noise costs a few int64 elementwise passes and no generator state at all. The
token a seeded request samples at position t therefore depends only on (s, t) and that position's
distribution: not on the rest of the batch, on how many speculative rows were verified before it, on a
preemption that recomputed it, or on which engine continues it after a KV handoff. Choice j of an `n > 1`
request samples with seed `s + j` (`SamplingParams.choices`), so the choices differ. Rows without a seed
draw fresh Exp(1) noise from the engine's generator (`torch.exponential_`: cheaper than the hash).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_STREAM = 0x5EED5EED5EED5EED  # separates the seed stream from other uses of splitmix64


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as the unsigned `x`."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix(z: int) -> int:
    """splitmix64's finalizer on a Python int (64-bit unsigned)."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def position_key(seed: int, position: int) -> int:
    """The int64 key of output position `position` of a request seeded `seed`."""
    base = _mix((seed ^ _STREAM) & _MASK64)
    return _signed(_mix((base + (position + 1) * _GOLDEN) & _MASK64))


def _mix_tensor(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps; shifts made logical by masking)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed(_M1)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed(_M2)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def uniform_from_hash(z: torch.Tensor) -> torch.Tensor:
    """int64 hashes -> float32 uniforms strictly inside (0, 1): (the top 23 bits + 1/2) / 2^23. Every value
    is exact in float32 (24 significant bits at most), so none rounds to 1 (a 24-bit version rounded
    2^24 - 1/2 up to 2^24: u = 1, q = -0, and p / q a NaN that argmax picked even where p = 0)."""
    return (((z >> 41) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R] int64 -> [R, vocab] float32 Exp(1) noise: entry (r, v) = -log(u), u a 23-bit uniform in
    (0, 1) from hash(keys[r], v)."""
    idx = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _signed(_GOLDEN)
    z = _mix_tensor(keys[:, None] + idx[None, :])
    return -torch.log(uniform_from_hash(z))


def sample_rows(
    probs: torch.Tensor, seeds: list[int | None], positions: list[int], generator: torch.Generator
) -> torch.Tensor:
    """probs [R, V] -> [R] int64: row r's token `argmax(probs[r] / q_r)`. Unseeded rows take q_r from
    `generator` (one `exponential_` over the batch, drawn for every row, the cheap path); seeded rows the
    hashed noise of their (seed, position) key, which costs a few int64 passes over the vocabulary."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    seeded = [r for r, s in enumerate(seeds) if s is not None]
    if seeded:
        keys = torch.tensor(
            [position_key(seeds[r], positions[r]) for r in seeded],  # type: ignore[arg-type]
            dtype=torch.int64,
            device=probs.device,
        )
        q[torch.tensor(seeded, device=probs.device)] = exponential_noise(keys, probs.shape[-1])
    return (probs / q).argmax(dim=-1)
