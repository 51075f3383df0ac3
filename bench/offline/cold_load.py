"""Benchmark 4 — cold adapter load: its time to first token and its effect on the running batch.

    python -m bench.offline.cold_load [--batch 32] [--rank 64] [--inject-after 8] [--repeats 3] [--threads 1]

`batch - 1` requests, each on its own resident (pinned) rank-16 adapter, decode a long output. After
`--inject-after` decode steps one more request arrives on an adapter the engine has never seen
(`--rank`, on disk; a fresh digest each repeat), and the loop keeps stepping. Measured from its
`add_request` (which hashes the files) to its first token: the time to first token and the running
batch's step times. The same injection with an adapter that is already resident is the control: both
include the newcomer's own prefill, so `(extra_cold - extra_warm) / step` is what loading cost the
running batch, in steps (goal: <= 1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common.progress import progress
from bench.common.workload import ModelSpec, bench_env, build_adapter, make_prompts, report
from bench.offline.throughput import prepare


@dataclass(slots=True)
class InjectionRun:
    """One injection: step times around it and the newcomer's time to first token."""

    cold: bool
    baseline_step_s: float  # median decode step before the injection
    ttft_s: float  # add_request -> first token of the newcomer
    window_steps: int  # steps from the injection to the newcomer's first token
    window_s: float  # their wall time (add_request included)
    step_s: list[float] = field(default_factory=list)  # every step's wall time, injection at `inject_at`
    inject_at: int = 0

    @property
    def extra_s(self) -> float:
        """Time the running batch lost in the window beyond its usual step time."""
        return self.window_s - self.window_steps * self.baseline_step_s


@dataclass(slots=True)
class ColdLoadResult:
    batch: int
    rank: int
    threads: int
    runs: list[InjectionRun] = field(default_factory=list)

    def _best(self, cold: bool) -> InjectionRun:
        return min((r for r in self.runs if r.cold == cold), key=lambda r: r.extra_s)

    @property
    def load_cost_steps(self) -> float:
        """(extra time with a cold adapter - with a resident one) / baseline step, best runs (goal <= 1)."""
        cold, warm = self._best(True), self._best(False)
        return (cold.extra_s - warm.extra_s) / warm.baseline_step_s

    def to_dict(self) -> dict:
        return asdict(self) | {"load_cost_steps": self.load_cost_steps}

    def markdown(self) -> str:
        lines = [
            "| newcomer's adapter | step before (ms) | TTFT (ms) | steps to 1st token "
            "| extra batch time (ms) |",
            "|---|---|---|---|---|",
        ]
        for cold in (False, True):
            r = self._best(cold)
            label = f"cold (rank {self.rank}, on disk)" if cold else "resident"
            lines.append(
                f"| {label} | {r.baseline_step_s * 1e3:.1f} | {r.ttft_s * 1e3:.0f} | {r.window_steps} | "
                f"{r.extra_s * 1e3:.1f} |"
            )
        lines.append(
            f"\nCold load cost to the running batch: **{self.load_cost_steps:.2f} steps** (goal <= 1)"
        )
        return "\n".join(lines)


def _inject(eng, prompts, params, loras, newcomer, tag: str, inject_after: int, cold: bool) -> InjectionRun:
    for i, (p, lr) in enumerate(zip(prompts[:-1], loras, strict=True)):
        eng.add_request(f"{tag}-{i}", p, params, lr)
    steps: list[float] = []
    while len(steps) < inject_after + 2:  # prefill step, then decodes
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    baseline = statistics.median(steps[2:])
    inject_at = len(steps)
    t_inject = time.perf_counter()
    eng.add_request(f"{tag}-new", prompts[-1], params, newcomer)
    add_s = time.perf_counter() - t_inject
    ttft = None
    window_steps = 0
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        steps.append(dt + (add_s if len(steps) == inject_at else 0.0))
        if ttft is None:
            window_steps += 1
            if any(o.request_id == f"{tag}-new" and o.outputs[0].token_ids for o in outs):
                ttft = time.perf_counter() - t_inject
    window_s = sum(steps[inject_at : inject_at + window_steps])
    return InjectionRun(cold, baseline, ttft or float("nan"), window_steps, window_s, steps, inject_at)


def run_cold_load(
    batch: int = 32,
    rank: int = 64,
    prompt_len: int = 64,
    new_tokens: int = 64,
    inject_after: int = 8,
    repeats: int = 3,
    threads: int = 1,
    spec: ModelSpec | None = None,
    workdir: Path | None = None,
    quiet: bool = False,
) -> ColdLoadResult:
    """Run benchmark 4 (see the module docstring)."""
    from engine import LLM, LoRARequest, SamplingParams

    spec = spec or ModelSpec()
    with bench_env(threads, workdir) as workdir:
        result = ColdLoadResult(batch, rank, torch.get_num_threads())
        with progress(quiet) as bar:
            task = bar.add_task("building model and adapters", total=1)
            base, dirs = prepare(workdir, spec, [16] * (batch - 1) + [rank])
            bar.advance(task)
            loras = [LoRARequest(f"a{i}", str(d)) for i, d in enumerate(dirs)]
            running, warm_newcomer = loras[: batch - 1], loras[batch - 1]
            prompts = make_prompts(batch, prompt_len, spec.vocab_size)
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            llm = LLM(
                str(base),
                device="cpu",
                dtype="float32",
                max_num_seqs=batch,
                max_loras=batch,
                max_lora_rank=max(16, rank),
                enable_prefix_caching=False,
            )
            eng = llm.engine
            for lr in loras:
                eng.pin_lora(eng.add_lora(lr))
            task = bar.add_task("injections (resident / cold, interleaved)", total=2 * repeats)
            for r in range(repeats):
                result.runs.append(
                    _inject(eng, prompts, params, running, warm_newcomer, f"w{r}", inject_after, cold=False)
                )
                bar.advance(task)
                cold_dir = build_adapter(workdir / f"cold-{time.time_ns()}", spec, rank, seed=10_000 + r)
                cold = LoRARequest(f"cold{r}", str(cold_dir))
                result.runs.append(
                    _inject(eng, prompts, params, running, cold, f"c{r}", inject_after, cold=True)
                )
                eng.remove_lora(f"cold{r}")
                bar.advance(task)
            eng.lora.shutdown()
        return result


def main(argv: list[str] | None = None) -> ColdLoadResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=64, help="rank of the cold adapter")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--inject-after", type=int, default=8, help="decode steps before the newcomer arrives")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)"
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of step times around the injection")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    result = run_cold_load(
        batch=args.batch,
        rank=args.rank,
        new_tokens=args.new_tokens,
        inject_after=args.inject_after,
        repeats=args.repeats,
        threads=args.threads,
        workdir=args.workdir,
        quiet=args.quiet,
    )
    from bench.common.plots import plot_cold_load

    return report(result, args.json, args.plot, plot_cold_load)


if __name__ == "__main__":
    main()
