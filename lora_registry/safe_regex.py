"""A restricted regular-expression language for user patterns in adapter configs (`target_modules`,
`exclude_modules`, `rank_pattern` / `alpha_pattern` keys), checked before any pattern is run.

PEFT lets these be Python regexes, and Python's backtracking matcher can take exponential time on
patterns like `(a+)+$` while holding the GIL (the whole server stalls). The patterns a module name
needs are simple, so only those are accepted; the others are refused with the reason, never run:

- at most `MAX_PATTERN_CHARS` characters;
- no backreferences, lookarounds or conditionals;
- a quantifier (`*`, `+`, `{m,n}`) applies to one character or character class only (`.*`, `\\d+`,
  `[a-z]{1,3}`); a group may only be made optional (`(q|k)?`, `(.*\\.)?`): no quantified groups;
- at most `MAX_UNBOUNDED` unbounded quantifiers (`*`, `+`, `{m,}`, or a bound above `BIG_BOUND`).

Matching such a pattern against a module name of n characters takes at most about n^MAX_UNBOUNDED
steps, i.e. microseconds for the names of a model.
"""

from __future__ import annotations

import re
import re._constants as sre_c  # the standard library's own regex parser (used, not reimplemented)
import re._parser as sre_p
from typing import Any

MAX_PATTERN_CHARS = 256
MAX_UNBOUNDED = 3
BIG_BOUND = 16

_SINGLE = {sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN, sre_c.CATEGORY}
_REPEATS = {sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", sre_c.MAX_REPEAT)}
_REFUSED = {
    sre_c.GROUPREF: "backreferences",
    sre_c.GROUPREF_EXISTS: "conditional groups",
    sre_c.ASSERT: "lookarounds",
    sre_c.ASSERT_NOT: "lookarounds",
}


class UnsafePattern(ValueError):
    """The pattern is outside the restricted language (the message says why)."""


def check_pattern(pattern: str) -> None:
    """Return if `pattern` is in the restricted language, else raise `UnsafePattern`."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise UnsafePattern(f"{len(pattern)} characters (at most {MAX_PATTERN_CHARS})")
    try:
        parsed = sre_p.parse(pattern)
    except re.error as exc:
        raise UnsafePattern(f"invalid regex ({exc})") from exc
    unbounded = _walk(list(parsed))
    if unbounded > MAX_UNBOUNDED:
        raise UnsafePattern(f"{unbounded} unbounded quantifiers (at most {MAX_UNBOUNDED})")


def _walk(items: list[tuple[Any, Any]]) -> int:
    """Check a parsed (sub)pattern; return its number of unbounded quantifiers."""
    unbounded = 0
    for op, arg in items:
        if op in _REFUSED:
            raise UnsafePattern(f"{_REFUSED[op]} are not allowed")
        if op in _REPEATS:
            _low, high, body = arg
            body = list(body)
            big = high is sre_c.MAXREPEAT or high > BIG_BOUND
            if len(body) == 1 and body[0][0] in _SINGLE:
                unbounded += int(big)
            elif high <= 1:  # an optional group: matched once or not at all
                unbounded += _walk(body)
            else:
                raise UnsafePattern("a quantifier may only follow a single character or class, e.g. '.*'")
        elif op == sre_c.SUBPATTERN:
            unbounded += _walk(list(arg[-1]))
        elif op == sre_c.BRANCH:
            unbounded += sum(_walk(list(branch)) for branch in arg[1])
        elif op == getattr(sre_c, "ATOMIC_GROUP", None):
            unbounded += _walk(list(arg))
    return unbounded
