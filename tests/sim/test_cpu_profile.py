"""The CPU profile: a non-negative fit to timed steps of real CPU engines."""

from __future__ import annotations

import numpy as np
import pytest

from bench.preemption import run_engine
from sim.cost_model import KVReads
from sim.cpu_profile import CpuCostModel, StepSample, fit_cpu_profile, timing_steps
from sim.replica import StepRecord
from tests.sim.conftest import token_prompts


def counts(rng: np.random.Generator) -> dict[str, int]:
    return {
        "prefill_tokens": int(rng.integers(0, 500)), "decode_tokens": int(rng.integers(0, 16)),
        "num_requests": int(rng.integers(1, 16)), "context_tokens": 0, "live_tokens": 0,
        "held_blocks": 0, "attention_pairs": int(rng.integers(0, 100_000)),
        "scored_tokens": int(rng.integers(0, 4000)), "num_moves": int(rng.integers(0, 50)),
    }  # fmt: skip


def test_the_fit_recovers_known_coefficients(tmp_path):
    rng = np.random.default_rng(0)
    truth = (0.01, 2e-4, 3e-5, 1e-8, 0.0, 5e-6)
    samples = []
    for _ in range(200):
        step = counts(rng)
        seconds = float(np.dot(truth, [1, step["num_requests"],
                                       step["prefill_tokens"] + step["decode_tokens"],
                                       step["attention_pairs"], step["scored_tokens"],
                                       step["num_moves"]]))  # fmt: skip
        samples.append(StepSample(step, seconds))
    profile = fit_cpu_profile(samples)
    assert profile.coefficients == pytest.approx(truth, abs=1e-9)
    assert profile.r_squared == pytest.approx(1.0)
    profile.to_json(tmp_path / "profile.json")
    loaded = CpuCostModel.from_json(tmp_path / "profile.json")
    record = StepRecord(**samples[0].counts, finished=(), first_tokens=())
    assert loaded.step(record, KVReads.LIVE).total_s == pytest.approx(samples[0].seconds)
    with pytest.raises(ValueError, match="more than"):
        fit_cpu_profile(samples[:3])


def test_real_steps_are_timed_with_the_replica_counts(tiny_llama_path):
    prompts = token_prompts(4, 64)
    with timing_steps() as samples:
        run_engine(tiny_llama_path, "eager", prompts, 64, 16, 0.5, "streaming_llm",
                   skip_tokenizer_init=True)  # fmt: skip
    # No preemption in a pool this size: every prompt token once, every output but the
    # last fed back once.
    scheduled = sum(s.counts["prefill_tokens"] + s.counts["decode_tokens"] for s in samples)
    assert scheduled == 4 * 64 + 4 * 15
    assert all(s.seconds > 0 for s in samples)
    assert sum(s.counts["num_moves"] for s in samples) > 0  # StreamingLLM evicted
