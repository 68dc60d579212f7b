"""Repack backends against the reference on odd shapes, argument checks, planner moves."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.layout import KVLayout
from kernels.repack import RepackBackend, check_repack_args, reference_repack, repack
from tests.kernels.conftest import DEVICE, triton_usable

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
    cache = KVLayout.FLASH.new_cache(4, 16, 1, 32)
    with pytest.raises(ValueError, match=message):
        check_repack_args([cache], torch.tensor(src), torch.tensor(dst), KVLayout.FLASH)
    # Through the dispatcher: the C loop checks slot values itself; nothing is copied.
    for layout in (KVLayout.FLASH, KVLayout.CPU_ATTN):
        caches = [layout.new_cache(4, 16, 1, 32).normal_() for _ in range(2)]
        before = [c.clone() for c in caches]
        for backend in _backends(layout):
            with pytest.raises(ValueError, match=message):
                repack(caches, torch.tensor(src), torch.tensor(dst), layout, backend=backend)
            assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))


def test_slot_checks_agree_on_cpu_and_device_paths() -> None:
    """The numpy checks (CPU slots), the torch ones (device slots) and the C loop's own give
    the same verdict: sources may repeat, destinations may not, and none may be both."""
    from kernels._repack_cpu import cpu_repack, load_library
    from kernels.repack import _slot_problem_numpy, _slot_problem_torch

    layout, block_size = KVLayout.CPU_ATTN, 8
    cache = layout.new_cache(5, block_size, 1, 32)  # 40 slots
    parts = layout.part_strides(cache)
    assert parts is not None
    rng = np.random.default_rng(0)
    verdicts = set()
    for trial in range(400):
        size = int(rng.integers(1, 6 if trial < 200 else 30))  # then: hash-set collisions
        src, dst = rng.integers(-1, 41, size), rng.integers(0, 41, size)
        by_numpy = _slot_problem_numpy(src, dst, 40)
        assert by_numpy == _slot_problem_torch(torch.from_numpy(src), torch.from_numpy(dst), 40)
        verdicts.add(by_numpy.split(":")[0] if by_numpy else None)
        if load_library() is None:
            continue
        try:
            cpu_repack(
                [cache], torch.from_numpy(src), torch.from_numpy(dst), parts, block_size, 1, 32,
                num_slots=40,
            )  # fmt: skip
            by_c = None
        except ValueError as error:
            by_c = str(error)
        assert by_c == by_numpy, (src, dst)
    assert len(verdicts) == 4  # out of range, dst twice, dst also a source, valid


def test_moves_into_a_cache_without_slots_are_rejected() -> None:
    """No blocks: every slot is out of range, whichever backend checks it."""
    for layout in (KVLayout.FLASH, KVLayout.CPU_ATTN):
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


@pytest.mark.parametrize("layout", [KVLayout.CPU_ATTN, KVLayout.FLASH])
def test_planner_moves_keep_every_live_token(layout: KVLayout) -> None:
    """The repack planner's moves, applied by the dispatcher, keep each live token's bytes."""
    token_table = pytest.importorskip("vtoken.token_table")
    planner = pytest.importorskip("vtoken.repack_planner")
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


def _planner_like_moves(
    num_blocks: int, block_size: int, num_tokens: int, evict_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compaction moves as the planner emits them: ascending holes <- ascending live sources,
    on blocks in random order, so runs of consecutive slots cross block edges."""
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(num_blocks)[: -(-num_tokens // block_size)]
    local = np.arange(num_tokens)
    slots = blocks[local // block_size] * block_size + local % block_size
    live = np.ones(num_tokens, dtype=bool)
    live[rng.choice(num_tokens, int(evict_fraction * num_tokens), replace=False)] = False
    num_live = int(live.sum())
    dst_local = np.flatnonzero(~live[:num_live])
    src_local = np.flatnonzero(live[num_live:]) + num_live
    return torch.from_numpy(slots[src_local]), torch.from_numpy(slots[dst_local])


CPU_PATHS = [  # (simd, prefetch, threads)
    (True, True, 1),
    (True, False, 2),
    (False, True, 3),
    (False, False, 1),
]


@pytest.mark.parametrize("layout", [KVLayout.CPU_ATTN, KVLayout.FLASH])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.uint8])
@pytest.mark.parametrize(
    ("block_size", "kv_heads", "head_dim"),
    [(16, 3, 64), (32, 8, 128), (128, 2, 64), (8, 1, 32), (24, 2, 80), (48, 1, 16), (1, 2, 16)],
)
@pytest.mark.parametrize(("simd", "prefetch", "threads"), CPU_PATHS)
def test_cpu_paths_match_reference_on_planner_moves(
    layout: KVLayout,
    dtype: torch.dtype,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    simd: bool,
    prefetch: bool,
    threads: int,
) -> None:
    """Every C path (SIMD byte permutes or scalar rows, prefetch on/off, threads over layers)
    against the reference, for odd block sizes / head dims and runs crossing block edges."""
    from kernels._repack_cpu import cpu_repack, load_library

    if load_library() is None:
        pytest.skip("no C compiler")
    num_blocks, num_tokens = 12, 9 * block_size + block_size // 2 + 1
    caches = [layout.new_cache(num_blocks, block_size, kv_heads, head_dim, dtype) for _ in range(3)]
    for index, cache in enumerate(caches):
        raw = torch.randint(0, 256, (cache.numel() * cache.element_size(),), dtype=torch.uint8)
        if dtype.is_floating_point:  # finite values: torch.equal compares values
            raw = torch.randn(cache.numel(), generator=torch.Generator().manual_seed(index))
            cache.copy_(raw.view(cache.shape))
        else:
            cache.view(-1).view(torch.uint8).copy_(raw)
    for seed, fraction in enumerate((0.5, 0.8, 0.05)):
        src, dst = _planner_like_moves(num_blocks, block_size, num_tokens, fraction, seed)
        if src.numel() == 0:
            continue
        expected = [cache.clone() for cache in caches]
        reference_repack(expected, src, dst, layout)
        parts = layout.part_strides(caches[0])
        assert parts is not None
        got = [cache.clone() for cache in caches]
        sizes = (block_size, kv_heads, head_dim)
        assert cpu_repack(got, src, dst, parts, *sizes, threads, simd=simd, prefetch=prefetch)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


@pytest.mark.parametrize("simd", [True, False])
def test_cpu_path_shuffled_and_reversed_moves(simd: bool) -> None:
    """Moves in any order (not the planner's), descending runs and a pair's moves split
    across the list still match the reference."""
    from kernels._repack_cpu import cpu_repack, load_library

    if load_library() is None:
        pytest.skip("no C compiler")
    layout, block_size, kv_heads, head_dim = KVLayout.CPU_ATTN, 32, 2, 64
    cache = layout.new_cache(6, block_size, kv_heads, head_dim, torch.bfloat16).normal_()
    src = torch.tensor([40, 41, 42, 100, 99, 98, 43, 150, 151, 5])
    dst = torch.tensor([1, 2, 3, 70, 69, 68, 4, 31, 32, 190])
    expected = cache.clone()
    reference_repack([expected], src, dst, layout)
    parts = layout.part_strides(cache)
    assert parts is not None
    assert cpu_repack([cache], src, dst, parts, block_size, kv_heads, head_dim, 1, simd=simd)
    assert torch.equal(cache, expected)


def test_default_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import _repack_cpu

    monkeypatch.setenv("VTOKEN_REPACK_THREADS", "3")
    assert _repack_cpu.default_threads(1) == 3
    monkeypatch.delenv("VTOKEN_REPACK_THREADS")
    monkeypatch.setattr(_repack_cpu.torch, "get_num_threads", lambda: 32)
    assert _repack_cpu.default_threads(100) == 1
    assert _repack_cpu.default_threads(3 << 13) == 3
    assert _repack_cpu.default_threads(1 << 30) == 32


def test_library_runs_on_torchs_openmp_pool() -> None:
    """With torch on GNU libgomp (torch's CPU wheels), the library is built with OpenMP,
    maps no runtime of its own, and really splits layers over the requested threads."""
    from kernels import _repack_cpu

    if _repack_cpu.load_library() is None:
        pytest.skip("no C compiler")
    runtimes = _repack_cpu._openmp_runtimes()
    assert len(runtimes) == 1, f"OpenMP runtimes mapped: {sorted(runtimes)}"
    torch_gomp = [os.path.basename(path) for path in runtimes] == ["libgomp.so.1"]
    assert _repack_cpu.uses_openmp() == torch_gomp
    layout, block_size, kv_heads, head_dim = KVLayout.CPU_ATTN, 16, 2, 64
    caches = [layout.new_cache(4, block_size, kv_heads, head_dim).normal_() for _ in range(4)]
    parts = layout.part_strides(caches[0])
    assert parts is not None
    src, dst = torch.tensor([40, 41, 50]), torch.tensor([1, 2, 3])
    ran = _repack_cpu.cpu_repack(caches, src, dst, parts, block_size, kv_heads, head_dim, 3)
    assert ran == (3 if torch_gomp else 1)
    assert _repack_cpu.cpu_repack(caches, src, dst, parts, block_size, kv_heads, head_dim, 1) == 1


@pytest.mark.parametrize("offset_bytes", [0, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_path_values_streamed_only_when_lines_are_aligned(
    offset_bytes: int, threads: int
) -> None:
    """V rows of whole lines are stored non-temporally (on the SIMD path: AVX-512 VBMI), which
    needs 64-byte aligned rows: a layer 16 bytes off alignment (a view into a larger buffer)
    takes the plain stores, for every layer of the call (an aligned streaming store there
    would fault)."""
    from kernels._repack_cpu import cpu_repack, load_library

    if load_library() is None:
        pytest.skip("no C compiler")
    layout, num_blocks, block_size, kv_heads, head_dim = KVLayout.CPU_ATTN, 10, 16, 3, 64
    shape = (num_blocks, kv_heads, block_size, 2 * head_dim)
    numel = num_blocks * kv_heads * block_size * 2 * head_dim
    caches = []
    for index in range(3):
        buffer = torch.randn(numel + 64, generator=torch.Generator().manual_seed(index))
        start = (offset_bytes // 2) if index == 1 else 0  # bf16: 2 bytes per element
        caches.append(buffer.to(torch.bfloat16)[start : start + numel].view(shape))
    assert (caches[1].data_ptr() % 64 == 0) == (offset_bytes == 0)
    src, dst = _planner_like_moves(num_blocks, block_size, 8 * block_size, 0.6, seed=3)
    expected = [cache.clone() for cache in caches]
    reference_repack(expected, src, dst, layout)
    parts = layout.part_strides(caches[0])
    assert parts is not None
    assert cpu_repack(caches, src, dst, parts, block_size, kv_heads, head_dim, threads)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("simd", "prefetch", "threads"), CPU_PATHS)
def test_cpu_path_with_k_and_v_strided_differently(
    simd: bool, prefetch: bool, threads: int
) -> None:
    """K and V with their own block/head strides and different head contiguity (K: flash
    rows of all heads; V: one row per head, blocks padded) are each moved through their own
    strides."""
    from kernels._repack_cpu import cpu_repack, load_library
    from kernels.layout import PartStrides

    if load_library() is None:
        pytest.skip("no C compiler")
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 32
    k_size = num_blocks * block_size * kv_heads * head_dim
    v_block = kv_heads * block_size * head_dim + 40
    keys = PartStrides(0, block_size * kv_heads * head_dim, kv_heads * head_dim, head_dim, 1)
    values = PartStrides(k_size, v_block, head_dim, block_size * head_dim, 1)
    flat = torch.randn(k_size + num_blocks * v_block).to(torch.bfloat16)
    src = torch.tensor([80, 81, 82, 95, 64, 33])
    dst = torch.tensor([3, 4, 5, 17, 18, 40])
    expected = flat.clone()
    heads = torch.arange(kv_heads).view(-1, 1)
    dims = torch.arange(head_dim).view(1, -1)
    for part in (keys, values):

        def offsets(slots: torch.Tensor, part: PartStrides = part) -> torch.Tensor:
            blocks, within = slots // block_size, slots % block_size
            start = part.base + blocks * part.block_stride + within * part.offset_stride
            return start.view(-1, 1, 1) + heads * part.head_stride + dims * part.dim_stride

        expected[offsets(dst)] = flat[offsets(src)]
    got = flat.clone()
    sizes = (block_size, kv_heads, head_dim)
    assert cpu_repack(
        [got], src, dst, (keys, values), *sizes, threads, simd=simd, prefetch=prefetch
    )
    assert torch.equal(got, expected)


def test_compiler_without_openmp_falls_back_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A compiler that rejects -fopenmp gives a single-threaded library, and later loads do
    not try the OpenMP build again."""
    import shutil
    import stat

    from kernels import _repack_cpu

    real = shutil.which("cc") or shutil.which("gcc")
    if real is None or not _repack_cpu.uses_openmp():
        pytest.skip("needs a C compiler and torch on GNU OpenMP")
    calls = tmp_path / "calls"
    fake = tmp_path / "cc"
    fake.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -fopenmp "*) echo openmp >> "{calls}"; exit 1;; esac\n'
        f'exec "{real}" "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        for _ in range(2):
            _repack_cpu._load.cache_clear()
            library = _repack_cpu._load()
            assert library is not None and not library.threads
        assert calls.read_text().split() == ["openmp"]
        layout, block_size, kv_heads, head_dim = KVLayout.CPU_ATTN, 16, 1, 32
        cache = layout.new_cache(3, block_size, kv_heads, head_dim).normal_()
        expected = cache.clone()
        src, dst = torch.tensor([33, 40]), torch.tensor([1, 2])
        reference_repack([expected], src, dst, layout)
        parts = layout.part_strides(cache)
        assert parts is not None
        sizes = (block_size, kv_heads, head_dim)
        assert _repack_cpu.cpu_repack([cache], src, dst, parts, *sizes, num_threads=2) == 1
        assert torch.equal(cache, expected)
    finally:
        _repack_cpu._load.cache_clear()
