"""The server checks registrations against its engine's side budget (`engine/lora/side_memory.py`)."""

from __future__ import annotations

from api.settings import ServerSettings
from engine.engine_config import EngineConfig
from engine.lora.side_memory import engine_side_budget, page_pool_bytes
from engine.model_config import ModelConfig


def test_the_registry_gets_the_engine_side_budget(text_model, tmp_path):
    base = text_model[0]
    env = {"LORAPLEX_DATA_DIR": str(tmp_path)}
    kw = dict(device="cpu", dtype="float32", max_loras=2, max_lora_rank=16)
    settings = ServerSettings.build(str(base), env=env, engine_kwargs=kw)
    cfg = ModelConfig.from_dir(base)
    pages = EngineConfig(model=str(base), **kw).adapter_pool_pages()
    assert settings.registry.lora_side_budget == (page_pool_bytes(cfg, pages, 16, 4), 4)
    kw |= {"lora_side_memory_bytes": 12345, "dtype": "bfloat16"}
    settings = ServerSettings.build(str(base), env=env, engine_kwargs=kw)
    assert settings.registry.lora_side_budget == (12345, 2)
    assert engine_side_budget(EngineConfig(model=str(base), **kw), cfg) == (12345, 2)
