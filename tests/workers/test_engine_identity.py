"""Plugin installed, policy ``none``: outputs bit-identical to vanilla vLLM (greedy, several
batch shapes, chunked prefill on: prompts longer than the 64-token step budget)."""

from __future__ import annotations

import pytest

from tests.workers.conftest import token_prompts
from workers.engine import engine_state, make_llm

pytestmark = pytest.mark.slow

BATCHES = [[40], [5, 33, 64, 150], [17, 90, 3, 120, 64, 31, 200, 8]]
CHUNKED = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}


@pytest.fixture(scope="module")
def outputs(tiny_llama_path, engine_variant):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    results = {}
    for name, vtoken in (("vanilla", None), ("none", {"policy": "none"})):
        llm = make_llm(
            tiny_llama_path, vtoken, skip_tokenizer_init=True, variant=engine_variant, **CHUNKED
        )
        assert (engine_state(llm) is None) == (vtoken is None)
        results[name] = [
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts(b)], params)
            for b in BATCHES
        ]
        del llm
    return results


@pytest.mark.parametrize("batch", range(len(BATCHES)))
def test_policy_none_is_bit_identical_to_vanilla(outputs, batch):
    for vanilla, managed in zip(outputs["vanilla"][batch], outputs["none"][batch], strict=True):
        a, b = vanilla.outputs[0], managed.outputs[0]
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            assert {k: v.logprob for k, v in step_a.items()} == {
                k: v.logprob for k, v in step_b.items()
            }
