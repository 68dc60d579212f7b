"""Gemma 3 270M (``vtoken model prepare gemma3-270m``: 15 sliding-window layers with a
512-token window, 3 full-attention layers; six KV cache groups in vLLM 0.32) on a vToken
engine. Policy ``none`` is bit-identical to vanilla vLLM, prefix caching off and on, with
prompts past the window; StreamingLLM and H2O evict from the full-attention layers only and
equal the transformers reference on the same evictions. One engine at a time (4-5 GB)."""

from __future__ import annotations

import pytest

from bench.common import natural_prompts
from tests.workers.test_engine_eviction import Replay
from vtoken import StandaloneBlockPool, VTokenManager
from workers.engine import engine_scheduler, engine_state, internal_request_id, make_llm

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(gemma3_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_path)
    long, short = natural_prompts(tokenizer, 2, 600)
    return [long, short[:100], long[:300] + short[:40]]  # past the window; a shared prefix


def _generate(llm, prompts, max_tokens=NUM_NEW_TOKENS):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [
        (
            o.outputs[0].token_ids,
            [{k: v.logprob for k, v in s.items()} for s in o.outputs[0].logprobs],
            o.num_cached_tokens,
        )
        for o in outputs
    ]


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "caching"])
def test_gemma3_policy_none_is_bit_identical_to_vanilla(gemma3_path, prompts, caching):
    results = {}
    for name, vtoken in (("vanilla", None), ("none", {"policy": "none"})):
        llm = make_llm(str(gemma3_path), vtoken, enable_prefix_caching=caching, max_model_len=1024)
        groups = engine_scheduler(llm).kv_cache_config.kv_cache_groups
        assert len(groups) == 6
        assert (engine_state(llm) is None) == (vtoken is None)
        results[name] = [_generate(llm, prompts), _generate(llm, prompts[2:])]
        del llm
    assert results["none"] == results["vanilla"]
    hits = [hit for _, _, hit in results["none"][1]]
    assert (hits[0] > 0) == caching


@pytest.mark.parametrize(
    "policy",
    [
        {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 120}},
        {"policy": "h2o", "budget_tokens": 124},
    ],
    ids=["streaming_llm", "h2o"],
)
def test_gemma3_eviction_equals_reference_on_the_same_evictions(gemma3_path, prompts, policy):
    """The full-attention layers keep 124 tokens of 600 (StreamingLLM: sinks 4 + 120 recent;
    H2O: a budget of 124 on the full-attention layers' scores), the sliding layers their
    512-token window."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.hf_sim import HFSimEngine

    config = {**policy, "record_evictions": True}
    llm = make_llm(str(gemma3_path), config, max_model_len=1024)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params)
    state = engine_state(llm)
    evicted = state.finished[internal_request_id(state, output.request_id)].evictions
    del llm
    assert sum(e.size for e in evicted) >= 600 - 124
    reference = HFSimEngine(str(gemma3_path))
    manager = VTokenManager(StandaloneBlockPool(64), 32)
    result = reference.generate(
        prompts[0], NUM_NEW_TOKENS, Replay(steps=evicted), lambda n: n, [manager]
    )
    assert result.token_ids == list(output.outputs[0].token_ids)
