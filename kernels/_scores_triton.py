"""Triton kernels for ``attention_scores`` over a batch of requests (varlen queries).

Three launches for any number of requests (grids put requests and rows on axis 0, whose
limit is 2**31 - 1, and KV heads on axis 2):

1. ``_logits_kernel``, grid ``(num_requests * row_tiles, max_key_tiles, num_kv_heads)``: a
   program reads one ``[BLOCK_N, head_dim]`` tile of a request's paged keys (through its
   block table row) once for all query rows of its KV group (row ``r = g * q_len + i``: q
   head ``kv_head * group + g``, query ``i``), and writes the log-sum-exp of each row over
   its tile (and, when kept, the scaled, causally masked float32 logits).
2. ``_lse_kernel``, grid ``(total_rows, num_kv_heads)``: each row's softmax normaliser, the
   log-sum-exp over the tiles of its request (each request has its own tile count).
3. ``_mass_kernel``, grid ``(num_requests, max_key_tiles, num_kv_heads)``: for a key tile,
   ``sum over rows of exp(logit - lse_row)``, added into the output (so query chunks of one
   request, launched one after another, accumulate). The logits are read back when a KV
   head has few rows (decode: ``group`` float32 per key, under the key bytes), else
   recomputed from the keys (a 32-query window: reading the keys again is cheaper).

The dot runs on tensor cores in the query's 16-bit dtype when the keys are of that dtype
or fp8 (products exact, accumulated in float32), else in float32 (``ieee``). An fp8 cache
is read through its float8 view; ``k_scale`` is folded into the scale. Token rows are
data-dependent addresses: ``ALIGN`` promises their alignment (``vector_alignment``), so
they load as 16-byte vectors. The key tile, the dot and the running softmax are
``kernels._score_tiles_triton``'s, shared with the fused decode kernel; the spans' table
is packed by ``kernels._span_table``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._score_tiles_triton import (
    BLOCK_N,
    dot,
    load_key_tile,
    native_dot,
    online_softmax,
)
from kernels._span_table import SpanTable
from kernels.layout import KVLayout, PartStrides, vector_alignment
from kernels.score_spans import ScoredSpan


@triton.jit
def _row_logits(
    query_ptr, q_start, q_len, causal, rows, row_mask, dims, dim_mask, kv_head, k, keys,
    key_mask, scale, query_token_stride, query_head_stride,
    GROUP: tl.constexpr, NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    """Scaled logits ``[BLOCK_R, BLOCK_N]`` of query rows ``rows`` (row ``g * q_len + i``:
    q head ``kv_head * GROUP + g``, query ``i``) against the key tile ``k``; ``-inf`` where
    query ``i`` may not see the key (``key > causal + i``) or outside the rows and keys."""
    query_index = rows % q_len
    q_head = kv_head * GROUP + rows // q_len
    q_offsets = (q_start + query_index) * query_token_stride + q_head * query_head_stride
    q = tl.load(
        query_ptr + q_offsets[:, None] + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    logits = dot(q, k, NATIVE_DOT) * scale
    visible = keys[None, :] <= (causal + query_index)[:, None]
    visible = visible & key_mask[None, :] & row_mask[:, None]
    return tl.where(visible, logits, float("-inf"))


@triton.jit
def _logits_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_dim], any float dtype
    cache_ptr,  # one layer's cache (float view)
    block_tables_ptr,  # [num_requests, max_blocks] int32/int64
    requests_ptr,  # [num_requests, 8] int64: q_start, q_len, seq_len, causal, logits
    #                 offset, first row, output key offset, tile log-sum-exp offset
    logits_ptr,  # flat float32: request r's [kv_heads, rows_r, seq_r] at its logits offset
    lse_ptr,  # per request [num_kv_heads, rows, tiles] float32, at its lse offset
    block_size,
    block_table_stride,
    scale,
    query_token_stride,
    query_head_stride,
    key_base,
    key_block_stride,
    key_offset_stride,
    key_head_stride,
    key_dim_stride,
    row_tiles,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    request = tl.program_id(0) // row_tiles
    row_tile = tl.program_id(0) % row_tiles
    key_tile = tl.program_id(1)
    kv_head = tl.program_id(2).to(tl.int64)
    info = requests_ptr + request * 8
    q_start = tl.load(info)
    q_len = tl.load(info + 1)
    seq_len = tl.load(info + 2)
    causal = tl.load(info + 3)  # query i sees keys j <= causal + i
    logits_start = tl.load(info + 4)
    num_rows = GROUP * q_len
    if key_tile * BLOCK_N >= seq_len or row_tile * BLOCK_R >= num_rows:
        return
    keys = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    key_mask = keys < seq_len
    dim_mask = dims < HEAD_DIM

    k = load_key_tile(
        cache_ptr, block_tables_ptr + request * block_table_stride, block_size, keys,
        key_mask, dims, dim_mask, key_base + kv_head * key_head_stride, key_block_stride,
        key_offset_stride, key_dim_stride, ALIGN,
    )  # fmt: skip
    logits = _row_logits(
        query_ptr, q_start, q_len, causal, rows, row_mask, dims, dim_mask, kv_head, k, keys,
        key_mask, scale, query_token_stride, query_head_stride, GROUP, NATIVE_DOT,
    )  # fmt: skip
    if STORE_LOGITS:
        out = logits_ptr + logits_start + (kv_head * num_rows + rows[:, None]) * seq_len
        tl.store(out + keys[None, :], logits, mask=row_mask[:, None] & key_mask[None, :])

    row_max = tl.max(logits, axis=1)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(tl.exp(logits - safe_max[:, None]), axis=1)
    lse = tl.where(row_sum > 0, safe_max + tl.log(tl.maximum(row_sum, 1e-30)), float("-inf"))
    # The request's tile log-sum-exps: [kv_heads, num_rows, its own tile count].
    lse_at = tl.load(info + 7) + (kv_head * num_rows + rows) * tl.cdiv(seq_len, BLOCK_N)
    tl.store(lse_ptr + lse_at + key_tile, lse, mask=row_mask)


@triton.jit
def _lse_kernel(
    row_requests_ptr,  # [total_rows] int64: the request of each row
    requests_ptr,
    tile_lse_ptr,  # per request [num_kv_heads, rows, tiles] float32, at its lse offset
    row_lse_ptr,  # [num_kv_heads, total_rows] float32
    total_rows,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    request = tl.load(row_requests_ptr + row)
    info = requests_ptr + request * 8
    q_len = tl.load(info + 1)
    seq_len = tl.load(info + 2)
    rows_start = tl.load(info + 5)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    at = tile_lse_ptr + tl.load(info + 7) + (kv_head * GROUP * q_len + row - rows_start) * num_tiles
    running_max = tl.full([1], float("-inf"), tl.float32)  # one row: [1, BLOCK_T] tiles
    running_sum = tl.zeros([1], tl.float32)
    for start in range(0, num_tiles, BLOCK_T):
        tiles = start + tl.arange(0, BLOCK_T)[None, :]
        lse = tl.load(at + tiles, mask=tiles < num_tiles, other=float("-inf"))
        running_max, running_sum = online_softmax(running_max, running_sum, lse)
    # Every row sees key 0, so its sum is positive.
    row_lse = tl.sum(running_max + tl.log(running_sum), axis=0)  # the one element
    tl.store(row_lse_ptr + kv_head * total_rows + row, row_lse)


@triton.jit
def _mass_kernel(
    requests_ptr,
    logits_ptr,
    lse_ptr,  # [num_kv_heads, total_rows] float32
    out_ptr,  # [num_kv_heads, out_stride] float32, request r's keys at its key offset
    total_rows,
    out_stride,
    query_ptr,  # the arguments below only when the logits are recomputed
    cache_ptr,
    block_tables_ptr,
    block_size,
    block_table_stride,
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
    NATIVE_DOT: tl.constexpr,
    STORED_LOGITS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    request = tl.program_id(0)
    key_tile = tl.program_id(1)
    kv_head = tl.program_id(2).to(tl.int64)
    info = requests_ptr + request * 8
    q_start = tl.load(info)
    q_len = tl.load(info + 1)
    seq_len = tl.load(info + 2)
    causal = tl.load(info + 3)
    logits_start = tl.load(info + 4)
    rows_start = tl.load(info + 5)
    if key_tile * BLOCK_N >= seq_len:
        return
    num_rows = GROUP * q_len
    keys = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_mask = keys < seq_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    if not STORED_LOGITS:  # the key tile is read once for every row tile below
        k = load_key_tile(
            cache_ptr, block_tables_ptr + request * block_table_stride, block_size, keys,
            key_mask, dims, dim_mask, key_base + kv_head * key_head_stride, key_block_stride,
            key_offset_stride, key_dim_stride, ALIGN,
        )  # fmt: skip
    mass = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row_start in range(0, num_rows, BLOCK_R):
        rows = row_start + tl.arange(0, BLOCK_R)
        row_mask = rows < num_rows
        lse = tl.load(lse_ptr + kv_head * total_rows + rows_start + rows, mask=row_mask, other=0.0)
        if STORED_LOGITS:
            at = logits_ptr + logits_start + (kv_head * num_rows + rows[:, None]) * seq_len
            logits = tl.load(
                at + keys[None, :], mask=row_mask[:, None] & key_mask[None, :], other=float("-inf")
            )
        else:
            logits = _row_logits(
                query_ptr, q_start, q_len, causal, rows, row_mask, dims, dim_mask, kv_head, k,
                keys, key_mask, scale, query_token_stride, query_head_stride, GROUP, NATIVE_DOT,
            )  # fmt: skip
        # Every row sees key 0, so its log-sum-exp is finite.
        mass += tl.sum(tl.exp(logits - lse[:, None]), axis=0)
    out = out_ptr + kv_head * out_stride + tl.load(info + 6) + keys
    tl.store(out, tl.load(out, mask=key_mask, other=0.0) + mass, mask=key_mask)


def triton_span_scores(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    spans: list[ScoredSpan],
    out: torch.Tensor,
    layout: KVLayout,
    scale: float,
) -> None:
    """Add each span's attention mass per key into ``out`` ``[num_kv_heads, columns]``.

    One launch of each kernel; a block-table row and its output columns must not appear
    in two spans of one call (their adds would race). Arguments are checked by the callers.
    """
    if not spans:
        return
    parts = layout.part_strides(kv_cache)
    if parts is None:
        raise ValueError(f"the Triton scores kernel does not handle layout {layout.value}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()  # the kernels step through a row by one
    launch = _Launch.plan(query, kv_cache, block_tables, spans, layout, parts[0], scale)
    logits, lse = launch.logits()
    launch.mass(logits, launch.row_lse(lse), out)


@dataclass(frozen=True, slots=True)
class _Launch:
    """The three launches of one :func:`triton_span_scores` call: their shared arguments
    and the tiling and code paths chosen for this call's shapes and dtypes."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim], last dim contiguous
    kv_cache: torch.Tensor
    keys: PartStrides
    block_size: int
    scale: float
    group: int  # query heads per KV head
    num_kv_heads: int
    spans: SpanTable
    block_r: int
    block_d: int
    row_tiles: int
    store_logits: bool
    native_dot: bool
    align: int

    @classmethod
    def plan(
        cls,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        spans: list[ScoredSpan],
        layout: KVLayout,
        keys: PartStrides,
        scale: float,
    ) -> _Launch:
        num_q_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = layout.num_kv_heads(kv_cache)
        group = num_q_heads // num_kv_heads
        table = SpanTable.pack(spans, group, num_kv_heads, block_tables, query.device)
        # Keep the float32 logits for the second pass when writing and reading them back
        # costs less than reading the keys again (decode: a few rows per KV head); else
        # recompute.
        store_logits = 8 * table.max_rows < head_dim * kv_cache.element_size()
        # tl.dot needs >= 16 rows; 64 keys x head_dim keeps a bf16 K tile at 16 KB.
        block_r = min(64, max(16, triton.next_power_of_2(table.max_rows)))
        block_d = max(16, triton.next_power_of_2(head_dim))
        align = vector_alignment(
            [kv_cache],
            [keys.base, keys.block_stride, keys.offset_stride, keys.head_stride],
            keys.dim_stride,
        )
        row_tiles = triton.cdiv(table.max_rows, block_r)
        return cls(
            query=query,
            kv_cache=kv_cache,
            keys=keys,
            block_size=layout.block_size(kv_cache),
            scale=scale,
            group=group,
            num_kv_heads=num_kv_heads,
            spans=table,
            block_r=block_r,
            block_d=block_d,
            row_tiles=row_tiles,
            store_logits=store_logits,
            native_dot=native_dot(query, kv_cache),
            align=align,
        )

    def logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``_logits_kernel``: the float32 logits (one element when not kept) and each
        row's log-sum-exp per key tile."""
        spans, query, keys, device = self.spans, self.query, self.keys, self.query.device
        size = spans.logits_size if self.store_logits else 1
        logits = torch.empty(size, dtype=torch.float32, device=device)
        lse = torch.empty(spans.lse_size, dtype=torch.float32, device=device)
        _logits_kernel[(spans.num_spans * self.row_tiles, spans.max_tiles, self.num_kv_heads)](
            query,
            self.kv_cache,
            spans.tables,
            spans.requests,
            logits,
            lse,
            self.block_size,
            spans.tables.stride(0),
            self.scale,
            query.stride(0),
            query.stride(1),
            keys.base,
            keys.block_stride,
            keys.offset_stride,
            keys.head_stride,
            keys.dim_stride,
            self.row_tiles,
            GROUP=self.group,
            HEAD_DIM=query.shape[2],
            BLOCK_R=self.block_r,
            BLOCK_N=BLOCK_N,
            BLOCK_D=self.block_d,
            NATIVE_DOT=self.native_dot,
            STORE_LOGITS=self.store_logits,
            ALIGN=self.align,
            num_warps=4,
        )
        return logits, lse

    def row_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """``_lse_kernel``: each row's softmax normaliser, ``[num_kv_heads, num_rows]``."""
        spans = self.spans
        row_lse = torch.empty(
            (self.num_kv_heads, spans.num_rows), dtype=torch.float32, device=self.query.device
        )
        _lse_kernel[(spans.num_rows, self.num_kv_heads)](
            spans.row_request, spans.requests, lse, row_lse, spans.num_rows, BLOCK_T=64,
            BLOCK_N=BLOCK_N, GROUP=self.group,
        )  # fmt: skip
        return row_lse

    def mass(self, logits: torch.Tensor, row_lse: torch.Tensor, out: torch.Tensor) -> None:
        """``_mass_kernel``: each key's attention mass added into ``out``."""
        spans, query, keys = self.spans, self.query, self.keys
        _mass_kernel[(spans.num_spans, spans.max_tiles, self.num_kv_heads)](
            spans.requests,
            logits,
            row_lse,
            out,
            spans.num_rows,
            out.stride(0),
            query,
            self.kv_cache,
            spans.tables,
            self.block_size,
            spans.tables.stride(0),
            self.scale,
            query.stride(0),
            query.stride(1),
            keys.base,
            keys.block_stride,
            keys.offset_stride,
            keys.head_stride,
            keys.dim_stride,
            GROUP=self.group,
            HEAD_DIM=query.shape[2],
            BLOCK_R=self.block_r,
            BLOCK_N=BLOCK_N,
            BLOCK_D=self.block_d,
            NATIVE_DOT=self.native_dot,
            STORED_LOGITS=self.store_logits,
            ALIGN=self.align,
            num_warps=4,
        )
