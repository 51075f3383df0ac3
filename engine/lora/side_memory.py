"""The device memory an adapter takes beside its pages, and the pool's budget for it.

Pages (A/B rank-rows of the projections) are preallocated (`AdapterPool`). What a resident adapter keeps
beside them is allocated at upload: its vocabulary copy (`VocabLoRA`: embedding / LM-head LoRA, trainable
token rows with their index, `modules_to_save` matrices) and its DoRA / lora_bias epilogue vectors
(`EpilogueStore`). `side_bytes` is that amount for one adapter, computed from its facts (shapes, no
weights needed), so the registry can refuse at registration what the engine could never hold:

    side_bytes = Σ embed/head LoRA   r · (vocab + hidden) · e
               + Σ token rows        n · hidden · e  (+ vocab · 8 for the embedding's row index, m · 8 ids)
               + Σ saved modules     vocab · hidden · e
               + Σ epilogue modules  layers · 2 · out · 4              (e: bytes per element of the pool)

The budget (`EngineConfig.lora_side_memory_bytes`; default: as much as the pages take,
`engine_side_budget`) bounds the sum over resident adapters: an upload evicts least-recently-used
adapters for room as for pages, and an adapter larger than the whole budget is refused when it is
loaded (and at registration, `lora_registry.validation`), with both numbers.
"""

from __future__ import annotations

from engine.engine_config import EngineConfig
from engine.lora.adapter_checkpoint import PROJECTIONS, AdapterCheckpoint, AdapterError, module_features
from engine.model_config import ModelConfig, resolve_dtype, resolve_lora_dtype


def side_bytes(ckpt: AdapterCheckpoint, cfg: ModelConfig, element_bytes: int) -> int:
    """Device bytes `ckpt` takes outside the pool's pages when resident (module docstring)."""
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    n = sum(w.rank * (vocab + hidden) * element_bytes for w in ckpt.vocab)
    for t in ckpt.tokens:
        n += len(t.indices) * hidden * element_bytes
        n += vocab * 8 if t.module == "embed_tokens" else len(t.indices) * 8
    n += len(ckpt.saved) * vocab * hidden * element_bytes
    if ckpt.use_dora or ckpt.lora_bias:
        modules = {w.module for w in ckpt.modules}
        n += sum(cfg.num_layers * 2 * module_features(cfg, m)[1] * 4 for m in modules)
    return n


def page_pool_bytes(cfg: ModelConfig, num_pages: int, page_rank: int, element_bytes: int) -> int:
    """Bytes of the pool's preallocated A/B pages: per module, pages × layers × page_rank × (in + out)."""
    per_rank = sum(sum(module_features(cfg, m)) for m in PROJECTIONS)
    return num_pages * cfg.num_layers * page_rank * per_rank * element_bytes


def engine_side_budget(config: EngineConfig, cfg: ModelConfig) -> tuple[int, int]:
    """(side budget in bytes, bytes per pool element) of an engine made with `config` on the model `cfg`,
    as its pool computes them (`lora_side_memory_bytes`, else the bytes of its pages), without making it."""
    device = config.resolve_device()
    element = resolve_lora_dtype(config.lora_dtype, resolve_dtype(config.dtype, cfg, device)).itemsize
    pages = config.adapter_pool_pages()
    return config.lora_side_memory_bytes or page_pool_bytes(
        cfg, pages, config.lora_page_rank, element
    ), element


def check_side_budget(ckpt: AdapterCheckpoint, cfg: ModelConfig, element_bytes: int, budget: int) -> None:
    """`AdapterError` when `ckpt`'s side stores alone exceed `budget` (it could never be resident)."""
    need = side_bytes(ckpt, cfg, element_bytes)
    if need > budget:
        raise AdapterError(
            f"adapter needs {need} bytes of device memory beside its pages (modules_to_save copies, "
            f"trainable token rows, embedding/LM-head LoRA, DoRA vectors), more than the adapter pool's "
            f"side budget of {budget} bytes (lora_side_memory_bytes)"
        )
