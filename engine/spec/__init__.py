"""Speculative decoding for mixed-adapter batches: proposers, verification in the target's forward,
adaptive per-sequence `k` (see decoder.py for how the pieces meet in the engine loop)."""

from engine.spec.config import SpeculativeConfig
from engine.spec.decoder import AdapterSpecStats, SpecDecoder, SpecStats

__all__ = ["AdapterSpecStats", "SpecDecoder", "SpecStats", "SpeculativeConfig", "make_spec_decoder"]


def make_spec_decoder(config: SpeculativeConfig | None, **draft_kwargs) -> SpecDecoder | None:
    """The engine's speculative decoder for `config` (None: speculation off); `draft_kwargs` are the
    `DraftProposer` arguments besides the config (target model config, device, dtype, KV geometry)."""
    if config is None:
        return None
    if config.method == "ngram":
        from engine.spec.ngram import NgramProposer

        return SpecDecoder(config, NgramProposer(config.ngram_min, config.ngram_max))
    from engine.spec.draft import DraftProposer

    return SpecDecoder(config, DraftProposer(config, **draft_kwargs))
