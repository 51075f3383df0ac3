"""What llama.cpp's GGUF files of the mixture-of-experts families hold beyond a dense model's: the router
(`ffn_gate_inp`), the experts stacked in 3-D tensors (`ffn_gate_exps` / `ffn_up_exps` [E, I, H],
`ffn_down_exps` [E, H, I]; older Mixtral files one tensor per expert, `ffn_gate.N`), Qwen2-MoE's shared
expert (`*_shexp`, its gate `ffn_gate_inp_shexp`), the q/k norms (Qwen3-MoE per head, OLMoE over whole
rows), the `{arch}.expert_*` metadata and OLMoE's `attention.clamp_kqv` (`clip_qkv`).

The files do not say whether top-k weights are renormalized: llama.cpp decides per architecture
(Qwen3-MoE and Mixtral yes, Qwen2-MoE and OLMoE no) unless `{arch}.expert_weights_norm` is stated; the
family passes its default. Dense layers (`mlp_only_layers`) are the blocks without a router tensor
(`engine/model/gguf_file.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.model.family import GGUFMeta, GGUFVector

# GGUF per-layer tensor -> HF module under model.layers.N (`ModelFamily.gguf_layer_modules`)
GGUF_MOE_LAYER_MODULES = {
    "ffn_gate_inp": "mlp.gate",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_STACKED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_PER_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


def is_expert_tensor(gguf_name: str) -> bool:
    """Whether the GGUF tensor holds expert weights (stacked, or one expert's in older files)."""
    return bool(_STACKED.match(gguf_name) or _PER_EXPERT.match(gguf_name))


def expert_tensors(gguf_name: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, tensor) of each expert weight in GGUF tensor `gguf_name`: a stacked `ffn_down_exps`
    [E, H, I] is transformers 5's fused `experts.down_proj`; a stacked gate or up [E, I, H] gives one
    `experts.N.gate_proj` / `up_proj` per expert (the fused `gate_up_proj` needs both halves); an older
    file's `ffn_gate.N` is expert N's."""
    m = _STACKED.match(gguf_name)
    if m is not None:
        layer, proj = m[1], m[2]
        if proj == "down":
            yield f"model.layers.{layer}.mlp.experts.down_proj", w
            return
        for e in range(w.shape[0]):
            yield f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight", w[e]
        return
    m = _PER_EXPERT.match(gguf_name)
    if m is not None:
        yield f"model.layers.{m[1]}.mlp.experts.{m[3]}.{m[2]}_proj.weight", w


def moe_gguf_config(norm_topk_prob: bool) -> Callable[[GGUFMeta, GGUFVector], dict[str, Any]]:
    """A family's `gguf_config`: the `config.json` MoE fields from `{arch}.expert_*` metadata, top-k
    weights renormalized as `expert_weights_norm` says, else as `norm_topk_prob` (the family's rule)."""

    def config(meta: GGUFMeta, vector: GGUFVector) -> dict[str, Any]:
        count, used = meta("expert_count", None), meta("expert_used_count", None)
        if count is None or used is None:
            from engine.model.gguf_file import GGUFError

            raise GGUFError("a mixture-of-experts GGUF file needs expert_count and expert_used_count")
        out: dict[str, Any] = {
            "num_experts": int(count),
            "num_experts_per_tok": int(used),
            "norm_topk_prob": bool(meta("expert_weights_norm", norm_topk_prob)),
        }
        inter = meta("expert_feed_forward_length", None)
        if inter is not None:
            out["moe_intermediate_size"] = int(inter)
        shared = meta("expert_shared_feed_forward_length", None)
        if shared is not None:
            out["shared_expert_intermediate_size"] = int(shared)
        clamp = meta("attention.clamp_kqv", None)
        if clamp is not None:  # OLMoE's `clip_qkv`
            out["clip_qkv"] = float(clamp)
        return out

    return config


def gguf_moe_tensor(key: str, w: torch.Tensor) -> torch.Tensor:
    """A family's `gguf_tensor`: Qwen2-MoE's shared-expert gate as the HF [1, H] row (llama.cpp reads it
    as a vector, a converter may write it either way); every other tensor as it is."""
    if key.endswith("mlp.shared_expert_gate.weight"):
        return w.reshape(1, -1)
    return w
