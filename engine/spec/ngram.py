"""Prompt lookup: propose what followed the longest earlier occurrence of the sequence's last n-gram.

For n from `max_n` down to `min_n`, the last n tokens of prompt + output are searched for among the
earlier tokens; at the first (earliest) occurrence found, the up to `k` tokens that followed it are the
proposal. No model runs. Strong where output copies input: extraction, editing, code, echo tasks.
"""

from __future__ import annotations

import numpy as np

from engine.sequence import Sequence


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the earliest earlier occurrence of the longest suffix n-gram.

    tokens [L] int64. A match must end before the last token (the suffix itself does not count)."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # candidate starts i with tokens[i:i+n] == suffix and i + n < length (followed by a token)
        limit = length - n
        cand = np.flatnonzero(tokens[:limit] == suffix[0])
        for j in range(1, n):
            if cand.size == 0:
                break
            cand = cand[tokens[cand + j] == suffix[j]]
        if cand.size:
            start = int(cand[0]) + n
            return tokens[start : min(start + k, length)].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            tokens = np.asarray(seq.all_token_ids, dtype=np.int64)
            out.append(lookup(tokens, k, self.min_n, self.max_n))
        return out

    def retain(self, alive: set[str]) -> None:
        return None  # no per-sequence state
