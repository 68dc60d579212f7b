"""Repack dispatcher: backends against the reference on odd shapes, argument checks,
planner moves, the fallback to torch. The C loop's own paths: ``test_repack_cpu.py``."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from kernels.layout import KVLayout
from kernels.repack import RepackBackend, check_repack_args, reference_repack, repack
from tests.kernels.conftest import DEVICE, triton_usable
from vtoken import repack_planner as planner
from vtoken import token_table

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _backends(layout: KVLayout) -> list[RepackBackend]:
    if layout is KVLayout.CPU_ATTN_AMX:
        return [RepackBackend.TORCH]
    native = RepackBackend.TRITON if DEVICE.type == "cuda" else RepackBackend.CPU
    return [native, RepackBackend.TRITON, RepackBackend.TORCH]


def _moves(num_slots: int, num_moves: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))
    return perm[:num_moves].to(DEVICE), perm[num_moves : 2 * num_moves].to(DEVICE)


CASES = [  # (block_size, kv_heads, head_dim, num_moves)
    (16, 1, 64, 1),
    (16, 3, 64, 37),
    (32, 8, 128, 20),
    (128, 2, 64, 70),
]


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "kv_heads", "head_dim", "num_moves"), CASES)
def test_repack_matches_reference(
    layout: KVLayout,
    dtype: torch.dtype,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    num_moves: int,
) -> None:
    num_blocks = max(3, -(-2 * num_moves // block_size) + 1)
    caches = [
        layout.new_cache(num_blocks, block_size, kv_heads, head_dim, dtype, DEVICE).normal_()
        for _ in range(3)
    ]
    src, dst = _moves(num_blocks * block_size, num_moves, seed=block_size + num_moves)
    expected = [cache.clone() for cache in caches]
    reference_repack(expected, src, dst, layout)
    moved = [layout.gather(cache, src) for cache in caches]
    for backend in _backends(layout):
        if backend is RepackBackend.TRITON and not triton_usable():
            continue
        got = [cache.clone() for cache in caches]
        repack(got, src, dst, layout, backend=backend)
        for g, e, m in zip(got, expected, moved, strict=True):
            assert torch.equal(g, e), backend
            assert torch.equal(layout.gather(g, dst), m), backend


def test_default_backend_and_empty_moves() -> None:
    cache = KVLayout.CPU_ATTN.new_cache(2, 16, 1, 32).normal_()
    before = cache.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    repack([cache], empty, empty, KVLayout.CPU_ATTN)
    assert torch.equal(cache, before)
    repack([cache], torch.tensor([3]), torch.tensor([20]), KVLayout.CPU_ATTN)
    assert torch.equal(
        KVLayout.CPU_ATTN.gather(cache, torch.tensor([20])),
        KVLayout.CPU_ATTN.gather(before, torch.tensor([3])),
    )


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([1, 2], [3], "sources but"),
        ([1, 2], [2, 3], "also a source"),
        ([1, 2], [3, 3], "appears twice"),
        ([1], [64], "out of range"),
        ([-1], [5], "out of range"),
    ],
)
def test_check_rejects_bad_moves(src: list[int], dst: list[int], message: str) -> None:
    cache = KVLayout.BHNC.new_cache(4, 16, 1, 32)
    with pytest.raises(ValueError, match=message):
        check_repack_args([cache], torch.tensor(src), torch.tensor(dst), KVLayout.BHNC)
    # Through the dispatcher: the C loop checks slot values itself; nothing is copied.
    for layout in (KVLayout.BHNC, KVLayout.CPU_ATTN):
        caches = [layout.new_cache(4, 16, 1, 32).normal_() for _ in range(2)]
        before = [c.clone() for c in caches]
        for backend in _backends(layout):
            with pytest.raises(ValueError, match=message):
                repack(caches, torch.tensor(src), torch.tensor(dst), layout, backend=backend)
            assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))


def test_moves_into_a_cache_without_slots_are_rejected() -> None:
    """No blocks: every slot is out of range, whichever backend checks it."""
    for layout in (KVLayout.BHNC, KVLayout.CPU_ATTN):
        cache = layout.new_cache(0, 16, 1, 32)
        for backend in _backends(layout):
            with pytest.raises(ValueError, match=r"out of range \[0, 0\)"):
                repack([cache], torch.tensor([5]), torch.tensor([10**6]), layout, backend=backend)
    with pytest.raises(ValueError, match="block_size >= 1"):
        check_repack_args([KVLayout.CPU_ATTN.new_cache(4, 0, 1, 32)], *[torch.tensor([1])] * 2,
                          KVLayout.CPU_ATTN)  # fmt: skip


def test_check_rejects_bad_caches() -> None:
    layout = KVLayout.CPU_ATTN
    a = layout.new_cache(4, 16, 1, 32)
    slots = torch.tensor([1]), torch.tensor([2])
    with pytest.raises(ValueError, match="differ"):
        check_repack_args([a, a.to(torch.bfloat16)], *slots, layout)
    with pytest.raises(ValueError, match="contiguous"):
        check_repack_args([a.transpose(2, 3)], *slots, layout)
    with pytest.raises(ValueError, match="int64"):
        check_repack_args([a], torch.tensor([1], dtype=torch.int32), slots[1], layout)
    with pytest.raises(ValueError, match="at least one"):
        check_repack_args([], *slots, layout)


@pytest.mark.parametrize("layout", [KVLayout.CPU_ATTN, KVLayout.BHNC])
def test_planner_moves_keep_every_live_token(layout: KVLayout) -> None:
    """The repack planner's moves, applied by the dispatcher, keep each live token's bytes."""
    rng = np.random.default_rng(0)
    block_size, num_tokens, pool_blocks = 16, 300, 40
    table = token_table.TokenTable(block_size)
    block_ids = rng.permutation(pool_blocks)[: table.num_blocks_needed(num_tokens)].tolist()
    table.append(num_tokens, block_ids)
    table.evict(np.sort(rng.choice(num_tokens, 170, replace=False)))
    cache = layout.new_cache(pool_blocks, block_size, 2, 64, torch.bfloat16, DEVICE).normal_()
    live = table.live_logical_ids()
    before = layout.gather(
        cache, torch.from_numpy(table.global_slots(table.slot_of(live))).to(DEVICE)
    )
    plan = planner.plan_repack(table)
    repack(
        [cache],
        torch.from_numpy(plan.src_slots).to(DEVICE),
        torch.from_numpy(plan.dst_slots).to(DEVICE),
        layout,
    )
    table.move(plan.src_local, plan.dst_local, plan.num_slots_after)
    after_slots = torch.from_numpy(table.global_slots(table.slot_of(live))).to(DEVICE)
    assert int(after_slots.max()) < max(block_ids) * block_size + block_size
    assert torch.equal(layout.gather(cache, after_slots), before)


@pytest.mark.parametrize("library", ["missing", "out_of_memory"])
def test_cpu_backend_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, library: str) -> None:
    """Without the C library, or when it runs out of memory (nothing copied), the CPU backend
    checks the moves in numpy and copies with the reference."""
    dispatcher = importlib.import_module("kernels.repack")  # the package exports repack()

    def out_of_memory(*args: object, **kwargs: object) -> int:
        raise MemoryError

    if library == "missing":
        monkeypatch.setattr(dispatcher, "load_library", lambda: None)
    elif dispatcher.load_library() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(dispatcher, "cpu_repack", out_of_memory)
    layout = KVLayout.CPU_ATTN
    cache = layout.new_cache(4, 16, 2, 32).normal_()
    expected = cache.clone()
    src, dst = torch.tensor([40, 41, 50]), torch.tensor([1, 2, 3])
    reference_repack([expected], src, dst, layout)
    repack([cache], src, dst, layout, backend=RepackBackend.CPU)
    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match="also a source"):
        repack([cache], src, torch.tensor([4, 5, 40]), layout, backend=RepackBackend.CPU)


def test_triton_launch_is_planned_once_per_cache_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps on one set of caches reuse one launch plan (one launch for every layer each),
    whatever their move counts (1, 16, 37: the counts Triton specialises differently)."""
    if not triton_usable():
        pytest.skip("Triton kernels cannot run here")
    from kernels import _repack_triton

    layout = KVLayout.BHNC
    caches = [layout.new_cache(12, 16, 2, 32, torch.float32, DEVICE).normal_() for _ in range(3)]
    planned = []
    plan = _repack_triton.RepackLaunch.plan
    monkeypatch.setattr(
        _repack_triton.RepackLaunch, "plan", lambda *a: planned.append(1) or plan(*a)
    )
    monkeypatch.setattr(_repack_triton, "_PLANS", {})
    launches = []
    launch = _repack_triton.RepackLaunch.__call__
    monkeypatch.setattr(
        _repack_triton.RepackLaunch, "__call__", lambda *a: launches.append(1) or launch(*a)
    )
    for seed, num_moves in enumerate((1, 16, 37)):
        src, dst = _moves(12 * 16, num_moves, seed=seed)
        expected = [cache.clone() for cache in caches]
        reference_repack(expected, src, dst, layout)
        repack(caches, src, dst, layout, backend=RepackBackend.TRITON)
        for got, want in zip(caches, expected, strict=True):
            assert torch.equal(got, want)
    assert planned == [1] and launches == [1, 1, 1]
