"""The CPU step's small ops, fused or not: time per call of each way to compute them, as ratios.

    python -m bench.kernels.fused_cpu [--tokens 32] [--dtype float32] [--repeats 7] [--calls 2000]
    python -m bench.kernels.fused_cpu --steps 200 [--tokens 32] [--dtype float32]

With ``--steps N``: whole decode steps of the offline benchmark's model instead (`--tokens` sequences,
64-token prompts, base model), the fused and the unfused path alternating step by step on one engine;
prints the median step time of each and their ratio (alternating per step keeps the machine's load
changes out of the ratio).

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


def decode_steps_ab(tokens: int, dtype: str, steps: int) -> dict[bool, tuple[float, float]]:
    """Per path (fused: True), the median (wall, CPU) seconds of a base-only decode step, the two paths
    alternating step by step. The process's CPU time is the work done, however the cores are shared (with
    one thread; with more it includes the threads' spinning at barriers)."""
    import statistics
    import tempfile
    from pathlib import Path

    from bench.common.workload import ModelSpec, build_base, make_prompts
    from engine import LLM, SamplingParams

    spec = ModelSpec()
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(Path(tmp), spec)
        llm = LLM(str(base), device="cpu", dtype=dtype, enable_lora=False, enable_prefix_caching=False,
                  max_num_seqs=tokens, adaptive_threads=False)  # fmt: skip
    eng, model = llm.engine, llm.engine.model
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(make_prompts(tokens, 64, spec.vocab_size)):
        eng.add_request(f"r{i}", p, params)
    while eng.runner.last_batch[0] != eng.runner.last_batch[1] or eng.runner.last_batch[0] == 0:
        eng.step()  # through the prefill
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(steps):
        model.fused_cpu_ops = fused = i % 2 == 0
        t0, c0 = time.perf_counter(), time.process_time()
        eng.step()
        times[fused].append((time.perf_counter() - t0, time.process_time() - c0))
    for rid in range(tokens):
        eng.abort_request(f"r{rid}")
    return {
        f: (statistics.median(w for w, _ in ts), statistics.median(c for _, c in ts))
        for f, ts in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=0, help="time whole decode steps instead (see above)")
    args = ap.parse_args(argv)
    if args.steps:
        med = decode_steps_ab(args.tokens, args.dtype, args.steps)
        print(
            f"{args.tokens} sequences, {args.dtype}, {torch.get_num_threads()} threads, median decode step:"
        )
        for i, what in enumerate(("wall", "CPU")):
            fused, unfused = med[True][i] * 1e3, med[False][i] * 1e3
            print(f"  {what:4s} {fused:7.2f} ms fused, {unfused:7.2f} ms unfused: {unfused / fused:.3f}x")
        return 0
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
