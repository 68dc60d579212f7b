"""Eviction during chunked prefill on the scheduler side, on fakes of vLLM's block pool and
block manager (no engine): which policies evict after a chunk, to which budget, in which
mode, and the contract with admission's prefill peak (``kv_bounds``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kernels.intmath import cdiv
from tests.workers.test_scheduler_side import (
    BLOCK_SIZE,
    FakeBlockManager,
    FakeBlockPool,
    FakeRequest,
)
from vtoken.policy import StepAttention
from workers.config import VTokenConfig
from workers.messages import StepScores
from workers.scheduler_side import VTokenScheduler

CHUNK = 12  # tokens a step: 3 blocks of 4


def _scores(state: VTokenScheduler, rng: np.random.Generator) -> StepScores:
    """Every statistic any policy asks for, over each request's live slots."""
    attention = {}
    for request_id, record in state.requests.items():
        slots = record.kv.table.num_slots
        attention[request_id] = StepAttention(
            step_scores=rng.random(slots),
            window_rows=rng.random((2, slots)),
            head_scores=rng.random((2, 3, slots)),
        )
    return StepScores(attention)


def _prefill_in_chunks(state: VTokenScheduler, request: FakeRequest, seed: int = 0):
    """Run the prompt ``CHUNK`` tokens a step; returns the blocks held after each chunk's
    allocation (what its forward runs on) and after each step."""
    rng = np.random.default_rng(seed)
    held = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        size = min(CHUNK, request.num_prompt_tokens - request.num_computed_tokens)
        assert state.allocate(request, size) is not None
        request.num_computed_tokens += size
        held.append(state.requests[request.request_id].kv.num_held_blocks)
        state.take_ops({request.request_id: size}, {request.request_id: request})
        state.after_step(
            {request.request_id: size}, {request.request_id: request}, _scores(state, rng)
        )
        held.append(state.requests[request.request_id].kv.num_held_blocks)
    # Every step the plan asked to evict was scored when it was scheduled.
    assert state.counters.num_evictions_unscored == 0
    return held


def _state(num_blocks: int = 64, **config) -> VTokenScheduler:
    settings = {"record_evictions": True, "check_invariants": True} | config
    return VTokenScheduler(
        VTokenConfig.model_validate(settings), FakeBlockPool(num_blocks), FakeBlockManager(), CHUNK
    )


@pytest.mark.parametrize(
    "vtoken",
    [
        {"policy": "h2o", "keep_ratio": 0.25},
        {"policy": "tova", "keep_ratio": 0.25},
        {"policy": "random", "keep_ratio": 0.25},
        {"policy": "scissorhands", "keep_ratio": 0.25},
        {"policy": "streaming_llm", "policy_args": {"sinks": 2, "recent": 6}},
    ],
    ids=lambda v: v["policy"],
)
def test_eager_evicts_after_every_prefill_chunk_to_the_budget_so_far(vtoken):
    """A 40-token prompt in chunks of 12: after each chunk the policy evicts to its budget
    at the tokens computed so far (0.25 x 12, 24, 36; StreamingLLM to its 8-token window),
    a step each, so the prompt never holds more than a chunk plus that budget."""
    state = _state(**vtoken)
    request = FakeRequest("r", num_prompt_tokens=40)
    held = _prefill_in_chunks(state, request)
    record = state.requests["r"]
    kept = {"streaming_llm": [8, 8, 8, 8]}.get(vtoken["policy"], [3, 6, 9, 10])
    assert len(record.evictions) == 4  # one step per chunk, the last one completing the prompt
    assert record.kv.num_steps == 4
    live = 12
    for step, (evicted, keep) in enumerate(zip(record.evictions, kept, strict=True)):
        assert evicted.size == max(0, live - keep) or vtoken["policy"] == "scissorhands", step
        live = keep + min(CHUNK, 40 - 12 * (step + 1))
    assert record.kv.table.num_live <= kept[-1]
    peak = max(held)
    assert peak <= cdiv(CHUNK, BLOCK_SIZE) + cdiv(max(kept), BLOCK_SIZE) < cdiv(40, BLOCK_SIZE)


@pytest.mark.parametrize(
    "vtoken",
    [
        {"policy": "snapkv", "keep_ratio": 0.25, "policy_args": {"window": 2}},
        {"policy": "page", "keep_ratio": 0.25, "policy_args": {"threshold": -1.0}},
        {"policy": "none"},
    ],
    ids=lambda v: v["policy"],
)
def test_policies_that_decide_at_the_end_of_prefill_only_observe_its_chunks(vtoken):
    """SnapKV and PAGE (and ``none``) evict nothing before the prompt is complete: the
    chunks before it are observed, no step counted, so ``prefill_done_now`` and the step
    that decides are as with one prefill step."""
    state = _state(**vtoken)
    request = FakeRequest("r", num_prompt_tokens=40)
    held = _prefill_in_chunks(state, request)
    record = state.requests["r"]
    assert held[:-1] == [3, 3, 6, 6, 9, 9, 10]  # whole prompt until the last step
    assert len(record.evictions) == 1 and record.kv.num_steps == 1
    # decided at the end (0.25 x 40 and what the policy protects), or never
    assert (record.evictions[0].size > 0) == (vtoken["policy"] != "none")


def test_on_demand_keeps_prefill_chunks_while_memory_is_free():
    """``on_demand`` without a hard bound or memory need: every chunk is observed as a
    step (an empty eviction each), nothing is evicted."""
    state = _state(policy="h2o", keep_ratio=0.25, eviction="on_demand")
    request = FakeRequest("r", num_prompt_tokens=40)
    held = _prefill_in_chunks(state, request)
    record = state.requests["r"]
    assert held[-1] == 10 and record.kv.num_steps == 4
    assert all(step.size == 0 for step in record.evictions)


def test_on_demand_evicts_a_prefill_chunk_when_memory_is_needed():
    """A pool of 8 blocks (7 usable): a 40-token prompt (10 blocks) fits only if it evicts
    during its prefill; on demand it does, for room, and never below its budget."""
    state = _state(num_blocks=8, policy="h2o", keep_ratio=0.25, eviction="on_demand")
    request = FakeRequest("r", num_prompt_tokens=40)
    held = _prefill_in_chunks(state, request)
    assert max(held) <= 7
    record = state.requests["r"]
    assert sum(step.size for step in record.evictions) > 0
    assert state.counters.num_evictions_under_pressure > 0
    assert state.counters.num_evictions_below_budget == 0


@pytest.mark.parametrize(
    ("vtoken", "cap"),
    [
        ({"policy": "h2o", "keep_ratio": 0.2}, None),
        ({"policy": "h2o", "keep_ratio": 0.2, "prefix_pin_tokens": 8}, None),
        ({"policy": "tova", "keep_ratio": 0.25, "policy_args": {"sinks": 4}}, None),
        ({"policy": "random", "keep_ratio": 0.1, "policy_args": {"sinks": 4, "recent": 6}}, None),
        ({"policy": "none", "prefix_pin_tokens": 8}, 16),  # the cap policy runs
        ({"policy": "snapkv", "keep_ratio": 0.2}, 20),  # the cap policy runs
        ({"policy": "h2o", "keep_ratio": 0.5}, 12),
    ],
    ids=["h2o", "h2o-pinned", "tova-sinks", "random-window", "none-capped", "snapkv-capped",
         "h2o-capped"],
)  # fmt: skip
@pytest.mark.parametrize("eviction", ["on_demand", "eager"])
def test_the_engine_never_holds_more_than_admission_counts_in_chunked_prefill(
    vtoken, cap, eviction
):
    """The contract behind admission's prefill peak: an 80-token prompt prefilled in chunks
    of 12 counts ``min(prompt blocks, chunk blocks + kept blocks)`` until its prefill ends
    (``kv_bounds`` with ``prefill_chunk_tokens``) and its steady bound afterwards (sent as
    ``hold_to_blocks``); the engine never holds more, at any allocation or step, and the
    prefill peak is below the prompt (not vacuous)."""
    from controlplane.kv_bounds import kv_bounds
    from serving.engine_translators import request_spec
    from workers.config import REQUEST_KEY

    prompt, max_tokens = 80, 24
    engines = VTokenConfig.model_validate(vtoken)
    chunk = engines.admission_prefill_chunk_tokens(CHUNK)
    assert chunk == CHUNK
    protection = engines.admission_protection()
    bounds = kv_bounds(
        prompt, max_tokens, BLOCK_SIZE, cap, engines.admission_keep_ratio(),
        protected_tokens=protection.tokens, protected_fraction=protection.fraction,
        prefill_chunk_tokens=chunk,
    )  # fmt: skip
    assert bounds.prefill_peak < cdiv(prompt, BLOCK_SIZE)
    hold = bounds.steady
    assert hold < cdiv(prompt + max_tokens, BLOCK_SIZE)  # the ingress sends it
    state = _state(**vtoken, eviction=eviction)
    extra = {"tenant": "acme", "vtoken_hold_to_blocks": hold}
    if cap is not None:
        extra[REQUEST_KEY] = request_spec(engines, cap)
    request = FakeRequest("r", prompt, sampling_params=SimpleNamespace(extra_args=extra))
    held = _prefill_in_chunks(state, request)
    assert max(held) <= bounds.peak, (bounds, held)
    assert state.counters.num_evictions_unscored == 0
    rng = np.random.default_rng(1)
    for _ in range(max_tokens - 1):
        assert state.allocate(request, 1) is not None
        held.append(state.requests["r"].kv.num_held_blocks)
        assert held[-1] <= hold, (hold, held)
        request.num_computed_tokens += 1
        state.take_ops({"r": 1}, {"r": request})
        state.after_step({"r": 1}, {"r": request}, _scores(state, rng))
