"""The scheduler-side state on fakes of vLLM's block pool and block manager (no engine)."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from kernels.intmath import cdiv
from vtoken.policy import StepAttention
from vtoken.repack_planner import ReclaimMode
from vtoken.reports import DEFAULT_TENANT
from workers.config import VTokenConfig
from workers.messages import StepScores
from workers.scheduler_side import VTokenScheduler

BLOCK_SIZE = 4


@dataclass
class FakeBlock:
    block_id: int
    ref_cnt: int = 0


class FakeBlockPool:
    """vLLM's BlockPool surface vToken uses, reference counts included (a block returns to
    the free queue when its last holder frees it); block 0 is the null block."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = [FakeBlock(i) for i in range(num_gpu_blocks)]
        self.free = deque(range(1, num_gpu_blocks))
        self.unpublished: set[int] = set()

    def get_num_free_blocks(self) -> int:
        return len(self.free)

    def get_new_blocks(self, num_blocks: int) -> list[FakeBlock]:
        assert num_blocks <= len(self.free)
        blocks = [self.blocks[self.free.popleft()] for _ in range(num_blocks)]
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def evict_blocks(self, block_ids: set[int]) -> None:  # drop from the prefix cache
        self.unpublished.update(block_ids)

    def touch(self, blocks) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block.block_id)
            block.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        for block in blocks:
            assert block.block_id not in self.free and block.ref_cnt > 0
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free.append(block.block_id)


class FakeBlockManager:
    block_size = BLOCK_SIZE
    records_new_block_ids = False

    def __init__(self) -> None:
        self.req_to_blocks: defaultdict[str, list[FakeBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self.new_block_ids: list[int] = []

    def pop_blocks_for_free(self, request_id: str) -> list[FakeBlock]:
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    sampling_params: object = None

    @property
    def num_tokens(self) -> int:
        return max(self.num_prompt_tokens, self.num_computed_tokens)


def make_state(mode: ReclaimMode, num_blocks: int = 32):
    pool, manager = FakeBlockPool(num_blocks), FakeBlockManager()
    config = VTokenConfig(policy="none", mode=mode, check_invariants=True)
    return VTokenScheduler(config, pool, manager), pool, manager


def run_prefill(state, request: FakeRequest) -> None:
    assert state.allocate(request, request.num_prompt_tokens) is not None
    request.num_computed_tokens = request.num_prompt_tokens


@pytest.mark.parametrize("mode", list(ReclaimMode))
def test_tail_eviction_shortens_the_physical_count(mode):
    state, _, manager = make_state(mode)
    request = FakeRequest("r", num_prompt_tokens=10)
    run_prefill(state, request)
    state.manager.evict_ids("r", np.array([9]))
    state._reclaim(state.requests["r"])
    table = state.manager.requests["r"].table
    assert table.num_slots == table.num_live == 9
    ops = state.take_ops({"r": 1}, {"r": request})
    assert ops.num_evicted == {"r": 1} and ops.num_moves == 0
    state.check_invariants()


def test_vtoken_repack_frees_tail_blocks_and_ships_the_moves():
    state, pool, manager = make_state(ReclaimMode.VTOKEN)
    request = FakeRequest("r", num_prompt_tokens=12)  # 3 blocks
    run_prefill(state, request)
    free_before = pool.get_num_free_blocks()
    state.manager.evict_ids("r", np.array([0, 1, 2, 5, 6]))  # 7 live -> 2 blocks
    state._reclaim(state.requests["r"])
    assert pool.get_num_free_blocks() == free_before + 1
    assert len(manager.req_to_blocks["r"]) == 2
    ops = state.take_ops({"r": 1}, {"r": request})
    assert ops.num_blocks == {"r": 2} and ops.num_evicted == {"r": 5}
    assert ops.num_moves == 5  # live slots 7..11 fill the holes 0, 1, 2, 5, 6
    kept = {b.block_id for b in manager.req_to_blocks["r"]}
    assert {int(s) // BLOCK_SIZE for s in ops.dst_slots} <= kept
    state.check_invariants()


def test_naive_ballast_holds_every_block_with_a_live_token():
    state, pool, _ = make_state(ReclaimMode.NAIVE)
    request = FakeRequest("r", num_prompt_tokens=12)  # logical blocks 0, 1, 2
    run_prefill(state, request)
    state.manager.evict_ids("r", np.array([0, 1, 2, 5, 6]))  # every block keeps a live token
    state._reclaim(state.requests["r"])
    assert state.request_report("r").allocated_blocks == 3
    assert state.request_report("r").ideal_blocks == 2
    state.manager.evict_ids("r", np.array([4, 7]))  # logical block 1 is now empty
    state._reclaim(state.requests["r"])
    assert state.request_report("r").allocated_blocks == 2
    state.check_invariants()
    state.free("r")
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_allocation_refused_when_the_pool_is_short():
    state, pool, _ = make_state(ReclaimMode.VTOKEN, num_blocks=4)  # 3 usable blocks
    request = FakeRequest("r", num_prompt_tokens=13)  # needs 4
    assert state.allocate(request, 13) is None
    assert pool.get_num_free_blocks() == 3
    assert state.allocate(request, 12) is not None


def test_snapshot_crosses_vllms_utility_call_as_plain_data():
    """The engine-core utility dumps the report (msgpack takes no pydantic model without
    vLLM's insecure pickling); ``workers/api.py`` validates it back, tenants recomputed."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    from workers.api import engine_counters
    from workers.vllm_patches.engine_core import vtoken_counters

    state, _, _ = make_state(ReclaimMode.NAIVE)
    run_prefill(state, FakeRequest("r", num_prompt_tokens=12))
    state.manager.evict_ids("r", np.array([0, 1, 2, 5, 6]))
    state._reclaim(state.requests["r"])
    engine_core = SimpleNamespace(
        scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(vtoken=state))
    )
    data = vtoken_counters(engine_core)
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(UtilityResult(state.snapshot()))
    sent = MsgpackDecoder(UtilityResult).decode(MsgpackEncoder().encode(UtilityResult(data)))
    llm = SimpleNamespace(engine_core=SimpleNamespace(call_utility=lambda name: sent.result))
    report = engine_counters(llm)
    assert report == state.snapshot()
    # 3 held, 7 live would fit in 2, but Naive-Evict frees no block: nothing reclaimable
    assert report.tenants[DEFAULT_TENANT].reclaimable_blocks == 0
    assert report.tenants[DEFAULT_TENANT].ideal_blocks == 2


@pytest.mark.parametrize(("policy", "floor", "floor_after"), [("h2o", 1, 2), ("snapkv", 5, 10)])
def test_a_request_in_prefill_reports_reclaimable_only_if_its_policy_evicts_then(
    policy, floor, floor_after
):
    """Before its prefill ends a prompt can be evicted only under a policy that evicts
    during prefill (H2O: to 0.2 x the 20 tokens computed so far, 1 block); under SnapKV,
    which decides when the prompt is complete, its floor is what it holds, whatever its
    budget (the router and the planner count reclaimable blocks as room)."""
    pool, manager = FakeBlockPool(64), FakeBlockManager()
    config = VTokenConfig(policy=policy, keep_ratio=0.2, eviction="on_demand")
    state = VTokenScheduler(config, pool, manager)
    request = FakeRequest("r", num_prompt_tokens=40)
    assert state.allocate(request, 20) is not None  # the first half of the prompt
    request.num_computed_tokens = 20
    (report,) = state.snapshot().requests
    assert (report.allocated_blocks, report.floor_blocks) == (5, floor)
    assert report.reclaimable_blocks == 5 - floor
    assert state.allocate(request, 20) is not None  # prefill done: its budget applies
    request.num_computed_tokens = 40
    (report,) = state.snapshot().requests
    # H2O: 0.2 x 40 = 8 tokens; SnapKV decides once, so what it holds is its floor
    assert (report.allocated_blocks, report.floor_blocks) == (10, floor_after)


@pytest.mark.parametrize("mode", list(ReclaimMode))
def test_blocks_above_budget_count_only_what_eviction_gives_back(mode):
    """A request whose policy protects more than its budget (40 sinks, a budget of 0.1 x
    length) has nothing above budget once it is at its sinks; naive mode frees nothing."""
    pool, manager = FakeBlockPool(64), FakeBlockManager()
    config = VTokenConfig(
        policy="h2o", policy_args={"sinks": 40}, keep_ratio=0.1, eviction="on_demand", mode=mode
    )
    state = VTokenScheduler(config, pool, manager)
    request = FakeRequest("r", num_prompt_tokens=60)  # 15 blocks of 4
    run_prefill(state, request)
    # keeps 40 sinks + H2O's recent half of its 6-token budget: 43 tokens, 11 blocks
    # block mode counts whole blocks: the sinks' 10 and the 2 a 3-token window can straddle
    expected = {ReclaimMode.VTOKEN: 15 - 11, ReclaimMode.NAIVE: 0, ReclaimMode.BLOCK: 15 - 12}[mode]
    assert state.blocks_above_budget("r") == expected
    state.manager.evict_ids("r", np.arange(40, 60))  # at its sinks now
    state._reclaim(state.requests["r"])
    assert state.blocks_above_budget("r") == 0


@pytest.mark.parametrize("hold", [None, 3])
def test_a_request_never_holds_more_than_admission_counts(hold):
    """``on_demand`` with memory to spare keeps a prompt whole after its prefill, unless
    admission counts the request at ``vtoken_hold_to_blocks``: then it evicts (within that
    bound, a block left for the next step) as soon as it holds more, at the step that ends
    its prefill and whenever decoding grows it past the bound again."""
    pool, manager = FakeBlockPool(64), FakeBlockManager()
    config = VTokenConfig(policy="h2o", keep_ratio=0.2, eviction="on_demand")
    state = VTokenScheduler(config, pool, manager)
    extra = {"tenant": "acme"} | ({"vtoken_hold_to_blocks": hold} if hold else {})
    request = FakeRequest("r", 40, sampling_params=SimpleNamespace(extra_args=extra))
    run_prefill(state, request)

    def scores() -> StepScores:  # H2O reads the step's attention over the request's slots
        slots = state.requests["r"].kv.table.num_slots
        return StepScores({"r": StepAttention(step_scores=np.linspace(1, 2, slots))})

    state.after_step({"r": 40}, {"r": request}, scores())
    record = state.requests["r"]
    # 0.2 x 40 = 8 tokens: 2 blocks of 4 (within the 3 admission counts); else all 10.
    assert record.kv.num_held_blocks == (2 if hold else 10)
    grown = []
    for step in range(8):  # decode: one token a step
        assert state.allocate(request, 1) is not None
        request.num_computed_tokens += 1
        state.after_step({"r": 1}, {"r": request}, scores())
        grown.append(record.kv.num_held_blocks)
        if hold:
            assert record.kv.num_held_blocks <= hold, (step, grown)
    assert max(grown) == (3 if hold else 12)
    # Counted apart from evictions for room or under pressure (there was neither).
    assert state.counters.num_evictions_under_pressure == 0
    assert (state.counters.num_evictions_to_bound > 1) == bool(hold)
    assert state.snapshot().num_evictions_to_bound == state.counters.num_evictions_to_bound


@pytest.mark.parametrize(
    ("vtoken", "cap", "floor"),
    [
        ({"policy": "h2o", "keep_ratio": 0.2}, None, False),
        ({"policy": "h2o", "keep_ratio": 0.2, "prefix_pin_tokens": 16}, None, False),
        ({"policy": "h2o", "keep_ratio": 0.2, "policy_args": {"sinks": 8}}, None, False),
        (
            {
                "policy": "h2o",
                "keep_ratio": 0.3,
                "prefix_pin_tokens": 20,
                "policy_args": {"recent_fraction": 0.25, "sinks": 4},
            },
            None,
            False,
        ),
        (
            {"policy": "random", "keep_ratio": 0.1, "policy_args": {"sinks": 4, "recent": 6}},
            None,
            False,
        ),
        # a tenant's cap: the engine's policy cannot hold it, the cap policy (H2O) runs
        ({"policy": "none", "prefix_pin_tokens": 24}, 32, False),
        (
            {
                "policy": "streaming_llm",
                "policy_args": {"sinks": 4, "recent": 8},
                "prefix_pin_tokens": 12,
            },
            24,
            False,
        ),
        ({"policy": "h2o", "keep_ratio": 0.5, "prefix_pin_tokens": 8}, 20, False),
        # a tenant squeezed to floors
        ({"policy": "h2o", "keep_ratio": 0.2, "policy_args": {"sinks": 20}}, None, True),
        ({"policy": "h2o", "keep_ratio": 0.2, "prefix_pin_tokens": 20}, None, True),
    ],
    ids=[
        "h2o", "h2o-pinned", "h2o-sinks", "h2o-pinned-over-sinks", "random-window",
        "none-capped-pinned", "streaming-capped-pinned", "h2o-capped-pinned",
        "h2o-sinks-floor", "h2o-pinned-floor",
    ],
)  # fmt: skip
def test_admission_counts_at_least_what_the_engine_keeps(vtoken, cap, floor):
    """The contract between the ingress and the engine: what admission counts a request at
    once its prefill ends (``kv_bounds`` from the engines' keep ratio, a tenant's cap or
    floor, and what the policy protects, sent as ``vtoken_hold_to_blocks``) is never below
    what the engine holds, at any step to ``max_tokens``: a pinned prefix, sinks and recent
    windows, which the policy keeps past its budget, included (a pinned prefix counted at
    the budget alone held twice what admission counted), also under the cap policy a
    capped request may run under, and for a tenant squeezed to its floors."""
    from controlplane.admission import kv_bounds
    from serving.engine_translators import request_spec
    from workers.config import REQUEST_KEY

    prompt, max_tokens = 40, 24
    engines = VTokenConfig.model_validate(vtoken)
    protection = engines.admission_protection()
    floor_tokens = engines.admission_floor_tokens() if floor else None
    bounds = kv_bounds(
        prompt, max_tokens, BLOCK_SIZE, cap, engines.admission_keep_ratio(),
        floor_tokens=floor_tokens, protected_tokens=protection.tokens,
        protected_fraction=protection.fraction,
    )  # fmt: skip
    hold = bounds.steady
    assert hold < cdiv(prompt + max_tokens, BLOCK_SIZE)  # a bound that makes it evict
    pool, manager = FakeBlockPool(64), FakeBlockManager()
    config = VTokenConfig.model_validate({**vtoken, "eviction": "on_demand"})
    state = VTokenScheduler(config, pool, manager)
    extra = {"tenant": "acme", "vtoken_hold_to_blocks": hold}
    if cap is not None:
        extra[REQUEST_KEY] = request_spec(VTokenConfig.model_validate(vtoken), cap)
    request = FakeRequest("r", prompt, sampling_params=SimpleNamespace(extra_args=extra))
    run_prefill(state, request)
    rng = np.random.default_rng(0)

    def scores() -> StepScores:
        slots = state.requests["r"].kv.table.num_slots
        return StepScores({"r": StepAttention(step_scores=rng.random(slots))})

    state.after_step({"r": prompt}, {"r": request}, scores())
    record = state.requests["r"]
    held = [record.kv.num_held_blocks]
    for _ in range(max_tokens - 1):
        assert state.allocate(request, 1) is not None
        held.append(record.kv.num_held_blocks)  # the step's forward runs on these
        request.num_computed_tokens += 1
        state.after_step({"r": 1}, {"r": request}, scores())
        held.append(record.kv.num_held_blocks)
    assert max(held) <= hold, (hold, held)
    table = record.kv.table
    assert table.num_live < table.num_logical  # it evicted: the bound was not vacuous


def _decode_on_a_full_pool(squeeze_below_budget: bool, steps: int = 40, policy: str = "h2o"):
    """Two requests (keep 0.5) of 16-token prompts on 8 blocks of 4, decoding one token a
    step: their budgets (half their length each) outgrow the pool from about 32 tokens
    each. Returns the state, the step whose allocation was refused (where vLLM preempts;
    ``None``: none was) and, per step, each request's (live tokens, budget)."""
    pool, manager = FakeBlockPool(9), FakeBlockManager()
    config = VTokenConfig(
        policy=policy,
        keep_ratio=0.5,
        eviction="on_demand",
        squeeze_below_budget=squeeze_below_budget,
        check_invariants=True,
    )
    state = VTokenScheduler(config, pool, manager)
    requests = {r: FakeRequest(r, 16) for r in ("a", "b")}
    for request in requests.values():
        run_prefill(state, request)

    def scores() -> StepScores:
        return StepScores(
            {
                r: StepAttention(step_scores=np.linspace(1, 2, record.kv.table.num_slots))
                for r, record in state.requests.items()
            }
        )

    state.after_step({r: 16 for r in requests}, requests, scores())
    seen = []
    for step in range(steps):
        for request in requests.values():
            if state.allocate(request, 1) is None:
                return state, step, seen
            request.num_computed_tokens += 1
        squeezed = state.counters.num_evictions_below_budget
        state.after_step({r: 1 for r in requests}, requests, scores())
        if state.counters.num_evictions_below_budget > squeezed:  # no deeper than the step needs
            assert state.pool.num_free_blocks <= 1
        seen.append(
            {
                r: (record.kv.table.num_live, state.budgets.budget(record))
                for r, record in state.requests.items()
            }
        )
    return state, None, seen


@pytest.mark.parametrize("policy", ["h2o", "random", "streaming_llm"])
def test_on_demand_squeezes_below_budget_before_vllm_would_preempt(policy):
    """With every request at its budget and the next step still short of blocks, an
    on-demand engine evicts further, a block at a time and never under its floor (half its
    budget by default, whatever its policy protects), instead of leaving vLLM to preempt;
    switched off, the pool runs out at once. Floors eventually do not fit either: then
    the allocation is refused (vLLM preempts)."""
    _, refused_without, _ = _decode_on_a_full_pool(False, policy=policy)
    assert refused_without is not None  # vLLM would preempt here
    state, refused_at, seen = _decode_on_a_full_pool(True, steps=200, policy=policy)
    assert refused_at is not None and refused_at > refused_without + 10
    below = [(live, budget) for step in seen for live, budget in step.values() if live < budget]
    assert below, "vacuous: nobody was squeezed below budget"
    assert all(2 * live >= budget for live, budget in below)  # squeeze_floor 0.5
    assert min(2 * live - budget for live, budget in below) < 2 * BLOCK_SIZE  # floor reached
    assert state.counters.num_evictions_below_budget > 0


def _at_budget_state(num_requests: int, num_tokens: int, num_blocks: int = 128, **config):
    """Decoding H2O requests (keep 0.5) already at their budgets, nothing free beyond."""
    pool, manager = FakeBlockPool(num_blocks), FakeBlockManager()
    settings = {"policy": "h2o", "keep_ratio": 0.5, "eviction": "on_demand"} | config
    state = VTokenScheduler(VTokenConfig(**settings), pool, manager)
    requests = {}
    for i in range(num_requests):
        request = requests[f"r{i}"] = FakeRequest(f"r{i}", num_tokens)
        run_prefill(state, request)
        keep = state.budgets.budget(state.requests[request.request_id])
        state.manager.evict_ids(request.request_id, np.arange(num_tokens - keep))
        state._reclaim(state.requests[request.request_id])
    return state, requests


def test_below_budget_takes_only_the_blocks_the_step_needs():
    state, requests = _at_budget_state(4, 200)  # budgets 100 tokens: 25 blocks of 4 each
    decoding = list(requests)
    planner = state.squeeze_planner()
    before = {r: planner.room(r) for r in decoding}
    for need in (1, 3):
        below = planner.below_budget(decoding, need)
        assert sum(planner.room(r, t) - before[r] for r, t in below.items()) == need
        assert len(below) == need  # one block each from the fullest shares
        # each keeps what its remaining blocks hold with the next token
        assert all((t + 1) % BLOCK_SIZE == 0 for t in below.values())
    assert planner.below_budget(decoding, 0) == {}


def test_the_waiting_queue_never_squeezes_below_budget():
    state, requests = _at_budget_state(3, 40, num_blocks=40)
    free = state.pool.num_free_blocks
    plan = state.squeeze_planner(requests).plan(list(requests), free + 20)
    assert plan.below == {} and not plan.always and not plan.for_room  # nothing gives room
    assert state.squeeze_planner(requests).plan(list(requests), 0).below == {}  # they fit


def test_a_request_with_a_pinned_hit_can_still_be_squeezed_below_budget():
    """Its pinned prefix sits in its policy's sinks and outside its budget: counted once in
    its floor, so the tokens above it can still go."""
    pool, manager = FakeBlockPool(64), FakeBlockManager()
    config = VTokenConfig(policy="h2o", keep_ratio=0.5, eviction="on_demand", pin_cache_hits=True)
    state = VTokenScheduler(config, pool, manager)
    first = FakeRequest("a", 12)
    run_prefill(state, first)
    manager.num_cached_block["a"] = 3
    hit = manager.req_to_blocks["a"][:2]  # 8 tokens
    state.free("a")
    second = FakeRequest("b", 64)
    assert state.allocate(second, 56, hit_blocks=hit) is not None
    second.num_computed_tokens = 64
    state._protect_shared(state.requests["b"])
    budget = state.budgets.budget(state.requests["b"])  # 8 pinned + 0.5 x 56
    assert budget == 36
    planner = state.squeeze_planner()
    below = planner.below_budget(["b"], 2)
    assert below and planner.room("b", below["b"]) - planner.room("b") == 2
    assert 8 + 14 <= below["b"] < budget  # the pin and half its own budget stay
    # 4 blocks: down to 6 blocks (23 tokens and the next), just above its floor of 22
    assert planner.below_budget(["b"], 4) == {"b": 23}
    assert planner.below_budget(["b"], 5) == {}  # not without going under its floor


def test_no_squeeze_when_the_floors_cannot_free_enough():
    """vLLM preempts then, and the preempted request's blocks are the room: squeezing the
    others as well would only cost them context."""
    state, requests = _at_budget_state(2, 40)  # budgets 20 tokens: floors 10
    planner = state.squeeze_planner()
    assert planner.below_budget(list(requests), 2)
    assert planner.below_budget(list(requests), 100) == {}


@dataclass
class EndingRequest(FakeRequest):
    max_tokens: int = 100
    num_output_tokens: int = 0
    resumable: bool = False


def _full_pool_at_budget(ending: EndingRequest):
    """Four decoding requests at their budgets (20 tokens: 5 full blocks each) and a
    request holding the rest of the pool: the next step needs a block for each."""
    pool, manager = FakeBlockPool(26), FakeBlockManager()
    config = VTokenConfig(policy="h2o", keep_ratio=0.5, eviction="on_demand")
    state = VTokenScheduler(config, pool, manager)
    requests = {r.request_id: r for r in [ending] + [FakeRequest(f"r{i}", 40) for i in (1, 2, 3)]}
    for request in requests.values():
        run_prefill(state, request)
        state.manager.evict_ids(request.request_id, np.arange(20))
        state._reclaim(state.requests[request.request_id])
    filler = FakeRequest("fill", 19)  # 5 blocks, room in them for its next token
    run_prefill(state, filler)
    assert pool.get_num_free_blocks() == 0
    return state, requests | {"fill": filler}


def test_a_request_ending_with_this_step_gives_its_blocks_instead_of_squeezing_others():
    going_on = EndingRequest("r0", 40, max_tokens=100, num_output_tokens=0)
    state, requests = _full_pool_at_budget(going_on)
    decoding = ["r0", "r1", "r2", "r3"]
    assert state.squeeze_planner(requests).plan(decoding, 0).below  # 4 blocks short
    ending = EndingRequest("r0", 40, max_tokens=5, num_output_tokens=4)
    state, requests = _full_pool_at_budget(ending)
    plan = state.squeeze_planner(requests).plan(decoding, 0)
    assert (plan.always, plan.for_room, plan.below) == (set(), set(), {})  # 5 blocks cover 3
    resumable = EndingRequest("r0", 40, max_tokens=5, num_output_tokens=4, resumable=True)
    state, requests = _full_pool_at_budget(resumable)
    assert state.squeeze_planner(requests).plan(decoding, 0).below  # it keeps its blocks


def test_a_request_ending_with_this_step_counts_out_of_its_tenants_allowance():
    pool, manager = FakeBlockPool(128), FakeBlockManager()
    config = VTokenConfig(policy="h2o", keep_ratio=0.5, eviction="on_demand")
    state = VTokenScheduler(config, pool, manager)
    params = SimpleNamespace(extra_args={"tenant": "x"})
    ending = EndingRequest("x0", 40, max_tokens=3, num_output_tokens=2, sampling_params=params)
    requests = {"x0": ending, "x1": FakeRequest("x1", 40, sampling_params=params)}
    for request in requests.values():
        run_prefill(state, request)  # 10 blocks each, nothing evicted: memory is plenty
    state.set_pressure({}, {"x": 15})  # x0's 10 blocks come back with this step: x fits
    plan = state.squeeze_planner(requests).plan(["x0", "x1"], 0)
    assert (plan.always, plan.for_room, plan.below) == (set(), set(), {})
    ending.max_tokens = 100
    assert state.squeeze_planner(requests).plan(["x0", "x1"], 0).for_room  # x is over


def test_the_smaller_budget_is_not_the_first_to_give():
    """One block from a 9-token budget costs it 2 tokens of 9; from a 40-token one, 1 of
    40: shares are compared after giving."""
    pool, manager = FakeBlockPool(64), FakeBlockManager()
    config = VTokenConfig(policy="h2o", keep_ratio=0.5, eviction="on_demand")
    state = VTokenScheduler(config, pool, manager)
    for request_id, length in (("a", 18), ("b", 80)):
        run_prefill(state, FakeRequest(request_id, length))
        state.manager.evict_ids(request_id, np.arange(length - length // 2))
        state._reclaim(state.requests[request_id])
    assert state.squeeze_planner().below_budget(["a", "b"], 1) == {"b": 39}


def test_short_of_floors_the_others_give_only_what_vllms_victim_leaves_short():
    state, requests = _at_budget_state(2, 40)  # 3 blocks each above their floors
    decoding = list(requests)
    planner = state.squeeze_planner(requests)
    assert planner.below_budget(decoding, 7) == {}  # 6 < 7, no victim known: nothing
    below = planner.below_budget(decoding, 7, victim=("v", 3))  # the victim gives 3
    assert sum(planner.room(r, t) - planner.room(r) for r, t in below.items()) == 4
    assert planner.below_budget(decoding, 7, victim=("v", 8)) == {}  # the victim covers it
    everything = planner.below_budget(decoding, 20, victim=("v", 3))  # more preemptions
    assert sum(planner.room(r, t) - planner.room(r) for r, t in everything.items()) == 6
    # The newest running request is the one vLLM's scheduler would preempt.
    assert planner.likely_victim(set()) == ("r1", 5 + 1)
    assert planner.likely_victim({"r1"}) == ("r0", 5 + 1)


def test_the_victim_counts_what_it_gives_after_its_own_eviction():
    """A prompt in prefill needs 14 blocks next step, the pool is full; r2, the newest (so
    vLLM's victim), evicts to budget for room this step (5 blocks): preempting it then gives
    only its 6 remaining blocks, so r0 and r1 give all 6 they can above their floors and
    one preemption suffices."""
    pool, manager = FakeBlockPool(31), FakeBlockManager()
    config = VTokenConfig(policy="h2o", keep_ratio=0.5, eviction="on_demand")
    state = VTokenScheduler(config, pool, manager)
    prompt = FakeRequest("rP", 96)
    assert state.allocate(prompt, 40) is not None
    prompt.num_computed_tokens = 40
    requests = {"rP": prompt}
    for request_id in ("r0", "r1", "r2"):
        request = requests[request_id] = FakeRequest(request_id, 40)
        run_prefill(state, request)
        if request_id != "r2":
            state.manager.evict_ids(request_id, np.arange(20))
            state._reclaim(state.requests[request_id])
    assert pool.get_num_free_blocks() == 0
    planner = state.squeeze_planner(requests)
    plan = planner.plan(["r0", "r1", "r2"], 0)
    assert plan.for_room == {"r2"} and plan.below == {"r0": 11, "r1": 11}
    assert planner.likely_victim(set(), {"r2"}) == ("r2", 11 - 5)
    # A request whose first allocation failed is waiting, not vLLM's victim.
    assert state.allocate(FakeRequest("w", 64), 64) is None
    waiting = state.squeeze_planner(requests | {"w": FakeRequest("w", 64)})
    assert waiting.likely_victim(set())[0] == "r2"


def test_a_tenant_over_its_allowance_goes_below_budget_first():
    pool, manager = FakeBlockPool(128), FakeBlockManager()
    config = VTokenConfig(policy="h2o", keep_ratio=0.5, eviction="on_demand")
    state = VTokenScheduler(config, pool, manager)
    requests = {}
    # Equal shares: without the allowance the first id ("a1", tenant y) would give first.
    for request_id, tenant in (("a1", "y"), ("x1", "x"), ("x2", "x")):
        params = SimpleNamespace(extra_args={"tenant": tenant})
        request = requests[request_id] = FakeRequest(request_id, 40, sampling_params=params)
        run_prefill(state, request)
        state.manager.evict_ids(request_id, np.arange(20))
        state._reclaim(state.requests[request_id])
    state.set_pressure({}, {"x": 6, "y": 100})  # x holds 10
    planner = state.squeeze_planner()
    excess = planner.excess_over_allowance(set(), set())
    assert excess == {"x": 4, "y": -95}
    below = planner.below_budget(list(requests), 2, excess)
    assert set(below) == {"x1", "x2"}
    # Once within its allowance the tenant gives no more than its share.
    # Over by 1 held block: x1's first block given is its next step's (20 tokens fill 5
    # blocks), so x gives again; x1's second frees a held one, then shares are level.
    below = planner.below_budget(list(requests), 4, {"x": 1})
    assert below == {"x1": 15, "x2": 19, "a1": 19}
    state.set_pressure({}, {})
    assert "a1" in state.squeeze_planner().below_budget(list(requests), 2)  # level shares


def test_a_bad_hold_value_is_ignored() -> None:
    pool, manager = FakeBlockPool(64), FakeBlockManager()
    state = VTokenScheduler(VTokenConfig(policy="h2o", keep_ratio=0.2), pool, manager)
    for value in (0, -3, "7", True, 2.5):
        params = SimpleNamespace(extra_args={"vtoken_hold_to_blocks": value})
        request = FakeRequest(f"r{value}", 8, sampling_params=params)
        assert state.allocate(request, 8) is not None
        assert state.requests[request.request_id].hold_blocks is None


# ---------------------------------------------------------------------- prefix caching
def _pinned_state(num_blocks: int = 16, pin: int = 0, mode: str = "vtoken"):
    pool, manager = FakeBlockPool(num_blocks), FakeBlockManager()
    config = VTokenConfig(
        policy="streaming_llm",
        policy_args={"sinks": 1, "recent": 2},
        prefix_pin_tokens=pin,
        check_invariants=True,
        mode=mode,
    )
    return VTokenScheduler(config, pool, manager), pool, manager


def test_a_hit_is_shared_pinned_and_released_by_reference_count():
    state, pool, manager = _pinned_state(pin=4)
    first = FakeRequest("a", num_prompt_tokens=12)
    run_prefill(state, first)
    assert state.num_cacheable_tokens("a", 12) == 12  # nothing evicted: every block
    manager.num_cached_block["a"] = 3  # vLLM published its 3 full blocks
    hit = manager.req_to_blocks["a"][:2]
    free_before = pool.get_num_free_blocks()
    second = FakeRequest("b", num_prompt_tokens=14)
    assert state.allocate(second, 6, hit_blocks=hit) is not None  # 8 hit + 6 new tokens
    assert pool.get_num_free_blocks() == free_before - 2  # only the new blocks
    assert [b.ref_cnt for b in hit] == [2, 2]
    assert manager.req_to_blocks["b"][:2] == hit and manager.num_cached_block["b"] == 2
    record = state.requests["b"]
    assert record.kv.num_pinned == 4 and record.kv.policy.sinks == 1  # the pin, not the policy
    reports = {r.request_id: r for r in state.manager.reports()}
    assert reports["a"].allocated_blocks == 3 and reports["a"].shared_blocks == 0
    assert reports["b"].allocated_blocks == 2 and reports["b"].shared_blocks == 2  # 4 held
    state.check_invariants()
    state.free("a")
    assert [b.ref_cnt for b in hit] == [1, 1]
    assert state.manager.report("b").shared_blocks == 0  # its earliest holder now: charged
    state.free("b")
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    state.check_invariants()


def test_a_hit_on_free_blocks_counts_them_as_taken_and_a_refusal_takes_nothing():
    state, pool, manager = _pinned_state(num_blocks=6, pin=8)  # 5 usable blocks
    first = FakeRequest("a", num_prompt_tokens=12)
    run_prefill(state, first)
    hit = manager.req_to_blocks["a"][:2]
    state.free("a")  # the hit blocks sit in the free queue now
    assert pool.get_num_free_blocks() == 5
    big = FakeRequest("b", num_prompt_tokens=28)
    assert state.allocate(big, 20, hit_blocks=hit) is None  # 2 taken + 5 new > 5 free
    assert [b.ref_cnt for b in hit] == [0, 0] and pool.get_num_free_blocks() == 5
    small = FakeRequest("c", num_prompt_tokens=20)
    assert state.allocate(small, 12, hit_blocks=hit) is not None  # 2 taken + 3 new
    assert pool.get_num_free_blocks() == 0 and [b.ref_cnt for b in hit] == [1, 1]


def test_a_policy_that_never_evicts_publishes_every_full_block():
    state, _, _ = make_state(ReclaimMode.VTOKEN)
    run_prefill(state, FakeRequest("r", num_prompt_tokens=10))
    assert state.requests["r"].cacheable is None and state.requests["r"].kv.num_pinned == 0
    assert state.num_cacheable_tokens("r", 10) == 10


def _shared_with_b(num_blocks: int, mode: str = "vtoken"):
    """Published blocks 0-3 of ``a`` (16 tokens); ``b`` hit blocks 0-1; ``a`` decodes:
    StreamingLLM keeps its sink 0 and recent 14, 15, so it evicts from block 0 on."""
    state, pool, manager = _pinned_state(num_blocks=num_blocks, pin=0, mode=mode)
    first = FakeRequest("a", num_prompt_tokens=16)
    run_prefill(state, first)
    manager.num_cached_block["a"] = 4
    hit = manager.req_to_blocks["a"][:2]
    own = [b.block_id for b in manager.req_to_blocks["a"]]
    assert state.allocate(FakeRequest("b", num_prompt_tokens=12), 4, hit_blocks=hit)
    first.num_computed_tokens = 16
    state.after_step({"a": 1}, {"a": first}, None)
    return state, pool, manager, hit, own


def test_an_eviction_from_shared_blocks_copies_what_it_keeps_and_leaves_them_intact():
    """Copy on evict: ``a`` keeps 3 tokens, in one new block of its own (its kept slot 0
    of shared block 0 copied, tokens 14, 15 moved in from its block 3); shared block 1 is
    only released; both shared blocks stay with ``b``, cached; ``a``'s own published
    blocks 2-3 leave the cache and it publishes nothing again."""
    state, pool, manager, hit, own = _shared_with_b(num_blocks=16)
    record = state.requests["a"]
    table = record.kv.table
    assert record.kv.num_pinned == 0 and not record.copy_deferred
    assert table.live_logical_ids().tolist() == [0, 14, 15]
    (new,) = table.block_ids
    assert new not in own and [b.ref_cnt for b in hit] == [1, 1]  # b's alone now
    assert pool.unpublished == set(own[2:])  # nothing shared was dropped from the cache
    assert manager.num_cached_block["a"] == 0 and record.cacheable == 0
    size = BLOCK_SIZE
    moves = sorted(zip(record.pending_src.tolist(), record.pending_dst.tolist(), strict=True))
    assert moves == sorted(
        [(own[0] * size, new * size), (own[3] * size + 2, new * size + 1)]
        + [(own[3] * size + 3, new * size + 2)]
    )
    assert record.pending_block_row.tolist() == [new]  # the workers rewrite the row
    assert state.counters.num_shared_copies == 1 and state.counters.num_copies_deferred == 0
    assert state.snapshot().shared_copies == 1
    assert state.manager.report("a").shared_blocks == 0  # the copy is its own
    ops = state.take_ops({"a": 1}, {"a": FakeRequest("a", 16, 16)})
    assert ops.block_rows["a"].tolist() == [new] and ops.num_moves == 3
    state.check_invariants()


def test_without_a_free_block_for_the_copy_the_shared_blocks_are_kept_that_step():
    """The pool is full: ``a`` keeps the blocks ``b`` shares (protected, counted) and
    evicts past them; only its own blocks 2-3 leave the cache."""
    state, pool, manager, hit, own = _shared_with_b(num_blocks=6)  # 5 usable, all held
    record = state.requests["a"]
    assert record.copy_deferred and state.counters.num_copies_deferred == 1
    assert record.kv.num_pinned == 8 and record.kv.policy.sinks == 1  # the shared blocks
    table = record.kv.table
    assert table.is_alive(np.arange(8)).all() and table.num_live < 16  # it evicted past them
    assert pool.unpublished == set(own[2:])
    assert manager.num_cached_block["a"] == 2 and record.cacheable == 8
    assert state.num_cacheable_tokens("a", 16) == 8
    assert state.counters.num_shared_copies == 0 and state.snapshot().copies_deferred == 1
    state.check_invariants()


def test_block_mode_keeps_every_block_another_request_holds():
    """Block mode writes no block, so it copies none: the blocks ``b`` shares stay in
    ``a``'s table (dropping one would free nothing), it drops only whole blocks of its own,
    and that is not counted as a deferred copy."""
    state, pool, manager, hit, own = _shared_with_b(num_blocks=16, mode="block")
    record = state.requests["a"]
    assert record.kv.table.block_ids[:2] == [b.block_id for b in hit]
    assert [b.ref_cnt for b in hit] == [2, 2]
    assert len(record.kv.table.block_ids) < 4  # it evicted whole blocks of its own
    assert state.counters.num_shared_copies == 0 and state.counters.num_copies_deferred == 0
    state.check_invariants()


def _decode(state, request: FakeRequest) -> None:
    """One step past its prefill (no attention statistics: the policies here need none)."""
    request.num_computed_tokens = request.num_prompt_tokens
    state.after_step({request.request_id: 1}, {request.request_id: request}, None)


def test_a_block_nobody_else_holds_is_the_adopters_own():
    """``a`` finished: the blocks ``b`` took from the cache are its alone; its eviction may
    take their tokens, and they leave the cache first."""
    state, pool, manager = _pinned_state(pin=0)
    run_prefill(state, FakeRequest("a", num_prompt_tokens=16))
    manager.num_cached_block["a"] = 4
    hit = manager.req_to_blocks["a"][:2]
    state.free("a")
    second = FakeRequest("b", num_prompt_tokens=16)
    assert state.allocate(second, 8, hit_blocks=hit)
    _decode(state, second)  # streaming_llm: 1 sink + 2 recent
    record = state.requests["b"]
    assert record.kv.num_pinned == 0 and record.kv.table.num_live == 3
    assert pool.unpublished == {b.block_id for b in hit}
    assert manager.num_cached_block["b"] == 0 and record.cacheable == 0
    state.check_invariants()


def _keep_half(pin_cache_hits: bool = False, check: bool = True):
    """Random eviction at keep 0.5 on a 16-block pool, with ``a`` (12 tokens, its 3 full
    blocks published) run: ``(state, pool, manager, a's first two blocks)``."""
    pool, manager = FakeBlockPool(16), FakeBlockManager()
    config = VTokenConfig(
        policy="random", keep_ratio=0.5, pin_cache_hits=pin_cache_hits, check_invariants=check
    )
    state = VTokenScheduler(config, pool, manager)
    run_prefill(state, FakeRequest("a", num_prompt_tokens=12))
    manager.num_cached_block["a"] = 3
    return state, pool, manager, manager.req_to_blocks["a"][:2]


def test_an_adopter_keeps_what_its_policy_keeps_without_the_cache():
    """``b`` shares 2 blocks that ``a`` holds: its keep ratio applies to all its 16 tokens,
    and it keeps the very tokens it keeps with no cache hit; what it keeps of the shared
    blocks it copies into blocks of its own, which it pays for; ``a``'s stay intact."""
    state, _, _, hit = _keep_half()
    second = FakeRequest("b", num_prompt_tokens=16)
    assert state.allocate(second, 8, hit_blocks=hit)
    _decode(state, second)
    record = state.requests["b"]
    assert record.kv.num_pinned == 0 and record.kv.table.num_live == 8  # ceil(0.5 * 16)
    alone, _, _, _ = _keep_half()
    run_prefill(alone, FakeRequest("b", num_prompt_tokens=16))
    _decode(alone, FakeRequest("b", num_prompt_tokens=16))
    kept = record.kv.table.live_logical_ids().tolist()
    assert kept == alone.requests["b"].kv.table.live_logical_ids().tolist()
    assert [b.ref_cnt for b in hit] == [1, 1] and state.counters.num_shared_copies == 2
    reports = {r.request_id: r for r in state.manager.reports()}
    assert reports["b"].allocated_blocks == 2 and reports["b"].shared_blocks == 0
    state.check_invariants()


def test_pinned_cache_hits_stay_protected_and_cached_outside_the_budget():
    """``pin_cache_hits``: what ``b`` took from the cache stays (for the next turn of a
    conversation) although nobody else holds it, and does not count against its budget."""
    state, pool, _, hit = _keep_half(pin_cache_hits=True)
    state.free("a")
    second = FakeRequest("b", num_prompt_tokens=24)
    assert state.allocate(second, 16, hit_blocks=hit)
    _decode(state, second)
    record = state.requests["b"]
    assert record.kv.num_pinned == 8 and record.shared_elsewhere == 0
    table = record.kv.table
    assert table.is_alive(np.arange(8)).all()
    # keep ratio on the rest: 8 pinned + ceil(0.5 * (24 - 8)) of its own
    assert table.num_live == 8 + 8
    assert not pool.unpublished & {b.block_id for b in hit}
    state.check_invariants()


def test_hard_bounds_come_before_pinned_hits_and_a_resumed_request_pins_nothing():
    state, _, _, hit = _keep_half(pin_cache_hits=True, check=False)
    state.free("a")
    bounded = FakeRequest("b", num_prompt_tokens=24)
    assert state.allocate(bounded, 16, hit_blocks=hit)
    state.requests["b"].hold_blocks = 3  # admission counts it at 3 blocks
    _decode(state, bounded)
    record = state.requests["b"]
    assert record.kv.num_pinned == 0 and record.kv.table.num_live <= 2 * BLOCK_SIZE
    state.free("b")
    resumed = FakeRequest("c", num_prompt_tokens=24)
    resumed.num_preemptions = 1  # its hit is its own former sequence
    assert state.allocate(resumed, 16, hit_blocks=hit)
    assert state.requests["c"].hit_tokens == 0


def _block_state(num_blocks: int = 16):
    """Block mode, StreamingLLM keeping 1 sink and 2 recent tokens (so whole middle
    blocks go), on fakes."""
    pool, manager = FakeBlockPool(num_blocks), FakeBlockManager()
    config = VTokenConfig(
        policy="streaming_llm",
        policy_args={"sinks": 1, "recent": 2},
        mode=ReclaimMode.BLOCK,
        check_invariants=True,
    )
    return VTokenScheduler(config, pool, manager), pool, manager


def test_block_mode_drops_middle_blocks_and_ships_the_new_row_without_moves():
    state, pool, manager = _block_state()
    request = FakeRequest("r", num_prompt_tokens=14)  # blocks 0..3, the last holds 2
    run_prefill(state, request)
    row = [b.block_id for b in manager.req_to_blocks["r"]]
    free_before = pool.get_num_free_blocks()
    state.after_step({"r": 14}, {"r": request}, None)  # keeps the sink's and the tail block
    table = state.requests["r"].kv.table
    assert table.live_logical_ids().tolist() == [0, 1, 2, 3, 12, 13]
    assert [b.block_id for b in manager.req_to_blocks["r"]] == [row[0], row[3]]
    assert pool.get_num_free_blocks() == free_before + 2
    ops = state.take_ops({"r": 1}, {"r": request})
    assert ops.num_moves == 0 and ops.num_blocks == {}
    assert ops.block_rows["r"].tolist() == [row[0], row[3]]
    assert ops.num_evicted == {"r": 8}  # 14 logical, 6 physical
    assert state.take_ops({"r": 1}, {"r": request}).block_rows == {}  # taken once
    assert state.manager.num_repack_moves == 0
    # The next token lands after the tail, in the tail block: no new block.
    assert state.allocate(request, 1) == []
    state.check_invariants()


def test_block_mode_unpublishes_from_the_first_dropped_block():
    """Published blocks 0-3: the drop of blocks 1-2 takes them and block 3 (whose place
    in the request's sequence changed) out of the prefix cache."""
    state, pool, manager = _block_state()
    request = FakeRequest("r", num_prompt_tokens=16)
    run_prefill(state, request)
    manager.num_cached_block["r"] = 4
    published = [b.block_id for b in manager.req_to_blocks["r"]]
    state.after_step({"r": 16}, {"r": request}, None)
    assert pool.unpublished == set(published[1:])
    assert manager.num_cached_block["r"] == 1 and state.requests["r"].cacheable == 4
    state.check_invariants()


@pytest.mark.parametrize(
    ("config", "limit"),
    [
        ({"policy": "h2o", "keep_ratio": 0.5}, 0),  # sums every query's attention
        ({"policy": "h2o", "keep_ratio": 0.5, "prefix_pin_tokens": 8}, 8),  # pinned queries
        ({"policy": "scissorhands", "keep_ratio": 0.5}, 0),
        ({"policy": "snapkv", "keep_ratio": 0.5, "policy_args": {"window": 6}}, 34),
        ({"policy": "tova", "keep_ratio": 0.5}, None),  # the last query: always computed
        ({"policy": "streaming_llm", "policy_args": {"sinks": 1, "recent": 4}}, None),
        ({"policy": "none"}, None),
        ({"policy": "h2o", "keep_ratio": 0.5, "eviction": "on_demand"}, None),
        ({"policy": "h2o", "keep_ratio": 0.5, "pin_cache_hits": True}, None),
    ],
)
def test_a_cache_hit_stops_where_the_policy_reads_the_prompts_attention(config, limit):
    """A hit's queries are never computed: under eager eviction the hit leaves the policy
    every query whose attention it reads (caching never changes what it keeps)."""
    state = VTokenScheduler(VTokenConfig(**config), FakeBlockPool(8), FakeBlockManager())
    assert state.hit_limit(FakeRequest("r", num_prompt_tokens=40)) == limit


def test_a_spec_the_engine_cannot_group_is_refused_without_raising():
    """A grouped override that got past the request checks (no geometry here): the
    scheduler side takes nothing for it, remembers it as refused (vLLM finishes it with an
    error) and serves the next request."""
    state, pool, _ = make_state(ReclaimMode.VTOKEN)
    override = {"policy": "h2o", "budget_tokens": 8, "policy_args": {"granularity": "layer"}}
    params = SimpleNamespace(extra_args={"vtoken_policy": override})
    free_before = pool.get_num_free_blocks()
    grouped = FakeRequest("g", num_prompt_tokens=10, sampling_params=params)
    assert state.allocate(grouped, 10) is None and state.allocate(grouped, 10) is None
    assert state.refused == {"g"} and not state.manages("g")
    assert pool.get_num_free_blocks() == free_before
    run_prefill(state, FakeRequest("r", num_prompt_tokens=10))
    state.check_invariants()


def test_a_hole_in_a_later_group_counts_as_a_hole():
    """Per-layer sets: only layer 1 evicts from block 0 (layer 0 evicts from the tail
    block). The live mask, the in-place prefix check and the prefix rule all see the
    hole in block 0: its published blocks from there on are unpublished."""
    from vtoken.groups import ModelGeometry

    pool, manager = FakeBlockPool(16), FakeBlockManager()
    layer = {"granularity": "layer"}
    config = VTokenConfig(policy="tova", policy_args=layer, keep_ratio=0.5, check_invariants=True)
    state = VTokenScheduler(config, pool, manager, geometry=ModelGeometry(2, 2))
    run_prefill(state, FakeRequest("r", num_prompt_tokens=16))
    manager.num_cached_block["r"] = 4
    published = [b.block_id for b in manager.req_to_blocks["r"]]
    record = state.requests["r"]
    table = record.kv.table
    assert table.holds_in_place(16) and table.live_mask.all()
    state.manager.evict_ids("r", np.array([[13], [1]]))  # layer 0: block 3; layer 1: block 0
    assert np.flatnonzero(~table.live_mask).tolist() == [1, 13]
    assert table.holds_in_place(1) and not table.holds_in_place(4)
    state.prefix.unpublish_changed(record)
    assert manager.num_cached_block["r"] == 0 and pool.unpublished == set(published)
    assert record.cacheable == 0
    state._reclaim(record)  # layer 1 compacts block 0: all live, not in place
    assert table.live_mask.all() and table.holds_in_place(1) and not table.holds_in_place(4)
    state.check_invariants()
