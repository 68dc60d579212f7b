"""How one call of ``kernels._scores_triton.triton_span_scores`` hands its spans to the
kernels: their table packed on the host and uploaded without the host waiting."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels._score_tiles_triton import BLOCK_N
from kernels.intmath import cdiv
from kernels.score_spans import ScoredSpan


@dataclass(frozen=True, slots=True)
class SpanTable:
    """One call's spans as the kernels read them, on ``device``. ``requests``:
    int64 ``[num_spans * 8]``, per span ``(q_start, q_len, seq_len, causal, logits offset,
    first row, key offset, lse offset)``; ``row_request``: int64 ``[num_rows]``, each row's
    span; ``tables``: the spans' block-table rows, in span order. A span has ``group *
    q_len`` rows per KV head; the sizes are of the float32 scratch over all KV heads."""

    requests: torch.Tensor
    row_request: torch.Tensor
    tables: torch.Tensor
    num_spans: int
    num_rows: int
    max_rows: int  # of one span
    max_tiles: int  # BLOCK_N key tiles of the longest span
    logits_size: int
    lse_size: int

    @classmethod
    def pack(
        cls,
        spans: list[ScoredSpan],
        group: int,
        num_kv_heads: int,
        block_tables: torch.Tensor,
        device: torch.device,
    ) -> SpanTable:
        rows = [group * span.q_len for span in spans]
        info, row_requests, logits_size, rows_start, lse_size = [], [], 0, 0, 0
        for index, (span, num_rows) in enumerate(zip(spans, rows, strict=True)):
            info.append([span.q_start, span.q_len, span.seq_len, span.causal, logits_size,
                         rows_start, span.key_offset, lse_size])  # fmt: skip
            logits_size += num_kv_heads * num_rows * span.seq_len
            lse_size += num_kv_heads * num_rows * cdiv(span.seq_len, BLOCK_N)
            rows_start += num_rows
            row_requests.extend([index] * num_rows)
        table_rows = [span.table_row for span in spans]
        # One host-to-device copy: the per-request table, then each row's request.
        packed_host = np.concatenate(
            [np.asarray(info, dtype=np.int64).ravel(), np.asarray(row_requests, dtype=np.int64)]
        )
        packed = _upload(torch.from_numpy(packed_host), device)
        tables = block_tables
        if table_rows != list(range(len(spans))):
            selected = _upload(torch.tensor(table_rows, dtype=torch.int64), device)
            tables = block_tables.index_select(0, selected)
        max_tiles = cdiv(max(span.seq_len for span in spans), BLOCK_N)
        requests, row_request = packed[: 8 * len(spans)], packed[8 * len(spans) :]
        return cls(
            requests=requests,
            row_request=row_request,
            tables=tables,
            num_spans=len(spans),
            num_rows=rows_start,
            max_rows=max(rows),
            max_tiles=max_tiles,
            logits_size=logits_size,
            lse_size=lse_size,
        )


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without the host waiting: from pinned memory on CUDA (a
    ``non_blocking`` copy from pageable memory synchronises)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
