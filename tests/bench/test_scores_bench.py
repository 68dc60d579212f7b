"""`vtoken bench scores`: one small case on the CPU, and the GPU target's rule."""

from __future__ import annotations

import pytest
import torch

from bench.fused_scores import fused_target_met
from bench.scores import (
    GPU_TARGET,
    GPU_TARGET_MIN_BATCH,
    GPU_TARGET_RATIO,
    case_target_met,
    gpu_target_met,
    run_case,
)


def test_a_cpu_case_reports_its_ratio_and_no_target() -> None:
    case = run_case("smollm2", 2, 64, 1, torch.device("cpu"), 1, torch.float32)
    assert case["batch"] == 2 and case["seq_len"] == 64 and case["q_len"] == 1
    assert case["ratio"] == pytest.approx(case["scores_ms"] / case["attention_ms"], rel=5e-2)
    assert case["device_ratio"] is None and case["target_met"] is None


def test_the_gpu_target_judges_the_device_time_where_measured() -> None:
    assert GPU_TARGET_RATIO == 1.0
    assert gpu_target_met(2.64, None) is False  # launches not hidden: ratio
    assert gpu_target_met(0.74, None) is True
    assert gpu_target_met(2.64, 0.95) is True  # the device's time alone
    assert gpu_target_met(0.5, 1.2) is False


def test_only_decode_cases_at_batch_32_or_more_on_cuda_have_a_target() -> None:
    """The target compares decode scoring with decode attention at serving batch sizes:
    batch 1, a 32-token query and every CPU case record no target (``None``)."""
    assert case_target_met("cuda", 32, 1, 2.64, None) is False
    assert case_target_met("cuda", 128, 1, 2.64, 0.9) is True
    assert case_target_met("cuda", 32, 1, 0.5, 0.0) is True  # 0.0 is a measured ratio
    for batch, q_len in ((1, 1), (31, 1), (32, 32), (128, 32)):
        assert case_target_met("cuda", batch, q_len, 0.5, 0.5) is None, (batch, q_len)
    assert case_target_met("cpu", 32, 1, 0.5, None) is None
    assert "q_len 1" in GPU_TARGET and f"batch >= {GPU_TARGET_MIN_BATCH}" in GPU_TARGET


def test_fused_scores_have_a_target_on_cuda_at_batch_32_or_more_only() -> None:
    assert fused_target_met("cpu", 128, 0.5, None) is None  # the interpreter's times
    assert fused_target_met("cuda", 1, 0.5, 0.5) is None
    assert fused_target_met("cuda", 32, 2.0, 0.0) is True  # device_ratio 0.0 is judged
    assert fused_target_met("cuda", 32, 0.5, 1.5) is False
    assert fused_target_met("cuda", 128, 1.2, None) is False
