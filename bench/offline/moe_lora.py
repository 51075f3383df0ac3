"""LoRA overhead on a MoE model vs on a dense one (issue 28's second ratio), in one run::

    python -m bench.offline.moe_lora [--adapters 16] [--batch 16] [--rank 16] [--new-tokens 24] \\
        [--runs 5] [--threads 0] [--dtype float32] [--workdir DIR] [--json OUT]

The two random models of `bench.offline.moe` (a Qwen3-MoE and the dense Qwen3 with the same *active*
parameters, built with transformers' own configs). Four legs decode the same prompts, interleaved per run
after a warm-up:
- `moe_lora`: the MoE model, its `--batch` requests spread over `--adapters` expert-LoRA adapters
  (q/k/v/o plus every expert's gate/up/down, the per-expert layout `bench.peer.moe_workload` writes);
- `moe_lora_op`: the same, with the expert LoRA on the op-by-op path (`FUSED_LORA` off: a layer with
  expert LoRA leaves the CPU's fused decode call, `engine/model/moe_experts.py`), for the fused call's gain;
- `moe_base`: the same requests without adapters, on the same engine;
- `dense_lora`: the dense model with as many adapters on all 7 projections
  (`bench.common.workload.build_adapter`), of the same rank;
- `dense_base`: its requests without adapters.
Figures: each leg's mean decode-step time per run (median and min–max over the runs), each model's LoRA
overhead (adapters / base, per run) and their quotient, MoE overhead / dense overhead (issue 28's goal:
<= 1, the MoE model's expert LoRA costing no more, relatively, than the dense model's LoRA), and the
op-by-op leg over the fused one. The load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common.workload import ModelSpec, bench_env, build_adapter, make_prompts, report, timed_run
from bench.offline.moe import MoEShape, build_models, spread
from bench.peer.moe_workload import build_adapter as build_expert_adapter

LEGS = ("moe_lora", "moe_lora_op", "moe_base", "dense_lora", "dense_base")


@dataclass(slots=True)
class MoELoRAResult:
    shape: dict
    adapters: int
    rank: int
    batch: int
    dtype: str
    threads: int
    step_ms: dict[str, list[float]] = field(default_factory=lambda: {leg: [] for leg in LEGS})
    lora_changed_tokens: dict[str, bool] = field(default_factory=dict)  # model -> adapters changed tokens
    resident: dict[str, int] = field(default_factory=dict)  # model -> adapters resident after the runs
    evictions: dict[str, int] = field(default_factory=dict)  # model -> adapter evictions (0: no thrash)
    fused_same_tokens: bool = False  # the fused call's greedy tokens == op by op's, in every run
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)

    def overhead(self, model: str) -> list[float]:
        """Per run, `model`'s ("moe" / "dense") decode step with adapters over without."""
        lora, base = self.step_ms[f"{model}_lora"], self.step_ms[f"{model}_base"]
        return [a / b for a, b in zip(lora, base, strict=True)]

    def quotient(self) -> list[float]:
        """Per run, the MoE model's LoRA overhead over the dense model's (goal: <= 1)."""
        return [m / d for m, d in zip(self.overhead("moe"), self.overhead("dense"), strict=True)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = {leg: spread(v) for leg, v in self.step_ms.items()}
        d["overhead_moe"], d["overhead_dense"] = spread(self.overhead("moe")), spread(self.overhead("dense"))
        d["quotient"] = spread(self.quotient())
        d["op_over_fused"] = spread(self.op_over_fused())
        return d

    def op_over_fused(self) -> list[float]:
        """Per run, the MoE + LoRA decode step op by op over the fused call's."""
        return [o / f for o, f in zip(self.step_ms["moe_lora_op"], self.step_ms["moe_lora"], strict=True)]

    def markdown(self) -> str:
        def cell(values: list[float], unit: str = "", digits: int = 2) -> str:
            m = spread(values)
            return f"{m['median']:.{digits}f}{unit} ({m['min']:.{digits}f}–{m['max']:.{digits}f})"

        rows = [
            "| leg | decode step, median (min–max) |",
            "|---|---|",
            *(f"| {leg} | {cell(v, ' ms')} |" for leg, v in self.step_ms.items()),
        ]
        load = " -> ".join("/".join(f"{v:.1f}" for v in vs) for vs in (self.load_before, self.load_after))
        return "\n".join(
            [
                *rows,
                "",
                f"- LoRA overhead, MoE ({self.adapters} expert-LoRA adapters): "
                f"{cell(self.overhead('moe'), 'x')}",
                f"- LoRA overhead, dense ({self.adapters} adapters, 7 projections): "
                f"{cell(self.overhead('dense'), 'x')}",
                f"- MoE overhead / dense overhead (goal <= 1): **{cell(self.quotient(), 'x')}**",
                f"- MoE + LoRA op by op / in the fused call: {cell(self.op_over_fused(), 'x')}",
                f"- adapters changed the greedy tokens: {self.lora_changed_tokens}; fused call's tokens == "
                f"op by op's: {self.fused_same_tokens}; resident after the runs "
                f"{self.resident}, evictions {self.evictions}",
                f"- batch {self.batch}, rank {self.rank}, {self.dtype}, {self.threads} threads; load {load}",
            ]
        )


def dense_spec(shape: MoEShape) -> ModelSpec:
    """The dense model's shape as `bench.common.workload` names it (for its adapters)."""
    return ModelSpec(shape.vocab, shape.hidden, shape.top_k * shape.expert_inter, shape.layers, shape.heads,
                     shape.kv_heads, 512)  # fmt: skip


def build_adapters(root: Path, shape: MoEShape, n: int, rank: int) -> tuple[list[Path], list[Path]]:
    """(`n` expert-LoRA adapters for the MoE model, `n` all-projection adapters for the dense one)."""
    moe = [
        build_expert_adapter(root / f"moe-a{i}", shape, rank, seed=100 + i, experts=True) for i in range(n)
    ]
    dense = []
    for i in range(n):
        out = root / f"dense-a{i}"
        dense.append(
            out
            if (out / "adapter_config.json").exists()
            else build_adapter(out, dense_spec(shape), rank, 200 + i)
        )
    return moe, dense


def run_moe_lora_bench(workdir: Path, shape: MoEShape | None = None, adapters: int = 16, batch: int = 16,
                       rank: int = 16, new_tokens: int = 24, runs: int = 5, dtype: str = "float32",
                       prompt_len: int = 16) -> MoELoRAResult:  # fmt: skip
    """The four legs (`LEGS`), interleaved, `runs` runs after a warm-up (module doc)."""
    import torch

    import engine.model.moe_experts as moe_experts
    from engine import LLM, LoRARequest, SamplingParams

    shape = shape or MoEShape()
    moe_dir, dense_dir = build_models(workdir, shape)
    moe_adapters, dense_adapters = build_adapters(workdir / "adapters", shape, adapters, rank)
    result = MoELoRAResult(asdict(shape), adapters, rank, batch, dtype, torch.get_num_threads(),
                           load_before=list(os.getloadavg()))  # fmt: skip
    engines, loras = {}, {}
    for model, path, paths in (("moe", moe_dir, moe_adapters), ("dense", dense_dir, dense_adapters)):
        llm = LLM(str(path), device="cpu", dtype=dtype, max_loras=adapters, max_lora_rank=rank,
                  max_num_seqs=batch, enable_prefix_caching=False)  # fmt: skip
        engines[model] = llm.engine
        loras[model] = [
            LoRARequest(f"{model}-a{i % adapters}", str(paths[i % adapters])) for i in range(batch)
        ]
    prompts = make_prompts(batch, prompt_len, shape.vocab)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for r in range(runs + 1):  # run 0 warms up (and loads the adapters)
        tokens = {}
        for leg in LEGS:
            model, kind, *path = leg.split("_")
            moe_experts.FUSED_LORA = path != ["op"]
            try:
                run = timed_run(engines[model], prompts, params, loras[model] if kind == "lora" else None,
                                f"{leg}-{r}")  # fmt: skip
            finally:
                moe_experts.FUSED_LORA = True
            tokens[leg] = run.token_ids
            if r > 0:
                result.step_ms[leg].append(1e3 * run.decode_s / max(run.decode_steps, 1))
        result.lora_changed_tokens = {m: tokens[f"{m}_lora"] != tokens[f"{m}_base"] for m in ("moe", "dense")}
        same = tokens["moe_lora"] == tokens["moe_lora_op"]
        result.fused_same_tokens = same and (r == 0 or result.fused_same_tokens)
    for model, engine in engines.items():
        pool = engine.get_lora_stats()
        result.resident[model], result.evictions[model] = pool.resident, pool.evictions
    result.load_after = list(os.getloadavg())
    return result


def main(argv: list[str] | None = None) -> MoELoRAResult:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16, help="requests decoded together")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per leg (after a warm-up)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep models and adapters here")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.adapters < 1 or args.batch < 1:
        ap.error("--runs, --adapters and --batch must be at least 1")
    with bench_env(args.threads, args.workdir) as work:
        result = run_moe_lora_bench(work, MoEShape(), args.adapters, args.batch, args.rank, args.new_tokens,
                                    args.runs, args.dtype, args.prompt_len)  # fmt: skip
    report(result, args.json, None, None)
    return result


if __name__ == "__main__":
    main()
