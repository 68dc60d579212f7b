"""The transformers reference engine: no eviction equals plain greedy generation, and
eviction really shrinks the model's cache while positions stay logical."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from policies import make_policy
from vtoken import ReclaimMode, StandaloneBlockPool, VTokenManager
from workers.hf_sim import HFSimEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return HFSimEngine(str(smollm2_path))


@pytest.fixture(scope="module")
def prompt(engine):
    from pydoc_data.topics import topics

    return engine.tokenizer(topics["for"])["input_ids"][:96]


def managers(block_size=16):
    return [
        VTokenManager(StandaloneBlockPool(64), block_size, mode)
        for mode in (ReclaimMode.VTOKEN, ReclaimMode.NAIVE)
    ]


def test_no_eviction_matches_plain_greedy_generation(engine, prompt):
    result = engine.generate(prompt, 12, make_policy("none"), lambda n: n, managers())
    with torch.inference_mode():
        expected = engine.model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False
        )[0, len(prompt) :]
    assert result.token_ids == expected.tolist()


def test_eviction_is_paired_and_reclaims(engine, prompt):
    vtoken, naive = managers()
    result = engine.generate(
        prompt, 8, make_policy("h2o"), lambda n: math.ceil(0.3 * n), [vtoken, naive]
    )
    evicted = np.concatenate(result.evicted)
    assert evicted.size == len(prompt) + 7 - math.ceil(0.3 * (len(prompt) + 7))
    for manager in (vtoken, naive):
        table = manager.requests["r0"].table
        assert not table.is_alive(evicted).any()
        manager.check_invariants()
    assert vtoken.report("r0").allocated_blocks == vtoken.report("r0").ideal_blocks
    assert naive.report("r0").allocated_blocks > vtoken.report("r0").allocated_blocks


def test_streaming_llm_with_sinks_keeps_text_coherent(engine, smollm2_path):
    """StreamingLLM's oracle: 4 sinks + a window stays close to the full cache while a
    window without sinks degrades (perplexity of the model's own continuation)."""
    from pydoc_data.topics import topics

    ids = engine.tokenizer(topics["compound"])["input_ids"][:128]
    context, target = ids[:32], ids[32:]

    def nll(policy):
        manager = VTokenManager(StandaloneBlockPool(64), 16, ReclaimMode.VTOKEN)
        return engine.teacher_forced_nll(context, target, policy, lambda n: 32, manager)

    full = nll(make_policy("none"))
    sinks = nll(make_policy("streaming_llm", sinks=4, recent=28))
    no_sinks = nll(make_policy("streaming_llm", sinks=0, recent=32))
    assert full < sinks < no_sinks
    assert math.exp(sinks) < 1.5 * math.exp(full)
