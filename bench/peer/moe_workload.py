"""The peer benchmark's mixture-of-experts workload (`bench peer --arch qwen3_moe`): a random Qwen3-MoE
checkpoint built with transformers' own config (`bench.offline.moe.MoEShape`: by default a scaled-down
Qwen3-30B-A3B, 8 layers, 32 experts, top-4), random PEFT adapters on its attention projections (q/k/v/o,
the adapters both engines take on MoE models), and optionally expert adapters.

The expert adapters are in the per-expert layout (`target_modules` on every expert's gate/up/down linear,
`experts.N.gate_proj`, plus q/k/v/o): the layout vLLM reads for Qwen3-MoE (its model has 2-D expert
weights, `is_3d_moe_weight` False) and that loraplex and PEFT both load too (PEFT converts it to the fused
parameters of transformers 5), so the two engines read identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common.workload import make_prompts
from bench.offline.moe import MoEShape
from bench.peer.offline import PeerWorkload

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")


def build_checkpoint(out: Path, shape: MoEShape, seed: int = 0) -> Path:
    """Save a random `Qwen3MoeForCausalLM` of `shape` (transformers' init, every layer sparse) at `out`
    unless one is there already; return `out`."""
    import transformers as tf

    if not (out / "config.json").exists():
        torch.manual_seed(seed)
        cfg = tf.Qwen3MoeConfig(**shape.common(), intermediate_size=shape.top_k * shape.expert_inter,
                                moe_intermediate_size=shape.expert_inter, num_experts=shape.experts,
                                num_experts_per_tok=shape.top_k, norm_topk_prob=True)  # fmt: skip
        tf.Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return out


def describe(shape: MoEShape) -> str:
    """One line naming the random model of `shape`."""
    return (
        f"random Qwen3-MoE ({shape.layers} layers, {shape.experts} experts, top-{shape.top_k}, hidden "
        f"{shape.hidden}, expert intermediate {shape.expert_inter}, vocab {shape.vocab})"
    )


def _dims(shape: MoEShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of the attention projections and of one expert's linears."""
    hd = shape.hidden // shape.heads
    h, q, kv, i = shape.hidden, shape.heads * hd, shape.kv_heads * hd, shape.expert_inter
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def build_adapter(out: Path, shape: MoEShape, rank: int, seed: int, experts: bool = False) -> Path:
    """Write (unless present) a PEFT LoRA adapter of rank `rank` on q/k/v/o of every layer, with `experts`
    also on every expert's gate/up/down (per-expert names); A ~ N(0, 1/in), B ~ N(0, 1e-4), alpha = 2 * rank
    (scaling 2)."""
    if (out / "adapter_config.json").exists():
        return out
    gen = torch.Generator().manual_seed(seed)
    dims = _dims(shape)
    tensors: dict[str, torch.Tensor] = {}

    def add(prefix: str, name: str) -> None:
        fin, fout = dims[name]
        tensors[f"{prefix}.{name}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) / fin**0.5
        tensors[f"{prefix}.{name}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) * 0.01

    for layer in range(shape.layers):
        pre = f"base_model.model.model.layers.{layer}"
        for name in ATTENTION:
            add(f"{pre}.self_attn", name)
        for e in range(shape.experts if experts else 0):
            for name in EXPERT_LINEARS:
                add(f"{pre}.mlp.experts.{e}", name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = [*ATTENTION, *(EXPERT_LINEARS if experts else ())]
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=targets, bias="none",
                  task_type="CAUSAL_LM", lora_dropout=0.0)  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def build_moe_workload(
    workdir: Path,
    adapters: int = 32,
    requests: int = 32,
    rank: int = 16,
    prompt_len: int = 64,
    new_tokens: int = 64,
    dtype: str = "float32",
    shape: MoEShape | None = None,
    expert_adapters: int = 0,
) -> PeerWorkload:
    """The MoE checkpoint under `workdir/qwen3_moe`, `adapters` attention adapters and `expert_adapters`
    expert (+ attention) adapters of rank `rank` beside it (reused when present), seeded token-id prompts."""
    shape = shape or MoEShape()
    if adapters < 1 or requests < 1 or new_tokens < 1 or prompt_len < 1 or expert_adapters < 0:
        raise ValueError("adapters, requests, prompt length and new tokens must be >= 1")
    tag = f"e{shape.experts}k{shape.top_k}l{shape.layers}h{shape.hidden}i{shape.expert_inter}v{shape.vocab}"
    base = build_checkpoint(workdir / f"qwen3_moe-{tag}", shape)
    attn = [build_adapter(workdir / f"attn{i}-r{rank}-{tag}", shape, rank, 1000 + i) for i in range(adapters)]
    expert = [
        build_adapter(workdir / f"experts{i}-r{rank}-{tag}", shape, rank, 2000 + i, experts=True)
        for i in range(expert_adapters)
    ]
    return PeerWorkload(
        model=str(base),
        adapters=[str(d) for d in attn],
        prompts=make_prompts(requests, prompt_len, shape.vocab),
        new_tokens=new_tokens,
        dtype=dtype,
        max_lora_rank=max(16, rank),
        expert_adapters=[str(d) for d in expert],
    )
