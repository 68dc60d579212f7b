"""Per-query attention probabilities of one request's rows, a bounded slice at a time.

What the policies that read query rows need (a window of the last queries, per-head
statistics): for query row ``i`` of a step of ``q_len`` rows, q head ``h`` and key ``j``,
``softmax_j(scale * q[i, h] . k[j, h // group])`` with vLLM's causal rule (row ``i`` sees
key ``j`` iff ``j <= seq_len - q_len + i``), as in ``kernels.attention_scores``, whose
torch backend shares this module's gather (``keys_transposed``) and logits
(``causal_logits``). ``attention_probabilities`` is the plain reference (every row at
once, keys gathered slot by slot).

``probability_slices`` computes each row's logits once: the request's keys are gathered
once per call (float32 ``[num_kv_heads, head_dim, seq_len]``), then each slice of rows is
one batched matmul over the KV heads (a KV head's q heads share its keys, no copy per q
head), masked, normalised and handed to the caller, who reduces it before the next slice
is computed. A slice's float32 logits and probabilities together stay under
``max_bytes`` (default ``MAX_SLICE_BYTES``; at least one row): the temporary does not
grow with the prefill chunk, whereas every row of an 8,192-token chunk at once is ``32
heads x 8192 x 8192 x 4`` bytes = 8 GiB per layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kernels.intmath import cdiv
from kernels.layout import KVLayout, indexable

# A slice's float32 logits and probabilities together (two [num_q_heads, rows, seq_len]
# tensors); the keys of the request (one layer, float32) come on top of it.
MAX_SLICE_BYTES = 64 * 1024 * 1024


def request_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """The cache slots of the request's keys ``[0, seq_len)`` (int64 ``[seq_len]``)."""
    positions = torch.arange(seq_len, device=block_table.device)
    return block_table.long()[positions // block_size] * block_size + positions % block_size


def attention_probabilities(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    layout: KVLayout,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Every query's softmax over the request's keys: float32 ``[num_q_heads, q_len,
    seq_len]`` on the cache's device, with the module's causal rule and head grouping.

    Arguments as ``attention_scores`` (not checked). Each row sums to 1; the hidden keys of
    a row are 0. Plain torch, one gather and one einsum: for what needs more than the mass
    per key (a query window, per-head statistics), and the reference of the scores.
    """
    q_len, num_q_heads, head_dim = query.shape
    group = num_q_heads // layout.num_kv_heads(kv_cache)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    slots = request_slots(block_table, seq_len, layout.block_size(kv_cache))
    keys = layout.gather(kv_cache, slots)[:, 0].float()  # [seq_len, kv_heads, head_dim]
    keys = keys.repeat_interleave(group, dim=1)  # [seq_len, q_heads, head_dim]
    logits = torch.einsum("qhd,shd->hqs", query.float(), keys) * scale
    device = logits.device  # the mask made there: a host copy would stall the host
    visible = torch.arange(seq_len, device=device).view(1, -1) <= (
        seq_len - q_len + torch.arange(q_len, device=device).view(-1, 1)
    )
    logits = logits.masked_fill(~visible, float("-inf"))
    return logits.softmax(dim=-1)


def keys_transposed(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, layout: KVLayout
) -> torch.Tensor:
    """Keys of the request as float32 ``[num_kv_heads, head_dim, seq_len]`` (one copy).

    Whole blocks are gathered (one contiguous chunk per block and head in cpu_attn, whose K
    is already ``[head_dim, block_size]``), so there is no per-token indexing.
    """
    block_size = layout.block_size(kv_cache)
    num_blocks = cdiv(seq_len, block_size)
    blocks = block_table[:num_blocks].long()
    if layout is KVLayout.CPU_ATTN_AMX:
        keys = layout.gather(kv_cache, request_slots(block_table, seq_len, block_size))[:, 0]
        return keys.permute(1, 2, 0).float()
    # [num_blocks, block_size, kv_heads, dim] -> [kv_heads, dim, num_blocks * block_size]
    keys = layout.keys_values(indexable(kv_cache))[0][blocks].view(kv_cache.dtype)
    keys = keys.permute(2, 3, 0, 1).float().reshape(keys.shape[2], keys.shape[3], -1)
    return keys[:, :, :seq_len]


def grouped_queries(query: torch.Tensor, num_kv_heads: int, scale: float) -> torch.Tensor:
    """``query`` ``[rows, num_q_heads, head_dim]`` times ``scale`` as float32 ``[num_kv_heads,
    group, rows, head_dim]``: the q heads of a KV head together (q head ``kv_head * group +
    g``), each group one batch of the matmul against its KV head's keys."""
    rows, num_q_heads, head_dim = query.shape
    grouped = query.float().permute(1, 0, 2)
    return grouped.reshape(num_kv_heads, num_q_heads // num_kv_heads, rows, head_dim) * scale


def causal_logits(
    queries: torch.Tensor, keys_t: torch.Tensor, first_row: int, q_len: int
) -> torch.Tensor:
    """Logits float32 ``[num_kv_heads, group, rows, seq_len]`` of the step's query rows
    ``[first_row, first_row + rows)`` of ``q_len`` (``queries``: their ``grouped_queries``)
    against ``keys_t`` (``keys_transposed``), ``-inf`` where the module's causal rule hides
    a key. The mask is made on the device (a host copy would stall the host)."""
    num_kv_heads, group, num_rows, head_dim = queries.shape
    seq_len = keys_t.shape[-1]
    rows = queries.reshape(num_kv_heads, group * num_rows, head_dim)
    logits = torch.bmm(rows, keys_t).view(num_kv_heads, group, num_rows, seq_len)
    if seq_len - q_len + first_row < seq_len - 1:  # the last queries see every key
        device = keys_t.device
        first_hidden = (
            seq_len - q_len + 1 + torch.arange(first_row, first_row + num_rows, device=device)
        )
        hidden = torch.arange(seq_len, device=device).view(1, -1) >= first_hidden.view(-1, 1)
        logits.masked_fill_(hidden, float("-inf"))
    return logits


def rows_per_slice(num_q_heads: int, seq_len: int, max_bytes: int = MAX_SLICE_BYTES) -> int:
    """How many query rows one slice holds: their logits and probabilities (float32, 8
    bytes per head and key) within ``max_bytes``; at least one row."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    return max(1, max_bytes // (8 * num_q_heads * seq_len))


def probability_slices(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    layout: KVLayout,
    *,
    scale: float | None = None,
    first_row: int = 0,
    max_bytes: int = MAX_SLICE_BYTES,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Rows ``[first_row, q_len)`` of the step's probabilities, in order, as ``(first row of
    the slice, float32 [num_q_heads, rows, seq_len])`` on the cache's device.

    ``query``: the request's ``[q_len, num_q_heads, head_dim]`` rows of the step; the other
    arguments as ``kernels.attention_scores.attention_scores`` (checked there by
    ``check_scores_args``, not here). Each row sums to 1; a row's hidden keys are 0. A slice
    is valid until the next one is asked for (reduce it, do not keep it: keeping every
    slice would hold what slicing bounds).
    """
    q_len, num_q_heads, head_dim = query.shape
    if not 0 <= first_row <= q_len:
        raise ValueError(f"first_row {first_row} outside the {q_len} query rows")
    num_kv_heads = layout.num_kv_heads(kv_cache)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    keys_t = keys_transposed(kv_cache, block_table, seq_len, layout)  # [kv, dim, seq_len]
    step = rows_per_slice(num_q_heads, seq_len, max_bytes)
    for start in range(first_row, q_len, step):
        queries = grouped_queries(query[start : start + step], num_kv_heads, scale)
        logits = causal_logits(queries, keys_t, start, q_len)
        probabilities = logits.view(num_q_heads, -1, seq_len).softmax(dim=-1)
        del logits, queries
        yield start, probabilities
        del probabilities  # before the next slice's logits: one slice alive at a time
