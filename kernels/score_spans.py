"""How ``attention_scores`` cuts a step's scoring into kernel launches (pure Python).

A request's query rows are scored against its keys; the float32 logits of one launch are
bounded by ``MAX_LOGITS`` elements (64 MiB): a request over the bound alone is split into
query chunks (exact: each query row is normalised on its own), each in its own launch,
since two chunks of one request add into the same output columns.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGITS = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ScoredSpan:
    """Rows ``[q_start, q_start + q_len)`` of the query tensor, scored against the first
    ``seq_len`` keys of a block-table row; query ``i`` sees keys ``j <= causal + i``; the
    mass is added at output columns ``[key_offset, key_offset + seq_len)``."""

    q_start: int
    q_len: int
    seq_len: int
    causal: int
    key_offset: int
    table_row: int


def request_spans(
    num_q_heads: int, q_start: int, q_len: int, seq_len: int, key_offset: int, row: int
) -> list[ScoredSpan]:
    """One request as query chunks whose logits stay under ``MAX_LOGITS``; vLLM's causal
    rule (query ``i`` of the request sees keys ``j <= seq_len - q_len + i``)."""
    chunk = max(1, MAX_LOGITS // (num_q_heads * seq_len))
    return [
        ScoredSpan(q_start + start, min(chunk, q_len - start), seq_len,
                   seq_len - q_len + start, key_offset, row)
        for start in range(0, q_len, chunk)
    ]  # fmt: skip


def pack_launches(requests: list[list[ScoredSpan]], num_q_heads: int) -> list[list[ScoredSpan]]:
    """Group the requests' spans into launches of at most ``MAX_LOGITS`` logits; a
    request cut into chunks gives one launch per chunk."""
    launches: list[list[ScoredSpan]] = []
    batch: list[ScoredSpan] = []
    size = 0
    for spans in requests:
        if len(spans) > 1:
            launches.extend([span] for span in spans)
            continue
        span = spans[0]
        cost = num_q_heads * span.q_len * span.seq_len
        if batch and size + cost > MAX_LOGITS:
            launches.append(batch)
            batch, size = [], 0
        batch.append(span)
        size += cost
    if batch:
        launches.append(batch)
    return launches
