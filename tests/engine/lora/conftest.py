"""The base model the adapter-reading tests check adapters against (tiny random Llama)."""

from __future__ import annotations

import pytest

from engine.model_config import ModelConfig

from .peft_factory import write_base_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    """The `ModelConfig` of a tiny random Llama checkpoint (`peft_factory.TINY_LLAMA`)."""
    return ModelConfig.from_dir(write_base_model(tmp_path_factory.mktemp("base")))
