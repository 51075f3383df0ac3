"""End-to-end GPU check of the engine (needs CUDA; ``--help`` works anywhere).

Two parts, each printing a markdown table:

1. **Parity** — the offline benchmark's small random Llama in float32 on the GPU, ``--parity-adapters``
   random PEFT adapters plus the base model in one mixed batch: loraplex's greedy tokens against HF
   transformers + PEFT ``generate(adapter_names=...)`` run on the same GPU (the numerics oracle).
2. **Throughput** — a random Llama of ``--size`` (``1b``: TinyLlama-1.1B's shape) in ``--dtype``:
   ``--requests`` requests on ``--adapters`` rank-``--rank`` adapters (all 7 projections) against the
   same batch on the base model only, interleaved, best of ``--repeats``. Ratios are the result: LoRA
   overhead (mixed / base time) and output tokens per second of each.

Usage: ``python -m bench.gpu.e2e [--size 1b] [--dtype bfloat16] [--requests 64] [--json out.json]``.
``bench/gpu/check.sh`` runs it with the other GPU checks.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common.workload import ModelSpec, RunTiming, best, build_adapter, make_prompts, timed_run

SIZES = {
    "tiny": ModelSpec(  # smoke tests of this script on CPU
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=128,
    ),
    "bench": ModelSpec(),
    # TinyLlama-1.1B's shape: 1.1 B parameters.
    "1b": ModelSpec(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        max_position_embeddings=2048,
    ),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_base_on_device(root: Path, spec: ModelSpec, dtype: torch.dtype, seed: int = 0) -> Path:
    """Save a random `LlamaForCausalLM` of shape `spec` in `dtype` under `root/base` (initialised on the
    GPU when there is one: a 1B model's random init on the host takes minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = root / "base"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = LlamaForCausalLM(LlamaConfig(**spec.hf_config()))
    model.to(dtype).save_pretrained(out)
    del model
    return out


def build_adapters(root: Path, spec: ModelSpec, count: int, rank: int) -> list[Path]:
    """`count` random rank-`rank` adapters `a{i}` on all 7 projections (reused when present)."""
    dirs = []
    for i in range(count):
        d = root / f"a{i}-r{rank}"
        if not (d / "adapter_config.json").exists():
            build_adapter(d, spec, rank, seed=1000 + i)
        dirs.append(d)
    return dirs


def _llm(
    base: Path,
    device: str,
    dtype: str,
    requests: int,
    prompt_len: int,
    adapters: int,
    rank: int,
    kv_gib: float,
):
    from engine import LLM

    return LLM(
        str(base),
        device=device,
        dtype=dtype,
        max_loras=max(1, min(adapters, requests)),
        max_lora_rank=max(16, rank),
        max_num_seqs=max(requests, 1),
        max_num_batched_tokens=max(2048, requests * prompt_len),
        enable_prefix_caching=False,
        kv_cache_memory_bytes=int(kv_gib * (1 << 30)),
    )


@dataclass(slots=True)
class ParityResult:
    adapters: int
    requests: int
    new_tokens: int
    token_match: float  # fraction of requests whose greedy tokens equal HF + PEFT's
    base_match: float  # the same for the base-model requests (no adapter)


def run_parity(
    workdir: Path, device: str, adapters: int, new_tokens: int, size: str = "bench"
) -> ParityResult:
    """loraplex vs HF + PEFT, both in float32 on `device`, on one mixed batch; base requests included."""
    from bench.common.hf_peft import load_peft_model
    from engine import LoRARequest, SamplingParams

    spec = SIZES[size]
    root = workdir / f"parity-{size}"
    base = build_base_on_device(root, spec, torch.float32)
    dirs = build_adapters(root, spec, adapters, 16)
    prompts = make_prompts(2 * adapters, 32, spec.vocab_size, seed=7)
    loras = [LoRARequest(f"a{i}", str(d)) for i, d in enumerate(dirs)]
    per_req = [loras[i] if i < adapters else None for i in range(len(prompts))]
    llm = _llm(base, device, "float32", len(prompts), 32, adapters, 16, kv_gib=2)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=per_req)]
    llm.engine.lora.shutdown()
    del llm
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    model = load_peft_model(base, dirs).to(device)
    names = [f"a{i}" if i < adapters else "__base__" for i in range(len(prompts))]
    want = _peft_greedy(model, prompts, names, new_tokens)
    match = [list(a) == list(b) for a, b in zip(ours, want, strict=True)]
    return ParityResult(
        adapters,
        len(prompts),
        new_tokens,
        token_match=sum(match[:adapters]) / adapters,
        base_match=sum(match[adapters:]) / (len(prompts) - adapters),
    )


@torch.inference_mode()
def _peft_greedy(model, prompts: list[list[int]], names: list[str], new_tokens: int) -> list[list[int]]:
    """HF + PEFT greedy generation of equal-length prompts on the model's device, one adapter per row
    (PEFT's name for "no adapter" is ``__base__``)."""
    ids = torch.tensor(prompts, dtype=torch.int64, device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        adapter_names=names,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :].tolist()


@dataclass(slots=True)
class ThroughputResult:
    size: str
    dtype: str
    device_name: str
    requests: int
    adapters: int
    rank: int
    prompt_len: int
    new_tokens: int
    mixed: RunTiming
    base: RunTiming
    build_s: float
    engine_start_s: float
    mixed_eager: RunTiming | None = None  # the same runs with CUDA graphs off (None: graphs were off)
    base_eager: RunTiming | None = None

    @property
    def lora_overhead(self) -> float:
        return self.mixed.total_s / self.base.total_s

    def markdown(self) -> str:
        """The result as a table and the LoRA-overhead ratio."""
        rows = [
            f"{self.device_name}; random Llama `{self.size}` in {self.dtype}; {self.requests} requests × "
            f"{self.prompt_len}-token prompts × {self.new_tokens} greedy tokens; engine start "
            f"{self.engine_start_s:.1f} s\n",
            "| run | total (s) | prefill (s) | decode (s) | decode steps | output tok/s |",
            "|---|---|---|---|---|---|",
        ]
        runs = [
            (f"{self.adapters} adapters, rank {self.rank}, all 7 projections", self.mixed),
            ("base model only", self.base),
        ]
        if self.mixed_eager is not None and self.base_eager is not None:
            runs = [(f"{label}, decode from CUDA graphs", r) for label, r in runs]
            runs += [
                (f"{self.adapters} adapters, eager", self.mixed_eager),
                ("base model only, eager", self.base_eager),
            ]
        for label, r in runs:
            rows.append(
                f"| {label} | {r.total_s:.3f} | {r.prefill_s:.3f} | {r.decode_s:.3f} | {r.decode_steps} | "
                f"{r.tokens_per_s:.0f} |"
            )
        rows.append(f"\n- LoRA overhead (mixed / base time): **{self.lora_overhead:.2f}x**")
        if self.mixed_eager is not None and self.base_eager is not None:
            mixed = self.mixed.tokens_per_s / self.mixed_eager.tokens_per_s
            base = self.base.tokens_per_s / self.base_eager.tokens_per_s
            rows.append(f"- CUDA graphs vs eager, output tok/s: **{mixed:.2f}x** mixed, **{base:.2f}x** base")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        d = asdict(self)
        for run in ("mixed", "base", "mixed_eager", "base_eager"):
            if d[run] is None:
                continue
            d[run].pop("token_ids")
            d[run].pop("step_s")
            d[run].pop("step_tokens")
        d["lora_overhead"] = self.lora_overhead
        return d


def run_throughput(args: argparse.Namespace, workdir: Path) -> ThroughputResult:
    """Mixed-adapter vs base-only generation of the same batch on a random model of `args.size`."""
    from engine import LoRARequest, SamplingParams

    spec = SIZES[args.size]
    root = workdir / f"model-{args.size}-{args.dtype}"
    t0 = time.perf_counter()
    base = build_base_on_device(root, spec, DTYPES[args.dtype])
    dirs = build_adapters(root, spec, args.adapters, args.rank)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = _llm(
        base, args.device, args.dtype, args.requests, args.prompt_len, args.adapters, args.rank, args.kv_gib
    )
    engine_start_s = time.perf_counter() - t0
    eng = llm.engine
    loras = [LoRARequest(f"a{i}", str(d)) for i, d in enumerate(dirs)]
    per_req = [loras[i % args.adapters] for i in range(args.requests)]
    for lr in set(per_req):
        eng.pin_lora(eng.add_lora(lr))
    prompts = make_prompts(args.requests, args.prompt_len, spec.vocab_size)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    timed_run(eng, prompts, params, per_req, "warm-lora")  # also captures the batch's graphs
    timed_run(eng, prompts, params, None, "warm-base")
    graphs = eng.runner.graphs  # None when CUDA graphs are off (or on CPU)
    modes = [graphs, None] if graphs is not None else [None]
    runs: dict[tuple[str, bool], list[RunTiming]] = {}
    for r in range(args.repeats):
        for mode in modes:  # interleaved: graphs, then eager, in every repeat
            eng.runner.graphs = mode
            tag = "graphs" if mode is not None else "eager"
            runs.setdefault(("mixed", mode is None), []).append(
                timed_run(eng, prompts, params, per_req, f"mixed-{tag}{r}")
            )
            runs.setdefault(("base", mode is None), []).append(
                timed_run(eng, prompts, params, None, f"base-{tag}{r}")
            )
    eng.runner.graphs = graphs
    eng.lora.shutdown()
    first_eager = graphs is None
    return ThroughputResult(
        args.size,
        args.dtype,
        _device_name(args.device),
        args.requests,
        args.adapters,
        args.rank,
        args.prompt_len,
        args.new_tokens,
        best(runs[("mixed", first_eager)]),
        best(runs[("base", first_eager)]),
        build_s,
        engine_start_s,
        None if first_eager else best(runs[("mixed", True)]),
        None if first_eager else best(runs[("base", True)]),
    )


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu smoke-tests this script")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=16.0, help="KV cache budget of the throughput engine")
    ap.add_argument("--parity-adapters", type=int, default=8)
    ap.add_argument("--parity-size", choices=sorted(SIZES), default="bench")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/loraplex-gpu-e2e"))
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/gpu/e2e.py needs a CUDA device (--device cpu smoke-tests the script itself)")
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {}
    ok = True
    if not args.skip_parity:
        parity = run_parity(args.workdir, args.device, args.parity_adapters, 24, args.parity_size)
        results["parity"] = asdict(parity)
        print(f"| parity (float32, {args.device}) vs HF + PEFT | requests | greedy tokens equal |")
        print("|---|---|---|")
        print(f"| {parity.adapters} adapters | {parity.adapters} | {parity.token_match:.0%} |")
        print(f"| base model | {parity.requests - parity.adapters} | {parity.base_match:.0%} |\n")
        ok = parity.token_match == 1.0 and parity.base_match == 1.0
    if not args.skip_throughput:
        tp = run_throughput(args, args.workdir)
        results["throughput"] = tp.to_dict()
        print(tp.markdown())
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
