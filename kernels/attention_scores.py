"""Attention mass per key slot: what eviction policies read and vLLM's kernels do not return.

For one request: queries ``[q_len, num_q_heads, head_dim]`` of the current step, the
request's keys in a paged cache (``block_table`` + ``seq_len``). Output float32
``[num_kv_heads, seq_len]``: ``out[h, j] = sum over queries i and over the q heads g of KV
group h of softmax_j(scale * q[i, g] . k[j, h])``, with vLLM's causal rule (query ``i``
sees key ``j`` iff ``j <= seq_len - q_len + i``) and q head ``g`` reading KV head
``g // (num_q_heads // num_kv_heads)``. Each row of ``out`` sums to
``q_len * num_q_heads / num_kv_heads``.

``batch_attention_scores`` does the same for several requests of a step at once (on CUDA
three kernel launches per layer for the whole batch, not a loop over requests).

Backends: ``triton`` (CUDA; logits, row log-sum-exp and mass kernels), ``torch``
(CPU: block-wise gather and one batched matmul per query chunk), and the reference, which
sums ``attention_probabilities`` (every query's softmax, before the sum).

An fp8 KV cache (vLLM stores it as ``uint8``) is passed as its float8 view with the layer's
per-tensor ``k_scale``: the logits are ``scale * k_scale * q . k``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import torch

from kernels import score_spans
from kernels._decode_batch import DecodeBatch
from kernels._decode_batch import decode_batches as _decode_batches
from kernels.layout import KVLayout, same_geometry
from kernels.row_probabilities import (
    attention_probabilities,
    causal_logits,
    grouped_queries,
    keys_transposed,
)
from kernels.score_spans import ScoredSpan


class ScoresBackend(StrEnum):
    TRITON = "triton"
    TORCH = "torch"
    REFERENCE = "reference"


def reference_attention_scores(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    layout: KVLayout,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain-torch reference of the module contract; float32 ``[num_kv_heads, seq_len]``."""
    probabilities = attention_probabilities(
        query, kv_cache, block_table, seq_len, layout, scale=scale
    )
    mass = probabilities.sum(dim=1)  # [q_heads, seq_len]
    return mass.view(layout.num_kv_heads(kv_cache), -1, seq_len).sum(dim=1)


def check_scores_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    layout: KVLayout,
) -> None:
    """Raise ``ValueError`` unless the arguments describe one request's scoring step."""
    layout.check_cache(kv_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [q_len, num_q_heads, head_dim], got {tuple(query.shape)}")
    q_len, num_q_heads, head_dim = query.shape
    num_kv_heads = layout.num_kv_heads(kv_cache)
    if head_dim != layout.head_dim(kv_cache):
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {layout.head_dim(kv_cache)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not a multiple of {num_kv_heads} KV heads")
    if not 1 <= q_len <= seq_len:
        raise ValueError(f"need 1 <= q_len ({q_len}) <= seq_len ({seq_len})")
    if block_table.dim() != 1 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_table must be a 1-D int32/int64 tensor")
    if block_table.numel() * layout.block_size(kv_cache) < seq_len:
        raise ValueError(f"block_table of {block_table.numel()} blocks cannot hold {seq_len}")
    if query.device != kv_cache.device or block_table.device != kv_cache.device:
        raise ValueError("query, kv_cache and block_table must share a device")
    _check_key_dtype(kv_cache)


def _check_key_dtype(kv_cache: torch.Tensor) -> None:
    if not kv_cache.dtype.is_floating_point:
        raise ValueError(
            f"keys of dtype {kv_cache.dtype} cannot be scored: pass an fp8 cache stored as "
            "uint8 as its float8 view (cache.view(torch.float8_e4m3fn)) with its k_scale"
        )


def torch_attention_scores(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    layout: KVLayout,
    scale: float,
) -> torch.Tensor:
    """Vectorised torch path (the CPU backend); arguments as ``attention_scores``."""
    q_len, num_q_heads = query.shape[:2]
    num_kv_heads = layout.num_kv_heads(kv_cache)
    keys_t = keys_transposed(kv_cache, block_table, seq_len, layout)
    queries = grouped_queries(query, num_kv_heads, scale)  # scaled once
    out = torch.zeros(num_kv_heads, seq_len, dtype=torch.float32, device=query.device)
    chunk = max(1, score_spans.MAX_LOGITS // (num_q_heads * seq_len))
    for start in range(0, q_len, chunk):
        logits = causal_logits(queries[:, :, start : start + chunk], keys_t, start, q_len)
        out += logits.view(num_kv_heads, -1, seq_len).softmax(dim=-1).sum(dim=1)
    return out


def attention_scores(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    layout: KVLayout,
    *,
    scale: float | None = None,
    k_scale: float = 1.0,
    backend: ScoresBackend | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Attention mass per key slot of one request: float32 ``[num_kv_heads, seq_len]``.

    ``query``: ``[q_len, num_q_heads, head_dim]``, ``kv_cache``: one layer of ``layout``,
    ``block_table``: the request's block ids (int32/int64, at least ``ceil(seq_len /
    block_size)`` of them), ``scale``: vLLM's softmax scale (default ``head_dim ** -0.5``),
    ``k_scale``: an fp8 cache's key scale. Bad shapes raise ``ValueError`` (unless
    ``check=False``).
    """
    if check:
        check_scores_args(query, kv_cache, block_table, seq_len, layout)
    scale = _effective_scale(query, scale, k_scale)
    backend = ScoresBackend(backend) if backend else _default_backend(kv_cache, layout)
    if backend is ScoresBackend.REFERENCE:
        return reference_attention_scores(
            query, kv_cache, block_table, seq_len, layout, scale=scale
        )
    if backend is ScoresBackend.TORCH:
        return torch_attention_scores(query, kv_cache, block_table, seq_len, layout, scale)
    out = torch.zeros(
        layout.num_kv_heads(kv_cache), seq_len, dtype=torch.float32, device=query.device
    )
    spans = score_spans.request_spans(query.shape[1], 0, query.shape[0], seq_len, 0, 0)
    _triton_scores(query, kv_cache, block_table.view(1, -1), [spans], out, layout, scale)
    return out


def batch_attention_scores(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    layout: KVLayout,
    *,
    scale: float | None = None,
    k_scale: float = 1.0,
    backend: ScoresBackend | None = None,
    check: bool = True,
) -> torch.Tensor:
    """``attention_scores`` of several requests of one step, concatenated: float32
    ``[num_kv_heads, sum(seq_lens)]``, request ``r``'s keys at ``sum(seq_lens[:r])``.

    Request ``r`` is query rows ``[query_starts[r], query_starts[r] + query_lens[r])`` of
    ``query`` (``[num_tokens, num_q_heads, head_dim]``, the step's batch) over the first
    ``seq_lens[r]`` keys of block-table row ``block_tables[r]`` (``[num_requests,
    max_blocks]``). The lengths are host integers (the scheduler's), so nothing waits on
    the device. On CUDA this is one pair of launches for requests whose float32 logits fit
    in 64 MiB together; a longer one (a prefill) is split into query chunks.
    """
    num_requests = len(seq_lens)
    if check:
        _check_batch_args(query, kv_cache, block_tables, query_starts, query_lens, seq_lens, layout)
    scale = _effective_scale(query, scale, k_scale)
    key_offsets = _key_offsets(seq_lens)
    out = torch.zeros(
        layout.num_kv_heads(kv_cache), key_offsets[-1], dtype=torch.float32, device=query.device
    )
    backend = ScoresBackend(backend) if backend else _default_backend(kv_cache, layout)
    if backend is not ScoresBackend.TRITON:
        batches: list[DecodeBatch] = []
        if backend is ScoresBackend.TORCH and layout is not KVLayout.CPU_ATTN_AMX:
            batches = _decode_batches(
                query_lens, seq_lens, block_tables, query_starts, query.shape[1], kv_cache,
                layout,
            )  # fmt: skip
        for batch in batches:
            batch.write_mass(out, key_offsets, query, kv_cache, layout, scale)
        single = {r for batch in batches for r in batch.requests}
        for r in range(num_requests):
            if r not in single:
                rows = query[query_starts[r] : query_starts[r] + query_lens[r]]
                out[:, key_offsets[r] : key_offsets[r + 1]] = attention_scores(
                    rows, kv_cache, block_tables[r], int(seq_lens[r]), layout,
                    scale=scale, backend=backend, check=False,
                )  # fmt: skip
        return out
    requests = [
        score_spans.request_spans(query.shape[1], int(query_starts[r]), int(query_lens[r]),
                                  int(seq_lens[r]),
                       key_offsets[r], r)
        for r in range(num_requests)
    ]  # fmt: skip
    _triton_scores(query, kv_cache, block_tables, requests, out, layout, scale)
    return out


def _key_offsets(seq_lens: Sequence[int]) -> list[int]:
    """Where each request's keys start in a step's concatenated keys, and the total:
    request ``r``'s are ``[offsets[r], offsets[r + 1])``."""
    key_offsets = [0]
    for seq_len in seq_lens:
        key_offsets.append(key_offsets[-1] + int(seq_len))
    return key_offsets


def summed_attention_mass(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor, float | None]],
    block_tables: torch.Tensor,
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    layout: KVLayout,
    *,
    backend: ScoresBackend | None = None,
) -> torch.Tensor:
    """``batch_attention_scores`` of one step's requests in several layers, summed over
    the layers and the KV heads: float32 ``[sum(seq_lens)]`` on the caches' device.

    ``layers``: ``(query, kv_cache, scale)`` per layer (``scale`` ``None``: ``head_dim **
    -0.5``), the step's queries as in ``batch_attention_scores`` (same requests, rows and
    block tables in every layer). On CPU the decode requests' gathers and masks are
    planned once for all layers, in chunks whose gathered keys and logits each stay under
    ``score_spans.MAX_LOGITS`` float32 elements. With Triton the decode requests of every
    layer are one launch (``kernels.fused_scores``), the others the batched kernels per layer.
    """
    if not layers:
        raise ValueError("need at least one layer")
    query, kv_cache, _ = layers[0]
    _check_batch_args(query, kv_cache, block_tables, query_starts, query_lens, seq_lens, layout)
    backend = ScoresBackend(backend) if backend else _default_backend(kv_cache, layout)
    key_offsets = _key_offsets(seq_lens)
    total = torch.zeros(key_offsets[-1], dtype=torch.float32, device=kv_cache.device)
    if backend is ScoresBackend.TRITON:
        _triton_summed_mass(layers, block_tables, query_starts, query_lens, seq_lens, layout, total)
        return total
    if backend is not ScoresBackend.TORCH or layout is KVLayout.CPU_ATTN_AMX:
        for query, kv_cache, scale in layers:
            total += batch_attention_scores(
                query, kv_cache, block_tables, query_starts, query_lens, seq_lens, layout,
                scale=scale, backend=backend, check=False,
            ).sum(0)  # fmt: skip
        return total
    batches = _decode_batches(
        query_lens, seq_lens, block_tables, query_starts, query.shape[1], kv_cache, layout
    )
    sums = [torch.zeros(len(b.requests), b.hidden.shape[-1], device=total.device) for b in batches]
    batched = {r for b in batches for r in b.requests}
    for query, kv_cache, layer_scale in layers:
        scale = _effective_scale(query, layer_scale, 1.0)
        for batch, summed in zip(batches, sums, strict=True):
            summed += batch.mass(query, kv_cache, layout, scale).sum(dim=1)
        for r in range(len(seq_lens)):
            if r not in batched:
                rows = query[query_starts[r] : query_starts[r] + query_lens[r]]
                total[key_offsets[r] : key_offsets[r + 1]] += attention_scores(
                    rows, kv_cache, block_tables[r], int(seq_lens[r]), layout,
                    scale=scale, backend=backend, check=False,
                ).sum(0)  # fmt: skip
    for batch, summed in zip(batches, sums, strict=True):
        for row, r in enumerate(batch.requests):
            total[key_offsets[r] : key_offsets[r + 1]] = summed[row, : batch.lengths[row]]
    return total


def _triton_summed_mass(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor, float | None]],
    block_tables: torch.Tensor,
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    layout: KVLayout,
    total: torch.Tensor,
) -> None:
    """``summed_attention_mass`` with Triton, added into ``total``: the decode requests
    through the fused kernel when the layers' queries and caches share one geometry (one
    launch and one request-table upload per step), the rest per layer."""
    from kernels.fused_scores import DecodeRequests, fused_decode_mass

    key_offsets = _key_offsets(seq_lens)
    queries, caches = [layer[0] for layer in layers], [layer[1] for layer in layers]
    fusable = all(same_geometry(q, queries[0]) for q in queries) and all(
        same_geometry(c, caches[0]) for c in caches
    )
    decode = [r for r, q_len in enumerate(query_lens) if q_len == 1] if fusable else []
    if decode:
        requests = DecodeRequests.build(
            block_tables, [query_starts[r] for r in decode], [seq_lens[r] for r in decode],
            columns=[key_offsets[r] for r in decode], table_rows=decode,
        )  # fmt: skip
        scales = [layer[2] for layer in layers]
        fused_decode_mass(queries, caches, scales, requests, layout, out=total)
    fused = set(decode)
    spans = [
        score_spans.request_spans(queries[0].shape[1], int(query_starts[r]), int(query_lens[r]),
                                  int(seq_lens[r]), key_offsets[r], r)
        for r in range(len(seq_lens)) if r not in fused
    ]  # fmt: skip
    if not spans:
        return
    per_head = torch.zeros(layout.num_kv_heads(caches[0]), total.numel(), device=total.device)
    for query, kv_cache, scale in layers:
        _triton_scores(
            query, kv_cache, block_tables, spans, per_head, layout,
            _effective_scale(query, scale, 1.0),
        )  # fmt: skip
    total += per_head.sum(0)


def _effective_scale(query: torch.Tensor, scale: float | None, k_scale: float) -> float:
    return (1.0 / math.sqrt(query.shape[-1]) if scale is None else scale) * float(k_scale)


def _default_backend(kv_cache: torch.Tensor, layout: KVLayout) -> ScoresBackend:
    if kv_cache.device.type == "cuda" and layout is not KVLayout.CPU_ATTN_AMX:
        return ScoresBackend.TRITON
    return ScoresBackend.TORCH


def _check_batch_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    layout: KVLayout,
) -> None:
    if not len(query_starts) == len(query_lens) == len(seq_lens):
        raise ValueError("query_starts, query_lens and seq_lens differ in length")
    if block_tables.dim() != 2 or block_tables.shape[0] < len(seq_lens):
        raise ValueError(
            f"block_tables must be [num_requests, max_blocks], got {tuple(block_tables.shape)}"
        )
    for r, (start, q_len, seq_len) in enumerate(
        zip(query_starts, query_lens, seq_lens, strict=True)
    ):
        if start < 0 or start + q_len > query.shape[0]:
            raise ValueError(f"request {r}: rows [{start}, {start + q_len}) outside the query")
        check_scores_args(
            query[start : start + q_len], kv_cache, block_tables[r], int(seq_len), layout
        )


def _triton_scores(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    requests: list[list[ScoredSpan]],
    out: torch.Tensor,
    layout: KVLayout,
    scale: float,
) -> None:
    from kernels._scores_triton import triton_span_scores

    for launch in score_spans.pack_launches(requests, query.shape[1]):
        triton_span_scores(query, kv_cache, block_tables, launch, out, layout, scale)
