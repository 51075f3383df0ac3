"""The tensors of a llama.cpp GGUF file, dequantized and renamed to Hugging Face keys.

llama.cpp's converter writes Llama's q and k projections with the rows of each head reordered (its RoPE
rotates adjacent pairs, HF's rotates the two halves of a head); `unpermute_rows` puts them back, so
the result equals the HF checkpoint the file was converted from (up to quantization); Granite's are
written the same way. Qwen2 and Phi-3 files are written unpermuted (Phi-3's q|k|v and gate|up as the
fused `attn_qkv` and `ffn_up` tensors, the family's `gguf_layer_modules`). A mixture-of-experts file's
stacked expert tensors become the HF keys of `engine/model/gguf_moe.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from engine.model.gguf_file import GGUFError, dequantize_tensor, open_reader
from engine.model.gguf_moe import expert_tensors, is_expert_tensor
from engine.model.loader import CheckpointError
from engine.model.registry import model_family
from engine.model_config import ModelConfig

_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# GGUF per-layer tensor -> HF module under model.layers.N
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# read into the config (rope_freqs) or derived from other weights by llama.cpp itself
_IGNORED = re.compile(
    r"^(rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd\.weight)$"
)


def hf_key(gguf_name: str, layer_modules: dict[str, str] = _LAYER_MODULES) -> str | None:
    """The HF checkpoint key of a GGUF tensor name, None for tensors the engine does not load (or reads
    into the config), or CheckpointError for a name this architecture does not have; `layer_modules`:
    the family's per-layer GGUF tensor -> HF module map."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    if _IGNORED.match(gguf_name):
        return None
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in layer_modules:
        raise CheckpointError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, module, leaf = m.groups()
    return f"model.layers.{layer}.{layer_modules[module]}.{leaf}"


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows (0, 2, 4, …, 1, 3, 5, …) of the GGUF
    tensor are HF rows (0 … d/2-1, d/2 … d-1), i.e. `w.view(H, d/2, 2, …).transpose(1, 2)`."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise CheckpointError(f"{rows} rows do not split into {n_heads} heads of rotary pairs")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(cfg: ModelConfig) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, HF key, float32 tensor in HF layout) for every weight of the GGUF file `cfg.path`.

    The reader is opened here (memory-mapped); tensors are dequantized one at a time while iterating.
    """
    reader = open_reader(cfg.path)
    return _iterate(reader, cfg)


def _iterate(reader: Any, cfg: ModelConfig) -> Iterator[tuple[str, str, torch.Tensor]]:
    family = model_family(cfg.architecture)
    permuted = cfg.architecture in family.gguf_permuted
    layer_modules = _LAYER_MODULES | dict(family.gguf_layer_modules)
    for t in reader.tensors:
        if is_expert_tensor(t.name):  # a MoE's experts: one GGUF tensor, one or more HF keys
            for expert_key, expert_w in expert_tensors(t.name, _dequantized(t, cfg)):
                yield cfg.path.name, expert_key, expert_w
            continue
        key = hf_key(t.name, layer_modules)
        if key is None:
            continue
        w = _dequantized(t, cfg)
        if permuted and key.endswith("q_proj.weight"):
            w = unpermute_rows(w, cfg.num_heads)
        elif permuted and key.endswith("k_proj.weight"):
            w = unpermute_rows(w, cfg.num_kv_heads)
        if family.gguf_tensor is not None:
            w = family.gguf_tensor(key, w)
        yield cfg.path.name, key, w


def _dequantized(t: Any, cfg: ModelConfig) -> torch.Tensor:
    """Reader tensor `t` as a writable float32 torch tensor in HF (row-major) shape."""
    try:
        array = dequantize_tensor(t)
    except GGUFError as exc:
        raise CheckpointError(f"{cfg.path.name}: {exc}") from exc
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only file mapping
        array = array.copy()
    return torch.from_numpy(array)
