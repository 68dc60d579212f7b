"""`vtoken bench repack`: planner move patterns and one real (small) case end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.repack import GPU_COPY_RATE_TARGET, PATTERNS, gpu_target_met, make_moves, run_case


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("block_size", [16, 128])
def test_patterns_are_valid_repacks(pattern: str, block_size: int) -> None:
    src, dst, pool_blocks = make_moves(pattern, block_size)
    assert src.size == dst.size > 0
    assert np.unique(dst).size == dst.size, "a destination twice"
    assert not np.isin(dst, src).any(), "a destination is also a source"
    assert max(src.max(), dst.max()) < pool_blocks * block_size
    if pattern.startswith("trickle"):  # <= 16 moves per request per step
        assert src.size <= (16 if pattern == "trickle1" else 8 * 16)
    if pattern.startswith("compact"):  # holes of one 4096-token request, filled from its tail
        kept = 4096 - int(4096 * int(pattern[-2:]) / 100)
        assert src.size <= kept


def test_run_case_reports_the_issue_fields() -> None:
    case = run_case("smollm2", 16, "trickle1", torch.device("cpu"), 2, torch.bfloat16)
    assert case["pattern"] == "trickle1" and case["moved_tokens"] == 16
    assert case["moved_bytes"] == 16 * 30 * 2 * 3 * 64 * 2
    # The rate ratio from the times: the rates are rounded to 1 MB/s, which on a loaded
    # machine (tens of MB/s for this tiny case) is off by more than 1%.
    assert case["ratio"] == pytest.approx(case["copy_ms"] / case["repack_ms"], rel=1e-2)
    assert case["speedup"] == pytest.approx(case["baseline_ms"] / case["repack_ms"], rel=1e-2)
    for key in ("layers", "kv_heads", "head_dim", "block_size", "copy_gbps", "baseline_ms"):
        assert case[key] > 0
    # Device-only times exist on CUDA alone (a CPU call has no launch to hide).
    assert case["device_ratio"] is None
    assert case["launch_hidden"] == {"repack": None, "copy": None}
    assert case["repack_launch_ms"] is None  # the host's launch cost: CUDA only
    assert case["target_met"] is None  # the target is the GPU's
    if case["floor_ms"] is not None:  # a C compiler: the memory floor ran beside them
        assert case["floor_ratio"] == pytest.approx(case["floor_ms"] / case["repack_ms"], rel=1e-2)
        assert case["traffic_mb"] > 2 * case["moved_bytes"] / 1e6  # transposed K: whole lines


def test_memory_floor_touches_exactly_the_repacks_lines() -> None:
    """The floor's line sets (transposed K rewritten in part, V rows of whole lines, sources
    read) and the C loop: partial lines keep their bytes, whole lines are zeroed, nothing
    else changes."""
    from bench import memory_floor
    from kernels.layout import KVLayout

    layout, block_size, kv_heads, head_dim = KVLayout.CPU_ATTN, 16, 2, 64
    caches = [
        layout.new_cache(6, block_size, kv_heads, head_dim, torch.bfloat16).normal_()
        for _ in range(2)
    ]
    src, dst = torch.tensor([80, 81, 40]), torch.tensor([3, 4, 17])
    floor = memory_floor.plan(caches, src, dst, layout)
    assert floor is not None
    row_bytes = 2 * head_dim * block_size * 2  # one (block, head): K then V, bf16
    k_bytes = head_dim * block_size * 2
    # K: 2 channel rows of 16 tokens per line, 32 lines per (block, head), 2 dst blocks.
    assert floor.partial.size == 2 * kv_heads * head_dim // 2
    # V: a token's row of 64 bf16 is two whole lines; 3 tokens, 2 heads.
    assert floor.whole.size == 3 * kv_heads * 2
    # Sources: 2 K regions (blocks 5 and 2) + 3 V rows, per head.
    assert floor.reads.size == kv_heads * (2 * head_dim // 2 + 3 * 2)
    assert not np.isin(floor.reads, np.concatenate([floor.partial, floor.whole])).any()
    assert np.all(floor.whole % row_bytes >= k_bytes) and np.all(
        floor.partial % row_bytes < k_bytes
    )
    lines = 2 * floor.partial.size + floor.whole.size + floor.reads.size
    assert floor.traffic_bytes(len(caches)) == 64 * lines * len(caches)

    run = floor.runner(caches, threads=2)
    if run is None:
        pytest.skip("no C compiler")
    before = [cache.clone() for cache in caches]
    run()
    for cache, old in zip(caches, before, strict=True):
        raw, old_raw = cache.view(-1).view(torch.uint8), old.view(-1).view(torch.uint8)
        zeroed = torch.zeros_like(raw, dtype=torch.bool)
        for start in floor.whole.tolist():
            zeroed[start : start + 64] = True
        assert torch.all(raw[zeroed] == 0)
        assert torch.equal(raw[~zeroed], old_raw[~zeroed])


def test_an_unknown_kv_cache_layout_is_a_clear_cli_error() -> None:
    from typer.testing import CliRunner

    from serving.cli import app

    result = CliRunner().invoke(app, ["bench", "repack", "--kv-cache-layout", "LNBHC"])
    assert result.exit_code == 2
    assert "unknown KV cache layout 'LNBHC'" in result.output


def test_the_gpu_target_judges_compaction_on_the_device_time_where_measured() -> None:
    assert GPU_COPY_RATE_TARGET == 0.8
    assert gpu_target_met("compact50", 0.48, None) is False  # launch not hidden: ratio
    assert gpu_target_met("compact80", 0.85, None) is True
    assert gpu_target_met("compact50", 0.48, 0.81) is True  # the device's time alone
    assert gpu_target_met("compact50", 0.9, 0.7) is False
    assert gpu_target_met("trickle", 0.1, 0.1) is None  # no target for this pattern
    assert gpu_target_met("scattered", 0.1, None) is None
