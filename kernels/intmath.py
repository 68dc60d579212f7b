"""Integer helpers shared by every package that counts blocks (kernels imports nothing of
ours, so everything above may use them)."""

from __future__ import annotations


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` in exact integer arithmetic (``denominator > 0``):
    the number of ``denominator``-token blocks that hold ``numerator`` tokens."""
    return -(-numerator // denominator)
