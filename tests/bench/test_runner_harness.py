"""The runner-shaped harness of ``bench/gpu_check.sh``: on CPU it passes with the repack
and fails without it (the reference comparison sees a wrong cache); on CUDA the fenced
run passes and the negative control (fence disabled) fails."""

from __future__ import annotations

import pytest
import torch

from bench.runner_harness import TOLERANCE, HarnessShape, run_harness

SHAPE = HarnessShape(num_steps=8)


def test_every_step_matches_the_host_reference_with_moves_and_reused_blocks():
    result = run_harness("cpu", shape=SHAPE)
    assert result.passed and len(result.max_errors) == SHAPE.num_steps
    assert max(result.max_errors) < TOLERANCE
    assert all(result.num_moves), "vacuous: a step moved nothing"
    assert sum(1 for n in result.num_reused_blocks if n) >= SHAPE.num_steps // 2


def test_a_cache_left_unrepacked_fails_the_check():
    result = run_harness("cpu", shape=SHAPE, drop_moves=True)
    assert not result.passed
    assert min(result.max_errors) > 100 * TOLERANCE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_fence_is_what_keeps_every_step_right():
    assert run_harness("cuda", shape=SHAPE).passed
    assert not run_harness("cuda", shape=SHAPE, fence=False).passed
