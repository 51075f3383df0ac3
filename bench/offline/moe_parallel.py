"""MoE decode on two ranks: tensor parallel vs expert parallel at the same total CPU threads, in one run.

    python -m bench.offline.moe_parallel [--threads 2] [--batch 8] [--new 24] [--runs 3] [--adapters 4]
        [--layers 8 --experts 32 --top-k 4 --hidden 512 --expert-inter 256] [--json OUT]

A random Qwen3-MoE-shaped model (transformers' own config, `bench.offline.moe.MoEShape`) and `--adapters`
random expert adapters (PEFT `target_parameters` on both fused expert parameters, rank 8, plus q/v). Legs:
TP=1 with `--threads` threads; TP=2 (each expert's intermediate rows split) and TP=2 with
`enable_expert_parallel` (each rank its experts whole, `linear` and `round_robin`) with `--threads / 2`
per rank; each on the base model and on the adapters mixed with base rows. The legs run interleaved,
`--runs` times; per leg the median decode step of each run, reported as the median and min-max over the
runs, and the ratios to TP=2 computed within each run (then their median). Also: rank 0's all-reduce wait
per decode step, its expert weight bytes and one adapter's expert page bytes (a rank's memory), and whether
every leg's tokens equal TP=1's. The machine's `uptime` load averages go with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common.workload import bench_env, make_prompts
from bench.offline.moe import MoEShape

MODES = ("tp1", "tp2", "ep-linear", "ep-round_robin")


@dataclass(slots=True)
class Leg:
    mode: str
    lora: bool
    step_ms: list[float] = field(default_factory=list)  # median decode step of each run
    wait_ms: list[float] = field(default_factory=list)  # rank 0's all-reduce wait per decode step
    tokens: list[list[int]] = field(default_factory=list, repr=False)


def build_moe(root: Path, shape: MoEShape, seed: int = 0) -> Path:
    """A random Qwen3-MoE checkpoint of `shape` (transformers' init)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen3MoeConfig(**shape.common(), intermediate_size=shape.top_k * shape.expert_inter,
                            moe_intermediate_size=shape.expert_inter, num_experts=shape.experts,
                            num_experts_per_tok=shape.top_k, norm_topk_prob=True)  # fmt: skip
    tf.Qwen3MoeForCausalLM(cfg).save_pretrained(root)
    return root


def expert_adapter(out: Path, shape: MoEShape, rank: int, seed: int) -> Path:
    """A PEFT adapter in current PEFT's layout for transformers 5 MoE models: `target_parameters` on the
    fused expert parameters (lora_A [E*r, in] expert-major, lora_B [out, r*E]; gate_up_proj the inner
    wrapper) and q/v LoRA; random A ~ N(0, 1/in), B ~ N(0, 1e-4)."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i, hd = shape.experts, shape.hidden, shape.expert_inter, shape.hidden // shape.heads
    t = {}
    for layer in range(shape.layers):
        pre = f"base_model.model.model.layers.{layer}"
        for name, fin, fout in (("q_proj", h, shape.heads * hd), ("v_proj", h, shape.kv_heads * hd)):
            t[f"{pre}.self_attn.{name}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) / fin**0.5
            t[f"{pre}.self_attn.{name}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) * 0.01
        for wrap, fin, fout in ((".base_layer", h, 2 * i), ("", i, h)):
            t[f"{pre}.mlp.experts{wrap}.lora_A.weight"] = torch.randn(e * rank, fin, generator=gen) / fin**0.5
            t[f"{pre}.mlp.experts{wrap}.lora_B.weight"] = torch.randn(fout, rank * e, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                  bias="none", task_type="CAUSAL_LM", lora_dropout=0.0)  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run_leg(engine, prompts, loras, params, leg: Leg, tag: str) -> None:
    """Generate once: the run's median decode step and rank 0's all-reduce wait per decode step."""
    group = engine.tp.group if engine.tp is not None else None
    for k, p in enumerate(prompts):
        engine.add_request(f"{tag}-{k}", p, params, loras[k] if loras else None)
    steps, waits, final = [], [], {}
    while engine.has_unfinished_requests():
        c0 = group.collective_seconds if group else 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        tokens, decodes = engine.runner.last_batch
        if engine.get_stats().last_step_tokens > 0 and tokens and tokens == decodes:
            steps.append(dt)
            waits.append((group.collective_seconds - c0) if group else 0.0)
        for o in outs:
            if o.finished:
                final[o.request_id] = list(o.outputs[0].token_ids)
    leg.step_ms.append(statistics.median(steps) * 1e3)
    leg.wait_ms.append(statistics.median(waits) * 1e3)
    leg.tokens = [final[f"{tag}-{k}"] for k in range(len(prompts))]


def engine_for(mode: str, base: Path, common: dict):
    from engine import LLMEngine

    if mode == "tp1":
        return LLMEngine.from_args(str(base), **common)
    ep = {} if mode == "tp2" else dict(enable_expert_parallel=True, expert_placement=mode.removeprefix("ep-"))
    return LLMEngine.from_args(str(base), tensor_parallel_size=2, **common, **ep)


def rank_memory(engine, adapter: str) -> dict:
    """Rank 0's expert weight bytes and the expert page bytes one resident adapter takes on it."""
    from engine.distributed.moe_shard import expert_bytes_per_rank
    from engine.lora.expert_pages import EXPERT_PROJS

    info = next(x for x in engine.list_loras() if adapter in x.names)
    store = engine.lora.pool.experts
    pages = sum(store.page_bytes(p) for p in EXPERT_PROJS)
    return {"expert_weight_bytes": expert_bytes_per_rank(engine.model), "adapter_expert_page_bytes": pages,
            "adapter_bytes": info.memory_bytes}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from engine import LoRARequest, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-inter", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    shape = MoEShape(layers=args.layers, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                     expert_inter=args.expert_inter)  # fmt: skip
    with bench_env(0, None) as work:
        base = build_moe(work / "moe", shape)
        dirs = [expert_adapter(work / f"x{k}", shape, rank=8, seed=k) for k in range(args.adapters)]
        names = [f"x{k}" for k in range(args.adapters)] + [None]  # adapters mixed with base rows
        loras = [None if n is None else LoRARequest(n, str(dirs[int(n[1:])])) for n in names]
        mixed = [loras[k % len(loras)] for k in range(args.batch)]
        prompts = make_prompts(args.batch, 32, shape.vocab)
        params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
        common = dict(device="cpu", dtype="float32", max_num_seqs=args.batch, max_lora_rank=8)
        common |= dict(max_loras=max(1, args.adapters), adaptive_threads=False, num_threads=args.threads)
        engines = {m: engine_for(m, base, common) for m in MODES}
        legs = {(m, lo): Leg(m, lo) for m in MODES for lo in (False, True)}
        for r in range(args.runs):
            for (m, lo), leg in legs.items():
                run_leg(engines[m], prompts, mixed if lo else None, params, leg, f"r{r}-{m}-{lo}")
        memory = {m: rank_memory(e, "x0") for m, e in engines.items()} if args.adapters else {}
        for m, e in engines.items():
            if m != "tp1":
                e.shutdown()
    load = os.getloadavg()
    same = all(leg.tokens == legs[("tp1", leg.lora)].tokens for leg in legs.values())
    rows = [
        f"Qwen3-MoE shape {asdict(shape)}, batch {args.batch}, {args.threads} threads in all, "
        f"{args.runs} runs; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "",
        "| leg | decode step ms, median (min-max) | / TP=2 (median of runs) | rank-0 all-reduce wait ms/step "
        "| rank-0 expert weights MiB | adapter expert pages/rank MiB |",
        "|---|---|---|---|---|---|",
    ]
    out: dict = {"shape": asdict(shape), "batch": args.batch, "threads": args.threads, "runs": args.runs,
                 "loadavg": load, "tokens_equal": same, "legs": {}}  # fmt: skip
    for (m, lo), leg in legs.items():
        ref = legs[("tp2", lo)].step_ms
        ratio = statistics.median(a / b for a, b in zip(leg.step_ms, ref, strict=True))
        mem = memory.get(m, {})
        name = (
            f"{m} ({args.threads // (1 if m == 'tp1' else 2)} thr/rank), {'adapters mixed' if lo else 'base'}"
        )
        med, lo_ms, hi_ms = statistics.median(leg.step_ms), min(leg.step_ms), max(leg.step_ms)
        weights_mib = mem.get("expert_weight_bytes", 0) / 2**20
        pages_mib = mem.get("adapter_expert_page_bytes", 0) / 2**20
        rows.append(
            f"| {name} | {med:.1f} ({lo_ms:.1f}-{hi_ms:.1f}) | {ratio:.2f} "
            f"| {statistics.median(leg.wait_ms):.2f} | {weights_mib:.1f} | {pages_mib:.2f} |"
        )
        out["legs"][f"{m}_{'lora' if lo else 'base'}"] = {
            "step_ms": leg.step_ms, "wait_ms": leg.wait_ms, "ratio_to_tp2": ratio, **mem
        }  # fmt: skip
    rows.append(f"\nevery leg's tokens equal TP=1's: {same}")
    print("\n".join(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
