"""Tiny PEFT adapters on a mixture-of-experts model's routed experts, in both layouts PEFT reads.

`build_adapter(..., target_parameters=[...])` (tests/helpers/tiny_adapters.py) gives what current PEFT
writes for transformers 5 (the fused 3-D expert parameters). `build_per_expert_adapter` writes what PEFT
saved for the older per-expert models (`experts.N.gate_proj/up_proj/down_proj`, Mixtral's
`block_sparse_moe.experts.N.w1/w3/w2` as plain LoRA linears); PEFT converts those to transformers 5's fused
layout when it loads them, which makes it the oracle for both; for Qwen2-MoE (which PEFT 0.21 does not
convert: it would leave the expert tensors unused) the oracle reads the adapter's fused twin, the same
weights written in the `target_parameters` layout (`twin=`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.lora.expert_targets import sparse_layers
from engine.model_config import ModelConfig
from tests.helpers.tiny_adapters import build_adapter

PER_EXPERT_PROJS = {  # checkpoint parent of the experts and the names of gate, up, down
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
}
DEFAULT_PROJS = ("mlp", ("gate_proj", "up_proj", "down_proj"))


def build_per_expert_adapter(
    base: Path,
    out: Path,
    r: int,
    lora_alpha: float,
    seed: int = 0,
    scale: float = 0.3,
    twin: Path | None = None,
) -> Path:
    """A q_proj LoRA of rank `r` (built by PEFT) plus rank-`r` LoRA on every expert's gate, up and down
    linears of every sparse layer, saved with the per-expert names and `target_modules`; with `twin`, the
    same weights also in the fused `target_parameters` layout there (gate|up stacked: rank 2r, alpha
    2·alpha, B block-diagonal, as PEFT converts them)."""
    model = ModelConfig.from_dir(base)
    parent, names = PER_EXPERT_PROJS.get(model.architecture, DEFAULT_PROJS)
    build_adapter(base, out, seed=seed, r=r, lora_alpha=lora_alpha, target_modules=["q_proj"])
    moe = model.extra["moe"]
    h, inter = model.hidden_size, int(moe["intermediate_size"])
    shapes = {names[0]: (h, inter), names[1]: (h, inter), names[2]: (inter, h)}
    gen = torch.Generator().manual_seed(seed + 100)
    tensors = load_file(out / "adapter_model.safetensors")
    for layer in sparse_layers(model):
        for e in range(int(moe["num_experts"])):
            for name, (fin, fout) in shapes.items():
                pre = f"base_model.model.model.layers.{layer}.{parent}.experts.{e}.{name}"
                tensors[f"{pre}.lora_A.weight"] = torch.randn(r, fin, generator=gen) * scale
                tensors[f"{pre}.lora_B.weight"] = torch.randn(fout, r, generator=gen) * scale
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", *names]
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    if twin is not None:
        _write_twin(out, twin, model, parent, names, r, lora_alpha)
    return out


def _write_twin(src: Path, out: Path, model: ModelConfig, parent: str, names, r: int, alpha: float) -> None:
    """`src`'s expert LoRA in PEFT's `target_parameters` layout: lora_A [E*r, in] expert-major, lora_B
    [out, r*E] rank-major; gate_up_proj is the inner wrapper (`experts.base_layer.`), down_proj the outer."""
    tensors = load_file(src / "adapter_model.safetensors")
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    num = int(model.extra["moe"]["num_experts"])
    for layer in sparse_layers(model):
        pre = f"base_model.model.model.layers.{layer}.{parent}.experts"

        def get(e: int, name: str, ab: str, pre: str = pre) -> torch.Tensor:
            return tensors[f"{pre}.{e}.{name}.lora_{ab}.weight"]

        a_gu = torch.stack([torch.cat([get(e, names[0], "A"), get(e, names[1], "A")]) for e in range(num)])
        b_gu = torch.stack(
            [torch.block_diag(get(e, names[0], "B"), get(e, names[1], "B")) for e in range(num)]
        )
        a_d = torch.stack([get(e, names[2], "A") for e in range(num)])
        b_d = torch.stack([get(e, names[2], "B") for e in range(num)])
        dst = f"base_model.model.model.layers.{layer}.mlp.experts"
        for key, a, b in ((f"{dst}.base_layer", a_gu, b_gu), (dst, a_d, b_d)):
            fused[f"{key}.lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
            fused[f"{key}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(fused, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg |= {
        "target_modules": ["q_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "rank_pattern": {"gate_up_proj": 2 * r},
        "alpha_pattern": {"gate_up_proj": 2 * alpha},
    }
    (out / "adapter_config.json").write_text(json.dumps(cfg))
