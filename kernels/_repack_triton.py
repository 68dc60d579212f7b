"""Triton repack kernel: one launch moves every (src, dst) slot pair in every layer, K and V.

Layers are separate tensors; the launcher passes the first layer's pointer and each
layer's element offset from it (``layer_offsets``), so one grid covers all layers without
a pointer table. Grid: ``(cdiv(num_moves, BLOCK_M), num_layers, 2 * kv_heads)``; a program
copies a ``[BLOCK_M, head_dim]`` tile of one head of K or V. In the flash layout a tile
row is contiguous (coalesced loads); in cpu_attn the K tile is strided (only run under
the interpreter, for tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.layout import PartStrides


@triton.jit
def _repack_kernel(
    cache_ptr,  # first layer's cache, any dtype
    layer_offsets_ptr,  # [num_layers] int64: element offset of each layer from cache_ptr
    src_slots_ptr,  # [num_moves] int64
    dst_slots_ptr,  # [num_moves] int64
    num_moves,
    block_size,
    k_base,
    k_block_stride,
    k_offset_stride,
    k_head_stride,
    k_dim_stride,
    v_base,
    v_block_stride,
    v_offset_stride,
    v_head_stride,
    v_dim_stride,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    move_tile = tl.program_id(0)
    layer = tl.program_id(1)
    part = tl.program_id(2) // KV_HEADS  # 0: keys, 1: values
    head = tl.program_id(2) % KV_HEADS
    is_key = part == 0
    base = tl.where(is_key, k_base, v_base)
    block_stride = tl.where(is_key, k_block_stride, v_block_stride)
    offset_stride = tl.where(is_key, k_offset_stride, v_offset_stride)
    head_stride = tl.where(is_key, k_head_stride, v_head_stride)
    dim_stride = tl.where(is_key, k_dim_stride, v_dim_stride)

    moves = move_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    move_mask = moves < num_moves
    src = tl.load(src_slots_ptr + moves, mask=move_mask, other=0)
    dst = tl.load(dst_slots_ptr + moves, mask=move_mask, other=0)
    layer_offset = tl.load(layer_offsets_ptr + layer) + base + head * head_stride
    src_rows = (
        layer_offset + (src // block_size) * block_stride + (src % block_size) * offset_stride
    )
    dst_rows = (
        layer_offset + (dst // block_size) * block_stride + (dst % block_size) * offset_stride
    )
    dims = tl.arange(0, BLOCK_D)
    mask = move_mask[:, None] & (dims < HEAD_DIM)[None, :]
    columns = (dims * dim_stride)[None, :]
    values = tl.load(cache_ptr + src_rows[:, None] + columns, mask=mask)
    tl.store(cache_ptr + dst_rows[:, None] + columns, values, mask=mask)


def triton_repack(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    parts: tuple[PartStrides, PartStrides],
    block_size: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    """Launch ``_repack_kernel`` once. Caches: one dtype and device, contiguous, checked by
    ``repack``; slots: contiguous int64 ``[num_moves]`` on the caches' device."""
    first = kv_caches[0]
    elem_size = first.element_size()
    byte_offsets = [cache.data_ptr() - first.data_ptr() for cache in kv_caches]
    if any(offset % elem_size for offset in byte_offsets):
        raise ValueError("layer caches are not element-aligned to each other")
    layer_offsets = torch.tensor(
        [offset // elem_size for offset in byte_offsets], dtype=torch.int64
    ).to(first.device, non_blocking=True)
    num_moves = src_slots.numel()
    # 32 moves x head_dim per program: 8 KB per bf16 tile at head_dim 128, enough loads in
    # flight per SM without many idle lanes for the <= 16-move trickle pattern.
    block_m = 32
    grid = (triton.cdiv(num_moves, block_m), len(kv_caches), 2 * kv_heads)
    keys, values = parts
    _repack_kernel[grid](
        first,
        layer_offsets,
        src_slots,
        dst_slots,
        num_moves,
        block_size,
        keys.base,
        keys.block_stride,
        keys.offset_stride,
        keys.head_stride,
        keys.dim_stride,
        values.base,
        values.block_stride,
        values.offset_stride,
        values.head_stride,
        values.dim_stride,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
