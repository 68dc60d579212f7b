"""On-demand eviction in a real engine: tokens stay until memory is needed, then running
requests are evicted to their budgets (and repacked) instead of vLLM preempting one.

- no memory pressure: nothing is evicted and the tokens equal vanilla vLLM's;
- a pool too small for its requests: ``on_demand`` finishes every request with no
  preemption, where the same engine that never evicts (policy ``none``) preempts;
- a pool too small even for the requests' budgets: they are squeezed below them, never
  under their floors, where the engine that stops at budgets preempts;
- the tokens of an on-demand run equal the transformers reference engine replaying the
  same evictions (SmolLM2-135M), so squeezing running requests keeps attention exact.
"""

from __future__ import annotations

import pytest

from tests.workers.conftest import token_prompts
from tests.workers.test_engine_eviction import Replay
from vtoken import StandaloneBlockPool, VTokenManager
from workers.engine import engine_state, internal_request_id, make_llm

pytestmark = pytest.mark.slow

BLOCK_SIZE = 32
H2O_ON_DEMAND = {
    "policy": "h2o",
    "keep_ratio": 0.5,
    "eviction": "on_demand",
    "record_evictions": True,
    "check_invariants": True,
}


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _evictions(llm, request_ids: list[str]) -> list[list]:
    state = engine_state(llm)
    return [state.finished[internal_request_id(state, r)].evictions for r in request_ids]


def test_without_pressure_nothing_is_evicted_and_tokens_equal_vanilla(
    tiny_llama_path, engine_variant
):
    prompts = token_prompts([120, 90], seed=5)
    kwargs = {
        "max_model_len": 512,
        "skip_tokenizer_init": True,
        "num_blocks": 64,
        "variant": engine_variant,
    }
    vanilla = make_llm(tiny_llama_path, None, **kwargs)
    expected = _generate(vanilla, prompts, 40)
    del vanilla
    llm = make_llm(tiny_llama_path, H2O_ON_DEMAND, **kwargs)
    assert _generate(llm, prompts, 40) == expected
    state = engine_state(llm)
    assert state.counters.num_evictions_under_pressure == 0 and state.counters.num_preemptions == 0
    assert all(step.size == 0 for steps in _evictions(llm, ["0", "1"]) for step in steps)


def _squeezed_run(model: str, config: dict, prompts: list[list[int]], max_tokens: int, **kw):
    llm = make_llm(model, config, block_size=BLOCK_SIZE, **kw)
    tokens = _generate(llm, prompts, max_tokens)
    return llm, tokens


def test_a_small_pool_evicts_running_requests_instead_of_preempting(tiny_llama_path):
    """Four requests of 100 + 60 tokens (5 blocks each) on 16 blocks (20 without eviction)."""
    prompts = token_prompts([100, 100, 100, 100], seed=7)
    kwargs = {"max_model_len": 256, "skip_tokenizer_init": True, "num_blocks": 17}
    never_evicts = {"policy": "none", "check_invariants": True}
    llm, tokens = _squeezed_run(tiny_llama_path, never_evicts, prompts, 60, **kwargs)
    assert all(len(t) == 60 for t in tokens)
    assert engine_state(llm).counters.num_preemptions > 0  # without eviction vLLM must preempt
    del llm
    llm, tokens = _squeezed_run(tiny_llama_path, H2O_ON_DEMAND, prompts, 60, **kwargs)
    assert all(len(t) == 60 for t in tokens)
    state = engine_state(llm)
    assert state.counters.num_preemptions == 0
    assert state.counters.num_evictions_under_pressure > 0
    evictions = _evictions(llm, ["0", "1", "2", "3"])
    assert any(step.size for steps in evictions for step in steps)
    # Squeezed only under pressure: some steps of every request evicted nothing.
    assert all(any(step.size == 0 for step in steps) for steps in evictions)
    assert state.pool.num_free_blocks == state.pool.num_blocks


def test_budgets_that_do_not_fit_are_squeezed_below_instead_of_preempted(tiny_llama_path):
    """Four requests of 100 + 60 tokens on 10 blocks of 32: at keep 0.5 their budgets end
    at 80 tokens (3 blocks) each, 12 blocks in all, so with every request at its budget
    vLLM must preempt; squeezed below budget (never under H2O's recent half of it, 40
    tokens) they fit, and nothing is preempted."""
    prompts = token_prompts([100, 100, 100, 100], seed=11)
    kwargs = {"max_model_len": 256, "skip_tokenizer_init": True, "num_blocks": 11}
    at_budget = H2O_ON_DEMAND | {"squeeze_below_budget": False}
    llm, tokens = _squeezed_run(tiny_llama_path, at_budget, prompts, 60, **kwargs)
    assert all(len(t) == 60 for t in tokens)
    assert engine_state(llm).counters.num_preemptions > 0
    del llm
    llm, tokens = _squeezed_run(tiny_llama_path, H2O_ON_DEMAND, prompts, 60, **kwargs)
    assert all(len(t) == 60 for t in tokens)
    state = engine_state(llm)
    assert state.counters.num_preemptions == 0 and state.counters.num_evictions_below_budget > 0
    final = [state.finished[internal_request_id(state, r)].report for r in "0123"]
    assert min(report.live_tokens for report in final) < 80  # someone went below budget
    assert all(report.live_tokens >= 40 for report in final)  # none under its floor
    assert state.pool.num_free_blocks == state.pool.num_blocks


@pytest.mark.parametrize(
    ("num_prompts", "new_tokens", "num_blocks"),
    [(3, 40, 12), (4, 60, 11)],
    ids=["to_budget", "below_budget"],
)
def test_squeezed_tokens_equal_the_reference_engine(
    smollm2_path, num_prompts, new_tokens, num_blocks, engine_variant
):
    """Prompts of 100 tokens at keep 0.5. 3 of them + 40 tokens on 12 blocks: squeezing to
    budgets suffices; 4 + 60 tokens on 11 blocks (budgets of 3 blocks each at the end):
    they must go below budget."""
    from workers.hf_sim import HFSimEngine

    reference = HFSimEngine(str(smollm2_path))
    from bench.fragmentation import natural_prompts

    prompts = natural_prompts(reference.tokenizer, num_prompts, 100)
    kwargs = {"max_model_len": 256, "num_blocks": num_blocks, "variant": engine_variant}
    run = _squeezed_run(str(smollm2_path), H2O_ON_DEMAND, prompts, new_tokens, **kwargs)
    llm, tokens = run
    state = engine_state(llm)
    assert state.counters.num_preemptions == 0 and state.counters.num_evictions_under_pressure > 0
    evictions = _evictions(llm, [str(i) for i in range(num_prompts)])
    assert any(step.size for steps in evictions for step in steps), "vacuous: no pressure"
    assert (state.counters.num_evictions_below_budget > 0) == (num_prompts == 4)
    del llm
    for prompt, expected, evicted in zip(prompts, tokens, evictions, strict=True):
        manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE)
        result = reference.generate(
            prompt, new_tokens, Replay(steps=evicted), lambda n: n, [manager]
        )
        assert result.token_ids == expected


TOVA_ON_DEMAND = H2O_ON_DEMAND | {"policy": "tova"}


def test_a_policy_that_reads_one_step_costs_no_score_pass_while_memory_is_free(
    tiny_llama_path,
):
    """TOVA reads only the step it evicts at: on an ample pool no step is scored, and the
    tokens equal vanilla vLLM's (H2O, whose mass accumulates, is scored every step)."""
    prompts = token_prompts([120, 90], seed=5)
    kwargs = {"max_model_len": 512, "skip_tokenizer_init": True, "num_blocks": 64}
    vanilla = make_llm(tiny_llama_path, None, **kwargs)
    expected = _generate(vanilla, prompts, 40)
    del vanilla
    llm = make_llm(tiny_llama_path, TOVA_ON_DEMAND, **kwargs)
    assert _generate(llm, prompts, 40) == expected
    counters = engine_state(llm).counters
    assert counters.num_scored_request_steps == 0 and counters.num_evictions_under_pressure == 0
    del llm
    llm = make_llm(tiny_llama_path, H2O_ON_DEMAND, **kwargs)
    _generate(llm, prompts, 40)
    assert engine_state(llm).counters.num_scored_request_steps >= 2 * 40


def test_a_tight_pool_scores_the_steps_that_evict_and_equals_the_reference(smollm2_path):
    """TOVA on a pool too small for its requests: every step asked to evict was scored
    (none kept its tokens for want of statistics), none preempted, and the tokens equal
    the transformers reference engine replaying the same evictions."""
    from bench.fragmentation import natural_prompts
    from workers.hf_sim import HFSimEngine

    reference = HFSimEngine(str(smollm2_path))
    prompts = natural_prompts(reference.tokenizer, 3, 100)
    kwargs = {"max_model_len": 256, "num_blocks": 12}
    llm, tokens = _squeezed_run(str(smollm2_path), TOVA_ON_DEMAND, prompts, 40, **kwargs)
    counters = engine_state(llm).counters
    assert counters.num_evictions_under_pressure > 0 and counters.num_preemptions == 0
    assert counters.num_evictions_unscored == 0
    total_steps = 3 * 40
    assert 0 < counters.num_scored_request_steps < total_steps  # not every step
    evictions = _evictions(llm, ["0", "1", "2"])
    del llm
    for prompt, expected, evicted in zip(prompts, tokens, evictions, strict=True):
        manager = VTokenManager(StandaloneBlockPool(64), BLOCK_SIZE)
        result = reference.generate(prompt, 40, Replay(steps=evicted), lambda n: n, [manager])
        assert result.token_ids == expected


def test_controller_pressure_squeezes_running_requests_of_that_tenant_only(tiny_llama_path):
    """Through the engine-core utility the replica calls when the plan changes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.api import engine_counters

    llm = make_llm(
        tiny_llama_path, H2O_ON_DEMAND, max_model_len=512, skip_tokenizer_init=True, num_blocks=64
    )
    engine, state = llm.llm_engine, engine_state(llm)
    for index, (tenant, ids) in enumerate(
        zip("ab", token_prompts([150, 150], seed=9), strict=True)
    ):
        params = SamplingParams(
            max_tokens=60, temperature=0, ignore_eos=True, extra_args={"tenant": tenant}
        )
        engine.add_request(f"{tenant}{index}", TokensPrompt(prompt_token_ids=ids), params)
    for _ in range(10):
        engine.step()
    before = {r.tenant: r for r in engine_counters(llm).requests}
    assert before["a"].evicted_tokens == before["b"].evicted_tokens == 0  # no memory pressure
    assert before["a"].reclaimable_blocks > 0  # held above its budget: the controller can ask
    set_pressure = engine.engine_core.engine_core.vtoken_set_pressure
    assert set_pressure({"a": 0.5}) is True
    engine.step()
    after = {r.tenant: r for r in engine_counters(llm).requests}
    target = before["a"].live_tokens // 2  # half of what the tenant held, not of its budget
    assert after["a"].live_tokens == target
    assert after["b"].evicted_tokens == 0 and after["b"].live_tokens == 150 + 10
    set_pressure({"a": 0.5})  # the same plan again: no compounding
    engine.step()
    assert {r.tenant: r for r in engine_counters(llm).requests}["a"].live_tokens == target
    # A new fraction (a new plan found a still over) applies to what it holds now:
    # 40% of the 80 it kept, so a tenant that stays over is squeezed further.
    set_pressure({"a": 0.4})
    engine.step()
    squeezed = int(target * 0.4)
    assert {r.tenant: r for r in engine_counters(llm).requests}["a"].live_tokens == squeezed
    set_pressure({})  # released: on demand, a keeps its new tokens again
    engine.step()
    engine.step()
    assert {r.tenant: r for r in engine_counters(llm).requests}["a"].live_tokens == squeezed + 2
    with pytest.raises(ValueError, match="keep fractions"):
        set_pressure({"a": 1.5})
    while engine.has_unfinished_requests():
        engine.step()
    assert state.counters.num_preemptions == 0


def test_a_prompt_in_chunks_gets_room_from_requests_above_budget(tiny_llama_path):
    """Chunked prefill (64-token steps): a 200-token prompt arriving while two requests
    decode above their budgets gets its blocks by squeezing them, not by a preemption."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(
        tiny_llama_path,
        {**H2O_ON_DEMAND, "record_evictions": False},
        num_blocks=14,
        max_model_len=320,
        skip_tokenizer_init=True,
        max_num_batched_tokens=64,
    )
    engine, state = llm.llm_engine, engine_state(llm)
    first, second, late = token_prompts([70, 60, 200], seed=3)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    engine.add_request("A1", TokensPrompt(prompt_token_ids=first), params)
    engine.add_request("A2", TokensPrompt(prompt_token_ids=second), params)
    for _ in range(26):
        engine.step()
    engine.add_request("B", TokensPrompt(prompt_token_ids=late), params)
    while engine.has_unfinished_requests():
        engine.step()
    assert state.counters.num_evictions_under_pressure > 0
    assert state.counters.num_preemptions == 0


def test_pressure_during_chunked_prefill_applies_to_the_whole_prompt(tiny_llama_path):
    """A request of a pressured tenant still in prefill evicts after each chunk to its
    policy's budget at the tokens computed so far (H2O evicts during prefill; pressure is a
    hard bound), and gets its pressure target from what it holds when its prompt is
    complete (not from the chunk computed so far); reading the counters meanwhile changes
    nothing."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.api import engine_counters

    llm = make_llm(
        tiny_llama_path,
        H2O_ON_DEMAND,
        num_blocks=64,
        max_model_len=512,
        skip_tokenizer_init=True,
        max_num_batched_tokens=64,
    )
    engine = llm.llm_engine
    (prompt,) = token_prompts([200], seed=4)
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, extra_args={"tenant": "a"}
    )
    engine.add_request("p", TokensPrompt(prompt_token_ids=prompt), params)
    while not engine_counters(llm).requests:
        engine.step()  # until the first 64-token chunk is in
    (report,) = engine_counters(llm).requests
    assert 0 < report.live_tokens < 200
    engine.engine_core.engine_core.vtoken_set_pressure({"a": 0.25})
    live = []
    while engine.has_unfinished_requests():
        reports = engine_counters(llm).requests  # polled mid-prefill, as a replica does
        live += [r.live_tokens for r in reports]
        engine.step()
    # Chunks of 64: the first before the pressure came, then half of 128 and of 192 (keep
    # 0.5); the last 8 complete the prompt with 96 + 8 held: a quarter of that from there on.
    assert live[:3] == [64, 64, 96]
    assert live[3:] == [(96 + 8) // 4] * (len(live) - 3), live


def test_a_tenant_above_its_allowance_is_evicted_to_budgets_at_the_next_step(tiny_llama_path):
    """The plan's allowance is enforced by the engine itself, step by step: a tenant whose
    requests grow past it (on demand they keep every token while memory is free) is brought
    back at the next step, most blocks above budget first; other tenants are untouched."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.api import engine_counters

    llm = make_llm(
        tiny_llama_path, H2O_ON_DEMAND, max_model_len=512, skip_tokenizer_init=True, num_blocks=64
    )
    engine = llm.llm_engine
    set_pressure = engine.engine_core.engine_core.vtoken_set_pressure
    prompts = token_prompts([150, 60, 150], seed=11)  # a1 5 blocks (2 above budget), a2 2 (1)
    for request_id, tenant, ids in zip(("a1", "a2", "b1"), "aab", prompts, strict=True):
        params = SamplingParams(
            max_tokens=60, temperature=0, ignore_eos=True, extra_args={"tenant": tenant}
        )
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), params)
    for _ in range(4):
        engine.step()

    def held() -> dict[str, int]:
        counters = engine_counters(llm)
        return {t: u.allocated_blocks for t, u in counters.tenants.items()}

    before = held()
    assert before["a"] > 4 and before["b"] > 4  # whole prompts: nothing evicted yet
    # a may hold 2 blocks fewer than now: its request most above budget gives them back
    assert set_pressure({}, {"a": before["a"] - 2, "b": 1000}) is True
    engine.step()
    after = {r.request_id.split("-")[0]: r for r in engine_counters(llm).requests}
    assert held()["a"] <= before["a"] - 2
    assert after["a1"].evicted_tokens > 0 and after["a2"].evicted_tokens == 0
    assert after["b1"].evicted_tokens == 0  # within its allowance
    with pytest.raises(ValueError, match="allowances"):
        set_pressure({}, {"a": -1})
    set_pressure({}, {})  # no limit any more: a keeps its new tokens again
    while engine.has_unfinished_requests():
        engine.step()


def test_one_window_row_through_the_batched_mass_path_equals_the_per_request_path(
    tiny_llama_path, monkeypatch
):
    """TOVA's one window row is a decode step's mass (a prefill chunk's last row): the
    worker scores it with the batched mass kernel. Its decisions and tokens equal those of
    the per-request path that materialises each layer's probabilities (forced here)."""
    from workers.worker_side import VTokenWorker

    eager_tova = {"policy": "tova", "keep_ratio": 0.5, "record_evictions": True}
    prompts = token_prompts([100, 70, 130], seed=11)
    kwargs = {"max_model_len": 256, "skip_tokenizer_init": True, "num_blocks": 32}
    fast, fast_tokens = _squeezed_run(tiny_llama_path, eager_tova, prompts, 30, **kwargs)
    fast_evictions = _evictions(fast, ["0", "1", "2"])
    del fast
    with monkeypatch.context() as patch:
        patch.setattr(VTokenWorker, "_as_mass", lambda self, request: None)
        slow, slow_tokens = _squeezed_run(tiny_llama_path, eager_tova, prompts, 30, **kwargs)
        slow_evictions = _evictions(slow, ["0", "1", "2"])
        del slow
    assert any(step.size for steps in fast_evictions for step in steps)
    assert fast_tokens == slow_tokens
    for fast_steps, slow_steps in zip(fast_evictions, slow_evictions, strict=True):
        assert [s.tolist() for s in fast_steps] == [s.tolist() for s in slow_steps]
