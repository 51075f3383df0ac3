"""Integer helpers for sizing grids, pages and blocks (the one home of `cdiv` and `next_pow2`)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: the number of size-`b` pieces that cover `a` items."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()
