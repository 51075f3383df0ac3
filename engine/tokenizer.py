"""Tokenizer loading and incremental detokenization (text grows token by token without re-decoding
everything, and never ends in half of a multi-byte character)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer_files(path: str | Path) -> bool:
    """Whether the checkpoint directory ships Hugging Face tokenizer files (a GGUF file is not looked
    into: its tokenizer, if any, is in its metadata)."""
    root = Path(path)
    return any((root / f).exists() for f in _TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> Any | None:
    """`AutoTokenizer` for the checkpoint directory, or None when it ships no tokenizer files.

    For a GGUF checkpoint, the tokenizer its `tokenizer.ggml.*` metadata describes (built by
    transformers, chat template included), or None when the file has none."""
    root = Path(path)
    from engine.model.gguf_file import find_gguf, gguf_tokenizer

    gguf = find_gguf(root)
    if gguf is not None:
        return gguf_tokenizer(gguf)
    if not has_tokenizer_files(root):
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


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character for every byte, inverted (char -> byte)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token stands for, even when it is only part of a UTF-8 character.

    decode([id]) when that is whole text; otherwise the token's vocabulary string read as a byte-fallback
    piece (`<0xE4>`), GPT-2 byte-level characters, or SentencePiece text (`▁` = space).
    """
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return text.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    if all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return piece.replace("▁", " ").encode()


def token_text(raw: bytes) -> str:
    """A token's bytes as text: UTF-8 where valid, `\\xNN` escapes for the bytes of a partial character."""
    return raw.decode("utf-8", errors="backslashreplace")
