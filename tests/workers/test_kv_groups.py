"""Which KV cache groups vToken manages, and the refusals that name a model's layer types
(vLLM's own KV cache spec classes; the engines: ``test_engine_hybrid.py``)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from workers.vllm_patches.kv_groups import (
    GroupLayout,
    describe_groups,
    group_layout,
    kv_group_problems,
)

SHAPE = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
FULL = FullAttentionSpec(**SHAPE)
SLIDING = SlidingWindowSpec(**SHAPE, sliding_window=512)


def _config(*groups: tuple[list[int], object], name: str = "self_attn.attn") -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.{name}" for i in layers], spec)
            for layers, spec in groups
        ],
    )


def test_one_full_attention_group_is_managed_alone():
    config = _config(([0, 1], FULL))
    assert kv_group_problems(config) == []
    assert group_layout(config) == GroupLayout(
        full_group=0,
        full_layer_names=("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),
    )
    assert not group_layout(config).hybrid


def test_gemma3_layout_full_group_beside_sliding_groups():
    """Gemma 3 270M as vLLM 0.32 groups it: five sliding groups of three layers, one full."""
    sliding = [[0, 1, 2], [3, 4, 6], [7, 8, 9], [10, 12, 13], [14, 15, 16]]
    config = _config(*[(layers, SLIDING) for layers in sliding], ([5, 11, 17], FULL))
    assert kv_group_problems(config) == []
    layout = group_layout(config)
    assert layout.full_group == 5
    assert layout.sliding_groups == (0, 1, 2, 3, 4)
    assert layout.windows == (512,) * 5
    assert layout.full_layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in (5, 11, 17))
    assert layout.hybrid and layout.num_groups == 6
    assert describe_groups(config).endswith(
        "group 4: sliding window 512 (layers 14-16), group 5: full attention (layers 5, 11, 17)"
    )


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (
            [
                ([0, 2], MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))),
                ([1, 3], FULL),
            ],
            r"other than full and sliding-window attention.*group 0: mamba \(layers 0, 2\)",
        ),
        (
            [([0], FULL), ([1], CrossAttentionSpec(**SHAPE))],
            r"group 1: cross attention \(layers 1\)",
        ),
        (
            [
                ([0, 1], ChunkedLocalAttentionSpec(**SHAPE, attention_chunk_size=8192)),
                ([2, 3], FULL),
            ],
            r"group 0: chunked local attention 8192 \(layers 0-1\)",
        ),
        (
            [([0, 1], FULL), ([2, 3], FULL), ([4, 5], SLIDING)],
            r"2 full-attention KV cache groups \(vToken manages one\)\): group 0: full attention"
            r" \(layers 0-1\), group 1: full attention \(layers 2-3\), group 2: sliding window"
            r" 512 \(layers 4-5\)",
        ),
        (
            [([0, 1], SLIDING)],
            r"no full-attention KV cache group",
        ),
    ],
    ids=["mamba", "cross-attention", "chunked-local", "two-full-groups", "sliding-only"],
)
def test_layouts_vtoken_cannot_manage_name_their_layer_types(groups, message):
    config = _config(*groups)
    (problem,) = kv_group_problems(config)
    assert problem.startswith("this model's KV cache (")
    with pytest.raises(ValueError, match=message):
        group_layout(config)


def test_per_layer_kv_sizes_that_differ_are_refused_with_their_sizes():
    wide = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.float32)
    mixed = UniformTypeKVCacheSpecs(
        block_size=32,
        kv_cache_specs={
            "model.layers.0.self_attn.attn": FULL,
            "model.layers.1.self_attn.attn": wide,
        },
    )
    (problem,) = kv_group_problems(_config(([0, 1], mixed)))
    sizes = sorted({FULL.page_size_bytes, wide.page_size_bytes})
    assert f"full attention with per-layer KV sizes {sizes} bytes per block (layers 0-1)" in problem


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            FullAttentionSpec(**SHAPE, attention_chunk_size=8192),
            r"chunked local attention 8192 allocated as full attention \(layers 2-3\)",
        ),
        (
            FullAttentionSpec(**SHAPE, sliding_window=512),
            r"sliding window 512 allocated as full attention \(layers 2-3\)",
        ),
    ],
    ids=["chunked-local-promoted", "sliding-promoted"],
)
def test_layers_vllm_promoted_to_full_attention_are_refused_by_their_type(spec, message):
    """With vLLM's hybrid KV cache manager off, chunked local and sliding-window layers
    arrive as ``FullAttentionSpec`` with a chunk size or window: not plain full attention
    (vToken's physical lengths would move their chunk boundaries and windows)."""
    config = _config(([0, 1], FULL), ([2, 3], spec))
    (problem,) = kv_group_problems(config)
    with pytest.raises(ValueError, match=message):
        group_layout(config)
    assert "group 0: full attention (layers 0-1)" in problem


def test_groups_whose_blocks_differ_from_the_full_group_are_refused():
    """One repack and one layout serve every layer's cache: a sliding group with another
    block size or head size (vLLM unifies page sizes that way) is refused at start."""
    for other in (
        SlidingWindowSpec(**{**SHAPE, "block_size": 16}, sliding_window=512),
        SlidingWindowSpec(**{**SHAPE, "head_size": 64}, sliding_window=512),
    ):
        (problem,) = kv_group_problems(_config(([0, 1], other), ([2], FULL)))
        assert "KV cache groups whose blocks differ" in problem
    padded = FullAttentionSpec(**SHAPE, page_size_padded=FULL.page_size_bytes * 2)
    assert kv_group_problems(_config(([0, 1], padded)))
