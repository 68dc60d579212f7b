"""Layouts: the offsets are a bijection, views agree, and they match what vLLM writes."""

from __future__ import annotations

import pytest
import torch

from kernels.layout import KVLayout

# vLLM's CPU attention picks (and its ops accept) the AMX layout only where the CPU has
# AMX tiles, as vLLM itself checks; elsewhere no engine writes that layout.
NEEDS_AMX = pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles"
)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("block_size", [16, 32])
def test_element_offsets_cover_the_cache_once(layout: KVLayout, block_size: int) -> None:
    cache = layout.new_cache(3, block_size, 2, 64)
    offsets = layout.element_offsets(cache, torch.arange(3 * block_size))
    assert torch.equal(offsets.flatten().sort().values, torch.arange(cache.numel()))


@pytest.mark.parametrize("layout", [KVLayout.BHNC, KVLayout.CPU_ATTN])
def test_keys_values_views_agree_with_gather(layout: KVLayout) -> None:
    cache = layout.new_cache(4, 16, 3, 32).normal_()
    keys, values = layout.keys_values(cache)
    slots = torch.tensor([0, 17, 63, 5])
    gathered = layout.gather(cache, slots)
    assert torch.equal(gathered[:, 0], keys[slots // 16, slots % 16])
    assert torch.equal(gathered[:, 1], values[slots // 16, slots % 16])


def test_for_cpu_isa() -> None:
    assert KVLayout.for_cpu_isa("vec") is KVLayout.CPU_ATTN
    assert KVLayout.for_cpu_isa("vec16") is KVLayout.CPU_ATTN
    assert KVLayout.for_cpu_isa("amx") is KVLayout.CPU_ATTN_AMX
    with pytest.raises(ValueError, match="not been probed"):
        KVLayout.for_cpu_isa("neon")


@pytest.mark.parametrize(
    ("isa", "dtype", "block_size", "head_dim"),
    [
        ("vec", torch.float32, 32, 64),
        ("vec", torch.bfloat16, 64, 128),
        ("vec16", torch.float16, 32, 80),
        pytest.param("amx", torch.bfloat16, 32, 64, marks=NEEDS_AMX),
        pytest.param("amx", torch.bfloat16, 128, 128, marks=NEEDS_AMX),
    ],
)
def test_layout_matches_vllm_cpu_writes(
    isa: str, dtype: torch.dtype, block_size: int, head_dim: int
) -> None:
    """Write tokens with vLLM's own op and read them back through our offsets."""
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip("not the CPU build of vLLM")
    layout = KVLayout.for_cpu_isa(isa)
    num_blocks, kv_heads = 3, 2
    cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, kv_heads, 2 * block_size, head_dim).chunk(2, 2)
    slots = torch.randperm(num_blocks * block_size)[:50]
    keys = torch.randn(50, kv_heads, head_dim).to(dtype)
    values = torch.randn(50, kv_heads, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    read = layout.gather(cache, slots)
    assert torch.equal(read[:, 0], keys)
    assert torch.equal(read[:, 1], values)
