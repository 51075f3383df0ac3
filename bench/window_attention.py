"""What a sliding window saves in the CPU attention: one layer's decode attention (native kernel, blocks
read in place) for `--requests` sequences of `--context` tokens, with no window and with `--window`,
best of `--repeats` rounds of 20 calls, and the KV blocks each keeps (all of them: the cache frees none
early, see docs/architecture.md "Sliding windows").

Usage: ``OMP_NUM_THREADS=1 python -m bench.window_attention --context 4096 --window 512``.
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels.paged_attention_cpu import PreparedPagedAttention


def best_ms(call, repeats: int) -> float:
    """Best mean time (ms) of 20 calls of `call`, over `repeats` rounds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            call()
        best = min(best, (time.perf_counter() - t0) / 20 * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    dtype, bs, n, ctx = getattr(torch, args.dtype), 16, args.requests, args.context
    blocks = -(-ctx // bs)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(n * blocks, bs, args.kv_heads, args.head_dim, generator=gen).to(dtype)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    tables = torch.randperm(n * blocks, generator=gen).view(n, blocks).to(torch.int32)
    q = torch.randn(n, args.heads, args.head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    lens, qsl = torch.full((n,), ctx, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32)
    plan = PreparedPagedAttention(tables, lens, qsl, range(n), k, dtype, args.heads, torch.get_num_threads())
    scale = args.head_dim**-0.5
    full = best_ms(lambda: plan(q, k, v, out, scale), args.repeats)
    windowed = best_ms(lambda: plan(q, k, v, out, scale, args.window), args.repeats)
    print(f"{n} decodes x {ctx} tokens, {args.dtype}, {torch.get_num_threads()} threads:")
    print(f"  no window {full:.3f} ms, window {args.window} {windowed:.3f} ms ({full / windowed:.2f}x)")
    needed = -(-args.window // bs) + 1
    print(f"  KV blocks per sequence per layer: {blocks} held; a window-only layer reads at most {needed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
