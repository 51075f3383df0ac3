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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common.hog import cpu_hogs, load_average
from bench.common.progress import progress
from bench.common.workload import (
    LoRAOptions,
    ModelSpec,
    RunTiming,
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


@dataclass(slots=True)
class OfflineResult:
    """Timings of one offline run and the ratios the performance goals are stated in."""

    requests: int
    adapters: int
    rank: int
    prompt_len: int
    new_tokens: int
    threads: int
    mixed: RunTiming
    base: RunTiming
    hf_peft_s: float | None = None
    hf_token_match: float | None = None  # fraction of requests whose greedy tokens equal PEFT's
    gemm_limit_decode_s: float | None = None
    spec: dict = field(default_factory=dict)
    lora_backend: str = ""  # the engine's LoRA path ("native", "torch", "triton")
    lora_dtype: str = ""  # the adapter pool's dtype
    dtype: str = "float32"  # the model's
    hogs: int = 0  # busy processes competing in the hog runs
    hog_mixed: RunTiming | None = None
    hog_base: RunTiming | None = None
    adaptive_threads: bool = True  # the engine's thread governor (engine/cpu_threads.py) was on
    floor: ByteFloor | None = None  # bytes a decode step must read, and the read bandwidth
    load_avg: list[float] = field(default_factory=list)  # 1-minute load average at the start and the end
    base_unfused: RunTiming | None = None  # `--compare-unfused`: base-only with the torch small ops on CPU

    @property
    def lora_overhead(self) -> float:
        """Mixed-adapter time / base-only time (goal <= 1.15)."""
        return self.mixed.total_s / self.base.total_s

    @property
    def speedup_vs_hf(self) -> float | None:
        """HF PEFT time / loraplex mixed time on the same batch (goal >= 5)."""
        return None if self.hf_peft_s is None else self.hf_peft_s / self.mixed.total_s

    @property
    def gemm_fraction(self) -> float | None:
        """GEMM-limit time / base decode time over the same decode steps (goal >= 0.6)."""
        return None if self.gemm_limit_decode_s is None else self.gemm_limit_decode_s / self.base.decode_s

    @property
    def hog_retained(self) -> tuple[float, float] | None:
        """Throughput under the hogs / quiet throughput, (mixed, base) (goal >= 1/3)."""
        if self.hog_mixed is None or self.hog_base is None:
            return None
        return self.mixed.total_s / self.hog_mixed.total_s, self.base.total_s / self.hog_base.total_s

    def to_dict(self) -> dict:
        d = asdict(self)
        for run in ("mixed", "base", "hog_mixed", "hog_base", "base_unfused"):
            if d[run] is not None:
                d[run].pop("token_ids")
        d.update(
            lora_overhead=self.lora_overhead,
            speedup_vs_hf=self.speedup_vs_hf,
            gemm_fraction=self.gemm_fraction,
            hog_retained=self.hog_retained,
        )
        return d

    def markdown(self) -> str:
        """The result as the table `docs/benchmarks.md` records."""
        tok = self.mixed.output_tokens
        lines = [
            "| run | total (s) | prefill (s) | decode (s) | output tok/s |",
            "|---|---|---|---|---|",
            f"| loraplex {self.dtype}, {self.adapters} adapters (rank {self.rank}, all 7 projections; "
            f"{self.lora_backend}, {self.lora_dtype} pages) | "
            f"{self.mixed.total_s:.2f} | {self.mixed.prefill_s:.2f} | {self.mixed.decode_s:.2f} | "
            f"{self.mixed.tokens_per_s:.0f} |",
            f"| loraplex, base model only | {self.base.total_s:.2f} | {self.base.prefill_s:.2f} | "
            f"{self.base.decode_s:.2f} | {self.base.tokens_per_s:.0f} |",
        ]
        if self.base_unfused is not None:
            u = self.base_unfused
            lines.append(
                f"| loraplex, base model only, unfused small ops | {u.total_s:.2f} | {u.prefill_s:.2f} | "
                f"{u.decode_s:.2f} | {u.tokens_per_s:.0f} |"
            )
        for name, run in (("adapters", self.hog_mixed), ("base model only", self.hog_base)):
            if run is not None:
                lines.append(
                    f"| loraplex, {name}, beside {self.hogs} busy processes | {run.total_s:.2f} | "
                    f"{run.prefill_s:.2f} | {run.decode_s:.2f} | {run.tokens_per_s:.0f} |"
                )
        if self.hf_peft_s is not None:
            hf_tps = tok / self.hf_peft_s
            lines.append(f"| HF transformers + PEFT, mixed batch | {self.hf_peft_s:.2f} | | | {hf_tps:.0f} |")
        if self.gemm_limit_decode_s is not None:
            n = self.base.decode_steps
            lines.append(f"| GEMM limit ({n} decode steps) | | | {self.gemm_limit_decode_s:.2f} | |")
        lines.append("")
        lines.append(f"- LoRA overhead (mixed / base time): **{self.lora_overhead:.2f}x**")
        if self.base_unfused is not None:
            u, b = self.base_unfused, self.base
            lines.append(
                f"- Fused CPU small ops, base only: **{u.total_s / b.total_s:.2f}x** the unfused throughput "
                f"(decode {u.decode_s / b.decode_s:.2f}x); greedy tokens equal: {u.token_ids == b.token_ids}"
            )
        if self.hog_retained is not None:
            m, b = self.hog_retained
            lines.append(
                f"- Beside {self.hogs} busy processes: **{m:.2f}x** (adapters) and **{b:.2f}x** (base) of "
                f"the quiet throughput (goal >= 0.33x); {self.threads} threads, "
                f"{'adaptive' if self.adaptive_threads else 'fixed'}"
            )
        if self.floor is not None and self.mixed.decode_steps and self.base.decode_steps:
            f = self.floor
            mixed_step = self.mixed.decode_s / self.mixed.decode_steps
            base_step = self.base.decode_s / self.base.decode_steps
            lines.append(
                f"- Decode step: {mixed_step * 1e3:.1f} ms mixed, {base_step * 1e3:.1f} ms base: overhead "
                f"**{mixed_step / base_step:.2f}x** vs the byte floor {f.lora_overhead:.2f}x "
                f"({f.base_bytes / 1e6:.0f} MB base + {f.adapter_bytes / 1e6:.0f} MB adapter pages at "
                f"{f.read_gb_s:.1f} GB/s: {f.step_s(True) * 1e3:.1f} / {f.step_s(False) * 1e3:.1f} ms); "
                f"**{mixed_step / base_step / f.lora_overhead:.2f}x** the floor"
            )
            lora_s, lora_floor = mixed_step - base_step, f.adapter_bytes / (f.read_gb_s * 1e9)
            lines.append(
                f"- LoRA time per decode step: {lora_s * 1e3:.1f} ms vs reading the adapter bytes at that "
                f"bandwidth {lora_floor * 1e3:.1f} ms: **{lora_s / lora_floor:.2f}x**"
            )
        if self.load_avg:
            lines.append(
                f"- Load average (1 min) at start / end: {' / '.join(f'{x:.1f}' for x in self.load_avg)}"
            )
        if self.speedup_vs_hf is not None:
            lines.append(
                f"- Speed-up over HF PEFT mixed-batch generate: **{self.speedup_vs_hf:.1f}x** (goal >= 5x); "
                f"greedy tokens equal to PEFT's for {self.hf_token_match:.0%} of requests"
            )
        if self.gemm_fraction is not None:
            lines.append(f"- Base decode at **{self.gemm_fraction:.0%}** of the GEMM limit (goal >= 60%)")
        return "\n".join(lines)


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
