"""Block accounting of a real engine in both modes (tiny random Llama, 48-block pool).

- reclamation: after every step a vtoken request holds ceil(live / block_size) blocks; a
  naive one holds exactly the logical blocks that still contain a live token; both modes
  make the same decisions and produce the same tokens;
- accounting: many requests, aborts and preemptions; ``check_invariants()`` after every
  scheduler step (config ``check_invariants``); the pool's free count returns to its start;
- counters API: per-request and per-tenant counters, tenant from ``extra_args``;
- prefix caching: on for every run here (so the accounting above runs with it); an
  evicting request without ``prefix_pin_tokens`` publishes nothing, so nothing is reused.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.workers.conftest import token_prompts
from vtoken.reports import DEFAULT_TENANT
from workers.api import engine_counters
from workers.engine import (
    block_pool,
    engine_scheduler,
    engine_state,
    engine_worker,
    internal_request_id,
    make_llm,
)

pytestmark = pytest.mark.slow

BLOCK_SIZE = 32
NUM_BLOCKS = 48
POLICY = {"policy": "random", "keep_ratio": 0.5, "check_invariants": True}
STREAMING = {"policy": "streaming_llm", "policy_args": {"sinks": 4, "recent": 28}}


def _params(max_tokens: int, tenant: str | None, policy: dict | None = None):
    from vllm import SamplingParams

    extra = {"tenant": tenant} if tenant is not None else {}
    if policy is not None:
        extra["vtoken_policy"] = policy
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra)


def _prompt(ids):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def _reclamation(llm, mode: str) -> dict:
    """Four requests that fit (one with its own policy); holdings checked after every step."""
    engine, state = llm.llm_engine, engine_state(llm)
    tenants = ["a", "b", None, "a"]
    policies = [None, None, None, STREAMING]
    for index, ids in enumerate(token_prompts([100, 150, 70, 90], seed=3)):
        engine.add_request(f"r{index}", _prompt(ids), _params(40, tenants[index], policies[index]))
    tokens: dict[str, list[int]] = {}
    counters_seen = None
    num_holey_steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        for report in state.manager.reports():
            table = state.manager.requests[report.request_id].table
            naive_blocks = np.unique(table.live_logical_ids() // BLOCK_SIZE).size
            assert report.naive_blocks == naive_blocks
            if mode == "vtoken":
                assert table.num_slots == table.num_live  # repacked: no holes
                assert report.allocated_blocks == math.ceil(report.live_tokens / BLOCK_SIZE)
            else:
                assert report.allocated_blocks == naive_blocks
            num_holey_steps += naive_blocks > report.ideal_blocks
        if counters_seen is None and len(state.manager.requests) == 4:
            counters_seen = engine_counters(llm)
    assert state.counters.num_preemptions == 0
    override = state.finished[internal_request_id(state, "r3")].report
    config = engine_scheduler(llm).kv_cache_config
    return {
        "tokens": tokens,
        "counters": counters_seen,
        "final": engine_counters(llm),
        "worker_moves": engine_worker(llm).num_moves,
        "page_bytes": sum(
            len(group.layer_names) * group.kv_cache_spec.page_size_bytes
            for group in config.kv_cache_groups
        ),
        "holey_steps": num_holey_steps,
        "override": (override.policy, override.live_tokens),
    }


def _accounting(llm) -> dict:
    """Fourteen requests on a pool too small for them: preemptions, plus three aborts."""
    engine, state, pool = llm.llm_engine, engine_state(llm), block_pool(llm)
    free_at_start = pool.get_num_free_blocks()
    lengths = [60 + 20 * i for i in range(14)]
    for index, ids in enumerate(token_prompts(lengths, seed=11)):
        engine.add_request(f"x{index}", _prompt(ids), _params(150, f"t{index % 3}"))
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step in (3, 9, 20):
            engine.abort_request([f"x{step % 14}"])
    return {
        "free_at_start": free_at_start,
        "free_at_end": pool.get_num_free_blocks(),
        "total": pool.num_gpu_blocks - 1,
        "preemptions": state.counters.num_preemptions,
        "tables_left": len(state.manager.requests),
    }


def _prefix_caching(llm) -> dict:
    ids = token_prompts([200], seed=5)[0]
    outputs = [llm.generate([_prompt(ids)], _params(4, None))[0] for _ in range(2)]
    return {
        "enable_caching": engine_scheduler(llm).kv_cache_manager.enable_caching,
        "cached_tokens": [o.num_cached_tokens for o in outputs],
    }


@pytest.fixture(scope="module")
def runs(tiny_llama_path):
    results = {}
    for mode in ("vtoken", "naive"):
        llm = make_llm(
            tiny_llama_path,
            dict(POLICY, mode=mode),
            num_blocks=NUM_BLOCKS,
            skip_tokenizer_init=True,
            max_model_len=512,
            enable_prefix_caching=True,
        )
        results[mode] = {
            "reclamation": _reclamation(llm, mode),
            "accounting": _accounting(llm),
            "prefix": _prefix_caching(llm),
        }
        del llm
    return results


@pytest.mark.parametrize("mode", ["vtoken", "naive"])
def test_holdings_after_every_step(runs, mode):
    assert len(runs[mode]["reclamation"]["tokens"]) == 4


@pytest.mark.parametrize("mode", ["vtoken", "naive"])
def test_a_request_may_bring_its_own_policy(runs, mode):
    assert runs[mode]["reclamation"]["override"] == ("streaming_llm", 32)


def test_naive_leaves_holes_that_vtoken_reclaims(runs):
    assert runs["naive"]["reclamation"]["holey_steps"] > 0


def test_both_modes_make_the_same_decisions(runs):
    assert runs["vtoken"]["reclamation"]["tokens"] == runs["naive"]["reclamation"]["tokens"]


@pytest.mark.parametrize("mode", ["vtoken", "naive"])
def test_pool_returns_to_start_after_aborts_and_preemptions(runs, mode):
    accounting = runs[mode]["accounting"]
    assert accounting["preemptions"] > 0, "the scenario must preempt"
    assert accounting["tables_left"] == 0
    assert accounting["free_at_end"] == accounting["free_at_start"] == accounting["total"]


def test_counters_api_per_request_and_tenant(runs):
    counters = runs["vtoken"]["reclamation"]["counters"]
    assert counters.mode == "vtoken" and counters.block_size == BLOCK_SIZE
    requests = counters.requests
    assert sorted(r.tenant for r in requests) == ["a", "a", "b", DEFAULT_TENANT]
    assert sorted(r.policy for r in requests) == ["random"] * 3 + ["streaming_llm"]
    for tenant, totals in counters.tenants.items():
        mine = [r for r in requests if r.tenant == tenant]
        assert totals.num_requests == len(mine)
        for key in ("live_tokens", "allocated_blocks", "ideal_blocks", "evicted_tokens"):
            assert getattr(totals, key) == sum(getattr(r, key) for r in mine)
    assert counters.total.allocated_blocks == counters.total_blocks - counters.free_blocks


@pytest.mark.parametrize("mode", ["vtoken", "naive"])
def test_repack_bytes_and_seconds_are_reported(runs, mode):
    """What the worker copied reaches the engine's report: every move copies a slot's K and
    V in every layer (vLLM's page size over the block size), in measured time."""
    reclamation = runs[mode]["reclamation"]
    final = reclamation["final"]  # both modes repack (they differ in the blocks they hold)
    # Moves the scheduler planned after the last step that ran never reach a worker.
    copied = reclamation["worker_moves"]
    assert 0 < copied <= final.repack_moves_total
    slot_bytes = reclamation["page_bytes"] // BLOCK_SIZE
    assert final.repack_bytes_total == copied * slot_bytes
    assert 0.0 < final.repack_seconds_total < 60.0


@pytest.mark.parametrize("mode", ["vtoken", "naive"])
def test_an_evicting_request_without_a_pin_publishes_nothing(runs, mode):
    prefix = runs[mode]["prefix"]
    assert prefix["enable_caching"] is True
    assert prefix["cached_tokens"] == [0, 0]
