"""When a step is scored: the pure timing, then the scheduler side on fakes (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from policies import make_policy
from tests.workers.test_scheduler_side import (
    FakeBlockManager,
    FakeBlockPool,
    FakeRequest,
    run_prefill,
)
from vtoken.policy import ScoreNeeds, StepAttention
from vtoken.repack_planner import ReclaimMode
from workers.config import VTokenConfig
from workers.scheduler_side import VTokenScheduler
from workers.score_timing import StepRequest, may_evict, memory_may_bind, next_step_blocks_at_most


def test_next_step_blocks_count_from_above() -> None:
    assert next_step_blocks_at_most(0, 16, 256) == 1  # decoding, its blocks full: one
    assert next_step_blocks_at_most(0, 16, 256, num_free_slots=1) == 0  # room for its token
    assert next_step_blocks_at_most(40, 16, None) == 4  # the rest of its prompt, and a block
    assert next_step_blocks_at_most(1000, 16, 64) == 5  # one chunk per step


def test_memory_binds_when_the_next_step_may_not_fit() -> None:
    running = [StepRequest(0), StepRequest(0), StepRequest(20)]  # 1 + 1 + (2 + 1) blocks
    assert not memory_may_bind(5, 0, running, 16, None)
    assert memory_may_bind(4, 0, running, 16, None)
    assert memory_may_bind(7, 3, running, 16, None)  # the waiting head counts
    with_room = [StepRequest(0, num_free_slots=3), StepRequest(0), StepRequest(20)]
    assert not memory_may_bind(4, 0, with_room, 16, None)  # 0 + 1 + 3: the first has room


def test_may_evict_takes_the_scheduled_requests_only() -> None:
    running = {"a": StepRequest(0), "b": StepRequest(0, bounded=True), "c": StepRequest(0)}
    assert may_evict(["a", "b"], running, eager=False, tight=False) == {"b"}
    assert may_evict(["a", "b"], running, eager=False, tight=True) == {"a", "b"}
    assert may_evict(["a", "x"], running, eager=True, tight=False) == {"a"}


@pytest.mark.parametrize(
    ("name", "skipped"), [("tova", True), ("snapkv", True), ("h2o", False), ("scissorhands", False)]
)
def test_a_policy_skips_its_statistics_unless_it_may_evict_or_accumulates(name, skipped) -> None:
    policy = make_policy(name)
    assert policy.needs_at_step(True) == policy.score_needs()
    assert (policy.needs_at_step(False) == ScoreNeeds()) is skipped


def test_a_policy_with_its_own_timing_is_scored_whatever_memory_holds() -> None:
    config = VTokenConfig(policy="snapkv", keep_ratio=0.5, eviction="on_demand")
    state = VTokenScheduler(config, FakeBlockPool(64), FakeBlockManager())
    request = FakeRequest("a", num_prompt_tokens=10)
    assert state.allocate(request, 10) is not None  # its whole prompt is this step
    request.num_computed_tokens = 10  # vLLM counts the scheduled tokens at once
    assert state.take_ops({"a": 10}, {"a": request}).score_needs.keys() == {"a"}


def _state(eviction: str, num_blocks: int, **fields) -> VTokenScheduler:
    config = VTokenConfig(
        policy="tova", keep_ratio=0.5, eviction=eviction, check_invariants=True, **fields
    )
    return VTokenScheduler(config, FakeBlockPool(num_blocks), FakeBlockManager())


def _decoding(state: VTokenScheduler, request_id: str, prompt: int) -> FakeRequest:
    request = FakeRequest(request_id, num_prompt_tokens=prompt)
    run_prefill(state, request)
    return request


def test_on_demand_scores_nothing_while_memory_is_free() -> None:
    state = _state("on_demand", num_blocks=64)  # 63 usable, 2 x 3 held
    requests = {r: _decoding(state, r, 10) for r in ("a", "b")}
    ops = state.take_ops({"a": 1, "b": 1}, requests)
    assert ops.score_needs == {}
    assert not any(record.scored for record in state.requests.values())


def test_on_demand_scores_every_request_once_memory_may_bind() -> None:
    state = _state("on_demand", num_blocks=8)  # 7 usable, 6 full: 1 free < 2 next blocks
    requests = {r: _decoding(state, r, 12) for r in ("a", "b")}
    ops = state.take_ops({"a": 1, "b": 1}, requests)
    assert ops.score_needs.keys() == {"a", "b"}
    assert all(record.scored for record in state.requests.values())


def test_on_demand_counts_only_the_blocks_decoding_requests_will_open() -> None:
    """Same pool, but each request's last block has room for its next token: the next
    step opens no block, so memory cannot bind and nothing is scored."""
    state = _state("on_demand", num_blocks=8)  # 7 usable, 6 held, 2 slots free in each
    requests = {r: _decoding(state, r, 10) for r in ("a", "b")}
    assert state.take_ops({"a": 1, "b": 1}, requests).score_needs == {}


def test_on_demand_scores_a_request_the_waiting_head_may_squeeze() -> None:
    state = _state("on_demand", num_blocks=64)
    requests = {"a": _decoding(state, "a", 10)}
    assert state.take_ops({"a": 1}, requests, num_waiting_blocks=60).score_needs == {}  # fits
    assert state.take_ops({"a": 1}, requests, num_waiting_blocks=61).score_needs.keys() == {"a"}


def test_on_demand_scores_a_request_at_its_admission_bound() -> None:
    state = _state("on_demand", num_blocks=64)
    request = FakeRequest("a", 12, sampling_params=_extra({"vtoken_hold_to_blocks": 3}))
    run_prefill(state, request)  # 3 full blocks held: its next block would pass the bound
    assert state.take_ops({"a": 1}, {"a": request}).score_needs.keys() == {"a"}


def test_on_demand_scores_a_tenant_under_pressure() -> None:
    state = _state("on_demand", num_blocks=64)
    requests = {"a": _decoding(state, "a", 10)}
    state.set_pressure({"default": 0.5})
    assert state.take_ops({"a": 1}, requests).score_needs.keys() == {"a"}


def test_eager_scores_every_step() -> None:
    state = _state("eager", num_blocks=64)
    requests = {"a": _decoding(state, "a", 10)}
    assert state.take_ops({"a": 1}, requests).score_needs.keys() == {"a"}


def test_an_unscored_request_asked_for_room_keeps_its_tokens_and_is_counted() -> None:
    state = _state("on_demand", num_blocks=64)
    requests = {"a": _decoding(state, "a", 10)}
    state.take_ops({"a": 1}, requests)  # memory free: not scored
    record = state.requests["a"]
    live = record.kv.table.num_live
    plan = state.squeeze_planner(requests).plan(["a"], num_waiting_blocks=0)
    plan.budgets["a"] = 2  # as if memory had turned out short
    state._evict(record, plan, attention=StepAttention())
    assert record.kv.table.num_live == live
    assert state.counters.num_evictions_unscored == 1


def test_naive_mode_times_alike() -> None:
    state = _state("on_demand", num_blocks=64, mode=ReclaimMode.NAIVE)
    requests = {"a": _decoding(state, "a", 10)}
    assert state.take_ops({"a": 1}, requests).score_needs == {}


def _extra(extra_args: dict) -> object:
    return SimpleNamespace(extra_args=extra_args)


def test_on_demand_scores_a_tenant_above_its_allowance_without_pressure() -> None:
    state = _state("on_demand", num_blocks=64)
    requests = {r: _decoding(state, r, 12) for r in ("a", "b")}  # 3 full blocks each
    state.set_pressure({}, {"default": 6})  # 6 held and 2 more next step > 6
    assert state.take_ops({"a": 1, "b": 1}, requests).score_needs.keys() == {"a", "b"}
    state.set_pressure({}, {"default": 8})
    assert state.take_ops({"a": 1, "b": 1}, requests).score_needs == {}
    roomy = _state("on_demand", num_blocks=64)
    requests = {r: _decoding(roomy, r, 10) for r in ("a", "b")}  # room for the next token
    roomy.set_pressure({}, {"default": 6})  # 6 held, none opened next step: within it
    assert roomy.take_ops({"a": 1, "b": 1}, requests).score_needs == {}


def test_snapkv_is_scored_at_the_chunk_that_completes_its_prompt_only() -> None:
    config = VTokenConfig(policy="snapkv", keep_ratio=0.5, eviction="on_demand")
    state = VTokenScheduler(config, FakeBlockPool(64), FakeBlockManager(), 8)
    request = FakeRequest("a", num_prompt_tokens=20)
    for size, scored in ((8, False), (8, False), (4, True)):
        assert state.allocate(request, size) is not None
        request.num_computed_tokens += size  # vLLM counts the scheduled tokens at once
        assert bool(state.take_ops({"a": size}, {"a": request}).score_needs) is scored
        if not scored:  # a chunk before the last: SnapKV neither reads nor decides
            state.after_step({"a": size}, {"a": request}, None)
