"""The memory floor of a CPU repack: the least memory work its moves need, timed.

A repack must load every cache line that holds a byte it moves, rewrite every line it
changes in part (a line of transposed K takes 2-4 bytes per moved token: the line is read
for ownership, then written back) and write the lines it overwrites whole (V rows of whole,
aligned lines, which the CPU path streams; rarely a K line whose every token moves, which
the repack still reads first). The floor does exactly that and nothing else:
one byte rewritten per partly-changed line, a streamed zero line per whole line, one load
per read line, each kind in address order, prefetched as the repack prefetches (as far
ahead, non-temporal hint) and split over the same threads by layer. ``floor_ms /
repack_ms`` near 1 means the repack is bound by the traffic its move pattern causes in
this layout, not by how it copies.

Its C loop is ``kernels/csrc/memory_floor.c``, built like the repack's (``kernels.cbuild``).
It zero-fills the whole destination lines: run the repack again before checking values.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from kernels.cbuild import CLibrary


@functools.lru_cache(maxsize=1)
def _library() -> CLibrary | None:
    """The floor's C loop (``kernels/csrc/memory_floor.c``), built as the repack is."""
    from kernels.cbuild import compile_library

    library = compile_library("memory_floor")
    if library is not None:
        function = library.handle.vtoken_floor
        function.restype = None
        # layers, then (offsets, count) of partial, whole and read lines, distance, threads
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 4
        function.argtypes += [ctypes.c_int64, ctypes.c_int64]
    return library


@dataclass(frozen=True)
class MemoryFloor:
    """Byte offsets (from a layer's base, the same in every layer) of the lines a repack
    rewrites in part, overwrites whole, and only reads."""

    partial: np.ndarray
    whole: np.ndarray
    reads: np.ndarray

    def traffic_bytes(self, num_layers: int) -> int:
        """DRAM bytes: partial lines in and out, whole lines out, read lines in."""
        lines = 2 * self.partial.size + self.whole.size + self.reads.size
        return 64 * lines * num_layers

    def runner(self, caches: Sequence[torch.Tensor], threads: int) -> Callable[[], None] | None:
        """A call that touches these lines in every layer; ``None`` without a C compiler."""
        from kernels.repack_cpu import prefetch_lines

        library, ahead = _library(), prefetch_lines()
        if library is None or ahead is None:
            return None
        if not library.threads:
            threads = 1
        layers = (ctypes.c_void_p * len(caches))(*(cache.data_ptr() for cache in caches))
        kinds = (self.partial, self.whole, self.reads)
        arrays = [np.ascontiguousarray(kind, dtype=np.int64) for kind in kinds]
        function = library.handle.vtoken_floor

        def run() -> None:
            args: list[Any] = [layers, len(caches)]
            for array in arrays:
                args += [array.ctypes.data, array.size]
            function(*args, ahead, threads)

        return run


def plan(
    caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, layout: Any
) -> MemoryFloor | None:
    """The lines moving ``src`` -> ``dst`` touches; ``None`` for layouts without affine
    strides (AMX packing)."""
    parts = layout.part_strides(caches[0])
    if parts is None:
        return None
    cache = caches[0]
    block_size, element = layout.block_size(cache), cache.element_size()
    heads = np.arange(layout.num_kv_heads(cache)).reshape(1, -1, 1)
    dims = np.arange(layout.head_dim(cache)).reshape(1, 1, -1)

    def element_bytes(slots: torch.Tensor) -> np.ndarray:
        values = slots.cpu().numpy().astype(np.int64)
        blocks, within = values // block_size, values % block_size
        offsets = []
        for part in parts:
            start = part.base + blocks * part.block_stride + within * part.offset_stride
            elements = start.reshape(-1, 1, 1) + heads * part.head_stride
            offsets.append((elements + dims * part.dim_stride).ravel() * element)
        return np.concatenate(offsets)

    written, counts = np.unique(element_bytes(dst) // 64, return_counts=True)
    aligned = all(cache.data_ptr() % 64 == 0 for cache in caches)
    full = counts * element == 64 if aligned else np.zeros(written.size, dtype=bool)
    read = np.setdiff1d(np.unique(element_bytes(src) // 64), written)
    return MemoryFloor(partial=written[~full] * 64, whole=written[full] * 64, reads=read * 64)
