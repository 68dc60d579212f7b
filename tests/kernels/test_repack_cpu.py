"""The C loop against the reference on every path (SIMD or scalar, prefetch or not, threads
over layers, odd shapes, strides, alignment), its status, and its thread count."""

from __future__ import annotations

import os
import types
from typing import Any

import numpy as np
import pytest
import torch

from kernels import repack_cpu
from kernels.cbuild import CLibrary, openmp_runtimes
from kernels.layout import KVLayout, PartStrides
from kernels.repack import reference_repack
from kernels.repack_cpu import cpu_repack, load_library, prefetch_lines, uses_openmp
from kernels.slot_checks import SlotProblem

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _needs_library() -> CLibrary:
    library = load_library()
    if library is None:
        pytest.skip("no C compiler")
    return library


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


@pytest.mark.parametrize("layout", [KVLayout.CPU_ATTN, KVLayout.BHNC])
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
    _needs_library()
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
    _needs_library()
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
    monkeypatch.setenv("VTOKEN_REPACK_THREADS", "3")
    assert repack_cpu.default_threads(1) == 3
    monkeypatch.delenv("VTOKEN_REPACK_THREADS")
    monkeypatch.setattr(repack_cpu.torch, "get_num_threads", lambda: 32)
    assert repack_cpu.default_threads(100) == 1
    assert repack_cpu.default_threads(3 << 13) == 3
    assert repack_cpu.default_threads(1 << 30) == 32


def test_library_runs_on_torchs_openmp_pool() -> None:
    """With torch on GNU libgomp (torch's CPU wheels), the library is built with OpenMP,
    maps no runtime of its own, and really splits layers over the requested threads."""
    _needs_library()
    runtimes = openmp_runtimes()
    # Other libraries may have mapped their own libgomp copy since the library was loaded
    # (sentencepiece does): the decision was taken then, with what was mapped then.
    if [os.path.basename(path) for path in runtimes] == ["libgomp.so.1"]:
        assert uses_openmp()
    torch_gomp = uses_openmp()
    layout, block_size, kv_heads, head_dim = KVLayout.CPU_ATTN, 16, 2, 64
    caches = [layout.new_cache(4, block_size, kv_heads, head_dim).normal_() for _ in range(4)]
    parts = layout.part_strides(caches[0])
    assert parts is not None
    src, dst = torch.tensor([40, 41, 50]), torch.tensor([1, 2, 3])
    ran = cpu_repack(caches, src, dst, parts, block_size, kv_heads, head_dim, 3)
    assert ran == (3 if torch_gomp else 1)
    assert cpu_repack(caches, src, dst, parts, block_size, kv_heads, head_dim, 1) == 1
    assert openmp_runtimes() == runtimes  # the library brought no runtime of its own


@pytest.mark.parametrize("offset_bytes", [0, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_path_values_streamed_only_when_lines_are_aligned(
    offset_bytes: int, threads: int
) -> None:
    """V rows of whole lines are stored non-temporally (on the SIMD path: AVX-512 VBMI), which
    needs 64-byte aligned rows: a layer 16 bytes off alignment (a view into a larger buffer)
    takes the plain stores, for every layer of the call (an aligned streaming store there
    would fault)."""
    _needs_library()
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
    _needs_library()
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


def test_status_names_are_the_python_side_problems() -> None:
    """The C file defines the status codes; every one it names is a ``SlotProblem`` or
    out of memory, and thread counts have no name."""
    handle = _needs_library().handle
    names = {code: handle.vtoken_repack_status_name(code) for code in range(-16, 17)}
    assert all(name is None for code, name in names.items() if code >= 0)
    named = {name.decode() for name in names.values() if name is not None}
    assert named == {"out_of_memory", *SlotProblem}


def test_prefetch_distance_comes_from_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_library()
    distance = prefetch_lines()
    assert isinstance(distance, int) and distance > 0
    monkeypatch.setattr(repack_cpu, "load_library", lambda: None)
    assert prefetch_lines() is None


def test_failures_raise_and_copy_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory (the C loop's status) raises ``MemoryError``; no library raises
    ``RuntimeError``: never a count of 0 threads."""
    real = _needs_library().handle
    layout = KVLayout.CPU_ATTN
    cache = layout.new_cache(4, 16, 1, 32).normal_()
    before = cache.clone()
    parts = layout.part_strides(cache)
    assert parts is not None
    args = ([cache], torch.tensor([40]), torch.tensor([1]), parts, 16, 1, 32)
    starved: Any = types.SimpleNamespace(
        vtoken_repack=lambda *args: -1, vtoken_repack_status_name=real.vtoken_repack_status_name
    )
    monkeypatch.setattr(repack_cpu, "load_library", lambda: CLibrary(starved, False))
    with pytest.raises(MemoryError):
        cpu_repack(*args)
    monkeypatch.setattr(repack_cpu, "load_library", lambda: None)
    with pytest.raises(RuntimeError, match="C compiler"):
        cpu_repack(*args)
    assert torch.equal(cache, before)
