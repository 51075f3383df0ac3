"""A served tiny model for server tests: a llama with a char tokenizer, PEFT adapters, and registration."""

from __future__ import annotations

from tests.helpers.tiny_adapters import ADAPTER_SPECS, PeftGreedyOracle, build_adapter
from tests.helpers.tiny_models import build_checkpoint, save_char_tokenizer

SERVED_ADAPTERS = ("all7-r4", "qv-r8-rslora", "gud-r12")


def build_text_model(root):
    """(base dir, {adapter name: dir}, PEFT oracle) for a tiny llama with a character tokenizer."""
    base = build_checkpoint(root / "model", "llama", vocab_size=100)
    save_char_tokenizer(base)
    adapters = {
        n: build_adapter(base, root / "adapters" / n, seed=i, **ADAPTER_SPECS[n])
        for i, n in enumerate(SERVED_ADAPTERS)
    }
    return base, adapters, PeftGreedyOracle(base)


def register(data_dir, model, name, path, activate=True):
    """Register an adapter straight into the registry in `data_dir` (as `loraplex adapters register`)."""
    from lora_registry import RegistrySettings, open_registry

    env = {"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_MODEL": str(model)}
    reg = open_registry(RegistrySettings.from_env(env))
    try:
        return reg.adapters.register(name, path, activate=activate)
    finally:
        reg.close()


def serve_text_model(text_model, data_dir, **server_kwargs):
    """Register every served adapter of `text_model` (from `build_text_model`) in `data_dir` and start a live
    server on it (`tests.helpers.live_server.start_server` keyword arguments pass through)."""
    from tests.helpers.live_server import start_server

    base, adapters, _ = text_model
    for name in SERVED_ADAPTERS:
        register(data_dir, base, name, adapters[name])
    return start_server(base, data_dir, **server_kwargs)
