"""Eviction on a hybrid model equals the transformers reference engine: the tiny random
Gemma 3 (window 16; sliding and full layers alternating). vToken evicts from the
full-attention layers only, the sliding layers keep their window; the reference
(``workers/hf_sim.py``) removes the same tokens from its full-attention layers' cache.
Greedy outputs equal on the engine's own evictions, and H2O's decisions (scores from
the full-attention layers only) equal the reference's."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies import make_policy
from tests.workers.conftest import token_prompts
from tests.workers.test_engine_eviction import Replay
from vtoken import StandaloneBlockPool, VTokenManager
from workers.engine import engine_state, internal_request_id, make_llm
from workers.hf_sim import HFSimEngine

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 24
PROMPT_LENGTHS = [100, 150]
CONFIGS = {
    "streaming_llm": {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 40}},
    "h2o": {"policy": "h2o", "keep_ratio": 0.5},
}


@pytest.fixture(scope="module")
def reference(tiny_gemma3_path):
    return HFSimEngine(tiny_gemma3_path)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engine_run(request, tiny_gemma3_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    config = dict(CONFIGS[request.param], record_evictions=True, check_invariants=True)
    llm = make_llm(tiny_gemma3_path, config, max_model_len=1024, num_blocks=96)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    prompts = token_prompts(PROMPT_LENGTHS)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    state = engine_state(llm)
    assert state.sliding is not None
    evictions = [
        state.finished[internal_request_id(state, o.request_id)].evictions for o in outputs
    ]
    yield request.param, [list(o.outputs[0].token_ids) for o in outputs], evictions
    del llm


def test_hybrid_engine_equals_reference_on_the_same_evictions(engine_run, reference):
    policy_name, engine_tokens, evictions = engine_run
    prompts = token_prompts(PROMPT_LENGTHS)
    for prompt, tokens, evicted in zip(prompts, engine_tokens, evictions, strict=True):
        assert len(evicted) == NUM_NEW_TOKENS
        assert sum(e.size for e in evicted) > 0, "the policy never evicted: test is vacuous"
        manager = VTokenManager(StandaloneBlockPool(64), 32)
        result = reference.generate(
            prompt, NUM_NEW_TOKENS, Replay(steps=evicted), lambda n: n, [manager]
        )
        assert result.token_ids == tokens, policy_name


def test_hybrid_engine_decisions_equal_reference_decisions(engine_run, reference):
    policy_name, _, evictions = engine_run
    config = CONFIGS[policy_name]
    for prompt, evicted in zip(token_prompts(PROMPT_LENGTHS), evictions, strict=True):
        manager = VTokenManager(StandaloneBlockPool(64), 32)
        policy = make_policy(policy_name, **config.get("policy_args", {}))
        keep = config.get("keep_ratio", 1.0)
        result = reference.generate(
            prompt, NUM_NEW_TOKENS, policy, lambda n, keep=keep: math.ceil(keep * n), [manager]
        )
        for step, (ours, theirs) in enumerate(zip(evicted, result.evicted, strict=True)):
            assert np.array_equal(ours, theirs), f"{policy_name} step {step}"
