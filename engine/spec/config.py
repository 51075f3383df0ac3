"""Speculative decoding settings: which proposer, how many tokens it may propose, and how `k` adapts.

`speculative` is None (off), `"ngram"` (prompt lookup: no extra model) or `"draft:PATH"` (a smaller
checkpoint with the same tokenizer, run without adapters). Parsed once from `EngineConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft"
    num_tokens: int  # k: the most tokens proposed for one sequence in one step
    draft_path: str | None = None
    ngram_min: int = 1  # shortest suffix n-gram looked up
    ngram_max: int = 4  # longest suffix n-gram looked up (the longest match wins)
    # Adaptive k (engine/spec/adaptive.py, cost.py): a sequence proposes only tokens likely enough to be
    # accepted to pay for their rows; one that should not speculate pauses, probing again after a pause
    # that doubles up to `max_backoff` steps. `cost_prior`: the break-even acceptance probability
    # assumed until the engine has timed enough steps.
    max_backoff: int = 64
    cost_prior: float = 0.2

    @classmethod
    def parse(cls, speculative: str | None, num_tokens: int) -> SpeculativeConfig | None:
        """The config for `LLM(speculative=..., num_speculative_tokens=...)`; None when off.

        Raises ValueError for an unknown method or a `k` outside 1..MAX_SPECULATIVE_TOKENS."""
        if speculative is None or speculative in ("", "none", "off"):
            return None
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise ValueError(f"num_speculative_tokens must be an integer, got {num_tokens!r}")
        if not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {num_tokens}"
            )
        if speculative == "ngram":
            return cls("ngram", num_tokens)
        if speculative.startswith("draft:") and len(speculative) > len("draft:"):
            return cls("draft", num_tokens, draft_path=speculative[len("draft:") :])
        raise ValueError(f"speculative must be 'ngram' or 'draft:PATH', got {speculative!r}")
