"""Triton kernel of ``kernels.fused_scores``: one launch scores every decode row of a step
in every scored layer.

A work item is one (layer, KV head, request): its ``GROUP`` query rows (the q heads of the
KV head; a decode request has one query) against the request's keys. The grid is
persistent: each of ``num_programs`` programs takes the next item from a counter
(``atomic_add``) until none is left, so a program that starts late (more programs than
fit on the device at once) takes fewer items; the request varies fastest, so programs
running together add into different columns. Each program has its own float32 scratch
of ``GROUP`` rows of the longest request's keys.

Per item, one pass over the keys: a key tile is read once through the block table, its
logits (``scale * q . k`` on tensor cores in the query's 16-bit dtype, else float32) are
written to the scratch while each row keeps its running maximum and sum (online
softmax); then the scratch (``4 * GROUP`` bytes per key, against ``2 * head_dim`` bytes of
a bf16 key) is read back, each logit rescaled once by its row's log-sum-exp, summed over
the rows and added (``atomic_add``) to the request's columns of the output, which thus
sums over the KV heads and layers. The key tile, the dot and the running softmax are
``kernels._score_tiles_triton``'s, shared with the batched score kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._score_tiles_triton import BLOCK_N, dot, load_key_tile, online_softmax


@triton.jit
def _fused_decode_mass_kernel(
    query_ptr,  # the lowest-addressed layer's queries [num_tokens, num_q_heads, head_dim]
    cache_ptr,  # the lowest-addressed layer's cache (float view)
    layers_ptr,  # [num_layers, 2] int64: element offsets of each layer's queries and cache
    scales_ptr,  # [num_layers] float32: each layer's logit scale (k_scale folded in)
    tables_ptr,  # [rows, max_blocks] int32/int64: block tables
    requests_ptr,  # [num_requests, 4] int64: query row, seq_len, output column, table row
    scratch_ptr,  # [num_programs, GROUP, scratch_keys] float32
    out_ptr,  # [total_keys] float32, added into
    next_item_ptr,  # [1] int32, zero: the items handed out so far
    num_requests,
    num_items,
    scratch_keys,
    table_stride,
    block_size,
    query_token_stride,
    query_head_stride,
    key_base,
    key_block_stride,
    key_offset_stride,
    key_head_stride,
    key_dim_stride,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    ALIGN: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_R)
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    scratch = scratch_ptr + pid.to(tl.int64) * GROUP * scratch_keys
    scratch_rows = scratch + rows[:, None].to(tl.int64) * scratch_keys
    item = tl.atomic_add(next_item_ptr, 1)
    while item < num_items:
        request = item % num_requests
        kv_head = ((item // num_requests) % NUM_KV_HEADS).to(tl.int64)
        layer = item // (num_requests * NUM_KV_HEADS)
        q_row = tl.load(requests_ptr + request * 4)
        seq_len = tl.load(requests_ptr + request * 4 + 1)
        column = tl.load(requests_ptr + request * 4 + 2)
        table = tables_ptr + tl.load(requests_ptr + request * 4 + 3) * table_stride
        layer_query = tl.load(layers_ptr + layer * 2)
        layer_cache = tl.load(layers_ptr + layer * 2 + 1)
        scale = tl.load(scales_ptr + layer)
        q_heads = kv_head * GROUP + rows
        q_at = layer_query + q_row * query_token_stride + q_heads * query_head_stride
        q = tl.load(
            query_ptr + q_at[:, None] + dims[None, :],
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        head_base = layer_cache + key_base + kv_head * key_head_stride
        running_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_R], tl.float32)
        for start in range(0, seq_len, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_mask = keys < seq_len
            k = load_key_tile(
                cache_ptr, table, block_size, keys, key_mask, dims, dim_mask, head_base,
                key_block_stride, key_offset_stride, key_dim_stride, ALIGN,
            )  # fmt: skip
            valid = row_mask[:, None] & key_mask[None, :]
            logits = tl.where(valid, dot(q, k, NATIVE_DOT) * scale, float("-inf"))
            tl.store(scratch_rows + keys[None, :], logits, mask=valid)
            running_max, running_sum = online_softmax(running_max, running_sum, logits)
        # Every decode row sees key 0: its sum is at least 1. Padding rows: 0.
        lse = tl.where(row_mask, running_max + tl.log(tl.maximum(running_sum, 1.0)), 0.0)
        tl.debug_barrier()  # the scratch written above is read by other threads below
        out = out_ptr + column
        for start in range(0, seq_len, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_mask = keys < seq_len
            valid = row_mask[:, None] & key_mask[None, :]
            logits = tl.load(scratch_rows + keys[None, :], mask=valid, other=0.0)
            mass = tl.sum(tl.where(valid, tl.exp(logits - lse[:, None]), 0.0), axis=0)
            tl.atomic_add(out + keys, mass, mask=key_mask, sem="relaxed")
        tl.debug_barrier()  # before the next item overwrites the scratch
        item = tl.atomic_add(next_item_ptr, 1)


def launch_fused_decode_mass(
    grid: int,
    args: tuple,
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    native_dot: bool,
    align: int,
) -> None:
    """One launch of ``_fused_decode_mass_kernel`` over ``grid`` programs; ``args`` are
    its runtime arguments in order (``kernels.fused_scores`` builds them)."""
    _fused_decode_mass_kernel[(grid,)](
        *args,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_R=max(16, triton.next_power_of_2(group)),  # tl.dot takes >= 16 rows
        BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        NATIVE_DOT=native_dot,
        ALIGN=align,
        num_warps=4,
        num_stages=3,
    )
