"""The CPU torch path's decode batches of ``kernels.attention_scores``: requests with one
query row each scored together (one gather, one batched matmul and one softmax for all of
them, padded to the longest), planned once per step and run per layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import score_spans
from kernels.intmath import cdiv
from kernels.layout import KVLayout, indexable


def decode_chunks(
    requests: Sequence[int], seq_lens: Sequence[int], per_key: int
) -> list[list[int]]:
    """Decode requests in groups whose padded buffers (``per_key`` float32 elements per
    key: the gathered keys or the logits, the larger) stay under ``MAX_LOGITS`` (padding
    to the group's longest key count: requests of similar lengths go together)."""
    order = sorted(requests, key=lambda r: int(seq_lens[r]))
    chunks: list[list[int]] = []
    for r in order:
        size = (len(chunks[-1]) + 1) * per_key * int(seq_lens[r]) if chunks else 0
        if chunks and size <= score_spans.MAX_LOGITS:
            chunks[-1].append(r)
        else:
            chunks.append([r])
    return chunks


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Requests with one query row each (a decode step) scored together on CPU: one
    gather, one batched matmul and one softmax for all of them, padded to the longest,
    instead of a handful of small torch calls per request (which cost more than the
    math). Built once per step; :meth:`mass` runs per layer."""

    requests: list[int]  # indices into the step's requests
    lengths: list[int]
    blocks: torch.Tensor  # [R * num_blocks] int64, padded rows repeat their first block
    rows: torch.Tensor  # [R] the requests' query rows
    hidden: torch.Tensor  # [R, 1, 1, num_blocks * block_size] bool: keys past a length

    @classmethod
    def build(
        cls,
        requests: list[int],
        block_tables: torch.Tensor,
        query_starts: Sequence[int],
        seq_lens: Sequence[int],
        block_size: int,
    ) -> DecodeBatch:
        lengths = [int(seq_lens[r]) for r in requests]
        num_blocks = cdiv(max(lengths), block_size)
        device = block_tables.device
        blocks = block_tables[torch.tensor(requests, device=device), :num_blocks].long()
        # Rows shorter than the longest end in blocks that are not theirs: read their first
        # block again there (those logits are masked).
        used = torch.tensor([cdiv(n, block_size) for n in lengths], device=device)
        beyond = torch.arange(num_blocks, device=device).view(1, -1) >= used.view(-1, 1)
        blocks = torch.where(beyond, blocks[:, :1], blocks)
        keys = torch.arange(num_blocks * block_size, device=device)
        hidden = keys.view(1, -1) >= torch.tensor(lengths, device=device).view(-1, 1)
        rows = torch.tensor([int(query_starts[r]) for r in requests], device=device)
        return cls(requests, lengths, blocks.view(-1), rows, hidden.view(len(requests), 1, 1, -1))

    def mass(
        self, query: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout, scale: float
    ) -> torch.Tensor:
        """``[R, num_kv_heads, num_blocks * block_size]`` float32 (0 past a length)."""
        num_requests, block_size = len(self.requests), layout.block_size(kv_cache)
        # Whole blocks as [head, dim, token]: cpu_attn's own order, one run per block and head.
        keys = layout.keys_values(indexable(kv_cache))[0].permute(0, 2, 3, 1)
        keys = keys.index_select(0, self.blocks).view(kv_cache.dtype).float()
        num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
        keys = keys.view(num_requests, -1, num_kv_heads, head_dim, block_size)
        group = query.shape[1] // num_kv_heads
        queries = query[self.rows].float().view(num_requests, 1, num_kv_heads, group, head_dim)
        logits = torch.matmul(queries * scale, keys)  # [R, blocks, kv_heads, group, block_size]
        logits = logits.permute(0, 2, 3, 1, 4).reshape(num_requests, num_kv_heads, group, -1)
        logits.masked_fill_(self.hidden, float("-inf"))
        return logits.softmax(dim=-1).sum(dim=2)

    def write_mass(
        self,
        out: torch.Tensor,
        key_offsets: Sequence[int],
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        scale: float,
    ) -> None:
        """:meth:`mass` into each request's columns of ``out`` (``[num_kv_heads,
        sum(seq_lens)]``, request ``r``'s keys at ``key_offsets[r]``)."""
        mass = self.mass(query, kv_cache, layout, scale)
        for row, r in enumerate(self.requests):
            out[:, key_offsets[r] : key_offsets[r + 1]] = mass[row, :, : self.lengths[row]]


def decode_batches(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: torch.Tensor,
    query_starts: Sequence[int],
    num_q_heads: int,
    kv_cache: torch.Tensor,
    layout: KVLayout,
) -> list[DecodeBatch]:
    decode = [r for r in range(len(seq_lens)) if query_lens[r] == 1]
    per_key = max(num_q_heads, layout.num_kv_heads(kv_cache) * layout.head_dim(kv_cache))
    block_size = layout.block_size(kv_cache)
    return [
        DecodeBatch.build(chunk, block_tables, query_starts, seq_lens, block_size)
        for chunk in decode_chunks(decode, seq_lens, per_key)
    ]
