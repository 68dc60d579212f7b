"""Kernels that vToken runs on the KV cache, each beside a plain-torch reference."""

from kernels.layout import KVLayout
from kernels.repack import reference_repack, repack

__all__ = ["KVLayout", "reference_repack", "repack"]
