"""Eviction during chunked prefill in a real engine (SmolLM2-135M, ``max_num_batched_tokens``
below the prompt): a 364-token prompt prefills in chunks of 128, and after each chunk
that does not complete it the policy evicts to its budget at the tokens computed so far.

- outputs equal the transformers reference engine (``workers/hf_sim.py``) prefilling in
  the same chunks with the same tokens dropped after each one;
- the reference engine's own decisions (its eager attention) equal the engine's (the
  captured queries and the score kernel), chunk by chunk;
- what the request holds during its prefill is about one chunk plus its budget, never the
  whole prompt, and never above admission's prefill peak (``kv_bounds``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.common import natural_prompts
from controlplane.kv_bounds import kv_bounds
from kernels.intmath import cdiv
from policies import make_policy
from tests.workers.test_engine_eviction import Replay
from vtoken import StandaloneBlockPool, VTokenManager
from workers.config import VTokenConfig
from workers.engine import engine_state, internal_request_id, make_llm
from workers.hf_sim import HFSimEngine

pytestmark = pytest.mark.slow

BLOCK_SIZE = 32
CHUNK = 128
PROMPT_TOKENS = 3 * CHUNK - 20  # chunks of 128, 128 and 108
NUM_NEW_TOKENS = 12
NUM_PREFILL_STEPS = 2  # chunks that do not complete the prompt
CONFIGS = {
    "streaming_llm": {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 60}},
    "h2o": {"policy": "h2o", "keep_ratio": 0.3},
}


def _budget(name: str):
    """The budget the engine applies at ``n`` computed tokens (StreamingLLM's fixed window
    is its own limit)."""
    keep = CONFIGS[name].get("keep_ratio")
    return (lambda n: n) if keep is None else (lambda n: math.ceil(keep * n))


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return HFSimEngine(str(smollm2_path))


@pytest.fixture(scope="module")
def prompts(reference):
    return natural_prompts(reference.tokenizer, 2, PROMPT_TOKENS)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engine_run(request, smollm2_path, prompts):
    """One request at a time (``max_num_seqs`` 1), so each prefills in chunks of exactly
    ``CHUNK`` tokens; the blocks each holds when a step's forward ran (before that step's
    eviction) are recorded."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    config = dict(CONFIGS[request.param], record_evictions=True, check_invariants=True)
    llm = make_llm(
        str(smollm2_path),
        config,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=1,
        max_num_batched_tokens=CHUNK,
    )
    state = engine_state(llm)
    held: dict[str, list[tuple[int, int]]] = {}  # request -> (tokens computed, blocks held)
    after_step = state.after_step

    def recording(num_scheduled_tokens, requests, *args, **kwargs):
        for request_id in num_scheduled_tokens:
            kv = state.manager.requests.get(request_id)
            if kv is None:
                continue
            held.setdefault(request_id, []).append((kv.table.num_logical, kv.num_held_blocks))
        return after_step(num_scheduled_tokens, requests, *args, **kwargs)

    state.after_step = recording  # the scheduler hook calls it on the instance
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    ids = [internal_request_id(state, o.request_id) for o in outputs]
    yield (
        request.param,
        [list(o.outputs[0].token_ids) for o in outputs],
        [state.finished[i].evictions for i in ids],
        [held[i] for i in ids],
    )
    del llm


def test_outputs_equal_the_reference_engine_with_the_same_tokens_dropped(
    engine_run, reference, prompts
):
    name, engine_tokens, evictions, _ = engine_run
    for prompt, tokens, evicted in zip(prompts, engine_tokens, evictions, strict=True):
        assert len(evicted) == NUM_PREFILL_STEPS + NUM_NEW_TOKENS  # a step per chunk
        assert all(step.size for step in evicted[:NUM_PREFILL_STEPS]), "no prefill eviction"
        manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE)
        result = reference.generate(
            prompt, NUM_NEW_TOKENS, Replay(steps=evicted), lambda n: n, [manager], chunk_size=CHUNK
        )
        assert result.token_ids == tokens, name


def test_engine_decisions_equal_the_reference_engines_chunk_by_chunk(
    engine_run, reference, prompts
):
    name, _, evictions, _ = engine_run
    config = CONFIGS[name]
    for prompt, evicted in zip(prompts, evictions, strict=True):
        manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE)
        policy = make_policy(name, **config.get("policy_args", {}))
        result = reference.generate(
            prompt, NUM_NEW_TOKENS, policy, _budget(name), [manager], chunk_size=CHUNK
        )
        for step, (ours, theirs) in enumerate(zip(evicted, result.evicted, strict=True)):
            assert np.array_equal(ours, theirs), f"{name} step {step}"


def test_a_prompt_in_prefill_holds_about_one_chunk_plus_its_budget(engine_run):
    """The most blocks held while the prompt was prefilled: within one chunk plus the
    budget at the last chunk's start (what admission's ``kv_bounds`` counts), well under
    the whole prompt's 12 blocks."""
    name, _, _, held = engine_run
    engines = VTokenConfig.model_validate(CONFIGS[name])
    budget = _budget(name)(PROMPT_TOKENS - 108)  # before the last chunk
    kept = max(budget, engines.make_policy().num_protected(budget))
    if engines.admission_keep_ratio() is None:
        kept = 64  # StreamingLLM: its 4 sinks and 60 recent tokens
    for steps in held:
        prefill = [blocks for computed, blocks in steps if computed <= PROMPT_TOKENS]
        assert len(prefill) == NUM_PREFILL_STEPS + 1
        peak = max(prefill)
        assert peak <= cdiv(CHUNK, BLOCK_SIZE) + cdiv(kept, BLOCK_SIZE), (name, prefill)
        assert peak < cdiv(PROMPT_TOKENS, BLOCK_SIZE) - 3, (name, prefill)
        if engines.admission_keep_ratio() is not None:
            protection = engines.admission_protection()
            bounds = kv_bounds(
                PROMPT_TOKENS, NUM_NEW_TOKENS, BLOCK_SIZE, None, engines.admission_keep_ratio(),
                protected_tokens=protection.tokens, protected_fraction=protection.fraction,
                prefill_chunk_tokens=engines.admission_prefill_chunk_tokens(CHUNK),
            )  # fmt: skip
            assert peak <= bounds.prefill_peak < cdiv(PROMPT_TOKENS, BLOCK_SIZE), (bounds, prefill)


def test_a_mid_prefill_eviction_keeps_the_prefix_cache_rule(tiny_llama_path):
    """With prefix caching, a pinned prefix of 64 tokens and chunks of 64: the first
    request evicts in its second chunk, never in its pinned prefix; what that eviction
    touched left the cache, so the same prompt afterwards hits exactly the blocks below
    it, and so does a third request arriving while the second is still in prefill (the
    blocks they share stay in place: invariants checked after every step)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.workers.conftest import token_prompts

    pin = 64
    config = {
        "policy": "h2o",
        "keep_ratio": 0.3,
        "prefix_pin_tokens": pin,
        "record_evictions": True,
        "check_invariants": True,
    }
    llm = make_llm(
        tiny_llama_path,
        config,
        block_size=BLOCK_SIZE,
        max_model_len=512,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
    )
    engine, state = llm.llm_engine, engine_state(llm)
    (prompt,) = token_prompts([200], seed=7)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs = {}

    def run(request_id: str, *, steps: int | None = None) -> None:
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        count = 0
        while engine.has_unfinished_requests() and (steps is None or count < steps):
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output
            count += 1

    run("a")
    evictions = state.finished[internal_request_id(state, "a")].evictions
    assert evictions[0].size == 0 and evictions[1].size > 0  # 64 pinned, then 128: evicts
    assert all(not (step < pin).any() for step in evictions), "a pinned token was evicted"
    below = int(evictions[1].min()) // BLOCK_SIZE * BLOCK_SIZE
    assert pin <= below < 128
    run("b", steps=1)  # b hits what a kept published, then prefills on
    run("c")
    assert outputs["b"].num_cached_tokens == below
    assert outputs["c"].num_cached_tokens >= below
    for request_id in ("b", "c"):
        steps = state.finished[internal_request_id(state, request_id)].evictions
        assert all(not (step < below).any() for step in steps), request_id
