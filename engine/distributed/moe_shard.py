"""What one rank holds of a mixture-of-experts model's feed-forward blocks and of each adapter's expert LoRA.

Attention (and a MoE model's dense layers) are sharded as for dense models (`engine/distributed/shard.py`).
The MoE block's parts, with `world` ranks:

- the router `gate` [E, H] (and Qwen2-MoE's `shared_expert_gate` [1, H]) whole on every rank: every rank
  routes its (identical) hidden states to the same top-k experts with the same weights;
- Qwen2-MoE's shared expert as a dense MLP: gate/up rows and down columns ``[r*S/N, (r+1)*S/N)``;
- the routed experts, by one of two rules:

  * **tensor parallel** (default): every expert on every rank, its intermediate dimension split — gate and
    up rows ``[r*I/N, (r+1)*I/N)`` (column-parallel), down columns the same (row-parallel);
  * **expert parallel** (`enable_expert_parallel`): each rank holds only its experts, whole — `linear`
    placement gives rank r experts ``[r*E/N, (r+1)*E/N)``, `round_robin` the experts ``e`` with
    ``e % N == r`` (`local_experts`). Dispatch: after the tensor-parallel attention the hidden states
    and the router's top-k choices (and every row's adapter id, from the step plan) are identical on
    every rank — the all-gather of tokens, top-k and adapter ids that expert parallel needs is
    implicit — so each rank computes only the (token, expert, adapter) groups of its local experts
    (`engine/model/moe_experts.py` drops the others' pairs).

Either way each rank's MoE output is a partial sum (its slice of every expert's down projection, or its
experts' weighted outputs), and the shared expert's partial output (scaled by the replicated sigmoid gate)
joins it: **one all-reduce** per MoE layer combines them (= the reduce-scatter + all-gather of an
expert-parallel combine, in one collective).

Expert LoRA (`engine/lora/expert_pages.py`) follows the rule of dense LoRA, so it adds no collective:
gate_up (column-parallel) A whole, B's rows of this rank's gate and up rows; down (row-parallel) A's
columns of this rank's intermediate columns, B whole; under expert parallel, the local experts' A and B
whole. Rank 0 decides slots and pages; every worker cuts its part of the same digest (`place`).

OLMoE's q/k norms run over whole q and k rows (all heads): each rank holds its heads' part of the norm
weights, and the sums of squares are summed over the ranks (`OlmoeAttention._sharded_norms`, one small
all-reduce of [T, 2] per layer; KV heads replicated on N/K ranks are counted once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.distributed.shard import TensorShard

PLACEMENTS = ("linear", "round_robin")
MOE_TENSOR_PARALLEL_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
)


def local_experts(num_experts: int, world: int, rank: int, placement: str) -> list[int]:
    """The global ids of the experts rank `rank` of `world` holds under expert parallel, ascending."""
    if placement == "round_robin":
        return list(range(rank, num_experts, world))
    n = num_experts // world
    return list(range(rank * n, (rank + 1) * n))


def check_moe_parallel(cfg: ModelConfig, world: int, expert_parallel: bool) -> str | None:
    """Why `cfg`'s MoE blocks cannot be split over `world` ranks (one line), or None: under expert
    parallel the experts must divide evenly, else the experts' intermediate size; the shared expert's
    size always."""
    moe = cfg.extra["moe"]
    n, inter, shared = int(moe["num_experts"]), int(moe["intermediate_size"]), moe["shared_intermediate_size"]
    if expert_parallel and n % world:
        return f"enable_expert_parallel over {world} ranks does not divide the model's {n} experts"
    if not expert_parallel and inter % world:
        return (
            f"tensor_parallel_size={world} does not divide the experts' intermediate size "
            f"(moe_intermediate_size) {inter}"
        )
    if shared and int(shared) % world:
        return (
            f"tensor_parallel_size={world} does not divide the shared expert's intermediate size "
            f"(shared_expert_intermediate_size) {shared}"
        )
    return None


def has_dense_layers(cfg: ModelConfig) -> bool:
    """Whether a MoE model has layers with a dense MLP of `intermediate_size` (which must split too)."""
    from engine.lora.expert_targets import sparse_layers

    return len(sparse_layers(cfg)) < cfg.num_layers


def local_moe(shard: TensorShard) -> dict[str, Any]:
    """The `extra["moe"]` of the rank's local config: `num_experts` stays the router's (global) count;
    `local_experts` lists the global ids of the experts it holds (None: all of them), `intermediate_size`
    is its share of each expert's (tensor parallel) and `shared_intermediate_size` its shared expert's."""
    moe = dict(shard.full.extra["moe"])
    w = shard.world
    if shard.expert_parallel:
        moe["local_experts"] = local_experts(int(moe["num_experts"]), w, shard.rank, shard.expert_placement)
    else:
        moe["intermediate_size"] = int(moe["intermediate_size"]) // w
    moe["shared_intermediate_size"] = int(moe["shared_intermediate_size"]) // w
    return moe


def _inter_rows(shard: TensorShard, width: int) -> slice:
    """This rank's share ``[r*width/N, (r+1)*width/N)`` of an intermediate dimension of `width`."""
    n = width // shard.world
    return slice(shard.rank * n, (shard.rank + 1) * n)


def _expert_ids(shard: TensorShard) -> list[int] | None:
    return local_moe(shard).get("local_experts")


def expert_tensor(
    shard: TensorShard, leaf: str, expert: int | None, half: int | None, t: torch.Tensor
) -> tuple[int | None, torch.Tensor] | None:
    """This rank's part of an expert checkpoint tensor of parameter `leaf` ("gate_up" or "down"): the
    fused 3-D tensor (`expert` None; [E, 2I, H] or [E, H, I]) or one expert's projection (`half` 0 gate,
    1 up, None down). Returns (the local expert index or None, the tensor), or None when the tensor is of
    an expert another rank holds."""
    local = _expert_ids(shard)
    if local is not None:  # expert parallel: the local experts whole
        if expert is None:
            return None, t[local]
        return (local.index(expert), t) if expert in local else None
    inter = int(shard.full.extra["moe"]["intermediate_size"])
    rows = _inter_rows(shard, inter)
    if leaf == "down":
        return expert, t[..., rows]
    if expert is None:  # [E, 2I, H]: this rank's gate rows, then its up rows
        return None, torch.cat([t[:, rows], t[:, inter + rows.start : inter + rows.stop]], dim=1)
    return expert, t[rows]


def expert_lora(
    shard: TensorShard, proj: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A [E', r, in'], B [E', out', r]) of an adapter's expert LoRA on `proj` (A [E, r, in],
    B [E, out, r] whole): the local experts under expert parallel; else gate_up's B rows of this rank's
    gate and up rows, down's A columns of its intermediate columns (module docstring)."""
    local = _expert_ids(shard)
    if local is not None:
        return a[local], b[local]
    inter = int(shard.full.extra["moe"]["intermediate_size"])
    rows = _inter_rows(shard, inter)
    if proj == "down":
        return a[:, :, rows], b
    return a, torch.cat([b[:, rows], b[:, inter + rows.start : inter + rows.stop]], dim=1)


def shared_expert_projection(shard: TensorShard, slice_names: tuple[str, ...], leaf: str, t: torch.Tensor):
    """This rank's part of a Qwen2-MoE shared-expert checkpoint tensor (a dense MLP of the shared size):
    gate/up rows (column-parallel), down columns (row-parallel)."""
    rows = _inter_rows(shard, int(shard.full.extra["moe"]["shared_intermediate_size"]))
    if slice_names[0] == "down_proj":
        return t[:, rows]
    parts = t.chunk(len(slice_names))  # a fused gate|up tensor: each slice's rows
    return torch.cat([p[rows] for p in parts])


def norm_rows(shard: TensorShard, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of OLMoE's whole-row q/k norm weight `t` (parameter `name`): its heads' entries."""
    d = shard.full.head_dim
    heads = shard.heads if name.endswith("q_norm.weight") else shard.kv_heads
    return t[heads.start * d : heads.stop * d]


def wire_moe(model: torch.nn.Module, shard: TensorShard, all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Give every MoE block of `model` its one all-reduce (routed partial sum + gated shared partial), the
    shared experts' down projections none of their own, and OLMoE's whole-row q/k norms theirs."""
    from engine.model.moe import SparseMoE
    from engine.model.olmoe import OlmoeAttention

    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.all_reduce = all_reduce
            if module.shared_expert is not None:
                module.shared_expert.down_proj.all_reduce = None
        elif isinstance(module, OlmoeAttention):
            module.norm_all_reduce = all_reduce
            module.norm_widths = (shard.full.q_size, shard.full.kv_size)
            k = shard.full.num_kv_heads
            module.kv_replicas = float(shard.world // k) if k < shard.world else 1.0


def expert_bytes_per_rank(model: torch.nn.Module) -> int:
    """Bytes of the routed experts' weights this rank's model holds (all its MoE layers)."""
    from engine.model.moe import Experts

    return sum(p.nbytes for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
