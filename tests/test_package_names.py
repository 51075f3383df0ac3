"""The project's top-level packages are the only modules of their names in the environment: another
installed distribution that ships a top-level `kernels`, `engine`, `api`, ... would be imported in place of
ours, or ours in place of it (transformers 5.25 began to depend on PyPI's `kernels` and then imported
loraplex's `kernels` at `from kernels import CUDAProperties`)."""

from __future__ import annotations

import importlib.metadata

OURS = ("engine", "kernels", "lora_registry", "api", "admin_ui", "migrations", "bench")


def test_no_other_distribution_ships_a_top_level_package_of_ours() -> None:
    shipped = importlib.metadata.packages_distributions()
    clashes = {name: sorted(set(shipped[name]) - {"loraplex"}) for name in OURS if name in shipped}
    assert not {name: d for name, d in clashes.items() if d}, clashes


def test_transformers_model_configs_import_beside_our_kernels_package() -> None:
    from transformers import LlamaConfig, Qwen3MoeConfig

    assert LlamaConfig().model_type == "llama" and Qwen3MoeConfig().model_type == "qwen3_moe"
