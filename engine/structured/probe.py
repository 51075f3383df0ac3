"""A bounded dry run of a freshly compiled grammar, so what llguidance refuses only while decoding (a
row over its item limit, a grammar that admits no output at all) is refused before a request runs.

llguidance builds its lexer and parser rows lazily: compiling succeeds, and the error (e.g. "Current row
has 10007 items; max is 2000" for an object with thousands of optional properties, or no allowed token
at all for `{"$ref": "#"}`) only shows at the first masks. `probe` computes the masks of the first few
states (the start, then up to `BRANCH` allowed tokens per state, `MAX_MASKS` masks in all) on copies of
the template. It also warms the template: the lexer states built here are shared by its copies, so the
first step of a constrained sequence does not pay for them inside the engine's batch.
"""

from __future__ import annotations

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from engine.structured.spec import StructuredSpecError

MAX_MASKS = 24  # masks computed per probe (each bounded by llguidance's own per-step fuel)
BRANCH = 3  # allowed tokens followed from each state


def probe(template: llguidance.LLMatcher, vocab_size: int, kind: str) -> None:
    """`StructuredSpecError` if a matcher of `template` fails within its first few tokens, or allows
    no token at the start. `vocab_size`: llguidance's tokenizer vocabulary."""
    bitmask = allocate_token_bitmask(1, vocab_size)
    frontier = [template.deep_copy()]
    masks = 0
    first = True
    while frontier and masks < MAX_MASKS:
        matcher = frontier.pop(0)
        fill_next_token_bitmask(matcher, bitmask, 0)
        masks += 1
        if matcher.is_error():
            raise StructuredSpecError(_reason(kind, matcher.get_error(), first))
        allowed = _allowed(bitmask[0], vocab_size)
        if first and allowed.size == 0 and not matcher.is_accepting():
            raise StructuredSpecError(f"unsupported {kind}: no output can match it")
        first = False
        for token in _spread(allowed):
            child = matcher.deep_copy()
            if not child.consume_token(int(token)) or child.is_error():
                raise StructuredSpecError(_reason(kind, child.get_error(), False))
            if not child.is_stopped():
                frontier.append(child)


def _allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def _spread(allowed: np.ndarray) -> list[int]:
    """Up to `BRANCH` of the allowed ids, spread over the allowed set (first, middle, last)."""
    if allowed.size <= BRANCH:
        return [int(t) for t in allowed]
    picks = np.linspace(0, allowed.size - 1, BRANCH).round().astype(int)
    return sorted({int(allowed[i]) for i in picks})


def _reason(kind: str, error: str, at_start: bool) -> str:
    """llguidance's error in one line (its parser-state dump left out)."""
    line = (error or "invalid").strip().splitlines()[0].strip()
    if at_start and "NoExtensionBias" in line:
        return f"unsupported {kind}: no output can match it (e.g. a $ref that refers only to itself)"
    return f"unsupported {kind}: {line}"
