"""A real KV tensor in the CPU_ATTN layout whose every token carries a recognisable value."""

from __future__ import annotations

import numpy as np
import torch

from kernels import KVLayout

NUM_HEADS, HEAD_DIM = 2, 8


class TaggedKV:
    """Writes ``tag(logical_id)`` into K and V of each token; checks it after repacks."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int = 2) -> None:
        self.layout = KVLayout.CPU_ATTN
        self.block_size = block_size
        self.caches = [
            self.layout.new_cache(num_blocks, block_size, NUM_HEADS, HEAD_DIM).fill_(-1.0)
            for _ in range(num_layers)
        ]

    @staticmethod
    def tag(logical_ids: np.ndarray, layer: int, part: int) -> torch.Tensor:
        """``[n, heads, head_dim]`` distinct values per (token, layer, K/V, head, dim)."""
        ids = torch.as_tensor(logical_ids, dtype=torch.float32)[:, None, None]
        head = torch.arange(NUM_HEADS, dtype=torch.float32)[None, :, None]
        dim = torch.arange(HEAD_DIM, dtype=torch.float32)[None, None, :]
        return ids * 1000 + layer * 100 + part * 50 + head * 10 + dim

    def write(self, global_slots: np.ndarray, logical_ids: np.ndarray) -> None:
        blocks = torch.as_tensor(global_slots // self.block_size)
        offsets = torch.as_tensor(global_slots % self.block_size)
        for layer, cache in enumerate(self.caches):
            for part, view in enumerate(self.layout.keys_values(cache)):
                view[blocks, offsets] = self.tag(logical_ids, layer, part)

    def read(self, global_slots: np.ndarray, layer: int, part: int) -> torch.Tensor:
        view = self.layout.keys_values(self.caches[layer])[part]
        slots = torch.as_tensor(global_slots)
        return view[slots // self.block_size, slots % self.block_size]

    def assert_intact(self, global_slots: np.ndarray, logical_ids: np.ndarray) -> None:
        for layer in range(len(self.caches)):
            for part in (0, 1):
                expected = self.tag(logical_ids, layer, part)
                assert torch.equal(self.read(global_slots, layer, part), expected)
