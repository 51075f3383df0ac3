"""Benchmark 2 — adapter scaling: throughput vs the byte floor, and pool hit rate, vs the number of
distinct adapters; then the LRU-thrash workload with resident-first admission on and off.

    python -m bench.offline.scaling [--counts 1 8 32 128 512] [--pool-pages 160] [--new-tokens 48] \
        [--threads 1] [--repeats 1] [--thrash-adapters 128] [--thrash-per-adapter 4] \
        [--thrash-orders cyclic random]

Sweep: the offline workload (64-token prompts, greedy, batch of 32 running requests) with
`max(32, count)` requests, request i on adapter i mod count; adapter ranks cycle through 8, 16, 32, 64
(page_rank 16, so 1-4 pages per projection). The device pool holds `--pool-pages` pages per projection,
fewer than the larger counts need, so those rotate adapters through it (LRU) and through the host cache.
Each count runs in a fresh engine: a warm-up pass, then `--repeats` measured passes, the fastest kept
(with its own pool hit rate, `1 - device uploads / requests`).

Byte floor (next to each point): the bytes every step of the pass must read — base weights once, plus
the pages of the step's distinct adapters — over the read bandwidth measured at the start of the run
(`bench/offline/step_bytes.py`); `of floor` = measured tok/s / the floor's tok/s.

Thrash (`--thrash-adapters 0` skips it): `--thrash-adapters` adapters (more than the pool holds) x
`--thrash-per-adapter` requests each, in cyclic or random order, same engine settings, each pass in a
fresh engine, resident-first admission on vs off interleaved (`bench/offline/thrash.py`).
"""

from __future__ import annotations

import argparse
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common.hog import load_average
from bench.common.progress import progress
from bench.common.workload import LoRAOptions, ModelSpec, bench_env, make_prompts, report, timed_run
from bench.offline.byte_floor import read_bandwidth_gb_s
from bench.offline.pool_pass import PoolPass, measure_pass
from bench.offline.step_bytes import StepBytesMeter
from bench.offline.thrash import ThrashPoint, run_thrash, thrash_markdown
from bench.offline.throughput import prepare

RANKS = (8, 16, 32, 64)


@dataclass(slots=True)
class ScalingPoint:
    adapters: int
    run: PoolPass


@dataclass(slots=True)
class ScalingResult:
    pool_pages: int
    threads: int
    new_tokens: int
    read_gb_s: float = 0.0
    cpu: str = ""
    load_avg: list[float] = field(default_factory=list)  # 1-minute load average at start and end
    points: list[ScalingPoint] = field(default_factory=list)
    thrash: list[ThrashPoint] = field(default_factory=list)

    def drop_vs_first(self) -> list[float]:
        """Throughput drop of each point relative to the first (fewest adapters), 0.1 = 10% slower."""
        first = self.points[0].run.tokens_per_s
        return [1 - p.run.tokens_per_s / first for p in self.points]

    def to_dict(self) -> dict:
        return asdict(self) | {"drop_vs_first": self.drop_vs_first()}

    def markdown(self) -> str:
        lines = [
            f"read bandwidth {self.read_gb_s:.1f} GB/s, {self.threads} thread(s), {self.cpu}, "
            f"load average {' -> '.join(f'{x:.1f}' for x in self.load_avg)}",
            "",
            "| adapters | requests | output tok/s | decode tok/s | decode floor tok/s | decode of floor "
            "| run of floor | adapters/step | drop vs 1 | pool hit rate | uploads | host loads | evictions |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p, drop in zip(self.points, self.drop_vs_first(), strict=True):
            r = p.run
            lines.append(
                f"| {p.adapters} | {r.requests} | {r.tokens_per_s:.0f} | {r.decode_tokens_per_s:.0f} | "
                f"{r.decode_floor_tokens_per_s:.0f} | {r.decode_of_floor:.0%} | {r.of_floor:.0%} | "
                f"{r.mean_distinct_adapters:.1f} | {drop:.1%} | {r.pool_hit_rate:.0%} | "
                f"{r.device_uploads} | {r.host_loads} | {r.evictions} |"
            )
        if self.thrash:
            lines += ["", thrash_markdown(self.thrash)]
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
    thrash_adapters: int = 128,
    thrash_per_adapter: int = 4,
    thrash_orders: tuple[str, ...] = ("cyclic", "random"),
) -> ScalingResult:
    """Run benchmark 2 (see the module docstring)."""
    from engine import LLM, LoRARequest, SamplingParams

    spec = spec or ModelSpec()
    lora = lora or LoRAOptions()
    with bench_env(threads, workdir) as workdir:
        result = ScalingResult(pool_pages, torch.get_num_threads(), new_tokens)
        result.cpu = _cpu_name()
        result.load_avg = [load_average()[0]]
        result.read_gb_s = read_bandwidth_gb_s()

        def make_llm(resident_first: bool = True) -> LLM:
            return LLM(
                str(base),
                device="cpu",
                dtype="float32",
                max_num_seqs=batch,
                max_loras=batch,
                max_lora_rank=max(RANKS),
                lora_pool_pages=pool_pages,
                enable_prefix_caching=False,
                lora_resident_first=resident_first,
                **lora.engine_kwargs(),
            )

        with progress(quiet) as bar:
            n_max = max(*counts, thrash_adapters)
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
                eng = make_llm().engine
                meter = StepBytesMeter(eng)
                timed_run(eng, prompts, params, per_req, f"warm{count}")
                passes = [
                    measure_pass(eng, meter, prompts, params, per_req, f"run{count}-{r}", result.read_gb_s)
                    for r in range(repeats)
                ]
                result.points.append(ScalingPoint(count, min(passes, key=lambda p: p.total_s)))
                eng.lora.shutdown()
                bar.advance(task)
            if thrash_adapters > 0:
                task = bar.add_task("thrash passes", total=repeats * len(thrash_orders) * 2)
                loras = [LoRARequest(f"a{i}", str(dirs[i])) for i in range(thrash_adapters)]
                prompts = make_prompts(thrash_adapters * thrash_per_adapter, prompt_len, spec.vocab_size)
                result.thrash = run_thrash(
                    make_llm,
                    loras,
                    prompts,
                    params,
                    thrash_per_adapter,
                    thrash_orders,
                    repeats,
                    result.read_gb_s,
                    lambda: bar.advance(task),
                )
        result.load_avg.append(load_average()[0])
        return result


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> ScalingResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--pool-pages", type=int, default=160, help="device pool pages per projection")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1, help="measured passes per point (the fastest is kept)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)"
    )
    ap.add_argument("--thrash-adapters", type=int, default=128, help="0: skip the thrash workload")
    ap.add_argument("--thrash-per-adapter", type=int, default=4, help="requests per adapter")
    ap.add_argument("--thrash-orders", nargs="+", default=["cyclic", "random"], choices=["cyclic", "random"])
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
        thrash_adapters=args.thrash_adapters,
        thrash_per_adapter=args.thrash_per_adapter,
        thrash_orders=tuple(args.thrash_orders),
    )
    from bench.common.plots import plot_scaling

    return report(result, args.json, args.plot, plot_scaling)


if __name__ == "__main__":
    main()
