"""CPU repack: the C loop of ``kernels/csrc/repack.c``, called through ctypes.

Why C, and how the loop orders its copies, is written at the top of the C file. This module
loads it (``kernels.cbuild``: compiled once per machine, with OpenMP on torch's own pool
where that is possible), picks the thread count, and turns the loop's status into Python:
the number of threads that ran, or an exception, in which case nothing was copied.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from typing import NoReturn

import torch

from kernels.cbuild import CLibrary, compile_library
from kernels.layout import PartStrides
from kernels.slot_checks import SlotProblem

# Moved bytes per thread at least. On torch's pool the team is already running, so splitting
# is cheap: on the 2-core development VM two threads beat one from a single moved token
# (22 KiB over 30 layers) up, taking 11-34% less time cold and 23-48% less warm. One moved
# token of a small model is about this much.
_MIN_BYTES_PER_THREAD = 8 << 10


def default_threads(moved_bytes: int) -> int:
    """Threads for a repack of ``moved_bytes``: ``VTOKEN_REPACK_THREADS`` if set, else torch's
    intra-op thread count (the same pool, see ``kernels.cbuild``), one per 8 KiB moved.

    Only a library built with OpenMP uses more than one (``uses_openmp``).
    """
    forced = os.environ.get("VTOKEN_REPACK_THREADS")
    if forced:
        return max(1, int(forced))
    by_size = max(1, moved_bytes // _MIN_BYTES_PER_THREAD)
    return max(1, min(torch.get_num_threads(), by_size))


@functools.lru_cache(maxsize=1)
def load_library() -> CLibrary | None:
    """The repack library with its prototypes set, built on first use; ``None`` without a
    working C compiler (the dispatcher then uses torch)."""
    library = compile_library("repack")
    if library is None:
        return None
    handle = library.handle
    handle.vtoken_repack.restype = ctypes.c_int
    handle.vtoken_repack.argtypes = [
        *(ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p),  # layers, moves
        *[ctypes.c_int64] * 5,  # num_moves, block_size, kv_heads, head_dim, elem_size
        ctypes.c_void_p,  # parts
        *[ctypes.c_int64] * 3,  # num_threads, options, num_slots
    ]
    handle.vtoken_repack_prefetch_lines.restype = ctypes.c_int64
    handle.vtoken_repack_prefetch_lines.argtypes = []
    handle.vtoken_repack_status_name.restype = ctypes.c_char_p
    handle.vtoken_repack_status_name.argtypes = [ctypes.c_int]
    return library


def uses_openmp() -> bool:
    """Whether the loaded library splits layers over torch's OpenMP pool."""
    library = load_library()
    return library is not None and library.threads


def prefetch_lines() -> int | None:
    """How far the C loop's prefetch cursor runs ahead of its copy, in 64-byte lines
    (``PREFETCH_LINES`` of the C file); ``None`` without the library."""
    library = load_library()
    return None if library is None else int(library.handle.vtoken_repack_prefetch_lines())


def cpu_repack(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    parts: tuple[PartStrides, PartStrides],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    num_threads: int | None = None,
    simd: bool = True,
    prefetch: bool = True,
    num_slots: int | None = None,
) -> int:
    """Move slots in every layer with the C loop; returns the number of threads that ran.

    ``src_slots``/``dst_slots``: contiguous int64 CPU ``[num_moves]``; caches: contiguous,
    one dtype, checked by the caller. ``num_slots`` given: the C loop first checks the moves
    as ``kernels.check_repack_args`` does and raises ``ValueError`` (``SlotProblem``'s
    message). ``MemoryError`` when the loop runs out of memory; ``RuntimeError`` without the
    library (``load_library`` is ``None``). Nothing is copied when it raises.
    """
    library = load_library()
    if library is None:
        raise RuntimeError("the CPU repack library could not be built (no working C compiler)")
    num_moves = src_slots.numel()
    elem_size = kv_caches[0].element_size()
    moved_bytes = num_moves * len(kv_caches) * 2 * kv_heads * head_dim * elem_size
    if num_threads is None:
        num_threads = default_threads(moved_bytes)
    if not library.threads:
        num_threads = 1
    pointers = (ctypes.c_void_p * len(kv_caches))(*(c.data_ptr() for c in kv_caches))
    packed = (ctypes.c_int64 * 10)(
        *(
            value
            for p in parts
            for value in (p.base, p.block_stride, p.offset_stride, p.head_stride, p.dim_stride)
        )
    )
    status = library.handle.vtoken_repack(
        pointers,
        len(kv_caches),
        src_slots.data_ptr(),
        dst_slots.data_ptr(),
        num_moves,
        block_size,
        kv_heads,
        head_dim,
        elem_size,
        packed,
        num_threads,
        (0 if simd else 1) | (0 if prefetch else 2),
        -1 if num_slots is None else num_slots,
    )
    if status >= 1:
        return status
    _raise_status(library, status, num_moves, num_slots)


def _raise_status(
    library: CLibrary, status: int, num_moves: int, num_slots: int | None
) -> NoReturn:
    """The C loop's failure ``status`` (below 1, named by the library) as an exception:
    ``MemoryError`` when it ran out of memory, else ``ValueError`` with the slot problem's
    message (reported only when ``num_slots`` was given)."""
    name = library.handle.vtoken_repack_status_name(status)
    assert name is not None, f"vtoken_repack returned {status}"
    if name == b"out_of_memory":
        raise MemoryError(f"the CPU repack ran out of memory planning {num_moves} moves")
    assert num_slots is not None, f"slot problem {name!r} reported without num_slots"
    raise ValueError(SlotProblem(name.decode()).message(num_slots))
