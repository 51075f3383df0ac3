from __future__ import annotations

import pytest

from tests.helpers.tiny_models import HFGreedyOracle, build_checkpoint, save_char_tokenizer


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch, **overrides) -> directory of a tiny random model (cached per arguments)."""
    cache: dict = {}

    def make(arch: str = "llama", tokenizer: bool = False, **overrides):
        key = (arch, tokenizer, tuple(sorted(overrides.items(), key=str)))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{arch}_ckpt")
            build_checkpoint(d, arch, **overrides)
            if tokenizer:
                save_char_tokenizer(d)
            cache[key] = d
        return cache[key]

    return make


@pytest.fixture(scope="session")
def oracle():
    cache: dict = {}

    def get(model_dir) -> HFGreedyOracle:
        if model_dir not in cache:
            cache[model_dir] = HFGreedyOracle(model_dir)
        return cache[model_dir]

    return get
