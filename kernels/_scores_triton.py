"""Triton logits kernel for ``attention_scores``; softmax and the sum over rows stay in torch.

Grid ``(num_kv_heads, cdiv(seq_len, BLOCK_N), cdiv(group * q_len, BLOCK_R))``: a program
reads one ``[BLOCK_N, head_dim]`` tile of paged keys (through the block table) once for
all query rows of its KV group (row ``r = g * q_len + i``: q head ``kv_head * group + g``,
query ``i``), so a decode step reads each key once, as the attention kernel does, and
writes ``group`` float32 logits per key (``2 * group / head_dim`` of the key bytes in
bf16). The dot runs in float32 with ``input_precision="ieee"``: scores stay comparable
with the torch paths, and decode scoring is bound by key reads, not by the dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layout import KVLayout


@triton.jit
def _logits_kernel(
    query_ptr,  # [q_len, num_q_heads, head_dim], any float dtype
    cache_ptr,  # one layer's cache
    block_table_ptr,  # [>= cdiv(seq_len, block_size)] int32/int64
    logits_ptr,  # [num_kv_heads, group * q_len, seq_len] float32
    q_len,  # queries in this launch (a chunk of the step's queries)
    seq_len,
    last_visible,  # query i of the chunk sees keys j <= last_visible + i
    block_size,
    scale,
    query_token_stride,
    query_head_stride,
    key_base,
    key_block_stride,
    key_offset_stride,
    key_head_stride,
    key_dim_stride,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    kv_head = tl.program_id(0)
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    num_rows = GROUP * q_len
    row_mask = rows < num_rows
    key_mask = keys < seq_len
    dim_mask = dims < HEAD_DIM

    query_index = rows % q_len
    q_head = kv_head * GROUP + rows // q_len
    q_offsets = query_index * query_token_stride + q_head * query_head_stride
    q = tl.load(
        query_ptr + q_offsets[:, None] + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)

    blocks = tl.load(block_table_ptr + keys // block_size, mask=key_mask, other=0).to(tl.int64)
    key_rows = key_base + blocks * key_block_stride + (keys % block_size) * key_offset_stride
    key_rows += kv_head * key_head_stride
    k_t = tl.load(
        cache_ptr + key_rows[None, :] + (dims * key_dim_stride)[:, None],
        mask=dim_mask[:, None] & key_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_D, BLOCK_N]

    logits = tl.dot(q, k_t, input_precision="ieee") * scale
    visible = keys[None, :] <= (last_visible + query_index)[:, None]
    logits = tl.where(visible, logits, float("-inf"))
    out = logits_ptr + kv_head * num_rows * seq_len + rows[:, None] * seq_len + keys[None, :]
    tl.store(out, logits, mask=row_mask[:, None] & key_mask[None, :])


def _launch_logits(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    last_visible: int,
    layout: KVLayout,
    scale: float,
) -> torch.Tensor:
    """Scaled, causally masked logits float32 ``[num_kv_heads, group * q_len, seq_len]``."""
    parts = layout.part_strides(kv_cache)
    if parts is None:
        raise ValueError(f"the Triton scores kernel does not handle layout {layout.value}")
    keys = parts[0]
    q_len, num_q_heads, head_dim = query.shape
    num_kv_heads = layout.num_kv_heads(kv_cache)
    group = num_q_heads // num_kv_heads
    num_rows = group * q_len
    logits = torch.empty(num_kv_heads, num_rows, seq_len, dtype=torch.float32, device=query.device)
    # tl.dot needs >= 16 on each side; 64 keys x head_dim keeps a bf16 K tile at 16 KB.
    block_r = min(64, max(16, triton.next_power_of_2(num_rows)))
    block_n = 64
    grid = (num_kv_heads, triton.cdiv(seq_len, block_n), triton.cdiv(num_rows, block_r))
    _logits_kernel[grid](
        query,
        kv_cache,
        block_table,
        logits,
        q_len,
        seq_len,
        last_visible,
        layout.block_size(kv_cache),
        scale,
        query.stride(0),
        query.stride(1),
        keys.base,
        keys.block_stride,
        keys.offset_stride,
        keys.head_stride,
        keys.dim_stride,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return logits


def triton_attention_scores(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    layout: KVLayout,
    scale: float,
) -> torch.Tensor:
    """Arguments as ``attention_scores`` (already checked); float32 ``[num_kv_heads, seq_len]``."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    q_len, num_q_heads, _ = query.shape
    out = torch.zeros(
        layout.num_kv_heads(kv_cache), seq_len, dtype=torch.float32, device=query.device
    )
    # Query chunks bound the float32 logits to about 64 MiB; exact, rows normalise alone.
    chunk = max(1, (16 * 1024 * 1024) // (num_q_heads * seq_len))
    for start in range(0, q_len, chunk):
        rows = query[start : start + chunk]
        last_visible = seq_len - q_len + start
        logits = _launch_logits(rows, kv_cache, block_table, seq_len, last_visible, layout, scale)
        out += logits.softmax(dim=-1).sum(dim=1)
    return out
