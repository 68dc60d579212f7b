"""Triton repack kernel: one launch moves every (src, dst) slot pair in every layer.

Layers are separate views of one buffer in vLLM (or separate tensors); the launcher passes
the first layer's pointer and each layer's element offset from it (``layer_offsets``), so
one grid covers all layers without a pointer table. A token of one head is one or two
"runs" of ``WIDTH`` elements (``KVLayout.copy_runs``): in vLLM 0.32's GPU layout K and V sit
side by side, one run of ``2 * head_dim``; in ``cpu_attn`` K and V are two runs of
``head_dim`` (K strided: only run under the interpreter, for tests).

Grid: ``(cdiv(num_moves, BLOCK_M), num_layers, num_runs * kv_heads)``; a program copies a
``[BLOCK_M, WIDTH]`` tile. Strides are runtime integers: Triton specialises a stride of 1
and multiples of 16, so a contiguous run becomes vector loads and stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.layout import PartStrides, vector_alignment


@triton.jit
def _repack_kernel(
    cache_ptr,  # first layer's cache, any dtype
    layer_offsets_ptr,  # [num_layers] int64: element offset of each layer from cache_ptr
    src_slots_ptr,  # [num_moves] int64
    dst_slots_ptr,  # [num_moves] int64
    num_moves,
    block_size,
    base_0,
    offset_stride_0,
    dim_stride_0,
    base_1,
    offset_stride_1,
    dim_stride_1,
    block_stride,
    head_stride,
    KV_HEADS: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALIGN: tl.constexpr,
):
    move_tile = tl.program_id(0)
    layer = tl.program_id(1)
    run = tl.program_id(2) // KV_HEADS
    head = tl.program_id(2) % KV_HEADS
    base = tl.where(run == 0, base_0, base_1)
    offset_stride = tl.where(run == 0, offset_stride_0, offset_stride_1)
    dim_stride = tl.where(run == 0, dim_stride_0, dim_stride_1)

    moves = move_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    move_mask = moves < num_moves
    src = tl.load(src_slots_ptr + moves, mask=move_mask, other=0)
    dst = tl.load(dst_slots_ptr + moves, mask=move_mask, other=0)
    start = tl.load(layer_offsets_ptr + layer) + base + head * head_stride
    src_rows = start + (src // block_size) * block_stride + (src % block_size) * offset_stride
    dst_rows = start + (dst // block_size) * block_stride + (dst % block_size) * offset_stride
    # Row starts are data-dependent: promise their alignment, or loads stay scalar.
    src_rows = tl.multiple_of(src_rows, ALIGN)
    dst_rows = tl.multiple_of(dst_rows, ALIGN)
    columns = tl.arange(0, BLOCK_W)
    mask = move_mask[:, None] & (columns < WIDTH)[None, :]
    columns = (columns * dim_stride)[None, :]
    values = tl.load(cache_ptr + src_rows[:, None] + columns, mask=mask)
    tl.store(cache_ptr + dst_rows[:, None] + columns, values, mask=mask)


@dataclass(frozen=True, slots=True)
class RepackLaunch:
    """Everything of a launch but the slots, for one set of layer caches: worked out once
    (an engine's caches never move), so a step's repack costs the host one kernel launch.
    ``layer_offsets``: each layer's element offset from the first, on the device. It holds
    no cache tensor: a plan outliving its engine must not keep the engine's KV pool (every
    layer a view of one buffer) allocated."""

    layer_offsets: torch.Tensor
    runs: tuple[PartStrides, ...]
    width: int
    block_size: int
    kv_heads: int
    block_m: int
    block_w: int
    align: int

    @classmethod
    def plan(
        cls,
        kv_caches: Sequence[torch.Tensor],
        runs: tuple[PartStrides, ...],
        width: int,
        block_size: int,
        kv_heads: int,
    ) -> RepackLaunch:
        if not 1 <= len(runs) <= 2 or any(
            (r.block_stride, r.head_stride) != (runs[0].block_stride, runs[0].head_stride)
            for r in runs
        ):
            raise ValueError("the Triton repack copies one or two runs with one block/head stride")
        first = kv_caches[0]
        elem_size = first.element_size()
        byte_offsets = [cache.data_ptr() - first.data_ptr() for cache in kv_caches]
        if any(offset % elem_size for offset in byte_offsets):
            raise ValueError("layer caches are not element-aligned to each other")
        offsets = torch.tensor([offset // elem_size for offset in byte_offsets], dtype=torch.int64)
        block_w = triton.next_power_of_2(width)
        same_dim_stride = all(run.dim_stride == runs[0].dim_stride for run in runs)
        align = vector_alignment(
            kv_caches,
            [runs[0].block_stride, runs[0].head_stride]
            + [value for run in runs for value in (run.base, run.offset_stride)],
            runs[0].dim_stride if same_dim_stride else 0,
        )
        return cls(
            layer_offsets=offsets.to(first.device),
            runs=runs,
            width=width,
            block_size=block_size,
            kv_heads=kv_heads,
            # About 16 KB per tile (32 moves of a 2 x 128 bf16 run): loads enough in flight
            # per SM without many idle lanes for the <= 16-move trickle pattern.
            block_m=max(16, min(64, 8192 // block_w)),
            block_w=block_w,
            align=align,
        )

    def __call__(
        self, first: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> None:
        """Launch ``_repack_kernel`` once for every layer (``first``: the planned set's
        first layer cache): contiguous int64 slots on the caches' device (not checked)."""
        num_moves = src_slots.numel()
        first_run, last_run = self.runs[0], self.runs[-1]
        grid = (
            triton.cdiv(num_moves, self.block_m),
            self.layer_offsets.numel(),
            len(self.runs) * self.kv_heads,
        )
        _repack_kernel[grid](
            first,
            self.layer_offsets,
            src_slots,
            dst_slots,
            num_moves,
            self.block_size,
            first_run.base,
            first_run.offset_stride,
            first_run.dim_stride,
            last_run.base,
            last_run.offset_stride,
            last_run.dim_stride,
            first_run.block_stride,
            first_run.head_stride,
            KV_HEADS=self.kv_heads,
            WIDTH=self.width,
            BLOCK_M=self.block_m,
            BLOCK_W=self.block_w,
            ALIGN=self.align,
            num_warps=4,
        )


_PLANS: dict[tuple, RepackLaunch] = {}


def repack_launch(
    kv_caches: Sequence[torch.Tensor],
    runs: tuple[PartStrides, ...],
    width: int,
    block_size: int,
    kv_heads: int,
) -> RepackLaunch:
    """The launch plan of a set of layer caches, kept per set (one geometry, checked by
    ``repack``): the engine plans once; a benchmark holds a few dozen sets."""
    first = kv_caches[0]
    key = (
        first.device, first.dtype, tuple(first.shape), first.stride(), runs, width,
        tuple(cache.data_ptr() for cache in kv_caches),
    )  # fmt: skip
    launch = _PLANS.get(key)
    if launch is None:
        # Never evicted: a kernel still queued (or a captured graph) may read its offsets.
        launch = _PLANS[key] = RepackLaunch.plan(kv_caches, runs, width, block_size, kv_heads)
    return launch


def triton_repack(
    kv_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    runs: tuple[PartStrides, ...],
    width: int,
    block_size: int,
    kv_heads: int,
) -> None:
    """Launch ``_repack_kernel`` once. Caches: one geometry, checked by ``repack``; slots:
    contiguous int64 ``[num_moves]`` on the caches' device; ``runs`` (one or two, sharing
    the block and head strides) and ``width`` from ``KVLayout.copy_runs``."""
    repack_launch(kv_caches, runs, width, block_size, kv_heads)(kv_caches[0], src_slots, dst_slots)
