"""GPU check and micro-benchmark of the Triton kernels (needs CUDA; ``--help`` works anywhere).

1. Correctness in bf16 (by default) of every kernel against ``kernels.reference``: SGMV shrink/expand
   and the fused BGMV kernel with mixed ranks, slot -1 tokens and random page tables; write_kv; paged
   decode and chunked prefill.
2. The LoRA kernels at decode batch sizes and one prefill batch, ``--adapters`` adapters of rank
   ``--rank`` over hidden size ``--hidden`` (tokens spread round-robin over adapters): SGMV shrink,
   expand, the pair, and the fused BGMV kernel (decode sizes), timed from CUDA graphs (no launch cost),
   reporting achieved memory bandwidth against a measured device-to-device copy. A markdown table.

Usage: ``python bench/kernels/triton_gpu.py [--dtype bfloat16] [--decode-batches 1,8,64]
[--prefill-tokens 4096]``.
``--device cpu`` (with ``TRITON_INTERPRET=1``, small sizes, not bf16; ``--tiny`` shrinks the checks)
smoke-tests this script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.intmath import cdiv  # after the path set-up: this file runs as a script

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--hidden", type=int, default=4096, help="H_in of the projection")
    p.add_argument(
        "--slices", default="4096", help="comma-separated H_out per slice, e.g. 4096,1024,1024 (qkv)"
    )
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--page-rank", type=int, default=16)
    p.add_argument("--decode-batches", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--skip-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--skip-bench", action="store_true", help="skip the micro-benchmark")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only under TRITON_INTERPRET=1")
    p.add_argument("--tiny", action="store_true", help="small correctness problems (CPU smoke test)")
    return p.parse_args(argv)


def _pools(num_pages: int, page_rank: int, h_in: int, h_outs: list[int], dtype: torch.dtype, dev: str):
    """Per-slice A/B pools, strided layer-1 views of ``[num_pages, 2 layers, ...]`` (as the engine)."""
    a = [
        torch.randn(num_pages, 2, page_rank, h_in, device=dev).div_(h_in**0.5).to(dtype)[:, 1] for _ in h_outs
    ]
    b = [
        torch.randn(num_pages, 2, h, page_rank, device=dev).div_(page_rank**0.5).to(dtype)[:, 1]
        for h in h_outs
    ]
    return a, b


def _lora_problem(
    token_slots: list[int],
    ranks: list[list[int]],
    h_in: int,
    h_outs: list[int],
    page_rank: int,
    dtype: torch.dtype,
    dev: str,
):
    """Random pools and page tables (random, non-contiguous pages) for ``ranks[slice][slot]``."""
    from kernels.lora_meta import build_lora_batch_meta

    num_slices, max_slots = len(ranks), len(ranks[0])
    max_pages = max(cdiv(r, page_rank) for row in ranks for r in row) or 1
    num_pages = num_slices * max_slots * max_pages + 8
    a_pools, b_pools = _pools(num_pages, page_rank, h_in, h_outs, dtype, dev)
    page_table = torch.stack([torch.randperm(num_pages)[: max_slots * max_pages] for _ in ranks])
    page_table = page_table.view(num_slices, max_slots, max_pages).to(torch.int32).to(dev)
    meta = build_lora_batch_meta(torch.tensor(token_slots, dtype=torch.int32, device=dev))
    rank_t = torch.tensor(ranks, dtype=torch.int32, device=dev)
    scalings = torch.rand(num_slices, max_slots, device=dev) + 0.5
    x = torch.randn(len(token_slots), h_in, device=dev).to(dtype)
    return x, a_pools, b_pools, page_table, rank_t, scalings, meta


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = max(want.float().abs().max().item() if want.numel() else 0.0, 1.0)
    ok = err <= tol * scale
    print(f"| {name} | {err:.3e} | {tol * scale:.3e} | {'ok' if ok else 'FAIL'} |")
    return ok


def check_correctness(dtype: torch.dtype, dev: str = "cuda", tiny: bool = False) -> bool:
    """Every kernel vs the reference on CUDA; returns True when all pass (`tiny`: small problems)."""
    from kernels import reference as ref
    from kernels.lora_bgmv import lora_bgmv
    from kernels.lora_expand import lora_expand
    from kernels.lora_shrink import lora_shrink
    from kernels.paged_attention import paged_attention_decode, paged_attention_prefill, write_kv

    torch.manual_seed(0)
    tol = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    print("| check | max abs err | allowed | result |\n|---|---|---|---|")
    ok = True
    ranks = [[1, 4, 8, 16, 64, 128, 16, 8], [8, 0, 16, 4, 128, 64, 1, 8], [16, 64, 0, 128, 8, 4, 1, 8]]
    h_in, h_outs, n_prefill = (64, [64, 32, 32], 40) if tiny else (512, [512, 128, 128], 300)
    decode_slots = [3, -1, 0, 5, 1, 2, 6, 4]
    few_rows = [3, 3, -1, 0, 5, 5, 5, 1, 2, 2, 6, 4, 4, 4, 4, 7]
    cases = (
        ("decode", decode_slots),
        ("few rows", few_rows),
        ("prefill", [i % 9 - 1 for i in range(n_prefill)]),
    )
    for label, slots in cases:
        x, a_pools, b_pools, pt, rk, sc, meta = _lora_problem(slots, ranks, h_in, h_outs, 16, dtype, dev)
        y = torch.randn(len(slots), sum(h_outs), device=dev).to(dtype)
        y_bgmv, y_want = y.clone(), y.clone()
        lora_bgmv(x, a_pools, b_pools, pt, rk, sc, meta, y_bgmv)
        ref.lora_shrink_expand_ref(x, a_pools, b_pools, pt, rk, sc, meta, y_want)
        ok &= _close(f"lora_bgmv {label}", y_bgmv, y_want, tol)
        if label == "few rows":
            continue
        out, want = torch.empty(3, len(slots), 128, device=dev), torch.empty(3, len(slots), 128, device=dev)
        lora_shrink(x, a_pools, pt, rk, meta, out)
        ref.lora_shrink_ref(x, a_pools, pt, rk, meta, want)
        ok &= _close(f"lora_shrink {label}", out, want, tol)
        y_ref = y.clone()
        lora_expand(want, b_pools, pt, rk, sc, meta, y)
        ref.lora_expand_ref(want, b_pools, pt, rk, sc, meta, y_ref)
        ok &= _close(f"lora_expand {label}", y, y_ref, tol)

    hq, hkv, d, bs = (4, 2, 16, 4) if tiny else (32, 8, 128, 16)
    seq_lens, q_lens = ([1, 7, 12, 20], [1, 7, 5, 9]) if tiny else ([1, 17, 300, 1000], [1, 17, 45, 200])
    max_blocks = max(cdiv(n, bs) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 4
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=dev).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks)[: len(seq_lens) * max_blocks].view(len(seq_lens), -1).int().to(dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    key, value = torch.randn(6, hkv, d, device=dev).to(dtype), torch.randn(6, hkv, d, device=dev).to(dtype)
    slot_mapping = torch.tensor([0, -1, 37, 50 if tiny else 500, 16, 3], device=dev)
    k2, v2 = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    ref.write_kv_ref(key, value, k2, v2, slot_mapping)
    ok &= _close("write_kv", torch.cat([k_cache, v_cache]), torch.cat([k2, v2]), 0.0)
    q = torch.randn(len(seq_lens), hq, d, device=dev).to(dtype)
    got = paged_attention_decode(q, k_cache, v_cache, tables, lens, d**-0.5)
    ok &= _close(
        "paged_attention_decode",
        got,
        ref.paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, d**-0.5),
        tol,
    )
    q = torch.randn(sum(q_lens), hq, d, device=dev).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    got = paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, d**-0.5)
    want = ref.paged_attention_prefill_ref(q, k_cache, v_cache, tables, qsl, lens, d**-0.5)
    ok &= _close("paged_attention_prefill", got, want, tol)
    return ok


def _time_ms(fn: Callable[[], object], dev: str) -> float:
    """Median time of ``fn`` in ms on CUDA: replayed from a CUDA graph (``do_bench_cudagraph``: the kernel
    without its host launch cost, as the engine's decode graphs run it), else ``do_bench``."""
    if dev.startswith("cuda"):
        import triton.testing

        fn()  # compile and fill the launchers' caches before any capture
        try:
            return float(triton.testing.do_bench_cudagraph(fn))
        except Exception as exc:  # a capture problem must not hide the timing
            print(f"(do_bench_cudagraph failed: {exc}; timing with launches)")
            return float(triton.testing.do_bench(fn))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(dev: str = "cuda") -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written over time)."""
    src = torch.empty((1 << 28) if dev.startswith("cuda") else (1 << 20), dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    ms = _time_ms(partial(dst.copy_, src), dev)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def bench(args: argparse.Namespace, dtype: torch.dtype, dev: str = "cuda") -> None:
    """Time shrink, expand, the SGMV pair and the fused BGMV kernel; report GB/s and the fraction of copy
    bandwidth (bytes each must move: activations, the active adapters' pages, the output)."""
    from kernels.lora_bgmv import lora_bgmv
    from kernels.lora_expand import lora_expand
    from kernels.lora_shrink import lora_shrink

    h_outs = [int(h) for h in args.slices.split(",")]
    ranks = [[args.rank] * args.adapters for _ in h_outs]
    es = torch.empty(0, dtype=dtype).element_size()
    copy_gbs = copy_bandwidth(dev)
    print(f"\nD2D copy bandwidth: {copy_gbs:.0f} GB/s; {args.adapters} adapters of rank {args.rank}, "
          f"H_in {args.hidden}, slices {h_outs}, {args.dtype}\n")  # fmt: skip
    print("| case | tokens | op | time (us) | GB/s | % of copy |\n|---|---|---|---|---|---|")
    cases = [("decode", int(b)) for b in args.decode_batches.split(",")] + [("prefill", args.prefill_tokens)]
    for label, n in cases:
        slots = [i % args.adapters for i in range(n)]
        x, a_pools, b_pools, pt, rk, sc, meta = _lora_problem(
            slots, ranks, args.hidden, h_outs, args.page_rank, dtype, dev
        )
        active = min(n, args.adapters)
        v = torch.empty(len(h_outs), n, args.rank, device=dev)
        y = torch.zeros(n, sum(h_outs), device=dev, dtype=dtype)
        shrink_bytes = (
            n * args.hidden * es + active * len(h_outs) * args.rank * args.hidden * es + v.numel() * 4
        )
        expand_bytes = v.numel() * 4 + active * sum(h_outs) * args.rank * es + 2 * y.numel() * es
        shrink = partial(lora_shrink, x, a_pools, pt, rk, meta, v)
        expand = partial(lora_expand, v, b_pools, pt, rk, sc, meta, y)

        def pair(shrink=shrink, expand=expand) -> None:
            shrink()
            expand()

        fused_bytes = shrink_bytes + expand_bytes - 2 * v.numel() * 4
        ops = (
            ("shrink", shrink_bytes, shrink),
            ("expand", expand_bytes, expand),
            ("sgmv pair", fused_bytes, pair),
            ("bgmv fused", fused_bytes, partial(lora_bgmv, x, a_pools, b_pools, pt, rk, sc, meta, y)),
        )
        for op, nbytes, fn in ops:
            ms = _time_ms(fn, dev)
            gbs = nbytes / (ms * 1e-3) / 1e9
            print(f"| {label} | {n} | {op} | {ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu_smoke = args.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if not cpu_smoke and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        print("bench/kernels/triton_gpu.py needs a CUDA device (kernel tests on CPU: pytest tests/kernels)")
        return 2
    dtype = DTYPES[args.dtype]
    ok = True
    if not args.skip_check:
        ok = check_correctness(dtype, args.device, args.tiny)
    if not args.skip_bench:
        bench(args, dtype, args.device)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
