"""A set per layer or per (layer, KV head) inside vLLM equals the reference engine.

The vLLM CPU engine (SmolLM2-135M: 30 layers, 3 KV heads) runs TOVA, H2O and SnapKV with
``granularity`` "layer" and "head": each group evicts its own tokens and compacts them on
its own map (``kernels/grouped_repack.py``). The reference engine (``workers/hf_sim.py``)
cuts each layer's (and head's) cache to the same sets. Its own decisions, from its eager
attention, must equal the engine's at every step, and its greedy tokens the engine's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.fragmentation import natural_prompts
from policies import make_policy
from vtoken import StandaloneBlockPool, VTokenManager
from workers.engine import engine_state, internal_request_id, make_llm
from workers.hf_sim import HFSimEngine

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 12
KEEP = 0.5
RUNS = [f"{policy}-{g}" for policy in ("tova", "h2o", "snapkv") for g in ("layer", "head")]


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return HFSimEngine(str(smollm2_path))


@pytest.fixture(scope="module")
def prompts(reference):
    return natural_prompts(reference.tokenizer, 2, 100)


@pytest.fixture(scope="module", params=RUNS)
def engine_run(request, smollm2_path, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    policy, granularity = request.param.split("-")
    config = {
        "policy": policy,
        "policy_args": {"granularity": granularity},
        "keep_ratio": KEEP,
        "record_evictions": True,
        "check_invariants": True,
    }
    llm = make_llm(str(smollm2_path), config, max_model_len=512)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    state = engine_state(llm)
    evictions = [
        state.finished[internal_request_id(state, o.request_id)].evictions for o in outputs
    ]
    yield policy, granularity, [list(o.outputs[0].token_ids) for o in outputs], evictions
    del llm


def test_engine_equals_reference_per_group(engine_run, reference, prompts):
    policy, granularity, engine_tokens, evictions = engine_run
    groups = {"layer": 30, "head": 90}[granularity]
    for prompt, tokens, evicted in zip(prompts, engine_tokens, evictions, strict=True):
        grouped = [e for e in evicted if e.size]
        assert grouped, "the policy never evicted: test is vacuous"
        assert all(e.shape[0] == groups for e in grouped)
        assert any((e != e[0]).any() for e in grouped), "every group kept one set: vacuous"
        manager = VTokenManager(StandaloneBlockPool(64), 32)
        result = reference.generate(
            prompt,
            NUM_NEW_TOKENS,
            make_policy(policy, granularity=granularity),
            lambda n: math.ceil(KEEP * n),
            [manager],
        )
        manager.check_invariants()
        for step, (ours, theirs) in enumerate(zip(evicted, result.evicted, strict=True)):
            assert np.array_equal(ours, theirs), f"{policy}-{granularity} step {step}"
        assert result.token_ids == tokens
