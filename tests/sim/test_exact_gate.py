"""Gate (a): an exact replica (vLLM's scheduler, a fake executor) reproduces what a real
vLLM CPU engine counts in ``bench preemption`` and ``bench concurrency``."""

from __future__ import annotations

import pytest

from sim.exact_gate import compare_concurrency, compare_preemption
from tests.sim.conftest import token_prompts

# 8 requests of 96 + 48 tokens on 16 blocks of 32: vanilla must preempt.
PREEMPTION = {"num_blocks": 16, "new_tokens": 48, "keep": 0.5}


@pytest.mark.parametrize(
    ("engine", "policy"),
    [
        ("vanilla", "streaming_llm"),
        ("on_demand", "random"),
        ("on_demand", "h2o"),
    ],
)
def test_preemption_counts_equal_the_real_engine(tiny_llama_path, engine, policy):
    prompts = token_prompts(8, 96)
    comparison = compare_preemption(tiny_llama_path, engine, prompts, policy=policy, **PREEMPTION)
    assert comparison.real == comparison.simulated, comparison
    assert comparison.real["completed"] == 8
    if engine == "vanilla":
        assert comparison.real["preemptions"] > 0  # the case tests what it claims to
    if policy == "h2o":
        assert comparison.attention == "replayed"
        assert comparison.real["evictions_under_pressure"] > 0


def test_concurrency_equals_the_real_engine(tiny_llama_with_tokenizer):
    prompts = token_prompts(6, 96)
    comparison = compare_concurrency(
        tiny_llama_with_tokenizer, "vtoken", prompts, num_blocks=12, new_tokens=32, limit=16,
        policy="random", keep=0.5,
    )  # fmt: skip
    assert comparison.real == comparison.simulated, comparison
    assert 1 < comparison.real["max_concurrency"] < 16
