"""What one tensor-parallel rank holds of the model and of each adapter (Megatron-style sharding).

With `world` ranks, rank `r` holds:

- attention heads ``[r*H/N, (r+1)*H/N)`` of q (and the matching columns of o); its KV heads are
  ``[r*K/N, (r+1)*K/N)`` when K >= N, else the one KV head its q heads read (``r*K // N``, replicated on
  ``N/K`` ranks), so every rank's paged KV cache holds only its heads;
- rows ``[r*I/N, (r+1)*I/N)`` of gate and up (and the matching columns of down);
- everything else whole: norms, q/k head norms, the embedding and the LM head (replicated, see below);
- of a mixture-of-experts model's blocks: the router whole, the experts' intermediate rows (or, with
  `expert_parallel`, its experts whole) and the shared expert's rows, with one all-reduce per block
  (`engine/distributed/moe_shard.py`).

q|k|v and gate|up are column-parallel (each rank computes its rows of the output, no communication);
o and down are row-parallel (each rank multiplies its columns of the input, and one all-reduce sums the
partial outputs); a row-parallel bias is added on rank 0 only, so the sum carries it once.

The embedding and LM head are replicated rather than vocabulary-parallel: the lookup is a gather (no
compute to split), and with the head on every rank only rank 0 computes logits (the others ask for no
rows), so neither needs a collective and the sampler reads whole rows. It costs `vocab * hidden` weights
per rank, which for the 1B-8B models this targets is small next to the layers.

LoRA follows the layer it adapts, so it adds no communication of its own:

- column-parallel (q, k, v, gate, up): A whole, B's rows of this rank's output rows;
- row-parallel (o, down): A's columns of this rank's input columns, B whole. Each rank's partial delta
  ``scale * (x_r @ A_r.T) @ B.T`` joins its partial base output before the layer's all-reduce, whose sum
  is ``scale * (x @ A.T) @ B.T``.

With `fully_sharded` (`--fully-sharded-loras`, S-LoRA's scheme) a column-parallel slice's A is split by
rank too: of every pool page (`page_rank` rank-rows), rank `r` holds rows ``[r*q, (r+1)*q)`` with
``q = page_rank / world`` (`a_page_rows`; rows beyond the adapter's rank are zero, so odd ranks and
`rank_pattern` need no special case). Each rank shrinks its ``T x q``-per-page part, one all-gather per
packed projection builds the whole ``T x r`` shrink output, and the rank expands it with its rows of B
(`engine/lora/sharded_shrink.py`). A takes 1/world of its pool memory per rank, at the price of that
all-gather; row-parallel slices stay as in the default mode (A already split, B whole).

DoRA magnitudes and lora_B biases follow B's rows (row-parallel: the bias on rank 0 only, the DoRA norm
summed over the ranks once per upload), and the embedding side of an adapter (vocabulary LoRA,
trainable tokens, `modules_to_save`) is applied by every rank to its replicated lookup, the LM-head side
by rank 0 alone: `engine/distributed/shard_adapters.py`, `adapter_frames.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.distributed.moe_shard import (
    MOE_TENSOR_PARALLEL_ARCHITECTURES,
    check_moe_parallel,
    has_dense_layers,
)
from engine.model_config import ModelConfig

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # LoRA slices split by output rows
ROW = ("o_proj", "down_proj")  # LoRA slices split by input columns
ROW_PARALLEL_MODULES = ("o_proj", "down_proj")  # the packed projections whose output is all-reduced
# architectures whose layers are exactly the shared decoder's projections (the MoE families' feed-forward
# blocks are sharded by `engine/distributed/moe_shard.py`)
TENSOR_PARALLEL_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GraniteForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    *MOE_TENSOR_PARALLEL_ARCHITECTURES,
)


class TensorParallelError(ValueError):
    """A `tensor_parallel_size` this model (or machine) cannot be split into."""


def check_tensor_parallel(cfg: ModelConfig, world: int, expert_parallel: bool = False) -> None:
    """TensorParallelError (one line) unless `cfg` splits into `world` ranks: heads, KV heads (or their
    replication) and the MLP width must divide evenly, and the architecture must be one this module (or
    `moe_shard.py`, for the MoE blocks: experts or their width, `expert_parallel`) shards."""
    if world < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {world}")
    if world == 1:
        return
    if cfg.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise TensorParallelError(
            f"tensor_parallel_size={world}: {cfg.architecture} is not supported under tensor parallel "
            f"(dense families only: {', '.join(TENSOR_PARALLEL_ARCHITECTURES)})"
        )
    h, k, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % world:
        raise TensorParallelError(
            f"tensor_parallel_size={world} does not divide the model's {h} attention heads"
        )
    if (k % world) if k >= world else (world % k):
        raise TensorParallelError(
            f"tensor_parallel_size={world} and the model's {k} KV heads: one must divide the other"
        )
    moe = bool(cfg.extra.get("moe"))
    if inter % world and (not moe or has_dense_layers(cfg)):
        raise TensorParallelError(
            f"tensor_parallel_size={world} does not divide the model's intermediate_size {inter}"
        )
    why = check_moe_parallel(cfg, world, expert_parallel) if moe else None
    if why is not None:
        raise TensorParallelError(why)


@dataclass(frozen=True, slots=True)
class TensorShard:
    """Rank `rank` of `world` over the model `full` (the checkpoint's config)."""

    rank: int
    world: int
    full: ModelConfig
    fully_sharded: bool = False  # column-parallel LoRA A split by rank as well (module docstring)
    expert_parallel: bool = False  # MoE: each rank holds its experts whole (`moe_shard.py`)
    expert_placement: str = "linear"  # which experts are whose: linear | round_robin

    @property
    def heads(self) -> range:
        """This rank's q heads."""
        n = self.full.num_heads // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads (one, shared with other ranks, when there are fewer KV heads than ranks)."""
        k = self.full.num_kv_heads
        if k >= self.world:
            n = k // self.world
            return range(self.rank * n, (self.rank + 1) * n)
        first = self.rank * k // self.world
        return range(first, first + 1)

    @property
    def inter(self) -> range:
        """This rank's rows of gate and up (columns of down)."""
        n = self.full.intermediate_size // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def local_config(self) -> ModelConfig:
        """The config of this rank's shard: its heads, KV heads and MLP width, and a MoE model's experts
        (`moe_shard.local_moe`); the rest unchanged."""
        local = replace(
            self.full,
            num_heads=len(self.heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.inter),
        )
        if self.full.extra.get("moe"):
            from engine.distributed.moe_shard import local_moe

            local = replace(local, extra=self.full.extra | {"moe": local_moe(self)})
        return local

    def _rows(self, module: str) -> slice:
        """The rows of projection `module`'s output (columns of its input, for o/down) this rank holds."""
        d = self.full.head_dim
        if module in ("q_proj", "o_proj"):
            return slice(self.heads.start * d, self.heads.stop * d)
        if module in ("k_proj", "v_proj"):
            return slice(self.kv_heads.start * d, self.kv_heads.stop * d)
        return slice(self.inter.start, self.inter.stop)

    def full_width(self, module: str) -> int:
        """Output width of projection `module` in the whole model."""
        cfg = self.full
        if module == "q_proj":
            return cfg.num_heads * cfg.head_dim
        if module in ("k_proj", "v_proj"):
            return cfg.num_kv_heads * cfg.head_dim
        return cfg.hidden_size if module in ROW else cfg.intermediate_size

    def projection(self, slice_names: tuple[str, ...], leaf: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a (packed) projection's checkpoint tensor `t` (`leaf`: weight or bias);
        `slice_names`: the slices `t` covers, in order (a fused checkpoint tensor, e.g. Phi-3's qkv_proj,
        covers several)."""
        if slice_names[0] in ROW:
            if leaf == "bias":  # added once: rank 0 keeps it, the others add zeros
                return t if self.rank == 0 else torch.zeros_like(t)
            return t[:, self._rows(slice_names[0])]
        parts, start = [], 0
        for name in slice_names:
            size, rows = self.full_width(name), self._rows(name)
            parts.append(t[start : start + size][rows])
            start += size
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def lora(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of an adapter's slice `module`: B's rows of a column-parallel slice, A's
        columns of a row-parallel one (module docstring)."""
        if module in ROW:
            return a[:, self._rows(module)], b
        return a, b[self._rows(module)]

    def splits_a(self, module: str) -> bool:
        """Whether this rank's pool holds only its share of `module`'s A rank-rows (fully sharded)."""
        return self.fully_sharded and self.world > 1 and module in COLUMN

    def a_page_rows(self, page: int, page_rank: int) -> range:
        """The rank-rows of A that this rank holds of pool page `page` (the `page`-th page of an
        adapter's module) in fully-sharded mode: its `page_rank / world` rows of that page."""
        q = page_rank // self.world
        start = page * page_rank + self.rank * q
        return range(start, start + q)
