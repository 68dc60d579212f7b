"""Per-query attention probabilities of one request's rows, a bounded slice at a time.

What the policies that read query rows need (a window of the last queries, per-head
statistics): for query row ``i`` of a step of ``q_len`` rows, q head ``h`` and key ``j``,
``softmax_j(scale * q[i, h] . k[j, h // group])`` with the causal rule of
``kernels.attention_scores`` (row ``i`` sees key ``j`` iff ``j <= seq_len - q_len + i``).
``attention_probabilities`` there is the plain reference (every row at once).

``probability_slices`` computes each row's logits once: the request's keys are gathered
once per call (float32 ``[num_kv_heads, head_dim, seq_len]``, as the CPU mass path does),
then each slice of rows is one batched matmul over the KV heads (a q head group's rows
share their KV head's keys, no copy per q head), masked, normalised and handed to the
caller, who reduces it before the next slice is computed. A slice's float32 logits and
probabilities together stay under ``max_bytes`` (default ``MAX_SLICE_BYTES``, at least one
row): the temporary does not grow with the prefill chunk, whereas every row of an 8,192-token
chunk at once is ``32 heads x 8192 x 8192 x 4`` bytes = 8 GiB per layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kernels.attention_scores import keys_transposed
from kernels.layout import KVLayout

# A slice's float32 logits and probabilities together (two [num_q_heads, rows, seq_len]
# tensors); the keys of the request (one layer, float32) come on top of it.
MAX_SLICE_BYTES = 64 * 1024 * 1024


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
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    keys_t = keys_transposed(kv_cache, block_table, seq_len, layout)  # [kv, dim, seq_len]
    step = rows_per_slice(num_q_heads, seq_len, max_bytes)
    key_index = torch.arange(seq_len, device=keys_t.device)
    for start in range(first_row, q_len, step):
        stop = min(q_len, start + step)
        num_rows = stop - start
        # q head h = kv_head * group + g: [kv_heads, group * rows, head_dim]
        rows = query[start:stop].float().permute(1, 0, 2)
        rows = rows.reshape(num_kv_heads, group * num_rows, head_dim)
        logits = torch.bmm(rows, keys_t).view(num_q_heads, num_rows, seq_len)
        logits.mul_(scale)
        if seq_len - q_len + start < seq_len - 1:  # else every row sees every key
            last_seen = seq_len - q_len + torch.arange(start, stop, device=keys_t.device)
            logits.masked_fill_(key_index.view(1, -1) > last_seen.view(-1, 1), float("-inf"))
        probabilities = logits.softmax(dim=-1)
        del logits
        yield start, probabilities
