"""Eviction inside vLLM equals the transformers reference engine (SmolLM2-135M).

The engine records which logical tokens it evicted at each step; the reference engine
(``workers/hf_sim.py``: transformers, evicted tokens removed from its cache, positions
logical) replays exactly those evictions. Greedy outputs must be equal. For H2O and
SnapKV the reference engine's own decisions (from its eager attention) must also equal the
engine's (from the captured queries: H2O's mass from the score kernel, SnapKV's window
rows from the row slices).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from bench.fragmentation import natural_prompts
from policies import make_policy
from vtoken import StandaloneBlockPool, VTokenManager
from vtoken.policy import EvictionPolicy, PolicyView
from workers.engine import engine_state, internal_request_id, make_llm
from workers.hf_sim import HFSimEngine

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 24
CONFIGS = {
    "streaming_llm": {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 60}},
    "h2o": {"policy": "h2o", "keep_ratio": 0.5},
    # the window path: the last 32 query rows of the prompt, computed once per layer
    "snapkv": {"policy": "snapkv", "keep_ratio": 0.5},
}


@dataclass
class Replay(EvictionPolicy):
    """Evicts, at each step, the ids a recorded run evicted at that step."""

    steps: list[np.ndarray] = field(default_factory=list)

    def select(self, view: PolicyView, budget: int) -> np.ndarray:
        return self.steps[view.step - 1]


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return HFSimEngine(str(smollm2_path))


@pytest.fixture(scope="module")
def prompts(reference):
    return natural_prompts(reference.tokenizer, 2, 160)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engine_run(request, smollm2_path, prompts, engine_variant):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    config = dict(CONFIGS[request.param], record_evictions=True, check_invariants=True)
    llm = make_llm(str(smollm2_path), config, max_model_len=1024, variant=engine_variant)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    state = engine_state(llm)
    evictions = [
        state.finished[internal_request_id(state, o.request_id)].evictions for o in outputs
    ]
    yield request.param, [list(o.outputs[0].token_ids) for o in outputs], evictions
    del llm


def test_engine_equals_reference_on_the_same_evictions(engine_run, reference, prompts):
    policy_name, engine_tokens, evictions = engine_run
    for prompt, tokens, evicted in zip(prompts, engine_tokens, evictions, strict=True):
        assert len(evicted) == NUM_NEW_TOKENS
        assert sum(e.size for e in evicted) > 0, "the policy never evicted: test is vacuous"
        manager = VTokenManager(StandaloneBlockPool(64), 32)
        result = reference.generate(
            prompt, NUM_NEW_TOKENS, Replay(steps=evicted), lambda n: n, [manager]
        )
        assert result.token_ids == tokens, policy_name


def test_engine_decisions_equal_reference_decisions(engine_run, reference, prompts):
    policy_name, _, evictions = engine_run
    config = CONFIGS[policy_name]
    for prompt, evicted in zip(prompts, evictions, strict=True):
        manager = VTokenManager(StandaloneBlockPool(64), 32)
        policy = make_policy(policy_name, **config.get("policy_args", {}))
        keep = config.get("keep_ratio", 1.0)
        result = reference.generate(
            prompt, NUM_NEW_TOKENS, policy, lambda n, keep=keep: math.ceil(keep * n), [manager]
        )
        for step, (ours, theirs) in enumerate(zip(evicted, result.evicted, strict=True)):
            assert np.array_equal(ours, theirs), f"{policy_name} step {step}"
