"""The worker's block-row ops on vLLM 0.32's own ``MultiGroupBlockTable`` (no engine):
block mode's rewrite of a row whose middle blocks were dropped, and the truncation of a
row whose tail blocks a repack emptied (no stale ids left past the new count); in a
hybrid model only the full-attention group's rows and ids."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from workers.vllm_patches.runner_hooks import _rewrite_blocks, _truncate_blocks

SHAPE = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}


def _kv_cache_config(*kinds: str):
    """vLLM's ``KVCacheConfig`` with one group of two layers per kind."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    specs = {
        "full": FullAttentionSpec(**SHAPE),
        "sliding": SlidingWindowSpec(**SHAPE, sliding_window=16),
    }
    groups = [
        KVCacheGroupSpec(
            [f"model.layers.{2 * i + j}.self_attn.attn" for j in range(2)], specs[kind]
        )
        for i, kind in enumerate(kinds)
    ]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_a_block_row_rewrites_the_cached_ids_and_the_batch_row():
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    table = MultiGroupBlockTable(4, 32, False, torch.device("cpu"), [4], max_num_blocks=[8])
    table[0].add_row([5, 2, 7, 9], 1)
    running = SimpleNamespace(block_ids=([5, 2, 7, 9],))
    unscheduled = SimpleNamespace(block_ids=([4, 6, 8],))  # cached, out of this batch
    runner = SimpleNamespace(
        requests={"a": running, "b": unscheduled},
        input_batch=SimpleNamespace(block_table=table, req_id_to_index={"a": 1}),
        kv_cache_config=_kv_cache_config("full"),
    )
    rows = {"a": np.array([5, 9], np.int32), "b": np.array([4], np.int32), "gone": np.zeros(1)}
    _rewrite_blocks(runner, rows)
    assert running.block_ids == ([5, 9],) and unscheduled.block_ids == ([4],)
    assert table[0].num_blocks_per_row[1] == 2
    assert table[0].block_table.np[1, :4].tolist() == [5, 9, 0, 0]
    table[0].append_row([3], 1)  # the step's new block goes after the rewritten row
    table.commit_block_table(2)
    assert table[0].block_table.gpu[1, :3].tolist() == [5, 9, 3]


def test_a_truncated_row_keeps_no_block_id_past_its_count():
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    table = MultiGroupBlockTable(4, 32, False, torch.device("cpu"), [4], max_num_blocks=[8])
    table[0].add_row([5, 2, 7, 9], 0)
    table[0].add_row([1, 3, 4], 1)
    first, second = (
        SimpleNamespace(block_ids=([5, 2, 7, 9],)),
        SimpleNamespace(block_ids=([1, 3, 4],)),
    )
    runner = SimpleNamespace(
        requests={"a": first, "b": second},
        input_batch=SimpleNamespace(block_table=table, req_id_to_index={"a": 0, "b": 1}),
        kv_cache_config=_kv_cache_config("full"),
    )
    _truncate_blocks(runner, {"a": 2, "gone": 1})
    assert first.block_ids == ([5, 2],) and second.block_ids == ([1, 3, 4],)
    assert table[0].num_blocks_per_row[0] == 2
    assert table[0].block_table.np[0, :5].tolist() == [5, 2, 0, 0, 0]
    assert table[0].block_table.np[1, :4].tolist() == [1, 3, 4, 0]  # untouched


def test_a_hybrid_model_truncates_its_full_attention_group_only():
    """Group 0 sliding-window (vLLM's), group 1 full attention (vToken's)."""
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    table = MultiGroupBlockTable(4, 32, False, torch.device("cpu"), [32, 32], max_num_blocks=[8, 8])
    table[0].add_row([0, 0, 11], 0)  # out-of-window blocks are vLLM's null block
    table[1].add_row([5, 2, 7, 9], 0)
    request = SimpleNamespace(block_ids=([0, 0, 11], [5, 2, 7, 9]))
    runner = SimpleNamespace(
        requests={"a": request},
        input_batch=SimpleNamespace(block_table=table, req_id_to_index={"a": 0}),
        kv_cache_config=_kv_cache_config("sliding", "full"),
    )
    _truncate_blocks(runner, {"a": 2})
    assert request.block_ids == ([0, 0, 11], [5, 2])
    assert table[1].num_blocks_per_row[0] == 2
    assert table[1].block_table.np[0, :4].tolist() == [5, 2, 0, 0]
    assert table[0].num_blocks_per_row[0] == 3
    assert table[0].block_table.np[0, :3].tolist() == [0, 0, 11]
