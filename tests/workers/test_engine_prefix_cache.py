"""vLLM's prefix caching beside vToken (``workers/prefix_cache.py``, the pinning rule).

- policy ``none`` with prefix caching on is bit-identical to vanilla vLLM with prefix
  caching on (tokens, log-probabilities and cache hits), over batches with a repeated
  prompt and prompts sharing a prefix, chunked prefill on;
- H2O evicting on demand with memory to spare evicts nothing and publishes every block:
  tokens and cache hits equal vanilla vLLM's;
- once a request evicts, only what lies below its first eviction stays cached, and its
  pinned prefix (``prefix_pin_tokens``) is never evicted: a later request with the same
  prefix hits those blocks while eviction runs, and its outputs equal the reference
  engine's with the same tokens evicted; a request that hit blocks evicts from them by
  copying (copy on evict) and the other holder's blocks stay intact;
- a different ``cache_salt`` (another tenant) gets no hit;
- the token tables, vLLM's block lists and reference counts are checked after every step
  (``check_invariants``).
"""

from __future__ import annotations

import pytest

from tests.workers.conftest import token_prompts
from tests.workers.test_engine_eviction import Replay
from vtoken import StandaloneBlockPool, VTokenManager
from workers.engine import engine_state, internal_request_id, make_llm

pytestmark = pytest.mark.slow

BLOCK_SIZE = 32
CHUNKED = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}


def _prompt(ids: list[int], salt: str | None = None):
    from vllm.inputs import TokensPrompt

    if salt is None:
        return TokensPrompt(prompt_token_ids=ids)
    return TokensPrompt(prompt_token_ids=ids, cache_salt=salt)


def _batches() -> list[list[list[int]]]:
    """Three batches run one after another on one engine: the second repeats a prompt of
    the first and shares prefixes with it, the third shares prefixes inside itself."""
    first = token_prompts([150, 70, 200], seed=1)
    shared = first[0][:96]
    second = [first[0], shared + [7, 8, 9], first[2][:140] + [11] * 30, [3] * 40]
    other = token_prompts([130], seed=9)[0]
    third = [other + [1, 2], other + [5] * 50, other[:64], shared + other[:33]]
    return [first, second, third]


@pytest.fixture(scope="module")
def identity_runs(tiny_llama_path):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    results = {}
    for name, vtoken in (("vanilla", None), ("none", {"policy": "none", "check_invariants": True})):
        llm = make_llm(
            tiny_llama_path,
            vtoken,
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            **CHUNKED,
        )
        assert (engine_state(llm) is None) == (vtoken is None)
        results[name] = [llm.generate([_prompt(p) for p in batch], params) for batch in _batches()]
        del llm
    return results


@pytest.mark.parametrize("batch", range(3))
def test_policy_none_with_prefix_caching_is_bit_identical_to_vanilla(identity_runs, batch):
    pairs = zip(identity_runs["vanilla"][batch], identity_runs["none"][batch], strict=True)
    for vanilla, managed in pairs:
        assert vanilla.num_cached_tokens == managed.num_cached_tokens
        a, b = vanilla.outputs[0], managed.outputs[0]
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            assert {k: v.logprob for k, v in step_a.items()} == {
                k: v.logprob for k, v in step_b.items()
            }


def test_on_demand_eviction_with_memory_to_spare_caches_as_vanilla_does(
    tiny_llama_path, identity_runs
):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    vtoken = {"policy": "h2o", "keep_ratio": 0.5, "eviction": "on_demand", "check_invariants": True}
    llm = make_llm(
        tiny_llama_path, vtoken, skip_tokenizer_init=True, enable_prefix_caching=True, **CHUNKED
    )
    runs = [llm.generate([_prompt(p) for p in batch], params) for batch in _batches()]
    assert engine_state(llm).manager.num_evicted_tokens == 0
    del llm
    for batch, outputs in enumerate(runs):
        for vanilla, managed in zip(identity_runs["vanilla"][batch], outputs, strict=True):
            assert vanilla.num_cached_tokens == managed.num_cached_tokens
            assert vanilla.outputs[0].token_ids == managed.outputs[0].token_ids


def test_identity_runs_hit_the_cache(identity_runs):
    """Not vacuous: the repeated prompt and the shared prefixes were served from the cache."""
    hits = [o.num_cached_tokens for o in identity_runs["none"][1]]
    assert hits[0] >= 128 and hits[1] == 96 and hits[2] == 128, hits
    assert sum(o.num_cached_tokens for o in identity_runs["none"][2]) > 0


# ---------------------------------------------------------------------- with eviction
PIN = 64
# TOVA reads only the last query's attention, so a cache hit is never cut for it
# (``PrefixCacheRule.hit_limit``; H2O's hits stop at its pinned prefix).
TOVA = {"policy": "tova", "keep_ratio": 0.5, "record_evictions": True, "check_invariants": True}
NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from workers.hf_sim import HFSimEngine

    return HFSimEngine(str(smollm2_path))


@pytest.fixture(scope="module")
def shared_prompts(reference):
    from bench.fragmentation import natural_prompts

    first, second = natural_prompts(reference.tokenizer, 2, 160)
    return [first, first[:136] + second[136:]]  # 136 shared tokens: 4 full blocks of 32


def _run_while_evicting(llm, prompts, salts=(None, None)):
    """Start the first request, step until it has evicted, then add the second (which
    shares its prefix); returns ``{request id: RequestOutput}`` and the engine state."""
    from vllm import SamplingParams

    engine, state = llm.llm_engine, engine_state(llm)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("a", _prompt(prompts[0], salts[0]), params)
    outputs = {}
    while state.manager.num_evicted_tokens == 0:
        for output in engine.step():
            outputs[output.request_id] = output
    assert "a" not in outputs or not outputs["a"].finished, "a finished before evicting"
    engine.add_request("b", _prompt(prompts[1], salts[1]), params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    return outputs, state


@pytest.fixture(scope="module")
def pinned_run(smollm2_path, shared_prompts):
    llm = make_llm(
        str(smollm2_path),
        dict(TOVA, prefix_pin_tokens=PIN),
        max_model_len=1024,
        enable_prefix_caching=True,
    )
    outputs, state = _run_while_evicting(llm, shared_prompts)
    evictions = {r: state.finished[internal_request_id(state, r)].evictions for r in outputs}
    salted, _ = _run_while_evicting(llm, shared_prompts, salts=("tenant-x", "tenant-y"))
    yield outputs, evictions, salted
    del llm


def _below_first_eviction(evictions: list) -> int:
    """Tokens below the block of a request's lowest first-step eviction."""
    first = next(step for step in evictions if step.size)
    return int(first.min()) // BLOCK_SIZE * BLOCK_SIZE


def test_a_second_request_hits_what_lies_below_the_first_eviction(pinned_run):
    """``b`` arrives after ``a``'s first eviction: it hits ``a``'s blocks below that
    eviction (the pin at least), of the 4 blocks they share."""
    outputs, evictions, _ = pinned_run
    assert outputs["a"].num_cached_tokens == 0
    kept = _below_first_eviction(evictions["a"])
    assert kept >= PIN
    assert outputs["b"].num_cached_tokens == min(kept, 128)
    for request_id in ("a", "b"):
        assert sum(step.size for step in evictions[request_id]) > 0, "no eviction: vacuous"
        for step in evictions[request_id]:
            assert not (step < PIN).any(), "a pinned token was evicted"


def test_outputs_equal_the_reference_engine_with_the_same_evictions(
    pinned_run, reference, shared_prompts
):
    outputs, evictions, _ = pinned_run
    for request_id, prompt in zip(("a", "b"), shared_prompts, strict=True):
        manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE)
        result = reference.generate(
            prompt, NUM_NEW_TOKENS, Replay(steps=evictions[request_id]), lambda n: n, [manager]
        )
        assert result.token_ids == list(outputs[request_id].outputs[0].token_ids), request_id


def test_another_salt_gets_no_hit(pinned_run):
    _, _, salted = pinned_run
    assert salted["a"].num_cached_tokens == 0  # the unsalted blocks are not its
    assert salted["b"].num_cached_tokens == 0  # another tenant's blocks are not either


def test_without_a_pin_only_what_lies_below_the_first_eviction_stays_cached(
    smollm2_path, shared_prompts
):
    llm = make_llm(str(smollm2_path), TOVA, max_model_len=1024, enable_prefix_caching=True)
    outputs, state = _run_while_evicting(llm, [shared_prompts[0], shared_prompts[0]])
    kept = _below_first_eviction(state.finished[internal_request_id(state, "a")].evictions)
    del llm
    assert kept < 128, "a evicted only in its last block: the test shows nothing"
    # b (the same prompt) hits exactly what a kept published: nothing at or past the block
    # a's eviction changed, everything below it
    assert outputs["b"].num_cached_tokens == kept


def test_an_adopter_evicts_from_shared_blocks_by_copying_and_leaves_them_intact(
    smollm2_path, shared_prompts, reference
):
    """``a`` never evicts and publishes every full block. ``b`` (TOVA) takes 5 of them while
    ``a`` runs and evicts in them like any other (copy on evict); ``c`` takes them after
    ``a`` and ``b`` finished, and evicts in them too. ``b`` and ``c`` equal the reference
    engine with the same evictions, and ``a``, which read the shared blocks all along,
    equals the reference engine with none."""
    from vllm import SamplingParams

    llm = make_llm(str(smollm2_path), TOVA, max_model_len=1024, enable_prefix_caching=True)
    engine, state = llm.llm_engine, engine_state(llm)
    prompt = shared_prompts[0]
    longer = prompt + shared_prompts[1][:150]  # room to evict beyond what it hits

    def params(max_tokens: int, **extra):
        return SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra or None
        )

    engine.add_request(
        "a", _prompt(prompt), params(3 * NUM_NEW_TOKENS, vtoken_policy={"policy": "none"})
    )
    engine.step()  # a's prefill: its blocks are published
    engine.add_request("b", _prompt(longer), params(NUM_NEW_TOKENS))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    assert "b" in outputs and outputs["b"].num_cached_tokens == 160
    engine.add_request("c", _prompt(longer), params(NUM_NEW_TOKENS))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    evictions = {r: state.finished[internal_request_id(state, r)].evictions for r in ("b", "c")}
    copies = state.counters.num_shared_copies
    del llm
    assert outputs["c"].num_cached_tokens >= 160
    assert any((step < 160).any() for step in evictions["b"]), "b kept the shared blocks"
    assert copies > 0, "b copied no shared block"
    assert any((step < 160).any() for step in evictions["c"]), "c kept blocks nobody shares"
    manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE)
    alone = reference.generate(prompt, 3 * NUM_NEW_TOKENS, None, lambda n: n, [manager])
    assert alone.token_ids == list(outputs["a"].outputs[0].token_ids), "a read a changed block"
    for request_id in ("b", "c"):
        manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE)
        result = reference.generate(
            longer, NUM_NEW_TOKENS, Replay(steps=evictions[request_id]), lambda n: n, [manager]
        )
        assert result.token_ids == list(outputs[request_id].outputs[0].token_ids), request_id
