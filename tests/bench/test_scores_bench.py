"""`vtoken bench scores`: one small case on the CPU, and the GPU target's rule."""

from __future__ import annotations

import pytest
import torch

from bench.scores import GPU_TARGET_RATIO, gpu_target_met, run_case


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
