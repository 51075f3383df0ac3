"""The routed experts of one MoE layer on the CPU: the per-expert GEMM loop vs one grouped GEMM per
projection, and what expert LoRA of many adapters adds.

    python -m bench.kernels.moe_experts_cpu [--experts 32] [--top-k 4] [--hidden 1024] [--inter 512]
        [--adapters 16] [--rank 16] [--repeats 7] [--threads 1]

A Qwen3-MoE-shaped layer with random weights (nothing read from disk). For a decode step of `--adapters`
tokens (one per adapter), a one-token step and a prefill step of 256 tokens it times a torch loop over
the experts with tokens (two GEMMs each: the engine's path before), `engine.model.moe_experts.
experts_forward` (the engine's path: one `torch._grouped_mm` per projection over the sorted rows; the
bits are checked equal), and `experts_forward` with every token on its own adapter's rank-`--rank` LoRA
on every expert (`ExpertPageStore` pages, `ExpertLoRAStep` runs). Times are the calling thread's CPU time
(`time.thread_time`; torch runs these ops on the calling thread at `--threads 1`), so other processes on
a shared machine do not count; variants alternate and take the best of `--repeats`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from engine.lora.expert_checkpoint import ExpertLoRAWeights
from engine.lora.expert_pages import ExpertPageStore
from engine.lora.expert_step import ExpertLoRAStep
from engine.model.moe_experts import experts_forward
from engine.model_config import ModelConfig


def loop_forward(gate_up: torch.Tensor, down: torch.Tensor, x, weights, ids) -> torch.Tensor:
    """`experts_forward` without LoRA as a torch loop over the experts with tokens (two GEMMs each)."""
    top_k, inter = ids.shape[1], down.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    xs = x[tokens]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=gate_up.shape[0]).tolist()):
        if n:
            gu = nn.functional.linear(xs[start : start + n], gate_up[e])
            h = nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            ys[start : start + n] = nn.functional.linear(h, down[e])
            start += n
    ys.mul_(weights.reshape(-1)[order].unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, ys)


def _lora_step(cfg: ModelConfig, n: int, rank: int, rows: int, gen: torch.Generator) -> ExpertLoRAStep:
    """`n` adapters with rank-`rank` LoRA on every expert of layer 0; row t on adapter t % n."""
    moe = cfg.extra["moe"]
    e, h, inter = moe["num_experts"], cfg.hidden_size, moe["intermediate_size"]
    store = ExpertPageStore(cfg, n, rank, torch.float32, torch.device("cpu"))
    residents = []
    for i in range(n):
        ws = tuple(
            ExpertLoRAWeights(0, p, rank, 2.0, torch.randn(e, rank, fin, generator=gen) / fin**0.5,
                              torch.randn(e, fout, rank, generator=gen) * 0.01)
            for p, fin, fout in (("gate_up", h, 2 * inter), ("down", inter, h))
        )  # fmt: skip
        residents.append(SimpleNamespace(slot=i, experts=store.upload(SimpleNamespace(experts=ws))))
    runs = [(residents[t % n], range(t, t + 1)) for t in range(rows)]
    return ExpertLoRAStep(store, runs)  # type: ignore[arg-type]


def _best(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Per variant, the least CPU time of this thread over `repeats` alternating calls."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.thread_time()
            fn()
            best[name] = min(best[name], time.thread_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    e, h, inter = args.experts, args.hidden, args.inter
    cfg = ModelConfig.from_dict(
        {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": h,
         "intermediate_size": inter, "moe_intermediate_size": inter, "num_hidden_layers": 1,
         "num_attention_heads": 8, "num_key_value_heads": 4, "num_experts": e,
         "num_experts_per_tok": args.top_k}
    )  # fmt: skip
    gate_up = torch.randn(e, 2 * inter, h, generator=gen) * 0.02
    down = torch.randn(e, h, inter, generator=gen) * 0.02
    print(f"experts {e}, top-{args.top_k}, hidden {h}, expert inter {inter}, threads {args.threads}")
    for rows in (1, args.adapters, 256):
        x = torch.randn(rows, h, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[: args.top_k] for _ in range(rows)])
        weights = torch.softmax(torch.randn(rows, args.top_k, generator=gen), -1)
        lora = _lora_step(cfg, args.adapters, args.rank, rows, gen)
        ref = loop_forward(gate_up, down, x, weights, ids)
        assert torch.equal(experts_forward(gate_up, down, x, weights, ids), ref)
        step = (gate_up, down, x, weights, ids)
        t = _best(
            {
                "loop": lambda step=step: loop_forward(*step),
                "grouped": lambda step=step: experts_forward(*step),
                "grouped+lora": lambda step=step, lora=lora: experts_forward(*step, lora, 0),
            },
            args.repeats,
        )
        print(
            f"rows {rows:4d}: loop {t['loop'] * 1e3:8.3f} ms  grouped {t['grouped'] * 1e3:8.3f} ms "
            f"(grouped/loop {t['grouped'] / t['loop']:.2f}x)  with {args.adapters} rank-{args.rank} expert "
            f"adapters {t['grouped+lora'] * 1e3:8.3f} ms ({t['grouped+lora'] / t['grouped']:.2f}x)"
        )


if __name__ == "__main__":
    main()
