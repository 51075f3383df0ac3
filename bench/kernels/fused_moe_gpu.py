"""The Triton fused-MoE kernel on a CUDA GPU: equal to the torch reference (bfloat16 and float32, where
the interpreter cannot run a bf16 `tl.dot`), and its time beside the engine's torch loop over experts::

    python -m bench.kernels.fused_moe_gpu [--experts 128 --top-k 8 --hidden 2048 --inter 768] \\
        [--tokens 1,16,256,2048] [--dtype bfloat16]

Shapes default to one Qwen3-30B-A3B layer. Times are CUDA-event medians of 20 launches after warm-up.
"""

from __future__ import annotations

import argparse

import torch


def _loop(x, w_gate_up, w_down, weights, ids):
    """The per-expert loop (what `engine/model/moe_experts.py` generalizes) on the GPU."""
    inter = w_down.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // ids.shape[1]
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    xs, start = x[tokens], 0
    ys = torch.empty_like(xs)
    for e, n in enumerate(counts):
        if n:
            gu = torch.nn.functional.linear(xs[start : start + n], w_gate_up[e])
            h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            ys[start : start + n] = torch.nn.functional.linear(h, w_down[e])
            start += n
    ys.mul_(weights.reshape(-1)[order].unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, ys)


def _median_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", default="1,16,256,2048")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from kernels.fused_moe import fused_moe
    from kernels.reference import fused_moe_ref

    dtype, dev = getattr(torch, args.dtype), torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    w_gate_up = (torch.randn(e, 2 * i, h, device=dev, generator=gen) * h**-0.5).to(dtype)
    w_down = (torch.randn(e, h, i, device=dev, generator=gen) * i**-0.5).to(dtype)
    print(f"| tokens | max err vs reference | fused | torch loop | loop / fused |  ({args.dtype}, E={e}, "
          f"k={args.top_k}, H={h}, I={i})\n|---|---|---|---|---|")  # fmt: skip
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, h, device=dev, generator=gen).to(dtype)
        logits = torch.randn(t, e, device=dev, generator=gen)
        weights, ids = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
        weights = weights.to(dtype)
        ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids).float()
        err = (fused_moe(x, w_gate_up, w_down, weights, ids).float() - ref).abs().max().item()
        fused_ms = _median_ms(lambda: fused_moe(x, w_gate_up, w_down, weights, ids))  # noqa: B023
        loop_ms = _median_ms(lambda: _loop(x, w_gate_up, w_down, weights, ids))  # noqa: B023
        print(f"| {t} | {err:.3g} (ref max {ref.abs().max().item():.3g}) | {fused_ms:.3f} ms | "
              f"{loop_ms:.3f} ms | {loop_ms / fused_ms:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
