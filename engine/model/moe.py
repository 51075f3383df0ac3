"""The mixture-of-experts feed-forward block the MoE families share (`qwen3_moe.py`, `mixtral.py`, …).

For the step's flat token batch `x` [T, H]:

1. route: `router_logits = x @ Wg.T` [T, E]; `p = softmax(logits)` in float32; the top-k experts of each
   token and their probabilities (renormalized to sum 1 where the config says `norm_topk_prob`;
   Mixtral always does), cast to the model's dtype as transformers does;
2. the routed experts (`engine/model/moe_experts.py`, `experts_forward`): the step's T*k (token, expert)
   pairs sorted by expert (and within an expert by adapter) once, one GEMM per projection per expert
   that has tokens, `gu = x_e @ W_gate_up[e].T`, `h = silu(gate) * up`, `y_e = h @ W_down[e].T`, each
   adapter's LoRA delta for that expert added on its rows, and the weighted combine (`index_add_`); on
   CUDA the Triton fused-MoE kernel (`kernels/fused_moe.py`), with the step's expert LoRA inside it.

Qwen2-MoE adds a shared expert (a dense gated MLP) scaled by `sigmoid(x @ w_shared_gate.T)`.

Under tensor parallel (`engine/distributed/moe_shard.py`) the router is whole on every rank, the experts'
intermediate dimension split (or, with expert parallel, each rank holds `local_experts` whole and computes
only their pairs), and the block ends with one all-reduce of the routed and shared partial outputs.

Expert weights are 3-D: `experts.gate_up` [E, 2I, H] (gate rows first) and `experts.down` [E, H, I],
transformers 5's fused layout; the loader fills them whole from a fused checkpoint or expert by expert
from the per-expert layout (`experts.N.gate_proj/up_proj/down_proj`, Mixtral's `w1/w3/w2`,
`expert_piece`). LoRA reaches the experts (`engine/lora/expert_checkpoint.py`: PEFT's `target_parameters`
or per-expert module names); adapters on the router, the shared expert or a dense layer's MLP are refused
at validation (`MOE_REFUSED_TARGETS`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from engine.model.decoder import MLP, DecoderForCausalLM, DecoderLayer
from engine.model.family import LLAMA_LORA_TARGETS, LoRATarget
from engine.model.linear import LoRAStepContext
from engine.model.moe_experts import experts_forward, fused_decode_applies
from engine.model.rope import RotaryEmbedding
from engine.model_config import ModelConfig, ModelConfigError

# the per-expert checkpoint's projection names -> (our 3-D parameter, half of gate_up: 0 gate, 1 up)
EXPERT_NAMES: Mapping[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", None),
    "w1": ("gate_up", 0),  # Mixtral's older names
    "w3": ("gate_up", 1),
    "w2": ("down", None),
}
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def expert_piece(key: str) -> tuple[str, int | None, int | None] | None:
    """For a checkpoint key of an expert weight: (our parameter name, expert index or None for the whole
    3-D tensor, half of gate_up or None); None for any other key."""
    m = _FUSED.match(key)
    if m is not None:
        return f"layers.{m[1]}.mlp.experts.{m[2].removesuffix('_proj')}", None, None
    m = _PER_EXPERT.match(key)
    if m is None or m[3] not in EXPERT_NAMES:
        return None
    leaf, half = EXPERT_NAMES[m[3]]
    return f"layers.{m[1]}.mlp.experts.{leaf}", int(m[2]), half


class Experts(nn.Module):
    """The experts' weights, stacked: `gate_up` [E, 2I, H], `down` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)

    def piece(self, leaf: str, expert: int, half: int | None) -> torch.Tensor:
        """The view of parameter `leaf` one per-expert checkpoint tensor fills."""
        w = self.gate_up if leaf == "gate_up" else self.down
        if half is None:
            return w[expert]
        return w[expert, half * self.inter : (half + 1) * self.inter]

    def checkpoint_pieces(self, name: str) -> list[str]:
        """The loader's tags for the per-expert pieces of parameter `name` (`engine/model/loader.py`)."""
        halves = (0, 1) if name.endswith("gate_up") else (None,)
        return [f"{name}#e{e}.{h}" for e in range(self.num_experts) for h in halves]


class Router(nn.Module):
    """The router's weight [E, H] (transformers' `gate`)."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)


class SparseMoE(nn.Module):
    """The routed experts (and Qwen2-MoE's gated shared expert) of one layer (module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        moe = cfg.extra["moe"]
        hidden = cfg.hidden_size
        self.top_k, self.norm_topk_prob = int(moe["top_k"]), bool(moe["norm_topk_prob"])
        self.layer = layer
        self.gate = Router(int(moe["num_experts"]), hidden)
        # expert parallel (`engine/distributed/moe_shard.py`): the global ids of this rank's experts
        self.local_experts: list[int] | None = moe.get("local_experts")
        held = int(moe["num_experts"]) if self.local_experts is None else len(self.local_experts)
        self.experts = Experts(held, hidden, int(moe["intermediate_size"]))
        self._expert_map: torch.Tensor | None = None
        # tensor / expert parallel: the one sum over ranks of the block's partial output
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Router | None = None
        if moe.get("shared_intermediate_size"):
            shared = dataclasses.replace(cfg, intermediate_size=int(moe["shared_intermediate_size"]))
            self.shared_expert = MLP(shared, layer)
            self.shared_expert_gate = Router(1, hidden)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of each token's top-k experts."""
        probs = torch.softmax(nn.functional.linear(x, self.gate.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, lora: LoRAStepContext | None = None, fused=None) -> torch.Tensor:
        """The block's output [T, H]: the routed experts with the step's expert LoRA (`lora.experts`,
        `engine/model/moe_experts.py`), plus Qwen2-MoE's gated shared expert; `fused` is unused. On CUDA
        the routed experts (and their LoRA) run the Triton fused-MoE kernel (`triton_experts`); on the CPU a
        decode step runs routing and experts as one native call, with their expert LoRA where its pages
        are in x's dtype."""
        hook = getattr(lora, "experts", None)
        if not self.uses_triton(x) and fused_decode_applies(
            x, self.experts.gate_up, self.experts.down, hook, self.layer, self.top_k
        ):
            out = self.fused_cpu_experts(x, hook)
        else:
            out = self.routed_experts(x, hook)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(nn.functional.linear(x, self.shared_expert_gate.weight))
            out.add_(gate * self.shared_expert(x, None))
        if self.all_reduce is not None:  # the ranks' partial outputs (experts and shared expert) summed
            self.all_reduce(out)
        return out

    def fused_cpu_experts(self, x: torch.Tensor, hook: Any = None) -> torch.Tensor:
        """`route` + the routed experts' weighted sum [T, H] in one call (`kernels/moe_fused_cpu.py`), with
        the expert LoRA of `hook` (the step's, or None) where it adapts this layer; under expert parallel
        only this rank's experts' pairs add to it."""
        from kernels.moe_fused_cpu import fused_moe_cpu

        emap = None if self.local_experts is None else self.expert_map(x.device)
        lora = None
        if hook is not None and hook.adapts(self.layer):
            lora = hook.kernel_lora(self.layer, x.shape[0], x.device)
        return fused_moe_cpu(x, self.gate.weight, self.experts.gate_up, self.experts.down, self.top_k,
                             self.norm_topk_prob, emap, lora=lora)  # fmt: skip

    def routed_experts(self, x: torch.Tensor, hook: Any) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] op by op: `route`, then the Triton kernel (CUDA) or
        `experts_forward` with the step's expert LoRA `hook`."""
        weights, ids = self.route(x)
        if self.local_experts is not None:  # expert parallel: other ranks' experts -> E, dropped
            ids = self.expert_map(x.device)[ids]
        if self.uses_triton(x) and (hook is None or hasattr(hook, "kernel_lora")):
            return self.triton_experts(x, weights, ids, hook)
        return experts_forward(self.experts.gate_up, self.experts.down, x, weights, ids, hook, self.layer)

    def expert_map(self, device: torch.device) -> torch.Tensor:
        """int64 [E]: each global expert's index among this rank's experts, or the local count for an
        expert another rank holds (`experts_forward` drops those pairs)."""
        if self._expert_map is None or self._expert_map.device != device:
            assert self.local_experts is not None, "expert parallel only"
            held = len(self.local_experts)
            m = torch.full((self.gate.weight.shape[0],), held, dtype=torch.long)
            m[self.local_experts] = torch.arange(held)
            self._expert_map = m.to(device)
        return self._expert_map

    def uses_triton(self, x: torch.Tensor) -> bool:
        """Whether the routed experts of a step over `x` run the Triton kernel: on CUDA tensors (under
        expert parallel too: it drops the pairs of other ranks' experts, `local_subset`)."""
        return x.is_cuda

    def triton_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, hook: Any = None
    ) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] by `kernels/fused_moe.py` (pairs sorted by expert, and by
        adapter where `hook`, the step's expert LoRA, adapts this layer, on the device; one grouped GEMM
        per projection with each pair's adapter delta inside; no host synchronization). Under expert parallel
        `ids` are this rank's indices, the local count for another rank's expert (those pairs add nothing)."""
        from kernels.fused_moe import fused_moe

        lora = None
        if hook is not None and hook.adapts(self.layer):
            lora = hook.kernel_lora(self.layer, x.shape[0], x.device)
        local = self.local_experts is not None
        return fused_moe(
            x, self.experts.gate_up, self.experts.down, weights, ids, lora=lora, local_subset=local
        )


def is_sparse_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether `layer` has the MoE block (else a dense MLP): not in `mlp_only_layers`, and every
    `decoder_sparse_step`-th layer (1-based), as transformers decides."""
    moe = cfg.extra["moe"]
    step = int(moe.get("decoder_sparse_step", 1))
    return layer not in moe.get("mlp_only_layers", ()) and (layer + 1) % step == 0


class MoEDecoderLayer(DecoderLayer):
    """The shared layer with the MoE block in place of the dense MLP where `is_sparse_layer`."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding):
        super().__init__(cfg, layer, rope)
        if is_sparse_layer(cfg, layer):
            self.mlp = SparseMoE(cfg, layer)  # type: ignore[assignment]


class MoEForCausalLM(DecoderForCausalLM):
    """The shared decoder with MoE layers (its attention is the config's: Qwen3's q/k norm, …). Its decode
    steps replay from CUDA graphs as a dense model's do (`engine/decode_graphs.py`): on CUDA the routed
    experts run the Triton kernel, which never synchronizes with the host."""

    layer_cls = MoEDecoderLayer


# MoE families' PEFT targets: the attention projections; the routed experts take LoRA through PEFT's
# `target_parameters` or per-expert module names (`engine/lora/expert_checkpoint.py`); LoRA on the router,
# the shared expert and the dense layers' MLP is refused at validation, naming the module
MOE_LORA_TARGETS: Mapping[str, LoRATarget] = {
    p: t for p, t in LLAMA_LORA_TARGETS.items() if t.parent == "self_attn"
}
_MOE_WHY = (
    "is part of the mixture-of-experts feed-forward block (router, shared expert, dense MLP); LoRA on it "
    "is not supported (only the attention projections q_proj, k_proj, v_proj, o_proj and the routed "
    "experts: target_parameters mlp.experts.gate_up_proj / down_proj, or per-expert gate_proj, up_proj, "
    "down_proj, w1, w2, w3)"
)
# module names of a MoE model's feed-forward blocks (any layout) an adapter may name, refused
MOE_REFUSED_TARGETS: Mapping[str, str] = dict.fromkeys(
    ("mlp", "gate", "experts", "shared_expert", "shared_expert_gate", "gate_up_proj", "block_sparse_moe"),
    _MOE_WHY,
)


def moe_settings(raw: dict[str, Any], norm_topk_prob: bool | None = None) -> dict[str, Any]:
    """The `cfg.extra["moe"]` a family's `configure` returns: the expert count (`num_experts`, or
    `num_local_experts` as transformers 5 writes every family's), top-k, `norm_topk_prob` (None: the
    config's, default False), the experts' intermediate size (`moe_intermediate_size`, else
    `intermediate_size`), the dense-layer rule and Qwen2-MoE's shared expert size."""
    if raw.get("use_sliding_window"):
        raise ModelConfigError("use_sliding_window is not supported for mixture-of-experts models")
    n = raw.get("num_experts", raw.get("num_local_experts"))
    if not isinstance(n, int) or n < 1:
        raise ModelConfigError(f"num_experts: expected a positive integer, got {n!r}")
    k = raw.get("num_experts_per_tok", 2)
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ModelConfigError(f"num_experts_per_tok: expected 1..{n}, got {k!r}")
    norm = bool(raw.get("norm_topk_prob", False)) if norm_topk_prob is None else norm_topk_prob
    return {
        "num_experts": n,
        "top_k": k,
        "norm_topk_prob": norm,
        "intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(i) for i in raw.get("mlp_only_layers") or ()],
        "shared_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
    }
