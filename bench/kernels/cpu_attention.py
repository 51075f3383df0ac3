"""The CPU attention paths compared in one process: the native paged kernel (blocks read in place) vs the
torch path (gather the blocks with `index_select`, one masked SDPA), interleaved, best of N.

Three measurements on the offline benchmark's random Llama (``--size``, as in ``bench.gpu.e2e``), base
model only (no adapters), at the thread count ``OMP_NUM_THREADS`` (the thread governor is off, so both
paths run at the same count whatever the load):

1. attention alone: one layer's decode attention for ``--requests`` sequences of ``--prompt-len`` tokens;
2. decode steps: ``--requests`` sequences decoding together, ``--steps`` steps per round, the path
   switched between rounds (A B B A ...), so both see the same contexts; after one untimed pass over
   the same context lengths (the torch path's first step at a new padded length is many times slower
   than its later ones);
3. offline throughput: the whole batch (``--requests`` prompts, ``--new-tokens`` greedy tokens each),
   generated once per path per repeat, interleaved; greedy tokens of the two paths are compared.

Each is reported as wall time and as the process's CPU time (``time.process_time``, all threads): on a
shared, loaded machine the wall time mostly measures the share of the cores the process got, while
the CPU time of one thread measures the work. Best of the rounds for each.

Usage: ``OMP_NUM_THREADS=2 python -m bench.kernels.cpu_attention --size bench --dtype float32 --requests 32``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from bench.common.workload import make_prompts, timed_run
from bench.gpu.e2e import DTYPES, SIZES, _llm, build_base_on_device

PATHS = ("native", "torch")


def _set_path(eng, path: str) -> None:
    eng.runner.backend.native.enabled = path == "native"


def _order(repeats: int) -> list[str]:
    """A B B A A B ...: each path first as often as second."""
    return [p for r in range(repeats) for p in (PATHS if r % 2 == 0 else PATHS[::-1])]


def attention_alone(spec, dtype: torch.dtype, requests: int, context: int, repeats: int) -> dict[str, float]:
    """Best time (ms) of one layer's decode attention per path, for `requests` sequences of `context`."""
    from engine.attention import AttentionMetadata
    from engine.attention.torch_backend import TorchAttentionBackend

    hq, hkv, bs = spec.num_heads, spec.num_kv_heads, 16
    d = spec.hidden_size // hq
    blocks = -(-context // bs)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(requests * blocks + 1, bs, hkv, d, generator=gen).to(dtype)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    tables = torch.randperm(requests * blocks, generator=gen).view(requests, blocks).to(torch.int32)
    q = torch.randn(requests, hq, d, generator=gen).to(dtype)
    best = {p: float("inf") for p in PATHS}
    for path in _order(repeats):
        backend = TorchAttentionBackend(native=path == "native")
        meta = AttentionMetadata(
            torch.zeros(0, dtype=torch.int64), tables, torch.full((requests,), context, dtype=torch.int32),
            torch.arange(requests + 1, dtype=torch.int32), [context] * requests, list(range(requests + 1)),
            requests, context, 1,
        )  # fmt: skip
        backend.attend(q, k, v, meta, 0.125)  # the step's plan (built once per step, on the first layer)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(20):
            backend.attend(q, k, v, meta, 0.125)
        best[path] = min(best[path], (time.perf_counter() - t0) / 20 * 1e3)
        best[path + " cpu"] = min(
            best.get(path + " cpu", float("inf")), (time.process_time() - c0) / 20 * 1e3
        )
    return best


def decode_steps(eng, prompts, steps: int, repeats: int) -> dict[str, float]:
    """Best per-step time (ms) of pure decode steps per path, paths alternating between rounds."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=steps * 2 * repeats + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"steps-{i}", p, params)
    while eng.runner.last_batch[0] != eng.runner.last_batch[1] or eng.runner.last_batch[0] == 0:
        eng.step()  # until a pure decode step ran
    best = {p: float("inf") for p in PATHS}
    for path in _order(repeats):
        _set_path(eng, path)
        eng.step()  # one step on the new path before timing
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            eng.step()
        best[path] = min(best[path], (time.perf_counter() - t0) / steps * 1e3)
        best[path + " cpu"] = min(
            best.get(path + " cpu", float("inf")), (time.process_time() - c0) / steps * 1e3
        )
    for rid in [f"steps-{i}" for i in range(len(prompts))]:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return best


def _fmt(best: dict[str, float]) -> str:
    """Wall and process CPU time (ms) of both paths and their ratios (torch / native)."""
    return (
        f"wall native {best['native']:.3f} ms, torch {best['torch']:.3f} ms "
        f"({best['torch'] / best['native']:.3f}x); CPU native {best['native cpu']:.3f} ms, "
        f"torch {best['torch cpu']:.3f} ms ({best['torch cpu'] / best['native cpu']:.3f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="bench")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/loraplex-gpu-e2e"))
    args = ap.parse_args(argv)
    from engine import SamplingParams

    spec, dtype = SIZES[args.size], DTYPES[args.dtype]
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    alone = attention_alone(spec, dtype, args.requests, args.prompt_len, args.repeats * 2)
    print(f"attention alone, one layer, {args.requests} x {args.prompt_len} tokens: {_fmt(alone)}")
    base = build_base_on_device(args.workdir / f"model-{args.size}-{args.dtype}", spec, dtype)
    llm = _llm(base, "cpu", args.dtype, args.requests, args.prompt_len, 1, 16, kv_gib=2)
    eng = llm.engine
    eng.thread_governor = None  # both paths at the same thread count (the governor reacts to the load)
    prompts = make_prompts(args.requests, args.prompt_len, spec.vocab_size)
    decode_steps(eng, prompts, args.steps, args.repeats)  # warm-up: the torch path's first step at each
    steps = decode_steps(eng, prompts, args.steps, args.repeats)  # context length costs far more than later
    print(f"decode step: {_fmt(steps)} (threads now {torch.get_num_threads()})")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, list] = {p: [] for p in PATHS}
    cpu: dict[str, float] = {p: float("inf") for p in PATHS}
    for i, path in enumerate(_order(args.repeats)):
        _set_path(eng, path)
        c0 = time.process_time()
        runs[path].append(timed_run(eng, prompts, params, None, f"{path}-{i}"))
        cpu[path] = min(cpu[path], time.process_time() - c0)
    tok = {p: max(r.output_tokens / r.total_s for r in runs[p]) for p in PATHS}
    same = sum(a == b for a, b in zip(runs["native"][0].token_ids, runs["torch"][0].token_ids, strict=True))
    n, t = tok["native"], tok["torch"]
    dec = {p: min(r.decode_s / max(1, r.decode_steps) for r in runs[p]) * 1e3 for p in PATHS}
    print(f"offline base: native {n:.0f} tok/s, torch {t:.0f} tok/s, native / torch {n / t:.3f}x; "
          f"decode steps in it: native {dec['native']:.2f} ms, torch {dec['torch']:.2f} ms "
          f"({dec['torch'] / dec['native']:.3f}x)")  # fmt: skip
    print(f"  CPU time per run: native {cpu['native']:.2f} s, torch {cpu['torch']:.2f} s "
          f"({cpu['torch'] / cpu['native']:.3f}x); greedy equal {same}/{len(prompts)}; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    eng.lora.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
