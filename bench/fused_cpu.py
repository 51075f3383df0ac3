"""The CPU step's small ops, fused or not: time per call of each way to compute them, as ratios.

    python -m bench.fused_cpu [--tokens 32] [--dtype float32] [--repeats 7] [--calls 2000]

For the offline benchmark model's shapes (hidden 384, intermediate 1024, 6 q / 2 kv heads of 64), times
per call, interleaved and best of `--repeats` rounds of `--calls` calls each:

- RMSNorm (+ the residual add): the engine's unfused torch formula, ``torch.nn.functional.rms_norm``
  (torch's own, composite on CPU), and the native ``kernels.fused_cpu.add_rms_norm``;
- RoPE on q and k: the unfused formula (`engine.model.rope.apply_rope`, after its per-step table
  gather) and the in-place native ``rope_``;
- SwiGLU: ``silu(gate) * up``, torch's in-place ``silu_`` then ``mul_``, and the native ``silu_mul``.

Prints microseconds per call and each way's ratio to the unfused torch formula. Threads: torch's
intra-op count (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.rope import RotaryEmbedding, apply_rope
from kernels import fused_cpu

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rms_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def time_calls(fns: dict[str, Callable[[], object]], repeats: int, calls: int) -> dict[str, float]:
    """Best microseconds per call of each function, the functions' rounds interleaved."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def cases(tokens: int, dtype: torch.dtype) -> dict[str, dict[str, Callable[[], object]]]:
    """Per op group, the ways to compute it (the first is the unfused torch formula)."""
    h, inter, nh, nkv, d, eps = 384, 1024, 6, 2, 64, 1e-6
    x, delta, w = (torch.randn(tokens, h).to(dtype) for _ in range(2)), None, torch.randn(h).to(dtype)
    x, delta = x
    qkv = torch.randn(tokens, (nh + 2 * nkv) * d).to(dtype)
    gu = torch.randn(tokens, 2 * inter).to(dtype)
    rope = RotaryEmbedding(d, 512, 10000.0, None)
    pos = torch.randint(0, 512, (tokens,))
    tables = rope.tables(pos)

    def unfused_rope() -> object:
        return apply_rope(qkv[:, : (nh + nkv) * d].view(tokens, nh + nkv, d), tables)

    def inplace_silu() -> object:
        g = gu[:, :inter].clone()
        return torch._C._nn.silu_(g).mul_(gu[:, inter:])

    return {
        "add + RMSNorm": {
            "torch, unfused": lambda: _rms_torch(x + delta, w, eps),
            "F.rms_norm": lambda: F.rms_norm(x + delta, (h,), w, eps),
            "native add_rms_norm": lambda: fused_cpu.add_rms_norm(x, delta, w, eps),
        },
        "RoPE q+k": {
            "torch, unfused": unfused_rope,
            "native rope_ (in place)": lambda: fused_cpu.rope_(qkv, nh + nkv, d, pos, rope.cos, rope.sin),
        },
        "SiLU * up": {
            "torch, unfused": lambda: F.silu(gu[:, :inter]) * gu[:, inter:],
            "torch silu_ + mul_": inplace_silu,
            "native silu_mul": lambda: fused_cpu.silu_mul(gu),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    isa = fused_cpu.available_isas()[-1]
    print(f"{args.tokens} tokens, {args.dtype}, {torch.get_num_threads()} threads, isa {isa}")
    for group, fns in cases(args.tokens, DTYPES[args.dtype]).items():
        best = time_calls(fns, args.repeats, args.calls)
        base = next(iter(best.values()))
        print(f"\n{group}")
        for name, us in best.items():
            print(f"  {name:28s} {us:8.2f} us  {base / us:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
