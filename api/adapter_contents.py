"""What an adapter version contains, as the admin API and the admin UI's adapter page show it.

`AdapterContents` summarises the engine's reading of the adapter (`inspect_adapter` without weights,
against the served base model): the LoRA options (DoRA, LoRA bias, rsLoRA), the modules with LoRA
(projections, embedding / LM head), the trainable tokens per module, the `modules_to_save` copies, and
the device memory it takes when resident in this server's pool: its pages (per targeted projection,
ceil(max rank / page_rank) pages of `layers · page_rank · (in + out)` elements) and its side stores
(`engine/lora/side_memory.py`), at the pool's element size. Versions are immutable, so the answer is
cached by content digest.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine.lora.adapter_checkpoint import AdapterError, inspect_adapter, module_features
from engine.lora.side_memory import side_bytes
from engine.model_config import ModelConfig
from kernels.intmath import cdiv
from lora_registry.errors import RegistryError
from lora_registry.schemas import AdapterDetail, AdapterInfo, VersionInfo

log = logging.getLogger("loraplex.admin")


@dataclass(slots=True, frozen=True)
class AdapterContents:
    digest: str
    use_dora: bool
    lora_bias: bool
    use_rslora: bool
    lora_modules: tuple[str, ...]  # modules with LoRA weights (projections, embed_tokens, lm_head)
    trainable_tokens: dict[str, int]  # module -> number of token rows the adapter replaces
    modules_to_save: tuple[str, ...]  # whole trained copies (embed_tokens / lm_head)
    page_bytes: int  # device memory of its pages in this server's pool
    side_bytes: int  # device memory beside the pages (copies, token rows, vocabulary LoRA, DoRA vectors)
    device_bytes: int  # the two together


@dataclass(slots=True, frozen=True)
class AdapterDetailView:
    """`GET /admin/api/adapters/{name}`: the registry's record and the serving version's contents."""

    adapter: AdapterInfo
    versions: tuple[VersionInfo, ...]
    contents: AdapterContents | None  # None: no version is current, or its files cannot be read here


@lru_cache(maxsize=1024)
def read_contents(
    digest: str, path: str, model_dir: str, max_rank: int, page_rank: int, element: int
) -> AdapterContents:
    """The contents of the adapter at `path` (content `digest`) for the base model in `model_dir`."""
    cfg = ModelConfig.from_dir(Path(model_dir))
    ckpt = inspect_adapter(path, cfg, max_lora_rank=max_rank, load_weights=False)
    ranks: dict[str, int] = {}
    for w in ckpt.modules:
        ranks[w.module] = max(ranks.get(w.module, 0), w.rank)
    pages = sum(
        cdiv(r, page_rank) * cfg.num_layers * page_rank * sum(module_features(cfg, m)) * element
        for m, r in ranks.items()
    )
    side = side_bytes(ckpt, cfg, element)
    tokens: dict[str, int] = {}
    for t in ckpt.tokens:
        tokens[t.module] = tokens.get(t.module, 0) + len(t.indices)
    lora = tuple(sorted(ranks)) + tuple(w.module for w in ckpt.vocab)
    return AdapterContents(
        digest,
        ckpt.use_dora,
        ckpt.lora_bias,
        ckpt.use_rslora,
        lora,
        tokens,
        tuple(s.module for s in ckpt.saved),
        pages,
        side,
        pages + side,
    )


async def current_contents(state, detail: AdapterDetail) -> AdapterContents | None:
    """The contents of `detail`'s current version (None without one, or when it cannot be read)."""
    cur = detail.adapter.current
    if cur is None:
        return None
    engine, registry = state.settings.engine, state.registry.adapters
    element = state.settings.registry.lora_side_budget[1] if state.settings.registry.lora_side_budget else 4
    try:
        path = registry.materialized_path(cur.digest) or await state.lookups.run(
            registry.adapter_path, cur.digest
        )
        args = (cur.digest, str(path), str(state.settings.model), engine.max_lora_rank, engine.lora_page_rank)
        return await asyncio.to_thread(read_contents, *args, element)
    except (AdapterError, RegistryError, OSError, ValueError) as exc:
        log.warning("adapter %s: contents not readable: %s", detail.adapter.name, exc)
        return None
