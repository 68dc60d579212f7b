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

It zero-fills the whole destination lines: run the repack again before checking values.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from kernels._repack_cpu import _Library

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

void vtoken_floor(char **layers, int64_t num_layers, const int64_t *partial,
                  int64_t num_partial, const int64_t *whole, int64_t num_whole,
                  const int64_t *reads, int64_t num_reads, int64_t ahead, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads((int)threads) if (threads > 1)
#endif
    for (int64_t l = 0; l < num_layers; ++l) {
        char *base = layers[l];
        for (int64_t i = 0; i < num_partial; ++i) {
            if (i + ahead < num_partial) __builtin_prefetch(base + partial[i + ahead], 0, 0);
            volatile char *p = base + partial[i];
            *p = *p;
        }
        for (int64_t i = 0; i < num_whole; ++i) {
#if defined(__x86_64__)
            __m128i *p = (__m128i *)(base + whole[i]);
            const __m128i zero = _mm_setzero_si128();
            for (int k = 0; k < 4; ++k) _mm_stream_si128(p + k, zero);
#else
            memset(base + whole[i], 0, 64);
#endif
        }
        for (int64_t i = 0; i < num_reads; ++i) {
            if (i + ahead < num_reads) __builtin_prefetch(base + reads[i + ahead], 0, 0);
            (void)*(volatile const char *)(base + reads[i]);
        }
#if defined(__x86_64__)
        _mm_sfence();
#endif
    }
}
"""


@functools.lru_cache(maxsize=1)
def _library() -> _Library | None:
    from kernels._repack_cpu import compile_library

    library = compile_library(_SOURCE, "floor")
    if library is not None:
        function = library.handle.vtoken_floor
        function.restype = None
        # layers, then (offsets, count) of partial, whole and read lines, distance, threads
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 4
        function.argtypes += [ctypes.c_int64, ctypes.c_int64]
    return library


def _prefetch_lines() -> int:
    """The repack's prefetch distance (``PREFETCH_LINES`` of its C source)."""
    from kernels._repack_cpu import _SOURCE as repack_source

    found = re.search(r"#define PREFETCH_LINES (\d+)", repack_source)
    assert found is not None, "the repack source defines PREFETCH_LINES"
    return int(found.group(1))


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
        library = _library()
        if library is None:
            return None
        if not library.threads:
            threads = 1
        layers = (ctypes.c_void_p * len(caches))(*(cache.data_ptr() for cache in caches))
        kinds = (self.partial, self.whole, self.reads)
        arrays = [np.ascontiguousarray(kind, dtype=np.int64) for kind in kinds]
        ahead = _prefetch_lines()
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
