"""Grouped repack (one head of one layer per move) against its one-move-at-a-time
reference on odd shapes, every layout, strided vLLM views; and its argument checks."""

from __future__ import annotations

import pytest
import torch

from kernels.grouped_repack import check_grouped_moves, grouped_repack, reference_grouped_repack
from kernels.layout import KVLayout, paged_layer_views

CASES = [  # (block_size, kv_heads, head_dim, num_layers, num_moves)
    (16, 1, 32, 1, 1),
    (16, 3, 64, 5, 37),
    (32, 2, 96, 3, 70),
]


def _moves(num_layers: int, kv_heads: int, num_slots: int, num_moves: int, seed: int):
    """Random moves, within each (layer, head) destinations distinct and never sources."""
    generator = torch.Generator().manual_seed(seed)
    layers = torch.randint(num_layers, (num_moves,), generator=generator)
    heads = torch.randint(kv_heads, (num_moves,), generator=generator)
    perm = torch.randperm(num_slots, generator=generator)
    src = perm[torch.randint(num_slots // 2, (num_moves,), generator=generator)]
    dst = perm[num_slots // 2 :][:num_moves]  # distinct, none a source
    return layers, heads, src, dst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "kv_heads", "head_dim", "num_layers", "num_moves"), CASES)
@pytest.mark.parametrize("layout", [*KVLayout, "LBNHC", "BLHNC"])
def test_grouped_repack_matches_reference(
    layout, dtype, block_size, kv_heads, head_dim, num_layers, num_moves
) -> None:
    num_blocks = -(-4 * num_moves // block_size) + 2
    if not isinstance(layout, KVLayout):  # vLLM's strided bhnc views of one buffer
        caches = paged_layer_views(
            num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, kv_cache_layout=layout
        )
        layout = KVLayout.BHNC
    else:
        caches = [
            layout.new_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
            for _ in range(num_layers)
        ]
    for cache in caches:
        cache.copy_(torch.randn(cache.shape).to(dtype))
    moves = _moves(num_layers, kv_heads, num_blocks * block_size, num_moves, seed=num_moves)
    expected = [cache.clone() for cache in caches]
    reference_grouped_repack(expected, *moves, layout)
    before = [cache.clone() for cache in caches]
    grouped_repack(caches, *moves, layout)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    assert any(not torch.equal(c, b) for c, b in zip(caches, before, strict=True)), "no-op"


def test_grouped_moves_are_checked() -> None:
    layout = KVLayout.CPU_ATTN
    caches = [layout.new_cache(4, 16, 2, 32) for _ in range(3)]
    one, five = torch.tensor([0]), torch.tensor([5])

    def check(layers=one, heads=one, src=one, dst=five):
        check_grouped_moves(caches, layers, heads, src, dst, layout)

    check()
    check(layers=torch.tensor([0, 1]), heads=torch.tensor([0, 0]), src=torch.tensor([1, 1]),
          dst=torch.tensor([2, 2]))  # fmt: skip  # the same slots in two layers: valid
    for kwargs, message in [
        ({"layers": torch.tensor([3])}, "layers out of range"),
        ({"heads": torch.tensor([2])}, "heads out of range"),
        ({"dst": torch.tensor([64])}, "dst_slots out of range"),
        ({"dst": torch.tensor([0])}, "also a source"),
        ({"src": torch.tensor([0, 1]), "dst": torch.tensor([2, 2]),
          "layers": torch.tensor([0, 0]), "heads": torch.tensor([1, 1])}, "repeats"),
        ({"heads": torch.tensor([0, 1])}, "entries"),
        ({"src": torch.tensor([0], dtype=torch.int32)}, "int64"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            check(**kwargs)
