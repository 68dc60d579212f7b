"""Hybrid models (sliding-window and full-attention KV cache groups) on a vToken engine:
the tiny random Gemma 3 (``workers.models.make_tiny_gemma3``: window 16, two groups).
Policy ``none`` is bit-identical to vanilla vLLM with prefix caching off and on; the
sliding group's blocks are vLLM's, freed as the window moves, and counted."""

from __future__ import annotations

import pytest

from tests.workers.conftest import token_prompts
from workers.engine import engine_scheduler, engine_state, make_llm

pytestmark = pytest.mark.slow

# Prompts past the window (16) and over several blocks (32), a shared prefix for caching.
PROMPTS = token_prompts([5, 40, 97, 150]) + [token_prompts([96])[0] + [7, 8, 9]]
CHUNKED = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}


def _generate(llm, prompts, max_tokens=30):
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


@pytest.fixture(scope="module", params=[False, True], ids=["no-caching", "caching"])
def outputs(request, tiny_gemma3_path):
    caching = request.param
    results: dict = {"caching": caching}
    for name, vtoken in (("vanilla", None), ("none", {"policy": "none"})):
        llm = make_llm(
            tiny_gemma3_path,
            vtoken,
            skip_tokenizer_init=True,
            num_blocks=96,
            max_model_len=1024,
            enable_prefix_caching=caching,
            **CHUNKED,
        )
        scheduler = engine_scheduler(llm)
        groups = scheduler.kv_cache_config.kv_cache_groups
        assert len(groups) == 2
        state = engine_state(llm)
        assert (state is None) == (vtoken is None)
        # Twice: the second round hits the prefix cache (caching on).
        results[name] = [_generate(llm, PROMPTS), _generate(llm, PROMPTS)]
        if state is not None:
            state.check_invariants()
            assert state.pool.num_blocks_elsewhere == 0  # all finished: nothing held
        del llm
    return results


def test_policy_none_is_bit_identical_to_vanilla_on_a_hybrid_model(outputs):
    """Tokens, logprobs and prefix-cache hits (vLLM's hybrid rule: every group hits the
    same length) equal; with caching on, the second round hits."""
    assert outputs["none"] == outputs["vanilla"]
    cached = [hit for _, _, hit in outputs["none"][1]]
    if outputs["caching"]:
        assert sum(cached) >= 32 * len(PROMPTS[1:]), cached
    else:
        assert not any(cached)
