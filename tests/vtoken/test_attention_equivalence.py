"""Attention over the repacked store equals attention over the live tokens of the original."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import KVLayout
from vtoken import StandaloneBlockPool, VTokenManager

NUM_HEADS, HEAD_DIM, NUM_BLOCKS = 2, 16, 40


def paged_attention(query, cache, block_ids, num_tokens, block_size, layout):
    """SDPA over the first ``num_tokens`` slots of a request's blocks, in slot order."""
    slots = torch.arange(num_tokens)
    blocks = torch.as_tensor(block_ids)[slots // block_size]
    keys, values = (part[blocks, slots % block_size] for part in layout.keys_values(cache))
    return F.scaled_dot_product_attention(  # [heads, q, d] over [heads, n, d]
        query, keys.transpose(0, 1), values.transpose(0, 1)
    )


@pytest.mark.parametrize("layout", [KVLayout.BHNC, KVLayout.CPU_ATTN])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_repacked_attention_matches_live_tokens(layout, block_size, seed):
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    pool = StandaloneBlockPool(NUM_BLOCKS)
    cache = layout.new_cache(NUM_BLOCKS, block_size, NUM_HEADS, HEAD_DIM)
    cache.copy_(torch.randn(cache.shape, generator=generator))
    manager = VTokenManager(pool, block_size)
    manager.add_request("r", prompt_len=0)
    num_tokens = int(rng.integers(block_size, 6 * block_size))
    manager.allocate("r", num_tokens)
    table = manager.requests["r"].table
    keys, values = (part.clone() for part in layout.keys_values(cache))
    evicted = np.sort(rng.choice(num_tokens, size=int(rng.integers(1, num_tokens)), replace=False))
    manager.evict_ids("r", evicted)
    live = np.setdiff1d(np.arange(num_tokens), evicted)
    original = table.global_slots(table.slot_of(live))
    (plan,) = manager.reclaim()  # the engine copies what the plan moves
    kernels.repack(
        [cache], torch.from_numpy(plan.src_slots), torch.from_numpy(plan.dst_slots), layout
    )

    query = torch.randn(NUM_HEADS, 3, HEAD_DIM, generator=generator)
    slots = torch.as_tensor(original)
    expected = F.scaled_dot_product_attention(
        query,
        keys[slots // block_size, slots % block_size].transpose(0, 1),
        values[slots // block_size, slots % block_size].transpose(0, 1),
    )
    actual = paged_attention(query, cache, table.block_ids, table.num_live, block_size, layout)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert len(table.block_ids) == -(-live.size // block_size)
