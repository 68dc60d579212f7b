"""The step-time model: each term from its constants, per engine, per device and dtype."""

from __future__ import annotations

import pytest

from sim.cost_model import (
    DEVICES,
    H200_REPACK_ROWS,
    H200_SCORE_ROWS_Q1,
    MODELS,
    REPACK_FIXED_MS,
    REPACK_MS_PER_MB,
    SCORE_FIXED_MS,
    SCORE_MS_PER_MB,
    KVReads,
    gpu_cost_model,
)
from sim.replica import StepRecord


def record(**counts: int) -> StepRecord:
    fields = {
        "prefill_tokens": 0, "decode_tokens": 64, "num_requests": 64, "context_tokens": 64 * 4096,
        "live_tokens": 64 * 800, "held_blocks": 64 * 200, "attention_pairs": 64 * 800,
        "num_moves": 0, "scored_tokens": 0, "finished": (), "first_tokens": (),
    }  # fmt: skip
    return StepRecord(**(fields | counts))


def test_weights_are_read_once_per_step_at_the_datasheet_bandwidth():
    cost = gpu_cost_model("h200", "llama-3.1-8b")
    step = cost.step(record(), KVReads.LIVE)
    expected = 8.03e9 * 2 / (4.8e12 * cost.bandwidth_efficiency)
    assert step.weights_s == pytest.approx(expected)
    fp8 = gpu_cost_model("h200", "llama-3.1-8b", "fp8").step(record(), KVReads.LIVE)
    assert fp8.weights_s == pytest.approx(expected / 2)
    h100 = gpu_cost_model("h100", "llama-3.1-8b").step(record(), KVReads.LIVE)
    assert h100.weights_s == pytest.approx(expected * 4.8 / 3.35)


def test_kv_reads_follow_the_engine():
    cost = gpu_cost_model("h200", "llama-3.1-8b")
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, bf16
    vanilla = cost.step(record(), KVReads.CONTEXT)
    vtoken = cost.step(record(), KVReads.LIVE)
    naive = cost.step(record(), KVReads.HELD_BLOCKS)
    assert vanilla.kv_bytes == 64 * 4096 * per_token
    assert vtoken.kv_bytes == 64 * 800 * per_token
    assert naive.kv_bytes == 64 * 200 * 16 * per_token
    assert vanilla.total_s > naive.total_s > vtoken.total_s


def test_tensor_parallel_splits_reads_and_adds_all_reduces():
    one = gpu_cost_model("h200", "llama-3.1-70b", tensor_parallel=1).step(record(), KVReads.LIVE)
    four = gpu_cost_model("h200", "llama-3.1-70b", tensor_parallel=4).step(record(), KVReads.LIVE)
    assert four.weights_s == pytest.approx(one.weights_s / 4)
    assert one.allreduce_s == 0 and four.allreduce_s > 0


def test_prefill_is_compute_bound():
    cost = gpu_cost_model("h200", "llama-3.1-8b")
    step = cost.step(record(prefill_tokens=8192, decode_tokens=0, num_requests=1,
                            attention_pairs=8192 * 4096), KVReads.CONTEXT)  # fmt: skip
    assert step.compute_s > step.weights_s + step.kv_s
    assert step.total_s == pytest.approx(step.host_s + step.compute_s)


def test_score_and_repack_fits_reproduce_the_h200_rows():
    for mb, ms in H200_SCORE_ROWS_Q1[1:]:
        assert SCORE_FIXED_MS + SCORE_MS_PER_MB * mb == pytest.approx(ms, rel=0.25)
    for mb, ms in H200_REPACK_ROWS:
        assert REPACK_FIXED_MS + REPACK_MS_PER_MB * mb == pytest.approx(ms, rel=0.1)
    cost = gpu_cost_model("h200", "llama-3.1-8b")
    # 128 requests x 4096 keys, one layer: 1074 MB, measured 1.034 ms per layer.
    scored = cost.step(record(scored_tokens=128 * 4096), KVReads.LIVE)
    assert scored.scores_s == pytest.approx(32 * 1.034e-3, rel=0.25)
    moved = cost.step(record(num_moves=1011 * 2), KVReads.LIVE)  # 132.5 MB at block 16
    assert moved.repack_s > 0


def test_the_pool_holds_what_memory_leaves_after_the_weights():
    cost = gpu_cost_model("h200", "llama-3.1-8b")
    per_block = 2 * 32 * 8 * 128 * 2 * 16
    memory = 143_771 * 2**20  # what the driver reports for an H200
    assert cost.kv_pool_blocks() == int((memory * 0.9 - 8.03e9 * 2) // per_block)
    with pytest.raises(ValueError, match="does not fit"):
        gpu_cost_model("h100", "llama-3.1-70b").kv_pool_blocks()


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="gpu"):
        gpu_cost_model("a100", "llama-3.1-8b")
    with pytest.raises(ValueError, match="model"):
        gpu_cost_model("h200", "llama-2")
    with pytest.raises(ValueError, match="dtype"):
        gpu_cost_model("h200", "llama-3.1-8b", "int4")
    assert set(DEVICES) == {"h200", "h100"} and "llama-3.1-70b" in MODELS
