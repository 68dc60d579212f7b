"""Token repack: copy KV entries from source slots to destination slots in every layer.

A slot is the global index ``block_id * block_size + offset``. ``src_slots`` and
``dst_slots`` are int64 tensors of equal length; no destination may also be a source
(the repack planner guarantees it: destinations are holes, sources are live), and no
destination may appear twice. Every path copies all layers, K and V, in one call.

Backends (``repack(..., backend=...)``; ``None`` picks the first that applies):

    triton   CUDA caches, bhnc or cpu_attn layout; one launch for all layers
    cpu      CPU caches, bhnc or cpu_attn layout; ``csrc/repack.c`` via ctypes (``repack_cpu``)

Caches may have any strides (vLLM 0.32's ``KVCacheLayout`` views, fp8 caches stored as
``uint8``: bytes are copied), but every layer must share one geometry (shape, strides,
dtype, device), as vLLM's per-layer views of one buffer do.
    torch    anything, including cpu_attn_amx: ``reference_repack``
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import torch

from kernels.layout import KVLayout, same_geometry
from kernels.repack_cpu import cpu_repack, load_library
from kernels.slot_checks import slot_problem_numpy, slot_problem_torch


class RepackBackend(StrEnum):
    TRITON = "triton"
    CPU = "cpu"
    TORCH = "torch"


def reference_repack(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layout: KVLayout,
) -> None:
    """Plain-torch reference: ``cache[dst] = cache[src]`` for K and V of every layer, in place.

    Reads every source before writing any destination, so it is exact for any layout
    (``layout.gather``/``scatter`` address each element through ``element_offsets``).
    """
    if src_slots.numel() == 0:
        return
    for cache in kv_caches:
        layout.scatter(cache, dst_slots, layout.gather(cache, src_slots))


def check_repack_args(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layout: KVLayout,
    *,
    slot_values: bool = True,
) -> None:
    """Raise ``ValueError`` unless the caches and slots are a valid repack.

    Caches: non-empty, of ``layout``, one geometry (shape, strides, dtype, device). Slots: 1-D
    int64 of equal length on the caches' device, and (``slot_values``) within the cache, no
    destination repeated or also a source (sources are read while destinations are written).
    """
    if not kv_caches:
        raise ValueError("repack needs at least one layer cache")
    first = kv_caches[0]
    layout.check_cache(first)
    for cache in kv_caches:  # one cheap test per layer (it runs every decode step)
        if same_geometry(cache, first):
            continue
        if cache.device != first.device:
            raise ValueError(f"layer caches on {cache.device} and {first.device}")
        raise ValueError(
            f"layer caches differ: {tuple(cache.shape)} {cache.stride()} {cache.dtype} vs "
            f"{tuple(first.shape)} {first.stride()} {first.dtype}"
        )
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if slots.dim() != 1 or slots.dtype != torch.int64:
            raise ValueError(f"{name} must be 1-D int64, got {slots.dtype} {tuple(slots.shape)}")
        if slots.device != first.device:
            raise ValueError(f"{name} on {slots.device}, caches on {first.device}")
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(f"{src_slots.numel()} sources but {dst_slots.numel()} destinations")
    if slot_values and src_slots.numel():
        _check_slot_values(first, src_slots, dst_slots, layout)


def _check_slot_values(
    cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, layout: KVLayout
) -> None:
    num_slots = _num_slots(cache, layout)
    if cache.device.type == "cpu":
        problem = slot_problem_numpy(src_slots.numpy(), dst_slots.numpy(), num_slots)
    else:
        problem = slot_problem_torch(src_slots, dst_slots, num_slots)
    if problem is not None:
        raise ValueError(problem.message(num_slots))


def _num_slots(cache: torch.Tensor, layout: KVLayout) -> int:
    return layout.num_blocks(cache) * layout.block_size(cache)


def pick_backend(cache: torch.Tensor, layout: KVLayout) -> RepackBackend:
    """The fastest backend for ``cache``'s device and ``layout``."""
    if layout is KVLayout.CPU_ATTN_AMX:
        return RepackBackend.TORCH
    if cache.device.type == "cuda":
        return RepackBackend.TRITON
    if cache.device.type == "cpu":
        return RepackBackend.CPU if load_library() is not None else RepackBackend.TORCH
    return RepackBackend.TORCH


def repack(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layout: KVLayout,
    *,
    check: bool = True,
    backend: RepackBackend | None = None,
) -> None:
    """Move tokens ``src_slots[i] -> dst_slots[i]`` in every layer, K and V, in place.

    ``kv_caches``: per-layer tensors of ``layout``. ``check=False`` skips the argument
    checks (on CUDA they synchronise the stream: check the moves on the host first, as
    ``kernels.async_repack`` does). On CUDA the copy is queued on the current stream.
    """
    if check:  # the slot values are checked by the backend's path below
        check_repack_args(kv_caches, src_slots, dst_slots, layout, slot_values=False)
    if src_slots.numel() == 0:
        return
    chosen = backend or pick_backend(kv_caches[0], layout)
    first = kv_caches[0]
    if check and chosen is not RepackBackend.CPU:
        _check_slot_values(first, src_slots, dst_slots, layout)
    if chosen is RepackBackend.TORCH:
        reference_repack(kv_caches, src_slots, dst_slots, layout)
        return
    parts = layout.part_strides(first)
    runs = layout.copy_runs(first)
    if parts is None or runs is None:
        raise ValueError(f"backend {chosen.value} does not handle layout {layout.value}")
    sizes = (layout.block_size(first), layout.num_kv_heads(first), layout.head_dim(first))
    if chosen is RepackBackend.TRITON:
        from kernels._repack_triton import triton_repack

        triton_repack(kv_caches, src_slots.contiguous(), dst_slots.contiguous(), *runs, *sizes[:2])
        return
    if first.device.type != "cpu":
        raise ValueError(f"backend cpu needs CPU caches, got {first.device}")
    # The C loop checks the slot values itself (microseconds, against tens through numpy).
    num_slots = _num_slots(first, layout) if check else None
    src, dst = src_slots.contiguous(), dst_slots.contiguous()
    if load_library() is not None:
        try:
            cpu_repack(kv_caches, src, dst, parts, *sizes, num_slots=num_slots)
            return
        except MemoryError:
            pass  # out of memory before its check, nothing copied: the torch path below
    if check:
        _check_slot_values(first, src_slots, dst_slots, layout)
    reference_repack(kv_caches, src_slots, dst_slots, layout)
