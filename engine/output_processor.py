"""The one output path: token ids -> text, stop strings, streaming hold-back, n choices.

`SequenceText` follows one sequence: each token id is detokenized incrementally, the earliest stop string
ending in the new text cuts the text there and ends the sequence, and `releasable()` gives the text that
may be streamed now (all of it once finished, else all but a suffix that could still grow into a stop
string). `LLMEngine` (for `LLM`) and the API server's `Generation` both use it, one per choice.
"""

from __future__ import annotations

from typing import Any

from engine.tokenizer import IncrementalDetokenizer


class SequenceText:
    def __init__(self, tokenizer: Any | None, stops: list[str], min_tokens: int = 0) -> None:
        """`min_tokens`: stop strings are looked for only in the text of tokens after the first
        `min_tokens` (vLLM's rule), as EOS and stop token ids cannot be sampled before then."""
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = stops
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.text = ""
        self.emitted = 0  # characters of `text` already released
        self.stop_hit: str | None = None  # the stop string that ended the sequence

    @property
    def stopped(self) -> bool:
        return self.stop_hit is not None

    def push(self, token_id: int, check_stops: bool = True) -> str | None:
        """Append one token's text; returns the stop string it completed (text cut before it), else None.
        Tokens after a stop are ignored; `check_stops=False` appends without looking for stop strings
        (the sequence already ended for another reason)."""
        if self.detok is None or self.stopped:
            return None
        self.num_tokens += 1
        piece = self.detok.push(token_id)
        if not piece:
            return None
        self.text += piece
        if not self.stops or not check_stops or self.num_tokens <= self.min_tokens:
            return None
        hit = find_stop(self.text, len(piece), self.stops)
        if hit is None:
            return None
        self.text = self.text[: hit[0]]
        self.stop_hit = hit[1]
        return hit[1]

    def accept(self, token_id: int, engine_finish: str | None) -> str | None:
        """Append a token the engine produced; return the sequence's finish reason after it.

        `engine_finish` is what the engine decided for this token: "stop" (EOS or a stop token id),
        "length" (max_tokens or the context) or None (still running). The one rule, for `LLM` and the
        server alike: a stop string completed by the token's text ends the sequence with "stop", also
        over "length"; the text of a stop token is appended but not searched for stop strings.
        """
        if self.stopped:
            return "stop"
        hit = self.push(token_id, check_stops=engine_finish != "stop")
        return "stop" if hit is not None else engine_finish

    def releasable(self, finished: bool) -> str:
        """Text not released before that can be released now (a possible stop-string prefix is held back
        until the sequence finishes or the prefix stops matching)."""
        end = (
            len(self.text) if finished or self.stopped else len(self.text) - held_back(self.text, self.stops)
        )
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters: (its start, the string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        idx = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
