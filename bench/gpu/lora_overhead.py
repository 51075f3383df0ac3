"""LoRA overhead on the GPU, decode and prefill measured separately (needs CUDA; ``--device cpu`` and
``--size tiny`` smoke-test the script).

One random Llama of ``--size`` (``1b``: TinyLlama-1.1B's shape) in ``--dtype``, two engines side by side:
a LoRA-enabled one with ``--adapters`` rank-``--rank`` adapters on all 7 projections (pinned), and the same
model with ``enable_lora=False``. Both capture their decode CUDA graphs at start (time and memory are
reported). Then, interleaved and repeated ``--repeats`` times (the best repeat counts):

- **decode** at each batch of ``--batches``: that many requests (request i on adapter i mod adapters) ×
  ``--prompt-len`` tokens × ``--new-tokens`` greedy tokens; the median step time of the full-batch decode
  steps, for mixed adapters, for the same batch on the base model on the LoRA engine, and on the
  LoRA-disabled engine.
- **prefill**: ``--prefill-prompts`` prompts of ``--prefill-len`` tokens on ``--prefill-adapters`` adapters
  in one step (one generated token); the prefill step's time, the same three ways.

``--compare-sgmv`` adds a fourth decode run: the mixed batch with the fused BGMV kernel off (every step
on the SGMV shrink/expand pair, `engine.lora.backend.BGMV_MAX_ROWS` set to 0 for it), so the kernel rule
is checked in the same run.

Ratios, all from the same run: mixed / base (the LoRA overhead; goal ≤ 1.15 at decode batches 64 and 256,
≤ 1.2 at prefill) and LoRA-disabled / base-on-LoRA-engine time (base-only batches at full speed: goal ≥ 0.98).

Usage: ``python -m bench.gpu.lora_overhead [--size 1b] [--batches 1,64,256] [--json out.json]``;
``bench/gpu/check.sh`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common.workload import RunTiming, make_prompts, timed_run
from bench.gpu.e2e import DTYPES, SIZES, build_adapters, build_base_on_device


@dataclass(slots=True)
class Leg:
    """One measured case: step times (ms) of mixed adapters, base on the LoRA engine, LoRA disabled."""

    kind: str  # "decode" or "prefill"
    batch: int  # requests in the step
    tokens: int  # tokens per step (decode: batch; prefill: prompts x length)
    mixed_ms: float = 0.0
    base_ms: float = 0.0
    no_lora_ms: float = 0.0
    mixed_sgmv_ms: float = 0.0  # mixed with the BGMV kernel off (--compare-sgmv; 0: not measured)

    @property
    def lora_overhead(self) -> float:
        return self.mixed_ms / self.base_ms if self.base_ms else 0.0

    @property
    def base_speed(self) -> float:
        """LoRA-disabled step time / base-only step time on the LoRA engine (1.0: full speed)."""
        return self.no_lora_ms / self.base_ms if self.base_ms else 0.0


@dataclass(slots=True)
class EngineStart:
    start_s: float
    graphs: int
    graph_capture_s: float
    graph_memory_mib: float


@dataclass(slots=True)
class OverheadResult:
    device_name: str
    size: str
    dtype: str
    adapters: int
    rank: int
    lora_engine: EngineStart
    no_lora_engine: EngineStart
    legs: list[Leg] = field(default_factory=list)

    def markdown(self) -> str:
        lo, nl = self.lora_engine, self.no_lora_engine
        rows = [
            f"{self.device_name}; random Llama `{self.size}` in {self.dtype}; {self.adapters} adapters of "
            f"rank {self.rank} on all 7 projections. Engine start: LoRA {lo.start_s:.1f} s ({lo.graphs} "
            f"graphs, {lo.graph_capture_s:.1f} s, {lo.graph_memory_mib:.0f} MiB), LoRA off "
            f"{nl.start_s:.1f} s ({nl.graphs} graphs, {nl.graph_capture_s:.1f} s, "
            f"{nl.graph_memory_mib:.0f} MiB)\n",
            "| step | batch | tokens | mixed (ms) | base, LoRA engine (ms) | LoRA off (ms) | mixed / base | "
            "LoRA off / base | mixed, SGMV only (ms) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for g in self.legs:
            sgmv = f"{g.mixed_sgmv_ms:.2f}" if g.mixed_sgmv_ms else "-"
            rows.append(
                f"| {g.kind} | {g.batch} | {g.tokens} | {g.mixed_ms:.2f} | {g.base_ms:.2f} | "
                f"{g.no_lora_ms:.2f} | **{g.lora_overhead:.2f}x** | {g.base_speed:.2f} | {sgmv} |"
            )
        return "\n".join(rows)

    def to_dict(self) -> dict:
        d = asdict(self)
        for leg, g in zip(d["legs"], self.legs, strict=True):
            leg["lora_overhead"], leg["base_speed"] = g.lora_overhead, g.base_speed
        return d


def _engine(base: Path, args: argparse.Namespace, enable_lora: bool):
    """An `LLMEngine` for every leg (`max_num_seqs` the largest batch) and how long its start took."""
    from engine import LLM

    max_batch = max(args.batches)
    tokens = max(max_batch * args.prompt_len, args.prefill_prompts * args.prefill_len)
    t0 = time.perf_counter()
    llm = LLM(
        str(base),
        device=args.device,
        dtype=args.dtype,
        enable_lora=enable_lora,
        max_loras=max(args.adapters, args.prefill_adapters),
        max_lora_rank=max(16, args.rank),
        max_num_seqs=max_batch,
        max_num_batched_tokens=tokens,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
    )
    start_s = time.perf_counter() - t0
    graphs = llm.engine.runner.graphs
    stats = graphs.stats if graphs is not None else None
    start = EngineStart(
        start_s,
        stats.graphs if stats else 0,
        stats.capture_s if stats else 0.0,
        stats.memory_bytes / (1 << 20) if stats else 0.0,
    )
    return llm.engine, start


def _decode_ms(run: RunTiming, batch: int) -> float:
    """Median time of the steps that decoded the full batch (`batch` tokens; the prompts, longer than one
    token, were prefilled before), in ms."""
    steps = [dt * 1e3 for dt, n in zip(run.step_s, run.step_tokens, strict=True) if n == batch]
    return statistics.median(steps) if steps else float("nan")


def _prefill_ms(run: RunTiming) -> float:
    return run.prefill_s * 1e3 / max(run.prefill_steps, 1)


def measure(args: argparse.Namespace) -> OverheadResult:
    """Build the model and adapters, start both engines, time every leg (module docstring)."""
    from engine import LoRARequest, SamplingParams

    spec = SIZES[args.size]
    root = args.workdir / f"model-{args.size}-{args.dtype}"
    base = build_base_on_device(root, spec, DTYPES[args.dtype])
    dirs = build_adapters(root, spec, max(args.adapters, args.prefill_adapters), args.rank)
    lora_eng, lora_start = _engine(base, args, True)
    plain_eng, plain_start = _engine(base, args, False)
    loras = [LoRARequest(f"a{i}", str(d)) for i, d in enumerate(dirs)]
    for lr in loras:
        lora_eng.pin_lora(lora_eng.add_lora(lr))
    result = OverheadResult(
        _device_name(args.device), args.size, args.dtype, args.adapters, args.rank, lora_start, plain_start
    )
    decode = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cases = [("decode", b, args.prompt_len, args.adapters, decode) for b in args.batches]
    cases.append(("prefill", args.prefill_prompts, args.prefill_len, args.prefill_adapters, one))
    for kind, batch, length, n_adapters, params in cases:
        prompts = make_prompts(batch, length, spec.vocab_size, seed=batch)
        per_req = [loras[i % n_adapters] for i in range(batch)]
        legs = [("mixed", lora_eng, per_req), ("base", lora_eng, None), ("no_lora", plain_eng, None)]
        if args.compare_sgmv and kind == "decode":
            legs.append(("mixed_sgmv", lora_eng, per_req))
        runs: dict[str, list[float]] = {name: [] for name, _, _ in legs}
        for r in range(args.repeats + 1):  # the first round warms up (graphs, kernels, allocator)
            for name, eng, reqs in legs:
                with _bgmv_off(name == "mixed_sgmv"):
                    run = timed_run(eng, prompts, params, reqs, f"{kind}{batch}-{name}{r}")
                if r > 0:
                    runs[name].append(_decode_ms(run, batch) if kind == "decode" else _prefill_ms(run))
        leg = Leg(kind, batch, batch if kind == "decode" else batch * length)
        leg.mixed_ms, leg.base_ms, leg.no_lora_ms = (min(runs[k]) for k in ("mixed", "base", "no_lora"))
        leg.mixed_sgmv_ms = min(runs.get("mixed_sgmv") or [0.0])
        result.legs.append(leg)
        print(
            f"{kind} batch {batch}: {leg.mixed_ms:.2f} / {leg.base_ms:.2f} / {leg.no_lora_ms:.2f} ms",
            flush=True,
        )
    lora_eng.lora.shutdown()
    return result


@contextlib.contextmanager
def _bgmv_off(off: bool) -> Iterator[None]:
    """While `off`: no step takes the fused BGMV kernel (`BGMV_MAX_ROWS` = 0), every one the SGMV pair."""
    from engine.lora import backend

    saved = backend.BGMV_MAX_ROWS
    backend.BGMV_MAX_ROWS = 0 if off else saved
    try:
        yield
    finally:
        backend.BGMV_MAX_ROWS = saved


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu smoke-tests this script")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument(
        "--batches", type=_int_list, default=[1, 64, 256], help="decode batch sizes, e.g. 1,64,256"
    )
    ap.add_argument("--prompt-len", type=int, default=128, help="decode legs' prompt length")
    ap.add_argument("--new-tokens", type=int, default=24, help="decode legs' generated tokens")
    ap.add_argument("--prefill-prompts", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--prefill-adapters", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=4.0, help="KV cache budget of each engine")
    ap.add_argument("--compare-sgmv", action="store_true", help="decode: also time mixed with BGMV off")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/loraplex-gpu-e2e"))
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    for name in ("adapters", "rank", "prompt_len", "new_tokens", "prefill_prompts", "prefill_len", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 1 <= args.prefill_adapters <= args.prefill_prompts:
        ap.error("--prefill-adapters must be between 1 and --prefill-prompts")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/gpu/lora_overhead.py needs a CUDA device (--device cpu smoke-tests the script itself)")
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    print(result.markdown())
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
