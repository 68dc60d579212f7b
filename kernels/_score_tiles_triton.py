"""Triton helpers of both score kernels (``kernels._scores_triton``: a batch of query
spans; ``kernels._fused_scores_triton``: every decode row of a step in one launch).

- ``BLOCK_N``: keys per tile;
- ``dot``: the logits' ``q @ k.T`` in float32: native (keys converted to the query's
  16-bit dtype, exact for bf16/fp16/fp8 keys, on tensor cores, products exact and
  accumulated in float32) or float32 FMA (``ieee``); ``native_dot`` chooses on the host;
- ``load_key_tile``: ``[BLOCK_N, BLOCK_D]`` keys of one KV head through a block-table row;
- ``online_softmax``: one tile's step of a running maximum and sum of exponentials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64


@triton.jit
def dot(q, k, NATIVE_DOT: tl.constexpr):
    """``q @ k.T`` in float32 (module docstring)."""
    if NATIVE_DOT:
        return tl.dot(q, tl.trans(k.to(q.dtype)))
    return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")


@triton.jit
def load_key_tile(
    cache_ptr, table_ptr, block_size, keys, key_mask, dims, dim_mask, head_base,
    key_block_stride, key_offset_stride, key_dim_stride,
    ALIGN: tl.constexpr,
):  # fmt: skip
    """Keys ``keys`` of one request (its block-table row at ``table_ptr``) and one KV head
    (its first key at element ``head_base`` of the cache): ``[BLOCK_N, BLOCK_D]``, each
    key's channels contiguous. Token rows are data-dependent addresses: ``ALIGN`` promises
    their alignment (``kernels.layout.vector_alignment``) so they load as 16-byte vectors."""
    blocks = tl.load(table_ptr + keys // block_size, mask=key_mask, other=0).to(tl.int64)
    key_rows = head_base + blocks * key_block_stride
    key_rows += (keys % block_size).to(tl.int64) * key_offset_stride
    key_rows = tl.multiple_of(key_rows, ALIGN)
    return tl.load(
        cache_ptr + key_rows[:, None] + (dims * key_dim_stride)[None, :],
        mask=key_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )


@triton.jit
def online_softmax(running_max, running_sum, values):
    """Rows' running maximum and ``sum(exp(value - maximum))`` (``[BLOCK_R]`` each) after
    the values ``[BLOCK_R, BLOCK]`` of one more tile; ``-inf`` values add nothing (a row
    with none finite yet keeps maximum ``-inf`` and sum 0)."""
    new_max = tl.maximum(running_max, tl.max(values, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(
        tl.exp(values - safe_max[:, None]), axis=1
    )
    return new_max, running_sum


# Under TRITON_INTERPRET=1 (tests without a GPU) kernels are InterpretedFunction objects.
INTERPRETED = type(dot).__name__ == "InterpretedFunction"


def native_dot(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``dot`` runs natively: a 16-bit query over keys of its dtype or fp8 (not
    under the interpreter for bf16, whose dot reads bf16 as raw integers)."""
    native = query.dtype in (torch.bfloat16, torch.float16) and (
        kv_cache.dtype == query.dtype or kv_cache.element_size() == 1
    )
    return native and not (query.dtype == torch.bfloat16 and INTERPRETED)
