"""Benchmark 2 — adapter scaling: throughput and pool hit rate vs the number of distinct adapters.

    python -m bench.scaling [--counts 1 8 32 128 512] [--pool-pages 160] [--new-tokens 48] [--threads 1] \
        [--repeats 1]

The offline workload (64-token prompts, greedy, batch of 32 running requests) with `max(32, count)`
requests, request i on adapter i mod count; adapter ranks cycle through 8, 16, 32, 64 (page_rank 16, so
1-4 pages per projection). The device pool holds `--pool-pages` pages per projection, fewer than the
larger counts need, so those rotate adapters through it (LRU) and through the host cache. Each count
runs the workload in a fresh engine: a warm-up pass, then `--repeats` measured passes, of which the
fastest is reported (with its own pool hit rate, `1 - device uploads / requests`).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.offline import prepare
from bench.progress import progress
from bench.workload import LoRAOptions, ModelSpec, bench_env, make_prompts, report, timed_run

RANKS = (8, 16, 32, 64)


@dataclass(slots=True)
class ScalingPoint:
    adapters: int
    requests: int
    output_tokens: int
    total_s: float
    decode_s: float
    pool_hit_rate: float
    device_uploads: int
    host_loads: int
    evictions: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s


@dataclass(slots=True)
class ScalingResult:
    pool_pages: int
    threads: int
    new_tokens: int
    points: list[ScalingPoint] = field(default_factory=list)

    def drop_vs_first(self) -> list[float]:
        """Throughput drop of each point relative to the first (fewest adapters), 0.1 = 10% slower."""
        first = self.points[0].tokens_per_s
        return [1 - p.tokens_per_s / first for p in self.points]

    def to_dict(self) -> dict:
        return asdict(self) | {"drop_vs_first": self.drop_vs_first()}

    def markdown(self) -> str:
        lines = [
            "| adapters | requests | output tok/s | drop vs 1 | pool hit rate | uploads | host loads "
            "| evictions |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p, drop in zip(self.points, self.drop_vs_first(), strict=True):
            lines.append(
                f"| {p.adapters} | {p.requests} | {p.tokens_per_s:.0f} | {drop:.1%} | "
                f"{p.pool_hit_rate:.0%} | {p.device_uploads} | {p.host_loads} | {p.evictions} |"
            )
        return "\n".join(lines)


def run_scaling(
    counts: tuple[int, ...] = (1, 8, 32, 128, 512),
    pool_pages: int = 160,
    batch: int = 32,
    prompt_len: int = 64,
    new_tokens: int = 48,
    threads: int = 1,
    repeats: int = 1,
    spec: ModelSpec | None = None,
    workdir: Path | None = None,
    quiet: bool = False,
    lora: LoRAOptions | None = None,
) -> ScalingResult:
    """Run benchmark 2 (see the module docstring)."""
    from engine import LLM, LoRARequest, SamplingParams

    spec = spec or ModelSpec()
    lora = lora or LoRAOptions()
    with bench_env(threads, workdir) as workdir:
        result = ScalingResult(pool_pages, torch.get_num_threads(), new_tokens)
        with progress(quiet) as bar:
            n_max = max(counts)
            task = bar.add_task("building model and adapters", total=1)
            base, dirs = prepare(workdir, spec, [RANKS[i % len(RANKS)] for i in range(n_max)])
            bar.advance(task)
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            task = bar.add_task("adapter counts", total=len(counts))
            for count in counts:
                requests = max(batch, count)
                prompts = make_prompts(requests, prompt_len, spec.vocab_size, seed=count)
                loras = [LoRARequest(f"a{i}", str(dirs[i])) for i in range(count)]
                per_req = [loras[i % count] for i in range(requests)]
                llm = LLM(
                    str(base),
                    device="cpu",
                    dtype="float32",
                    max_num_seqs=batch,
                    max_loras=batch,
                    max_lora_rank=max(RANKS),
                    lora_pool_pages=pool_pages,
                    enable_prefix_caching=False,
                    **lora.engine_kwargs(),
                )
                eng = llm.engine
                timed_run(eng, prompts, params, per_req, f"warm{count}")
                passes = []
                for r in range(repeats):
                    before = eng.get_lora_stats()
                    run = timed_run(eng, prompts, params, per_req, f"run{count}-{r}")
                    after = eng.get_lora_stats()
                    uploads = after.device_uploads - before.device_uploads
                    passes.append(
                        ScalingPoint(
                            adapters=count,
                            requests=requests,
                            output_tokens=run.output_tokens,
                            total_s=run.total_s,
                            decode_s=run.decode_s,
                            pool_hit_rate=1 - uploads / requests,
                            device_uploads=uploads,
                            host_loads=after.loads - before.loads,
                            evictions=after.evictions - before.evictions,
                        )
                    )
                result.points.append(min(passes, key=lambda p: p.total_s))
                eng.lora.shutdown()
                bar.advance(task)
        return result


def main(argv: list[str] | None = None) -> ScalingResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--pool-pages", type=int, default=160, help="device pool pages per projection")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1, help="measured passes per count (the fastest is kept)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)"
    )
    ap.add_argument("--workdir", type=Path, default=None, help="reuse generated model/adapters from here")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of throughput and hit rate vs count")
    LoRAOptions.add_arguments(ap)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_scaling(
        counts=tuple(args.counts),
        pool_pages=args.pool_pages,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        threads=args.threads,
        repeats=args.repeats,
        workdir=args.workdir,
        quiet=args.quiet,
        lora=LoRAOptions.from_args(args),
    )
    from bench.plots import plot_scaling

    return report(result, args.json, args.plot, plot_scaling)


if __name__ == "__main__":
    main()
