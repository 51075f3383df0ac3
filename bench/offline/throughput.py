"""Benchmark 1 — offline mixed-adapter throughput (`loraplex bench offline`).

    python -m bench.offline.throughput [--adapters 32] [--requests 32] [--rank 16] [--prompt-len 64] \\
        [--new-tokens 48] [--repeats 3] [--threads 1] [--dtype float32] [--hog N] [--no-hf] \\
        [--model path/to/model.gguf | path/to/hf_dir] [--json out.json] [--plot docs/x.png] \\
        [--compare-unfused]

A random-weight Llama (hidden 384, 6 layers, intermediate 1024, vocab 8000, 6 heads / 2 KV heads) and
`--adapters` random rank-`--rank` PEFT adapters on all 7 projections are written to a work directory
(nothing is downloaded); `--model` benchmarks a given checkpoint instead (a GGUF file is dequantized at
load; the HF + PEFT baseline gets transformers' dequantized copy of it). In one process, one after
another, it times greedy generation of the same batch (request i on adapter i mod N):

1. loraplex with the adapters, and 2. loraplex on the base model — interleaved, best of `--repeats`;
3. HF transformers + PEFT `generate(adapter_names=...)` on the same batch (its tokens are compared);
4. the "GEMM limit": the dense matmuls alone for the base run's decode steps (`bench.offline.gemm_limit`).

With `--compare-unfused`, each repeat also times 2 with the small ops between the projections as the
torch formulas instead of the fused native kernels (`engine/model/cpu_fused.py`), interleaved.

Ratios are the result: LoRA overhead (1/2), speed-up over PEFT (3/1), and the base decode's fraction
of the GEMM limit (4 / decode time of 2).

With `--speculative ngram` (or `draft:PATH`) it runs `bench.offline.speculative` instead: tokens/s and mean
acceptance length with and without speculative decoding, on the demo tasks and a random model.

With `--hog N`, every repeat also runs 1 and 2 while N busy processes compete for the cores
(`bench.common.hog`, started before and killed after each such run), so the slowdown under contention is
a ratio measured in the same run. The load average is recorded at the start and the end.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import torch

from bench.common.hog import cpu_hogs, load_average
from bench.common.progress import progress
from bench.common.workload import (
    LoRAOptions,
    ModelSpec,
    bench_env,
    best,
    build_adapter,
    build_base,
    hf_copy,
    make_prompts,
    report,
    timed_run,
)
from bench.offline.byte_floor import ByteFloor, adapter_page_bytes, base_weight_bytes, read_bandwidth_gb_s
from bench.offline.gemm_limit import gemm_limit_seconds
from bench.offline.offline_result import OfflineResult

__all__ = ["OfflineResult", "main", "prepare", "run_offline"]


def prepare(
    workdir: Path, spec: ModelSpec, ranks: list[int], model: Path | None = None
) -> tuple[Path, list[Path]]:
    """Build (or reuse) the base model and adapters `a{i}` of rank `ranks[i]` under `workdir`; with
    `model` (an HF directory or a GGUF file, whose shape `spec` must then be) that is the base."""
    if model is not None:
        base = model
        tag = f"-{Path(model).stem}"
    else:
        base, tag = workdir / "base", ""
        if not (base / "config.json").exists():
            build_base(workdir, spec)
    dirs = []
    for i, r in enumerate(ranks):
        d = workdir / f"a{i}-r{r}{tag}"
        if not (d / "adapter_config.json").exists():
            build_adapter(d, spec, r, seed=1000 + i)
        dirs.append(d)
    return base, dirs


def run_offline(
    adapters: int = 32,
    requests: int = 32,
    rank: int = 16,
    prompt_len: int = 64,
    new_tokens: int = 48,
    repeats: int = 3,
    threads: int = 1,
    hf: bool = True,
    gemm_repeats: int = 5,
    spec: ModelSpec | None = None,
    workdir: Path | None = None,
    quiet: bool = False,
    lora: LoRAOptions | None = None,
    dtype: str = "float32",
    hogs: int = 0,
    adaptive_threads: bool = True,
    model: Path | None = None,
    compare_unfused: bool = False,
) -> OfflineResult:
    """Run benchmark 1 (see the module docstring) and return its timings; `model` replaces the random
    Llama by a checkpoint (HF directory or GGUF file)."""
    from engine import LLM, LoRARequest, SamplingParams

    spec = ModelSpec.of_model(model) if model is not None else spec or ModelSpec()
    lora = lora or LoRAOptions()
    load_start = load_average()[0]
    with bench_env(threads, workdir) as workdir:
        with progress(quiet) as bar:
            task = bar.add_task("building model and adapters", total=1)
            base, dirs = prepare(workdir, spec, [rank] * adapters, model)
            bar.advance(task)
            loras = [LoRARequest(f"a{i}", str(d)) for i, d in enumerate(dirs)]
            prompts = make_prompts(requests, prompt_len, spec.vocab_size)
            per_req = [loras[i % adapters] for i in range(requests)]
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            llm = LLM(
                str(base),
                device="cpu",
                dtype=dtype,
                max_loras=max(1, min(adapters, requests)),
                max_lora_rank=max(16, rank),
                max_num_seqs=max(requests, 1),
                max_num_batched_tokens=max(2048, requests * prompt_len),
                enable_prefix_caching=False,
                adaptive_threads=adaptive_threads,
                **lora.engine_kwargs(),
            )
            eng = llm.engine
            for lr in set(per_req):
                eng.pin_lora(eng.add_lora(lr))
            timed_run(eng, prompts[:4], params, per_req[:4], "warm-lora")
            timed_run(eng, prompts[:4], params, None, "warm-base")
            legs = (4 if hogs else 2) + compare_unfused
            task = bar.add_task("loraplex mixed / base (interleaved)", total=legs * repeats)
            mixed, base_runs, hog_mixed, hog_base, unfused = [], [], [], [], []
            for r in range(repeats):
                mixed.append(timed_run(eng, prompts, params, per_req, f"mixed{r}"))
                bar.advance(task)
                base_runs.append(timed_run(eng, prompts, params, None, f"base{r}"))
                bar.advance(task)
                if compare_unfused:  # the same engine with the torch formulas for the small ops
                    eng.model.fused_cpu_ops = False
                    unfused.append(timed_run(eng, prompts, params, None, f"unfused{r}"))
                    eng.model.fused_cpu_ops = True
                    bar.advance(task)
                if hogs:
                    with cpu_hogs(hogs):
                        hog_mixed.append(timed_run(eng, prompts, params, per_req, f"hog-mixed{r}"))
                    bar.advance(task)
                    with cpu_hogs(hogs):
                        hog_base.append(timed_run(eng, prompts, params, None, f"hog-base{r}"))
                    bar.advance(task)
            result = OfflineResult(
                requests,
                adapters,
                rank,
                prompt_len,
                new_tokens,
                threads if threads > 0 else torch.get_num_threads(),
                best(mixed),
                best(base_runs),
                spec=asdict(spec),
                lora_backend=eng.lora.backend,
                lora_dtype=str(eng.lora.pool.dtype).removeprefix("torch."),
                dtype=str(eng.dtype).removeprefix("torch."),
                hogs=hogs,
                adaptive_threads=adaptive_threads,
                hog_mixed=best(hog_mixed) if hogs else None,
                hog_base=best(hog_base) if hogs else None,
                base_unfused=best(unfused) if compare_unfused else None,
            )
            result.floor = ByteFloor(
                base_weight_bytes(eng.model),
                adapter_page_bytes(eng.lora.pool, list(eng.lora.pool.resident)),
                read_bandwidth_gb_s(),
            )
            task = bar.add_task("GEMM limit", total=1)
            result.gemm_limit_decode_s = gemm_limit_seconds(
                eng.model, result.base.decode_batches, gemm_repeats
            )
            bar.advance(task)
            if hf:
                from bench.common.hf_peft import load_peft_model, time_peft_generate

                task = bar.add_task("HF transformers + PEFT generate", total=1)
                peft_model = load_peft_model(hf_copy(base, workdir), dirs)
                hf_s, hf_tokens = time_peft_generate(
                    peft_model, prompts, [i % adapters for i in range(requests)], new_tokens
                )
                result.hf_peft_s = hf_s
                ours = result.mixed.token_ids
                result.hf_token_match = sum(a == b for a, b in zip(ours, hf_tokens, strict=True)) / requests
                bar.advance(task)
            if eng.lora is not None:
                eng.lora.shutdown()
        result.load_avg = [load_start, load_average()[0]]
        return result


def main(argv: list[str] | None = None) -> OfflineResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved mixed/base repeats (best of N)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)"
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers + PEFT baseline")
    ap.add_argument("--workdir", type=Path, default=None, help="reuse generated model/adapters from here")
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="benchmark this checkpoint (HF dir or .gguf file), not a random one",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart of the throughputs")
    ap.add_argument("--dtype", default="float32", help="model dtype: float32 or bfloat16 (or auto)")
    ap.add_argument(
        "--hog", type=int, default=0, help="also run each repeat beside N busy processes (contention)"
    )
    ap.add_argument(
        "--fixed-threads", action="store_true", help="keep --threads under contention (no thread governor)"
    )
    ap.add_argument(
        "--compare-unfused",
        action="store_true",
        help="also time base-only with the CPU's small ops as torch formulas (interleaved)",
    )
    LoRAOptions.add_arguments(ap)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument(
        "--speculative",
        default=None,
        help="ngram or draft:PATH: run the speculative-decoding comparison instead "
        "(bench/offline/speculative.py)",
    )
    from bench.offline.speculative import add_arguments as add_spec_arguments

    add_spec_arguments(ap)
    args = ap.parse_args(argv)
    if args.speculative is not None:
        from bench.offline.speculative import from_args as run_spec

        return run_spec(args)  # type: ignore[return-value]
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_offline(
        adapters=args.adapters,
        requests=args.requests,
        rank=args.rank,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        threads=args.threads,
        hf=not args.no_hf,
        workdir=args.workdir,
        quiet=args.quiet,
        lora=LoRAOptions.from_args(args),
        dtype=args.dtype,
        hogs=args.hog,
        adaptive_threads=not args.fixed_threads,
        model=args.model,
        compare_unfused=args.compare_unfused,
    )
    from bench.common.plots import plot_offline

    return report(result, args.json, args.plot, plot_offline)


if __name__ == "__main__":
    main()
