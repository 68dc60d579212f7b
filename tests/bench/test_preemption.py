"""The preemption benchmark's rows on a tiny model: a pool too small for its requests makes
vanilla vLLM preempt, and on-demand eviction finishes the same requests without it."""

from __future__ import annotations

import pytest

from bench.preemption import run_engine
from tests.workers.conftest import token_prompts
from workers.models import make_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def test_on_demand_replaces_preemptions_with_evictions(tiny_llama_path):
    prompts = token_prompts([100] * 4, seed=2)
    rows = {
        engine: run_engine(tiny_llama_path, engine, prompts, 17, 60, 0.5, skip_tokenizer_init=True)
        for engine in ("vanilla", "on_demand", "on_demand_at_budget")
    }
    vanilla, on_demand = rows["vanilla"], rows["on_demand"]
    assert rows["on_demand_at_budget"].completed == 4
    assert vanilla.completed == on_demand.completed == 4
    assert vanilla.preemptions > 0 and vanilla.recomputed_tokens >= 100
    assert vanilla.evictions_under_pressure == 0 and vanilla.mean_live_tokens_at_end is None
    assert on_demand.preemptions == on_demand.recomputed_tokens == 0
    assert on_demand.evictions_under_pressure > 0
    assert on_demand.mean_live_tokens_at_end is not None
    assert on_demand.mean_live_tokens_at_end < 160 and on_demand.tokens_per_s > 0
    assert vanilla.scored_request_steps == 0 and on_demand.scored_request_steps >= 4 * 60
