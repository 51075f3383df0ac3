"""Load a Hugging Face checkpoint directory (`*.safetensors`, sharded or not), or a GGUF file, into our
model."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from engine.model.decoder import DecoderForCausalLM
from engine.model.family import LLAMA_CHECKPOINT_MODULES
from engine.model.registry import model_family
from engine.model.rope import RotaryEmbedding
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.distributed.shard import TensorShard

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class CheckpointError(ValueError):
    """Weights are missing, extra or of the wrong shape for the config."""


def load_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, shard: TensorShard | None = None
) -> DecoderForCausalLM:
    """Build the architecture's model (its family, `engine/model/registry.py`) on `device` in `dtype`
    and fill every parameter from the checkpoint's tensors.

    The module tree is created on the meta device and materialized once, so no memory is spent on
    random initialization. Packed projections (q|k|v, gate|up) are filled slice by slice, or whole
    where the checkpoint stores them fused (the family's `checkpoint_modules`). A GGUF
    checkpoint (`cfg.path` is the file) is dequantized tensor by tensor (`gguf_loader`).

    `shard`: build this tensor-parallel rank's shard only (`engine/distributed/shard.py`): the model of
    its local config, each projection tensor cut to the rank's rows or columns as it is read.
    """
    if Path(cfg.path).is_file():
        from engine.model.gguf_loader import gguf_tensors

        tensors: Iterator[tuple[str, str, torch.Tensor]] = gguf_tensors(cfg)
    else:
        tensors = _safetensors(Path(cfg.path))
    family = model_family(cfg.architecture)
    with torch.device("meta"):
        model = family.build(cfg if shard is None else shard.local_config())
    model = model.to(dtype).to_empty(device=device)
    for module in model.modules():  # every RoPE table set (Gemma 3 has a local and a global one)
        if isinstance(module, RotaryEmbedding):
            module.reset_tables(device)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        for source, hf_key, tensor in tensors:
            key = family.checkpoint_key(hf_key)
            if key is not None and _copy_expert(model, params, key, tensor, hf_key, filled, shard):
                continue
            target = None if key is None else _target(key, family.checkpoint_modules)
            if target is None:
                continue
            name, slice_idx = target
            if name not in params:
                raise CheckpointError(f"{source}: unexpected tensor {hf_key!r}")
            if shard is not None:
                tensor = _shard_tensor(model, shard, name, slice_idx, tensor)
            _copy_into(model, params[name], name, slice_idx, tensor, hf_key)
            filled.add(name if slice_idx is None else f"{name}#{slice_idx}")
    _check_complete(model, params, filled)
    return model.eval()


def _safetensors(root: Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, HF tensor key, tensor) for every tensor of the directory's `*.safetensors` files;
    CheckpointError at once when there are none."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        bins = list(root.glob("*.bin"))
        hint = " (pickle .bin weights are refused; convert to safetensors)" if bins else ""
        raise CheckpointError(f"{root}: no *.safetensors weight files{hint}")
    return _read_safetensors(files)


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield file.name, key, f.get_tensor(key)


def _target(
    key: str, modules: Mapping[str, tuple[str, int | None]] = LLAMA_CHECKPOINT_MODULES
) -> tuple[str, int | None] | None:
    """Our parameter name for an HF tensor key, and the slice index when it goes into a packed weight;
    `modules`: the family's per-layer HF module -> (our module, slice index or None: the whole)."""
    if key.startswith(("model.embed_tokens.", "model.norm.")):
        return key.removeprefix("model."), None
    if key == "lm_head.weight":
        return "lm_head", None
    m = _LAYER.match(key)
    if m is None:
        return None  # e.g. buffers some exporters save
    layer, rest = m.groups()
    module, _, leaf = rest.rpartition(".")
    if "rotary_emb" in module:
        return None
    if module in modules:
        packed, idx = modules[module]
        return f"layers.{layer}.{packed}.{leaf}", idx
    return f"layers.{layer}.{rest}", None


def _copy_expert(
    model,
    params,
    key: str,
    src: torch.Tensor,
    hf_key: str,
    filled: set[str],
    shard: TensorShard | None = None,
) -> bool:
    """Copy an expert weight of a MoE checkpoint (`engine.model.moe.expert_piece`: the fused 3-D tensor
    whole, or one expert's projection into its slice) and note it in `filled`; False for other keys.
    `shard`: only this rank's part (`engine/distributed/moe_shard.py`: its experts, or their rows)."""
    if ".experts." not in key:
        return False
    from engine.model.moe import expert_piece

    piece = expert_piece(key)
    if piece is None:
        return False
    name, expert, half = piece
    if name not in params:
        raise CheckpointError(f"unexpected tensor {hf_key!r}")
    dest = params[name]
    if shard is not None and shard.world > 1:
        from engine.distributed.moe_shard import expert_tensor

        moe = model.get_submodule(name.rsplit(".", 2)[0])
        if expert is not None and expert >= moe.gate.weight.shape[0]:
            raise CheckpointError(f"tensor {hf_key!r}: expert {expert} beyond the config's experts")
        part = expert_tensor(shard, name.rsplit(".", 1)[1], expert, half, src)
        if part is None:
            return True  # another rank's expert
        expert, src = part
    if expert is not None:
        experts = model.get_submodule(name.rsplit(".", 1)[0])
        if expert >= experts.num_experts:
            raise CheckpointError(
                f"tensor {hf_key!r}: expert {expert} beyond the config's {experts.num_experts}"
            )
        dest = experts.piece(name.rsplit(".", 1)[1], expert, half)
    if tuple(src.shape) != tuple(dest.shape):
        raise CheckpointError(f"tensor {hf_key!r} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)
    filled.add(name if expert is None else f"{name}#e{expert}.{half}")
    return True


def _shard_tensor(model, shard: TensorShard, name: str, slice_idx: int | None, t: torch.Tensor):
    """The part of checkpoint tensor `t` (for parameter `name`, slice `slice_idx`) that `shard` holds:
    a projection's rows or columns, anything else whole."""
    from engine.model.linear import ProjectionLinear

    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if (
        name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))
        and module.weight.numel() < t.numel()
    ):
        from engine.distributed.moe_shard import norm_rows  # OLMoE's q/k norms over whole rows

        return norm_rows(shard, name, t)
    if not isinstance(module, ProjectionLinear):
        return t
    names = module.slice_names if slice_idx is None else (module.slice_names[slice_idx],)
    if ".mlp.shared_expert." in name:
        from engine.distributed.moe_shard import shared_expert_projection

        return shared_expert_projection(shard, names, leaf, t)
    return shard.projection(names, leaf, t)


def _copy_into(model, dest: torch.Tensor, name: str, slice_idx: int | None, src: torch.Tensor, key: str):
    if slice_idx is not None:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        start, size = module.slice_offsets()[slice_idx], module.slice_sizes[slice_idx]
        dest = dest[start : start + size]
    if tuple(src.shape) != tuple(dest.shape):
        raise CheckpointError(f"tensor {key!r} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)


def _check_complete(model, params: Mapping[str, torch.Tensor], filled: set[str]) -> None:
    missing = []
    for name in params:
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        n_slices = len(getattr(owner, "slice_sizes", ()))
        pieces = getattr(owner, "checkpoint_pieces", None)
        if pieces is not None and name not in filled:  # a MoE's experts, filled expert by expert
            missing += [p for p in pieces(name) if p not in filled]
        elif n_slices > 1 and name not in filled:  # filled slice by slice (or whole: a fused checkpoint)
            missing += [f"{name}[slice {i}]" for i in range(n_slices) if f"{name}#{i}" not in filled]
        elif name not in filled:
            missing.append(name)
    if missing:
        raise CheckpointError(f"checkpoint lacks weights for: {', '.join(missing[:8])}")
