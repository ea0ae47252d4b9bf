"""Integer helpers every layer shares (a leaf: imports nothing from the package)."""
from __future__ import annotations


def cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` for integers, ``d > 0``: e.g. the pages that hold ``n`` tokens."""
    return -(-n // d)


def next_pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two ``>= n`` and ``>= lo`` (``lo`` a power of two): tile and
    bucket sizes."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())
