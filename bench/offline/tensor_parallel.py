"""Tensor parallel TP=2 vs TP=1 at the same total CPU threads, in one run.

    python -m bench.offline.tensor_parallel [--threads 2] [--batch 8] [--new 32] [--repeats 3]
        [--hidden 1024 --layers 8 --heads 16 --kv-heads 4 --inter 2816] [--fully-sharded] [--json out.json]

A random-weight Llama of the given shape; `--batch` requests of 64 random prompt tokens, `--new` greedy
tokens each, on the base model and on 4 random rank-16 adapters (all 7 projections) mixed. Legs run
alternately `--repeats` times: TP=1 with `--threads` threads, TP=2 with `--threads / 2` per rank.
Reported per leg (best run): decode step time (median over the run's decode steps), for TP=2 the time
rank 0 waits in all-reduces per decode step (the collective itself plus any imbalance between the ranks:
on a loaded machine mostly the other rank not being scheduled), the all-reduces per step (2 per layer
with or without LoRA: LoRA adds none), the quickest single all-reduce (its own cost when no rank is
waited for) and that cost times the all-reduces as a share of the step, and whether TP=2's tokens equal
TP=1's. With `--fully-sharded`, one more leg: TP=2 with `fully_sharded_loras` on the mixed adapters
(column-parallel A split by rank, one all-gather per packed projection: the collectives per step grow
by 2 per layer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common.workload import ModelSpec, bench_env, build_adapter, build_base, make_prompts


@dataclass(slots=True)
class Leg:
    tp: int
    lora: bool
    fully_sharded: bool = False
    decode_step_ms: float = float("inf")  # median decode step of the best run
    collective_ms: float = 0.0  # rank 0's all-reduce time per decode step (TP=2)
    allreduces_per_step: float = 0.0
    fastest_allreduce_us: float = 0.0  # rank 0's quickest all-reduce: its own cost, no rank waited for
    tokens: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def compute_ms(self) -> float:
        return self.decode_step_ms - self.collective_ms


def run_leg(engine, prompts, loras, params, leg: Leg, tag: str) -> None:
    """Generate once, timing each decode step and (TP=2) rank 0's all-reduce time in it; keep the best."""
    group = engine.tp.group if engine.tp is not None else None
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params, loras[i] if loras else None)
    steps, coll, calls, final = [], [], [], {}
    while engine.has_unfinished_requests():
        c0, n0 = (group.collective_seconds, group.collective_calls) if group else (0.0, 0)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        tokens, decodes = engine.runner.last_batch
        ran = engine.get_stats().last_step_tokens > 0  # not a step that waited for an adapter load
        if ran and tokens and tokens == decodes:
            steps.append(dt)
            if group:
                coll.append(group.collective_seconds - c0)
                calls.append(group.collective_calls - n0)
        for o in outs:
            if o.finished:
                final[o.request_id] = list(o.outputs[0].token_ids)
    med = statistics.median(steps) * 1e3
    if med < leg.decode_step_ms:
        leg.decode_step_ms = med
        leg.collective_ms = statistics.median(coll) * 1e3 if coll else 0.0
        leg.allreduces_per_step = statistics.mean(calls) if calls else 0.0
    if group is not None:
        leg.fastest_allreduce_us = group.fastest_collective * 1e6
    leg.tokens = [final[f"{tag}-{i}"] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> None:
    from engine import LLMEngine, LoRARequest, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--fully-sharded", action="store_true", help="add a TP=2 fully_sharded_loras leg")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    spec = ModelSpec(
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
    )
    with bench_env(0, None) as work:
        base = build_base(work, spec)
        dirs = [build_adapter(work / f"a{i}", spec, rank=16, seed=i) for i in range(4)]
        loras = [LoRARequest(f"a{i % 4}", str(dirs[i % 4])) for i in range(args.batch)]
        prompts = make_prompts(args.batch, 64, spec.vocab_size)
        params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
        common = dict(device="cpu", dtype="float32", max_num_seqs=args.batch, max_lora_rank=16)
        common |= dict(max_loras=4, adaptive_threads=False, num_threads=args.threads)
        kinds = [(1, False), (2, False)] + ([(2, True)] if args.fully_sharded else [])
        engines = {
            (tp, fs): LLMEngine.from_args(
                str(base), tensor_parallel_size=tp, fully_sharded_loras=fs, **common
            )
            for tp, fs in kinds
        }
        legs = {
            (tp, lora, fs): Leg(tp, lora, fs) for tp, fs in kinds for lora in (False, True) if lora or not fs
        }
        for r in range(args.repeats):
            for (tp, lora, fs), leg in legs.items():
                tag = f"r{r}-{tp}-{lora}-{fs}"
                run_leg(engines[(tp, fs)], prompts, loras if lora else None, params, leg, tag)
        for (tp, _), engine in engines.items():
            if tp > 1:
                engine.shutdown()
    rows = [
        "| leg | decode step ms | rank-0 all-reduce wait ms/step | compute ms/step | all-reduces/step "
        "| fastest all-reduce us | all-reduce cost / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for (tp, lora, fs), leg in legs.items():
        name = f"TP={tp} ({args.threads // tp} thr/rank), {'4 adapters mixed' if lora else 'base'}"
        name += ", fully sharded" if fs else ""
        floor = leg.fastest_allreduce_us * leg.allreduces_per_step / 1e3 / leg.decode_step_ms
        rows.append(
            f"| {name} | {leg.decode_step_ms:.1f} | {leg.collective_ms:.2f} | {leg.compute_ms:.1f} "
            f"| {leg.allreduces_per_step:.0f} | {leg.fastest_allreduce_us:.0f} | {floor:.1%} |"
        )
    same = all(leg.tokens == legs[(1, lo, False)].tokens for (_, lo, _), leg in legs.items())
    rows.append(f"\nTP=2 tokens equal TP=1: {same}; shape {asdict(spec)}, batch {args.batch}")
    print("\n".join(rows))
    if args.json is not None:
        out = {f"tp{tp}_{'lora' if lo else 'base'}{'_fs' if fs else ''}": asdict(leg)
               | {"compute_ms": leg.compute_ms} for (tp, lo, fs), leg in legs.items()}  # fmt: skip
        for v in out.values():
            v.pop("tokens")
        args.json.write_text(json.dumps(out | {"tokens_equal": same, "shape": asdict(spec)}, indent=2))


if __name__ == "__main__":
    main()
