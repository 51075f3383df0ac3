"""Speculative decoding vs none, in one run (`loraplex bench offline --speculative ngram`).

    python -m bench.offline.speculative [--speculative ngram] [--num-speculative-tokens 4] [--batches 1,8,32]
        [--repeats 2] [--threads 1] [--no-random] [--json out.json]

For every task and batch size B, the same requests (4 * B, at least 16, so continuous batching refills
the batch of `max_num_seqs = B`) are generated greedily by two engines that differ only in
`speculative`, alternately, `--spec-repeats` times. Reported: output tokens/s of each (best run), the
speed-up as the ratio of the bests and as the median of the ratios of back-to-back pairs, the
mean acceptance length (tokens emitted per verification: 1 + accepted / verifications), the fraction of
proposed tokens accepted, steps, and whether the tokens were identical (they must be).

Tasks:
- the demo model (demo/, see demo/README.md) on its five tasks: echo (no adapter), upper, reverse,
  rot13, novowels, and all five mixed in one batch; prompts `text=` as the demo was trained on, `stop="\\n"`;
- a random-weight Llama (bench.common.workload.ModelSpec) with random rank-16 adapters, mixed, on random
  token prompts of 64 tokens, 32 new tokens (`ignore_eos`).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.common.workload import ModelSpec, bench_env, build_adapter, build_base, make_prompts, report

DEMO = Path(__file__).resolve().parents[2] / "demo"
DEMO_TASKS = ("echo", "upper", "reverse", "rot13", "novowels")


@dataclass(slots=True)
class Cell:
    """One task at one batch size: the best run of each engine."""

    task: str
    batch: int
    requests: int
    plain_tok_s: float
    spec_tok_s: float
    plain_steps: int
    spec_steps: int
    mean_acceptance_length: float  # tokens per verification (1 + accepted / verifications)
    acceptance_rate: float  # accepted / proposed
    identical: bool  # greedy tokens equal with and without speculation
    paired_speedups: list[float] = field(default_factory=list)  # per repeat: plain time / spec time

    @property
    def speedup(self) -> float:
        """Best with / best without."""
        return self.spec_tok_s / self.plain_tok_s

    @property
    def median_speedup(self) -> float:
        """Median over repeats of the ratio of two back-to-back runs (robust to load that drifts)."""
        r = sorted(self.paired_speedups)
        return (r[(len(r) - 1) // 2] + r[len(r) // 2]) / 2 if r else self.speedup


@dataclass(slots=True)
class SpecBenchResult:
    speculative: str
    num_speculative_tokens: int
    threads: int
    cells: list[Cell] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for c, cell in zip(d["cells"], self.cells, strict=True):
            c["speedup"] = cell.speedup
            c["median_speedup"] = cell.median_speedup
        return d

    def markdown(self) -> str:
        lines = [
            f"Speculative `{self.speculative}`, k = {self.num_speculative_tokens} (adaptive), "
            f"{self.threads} thread(s); greedy.",
            "",
            "| task | batch | requests | tok/s without | tok/s with | speed-up (best) | speed-up (median "
            "of pairs) | mean acceptance length | accepted / proposed | steps without / with | same tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in self.cells:
            lines.append(
                f"| {c.task} | {c.batch} | {c.requests} | {c.plain_tok_s:.0f} | {c.spec_tok_s:.0f} | "
                f"{c.speedup:.2f}x | **{c.median_speedup:.2f}x** | {c.mean_acceptance_length:.2f} | "
                f"{c.acceptance_rate:.0%} | "
                f"{c.plain_steps} / {c.spec_steps} | {'yes' if c.identical else 'NO'} |"
            )
        return "\n".join(lines)


@dataclass(slots=True)
class _Run:
    seconds: float
    tokens: list[list[int]]
    steps: int
    proposed: int
    accepted: int
    verifications: int


def _run(engine, prompts, params, loras, tag: str) -> _Run:
    """Queue every request, step until all finish; the speculation counters are differences."""
    before = engine.get_stats()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for rid, p, lr in zip(ids, prompts, loras, strict=True):
        engine.add_request(rid, p, params, lr)
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    after = engine.get_stats()
    return _Run(
        seconds,
        [final[r] for r in ids],
        after.num_steps - before.num_steps,
        after.spec_proposed_tokens - before.spec_proposed_tokens,
        after.spec_accepted_tokens - before.spec_accepted_tokens,
        after.spec_verifications - before.spec_verifications,
    )


def _cell(task, batch, engines, prompts, params, loras, repeats: int) -> Cell:
    plain_eng, spec_eng = engines
    _run(plain_eng, prompts[:4], params, loras[:4], "warm")
    _run(spec_eng, prompts[:4], params, loras[:4], "warm")
    plain: list[_Run] = []
    spec: list[_Run] = []
    for r in range(repeats):
        plain.append(_run(plain_eng, prompts, params, loras, f"p{task}{batch}-{r}"))
        spec.append(_run(spec_eng, prompts, params, loras, f"s{task}{batch}-{r}"))
    p, s = min(plain, key=lambda x: x.seconds), min(spec, key=lambda x: x.seconds)
    tokens = sum(len(t) for t in p.tokens)
    return Cell(
        task,
        batch,
        len(prompts),
        tokens / p.seconds,
        sum(len(t) for t in s.tokens) / s.seconds,
        p.steps,
        s.steps,
        (s.accepted + s.verifications) / s.verifications if s.verifications else 1.0,
        s.accepted / s.proposed if s.proposed else 0.0,
        all(a == b for run in spec for a, b in zip(p.tokens, run.tokens, strict=True)),
        [a.seconds / b.seconds for a, b in zip(plain, spec, strict=True)],
    )


def _engines(model: Path, batch: int, speculative: str, k: int, **kw):
    from engine import LLMEngine

    common = dict(device="cpu", dtype="float32", max_num_seqs=batch, adaptive_threads=False) | kw
    plain = LLMEngine.from_args(str(model), **common)
    spec = LLMEngine.from_args(str(model), speculative=speculative, num_speculative_tokens=k, **common)
    return plain, spec


def demo_text(rng: random.Random) -> str:
    """An input like the demo's training data: 1-3 words of 1-8 lowercase letters, at most 24 characters."""
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8)))
        for _ in range(rng.randint(1, 3))
    ]
    return " ".join(words)[:24].strip()


def run_speculative(
    speculative: str = "ngram",
    k: int = 4,
    batches: tuple[int, ...] = (1, 8, 32),
    repeats: int = 2,
    threads: int = 1,
    random_model: bool = True,
    workdir: Path | None = None,
) -> SpecBenchResult:
    """Run the benchmark (see the module docstring)."""
    from engine import LoRARequest, SamplingParams

    result = SpecBenchResult(speculative, k, threads if threads > 0 else torch.get_num_threads())
    rng = random.Random(0)
    demo_params = SamplingParams(max_tokens=32, temperature=0.0, stop=["\n"])
    demo_loras = {t: LoRARequest(t, str(DEMO / "adapters" / t)) for t in DEMO_TASKS[1:]}
    with bench_env(threads, workdir) as work:
        for batch in batches:
            n = max(16, 4 * batch)
            engines = _engines(DEMO / "base", batch, speculative, k, max_lora_rank=16)
            prompts = [demo_text(rng) + "=" for _ in range(n)]
            for task in (*DEMO_TASKS, "mixed"):
                if task == "mixed":
                    loras = [demo_loras.get(DEMO_TASKS[i % len(DEMO_TASKS)]) for i in range(n)]
                else:
                    loras = [demo_loras.get(task)] * n
                cell = _cell(f"demo {task}", batch, engines, prompts, demo_params, loras, repeats)
                result.cells.append(cell)
                print(result.markdown().splitlines()[-1], flush=True)
        if random_model:
            spec = ModelSpec()
            base = work / "base"
            if not (base / "config.json").exists():
                build_base(work, spec)
            dirs = []
            for i in range(4):
                d = work / f"a{i}"
                if not (d / "adapter_config.json").exists():
                    build_adapter(d, spec, 16, seed=1000 + i)
                dirs.append(LoRARequest(f"a{i}", str(d)))
            params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            for batch in batches:
                n = max(16, 2 * batch)
                engines = _engines(base, batch, speculative, k, max_lora_rank=16, enable_prefix_caching=False)
                prompts = make_prompts(n, 64, spec.vocab_size, seed=batch)
                loras = [dirs[i % len(dirs)] if i % 5 else None for i in range(n)]
                result.cells.append(
                    _cell("random llama, mixed", batch, engines, prompts, params, loras, repeats)
                )
                print(result.markdown().splitlines()[-1], flush=True)
    return result


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="k, the most proposed per step")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (max_num_seqs)")
    ap.add_argument("--spec-repeats", type=int, default=2, help="alternating runs per cell (best of N)")
    ap.add_argument("--no-random", action="store_true", help="skip the random-model task")


def main(argv: list[str] | None = None) -> SpecBenchResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculative", default="ngram", help="ngram or draft:PATH")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--workdir", type=Path, default=None, help="reuse the random model from here")
    ap.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    add_arguments(ap)
    args = ap.parse_args(argv)
    return from_args(args)


def from_args(args: argparse.Namespace) -> SpecBenchResult:
    """Run with parsed options (shared by `bench.offline.throughput --speculative ...`)."""
    result = run_speculative(
        args.speculative,
        args.num_speculative_tokens,
        tuple(int(b) for b in str(args.batches).split(",") if b),
        args.spec_repeats,
        args.threads,
        not args.no_random,
        args.workdir,
    )
    return report(result, args.json, None, None)


if __name__ == "__main__":
    main()
