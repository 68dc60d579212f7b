"""`vtoken bench repack`: planner move patterns and one real (small) case end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.repack import PATTERNS, make_moves, run_case


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
    assert case["ratio"] == pytest.approx(case["repack_gbps"] / case["copy_gbps"], rel=1e-2)
    assert case["speedup"] == pytest.approx(case["baseline_ms"] / case["repack_ms"], rel=1e-2)
    for key in ("layers", "kv_heads", "head_dim", "block_size", "copy_gbps", "baseline_ms"):
        assert case[key] > 0
