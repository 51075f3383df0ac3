"""Tokenizer loading and incremental detokenization (text grows token by token without re-decoding
everything, and never ends in half of a multi-byte character)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str | Path) -> Any | None:
    """`AutoTokenizer` for the checkpoint directory, or None when it ships no tokenizer files."""
    root = Path(path)
    if not any((root / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))


class IncrementalDetokenizer:
    """Appends the text of each new token id.

    Decodes a short window `tokens[prefix:]` and subtracts the text of `tokens[prefix:read]`, so
    tokenizers whose pieces depend on their neighbours (leading spaces, byte fallback) still produce
    exactly `decode(all tokens)`. Text is held back while it ends in an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.tokens.append(token_id)

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

        prefix_text = decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters: (its start, the string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        idx = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best
