"""vLLM's engine settings in `EngineConfig`: `gpu_memory_utilization` sizes the CUDA KV cache as vLLM
does (a share of the whole device, less what is in use), `max_model_len` caps the model's context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine_config import EngineConfig, cuda_kv_budget
from engine.model_config import ModelConfig

DEMO = Path(__file__).resolve().parents[2] / "demo"
GIB = 1 << 30


def test_kv_budget_is_the_share_of_the_device_less_what_is_in_use() -> None:
    # 80 GiB device, 20 GiB in use (weights, other processes): 0.9 allows 72, so 52 GiB are left.
    assert cuda_kv_budget(60 * GIB, 80 * GIB, 0.9) == int(80 * GIB * 0.9) - 20 * GIB
    assert cuda_kv_budget(80 * GIB, 80 * GIB, 0.5) == 40 * GIB
    with pytest.raises(ValueError, match=r"0\.2 allows 16\.00 GiB .* 20\.00 GiB is already in use"):
        cuda_kv_budget(60 * GIB, 80 * GIB, 0.2)


def test_gpu_memory_utilization_is_checked_and_unused_on_cpu() -> None:
    cfg = EngineConfig(model=".", gpu_memory_utilization=0.3)
    cfg.check_choices()
    assert cfg.kv_budget_bytes(torch.device("cpu")) == EngineConfig(model=".").kv_budget_bytes(
        torch.device("cpu")
    )
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(model=".", gpu_memory_utilization=bad).check_choices()


def test_max_model_len_caps_the_context_within_the_models_positions() -> None:
    raw = ModelConfig.from_dir(DEMO / "base")
    assert raw.max_model_len == 64
    assert raw.capped(40).max_model_len == 40 and raw.capped(None) is raw
    assert raw.capped(40).max_position_embeddings == 64  # the model itself is unchanged
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 64\]"):
        raw.capped(65)
