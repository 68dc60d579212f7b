"""Block-granular eviction: whole blocks chosen by summed scores, protected blocks and the
tail kept, no copies; the manager's block mode frees them and keeps its invariants."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import make_policy
from vtoken import ReclaimMode, StandaloneBlockPool, VTokenManager
from vtoken.block_eviction import num_protected_blocks, select_blocks
from vtoken.policy import EvictionPolicy, PolicyView, Protection, StepAttention
from vtoken.repack_planner import plan_block_drop
from vtoken.token_table import TokenTable

from .kv_store import TaggedKV


@dataclass
class Fixed(EvictionPolicy):
    """Scores given per logical id."""

    name = "fixed"
    values: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def score(self, view: PolicyView) -> np.ndarray:
        return self.values[view.logical_ids]


def view_of(num: int, logical_ids: np.ndarray | None = None) -> PolicyView:
    ids = np.arange(num) if logical_ids is None else logical_ids
    return PolicyView(logical_ids=ids, num_logical=num, prompt_len=num, step=1)


def test_the_lowest_summed_blocks_go_first_until_the_budget_holds():
    # The module docstring's example: blocks sum to 0.5, 3.3, 0.2 and the tail 1.1.
    values = np.array([0.1, 0.1, 0.2, 0.1, 0.9, 0.8, 0.7, 0.9, 0.0, 0.1, 0.0, 0.1, 0.5, 0.6])
    evicted = select_blocks(Fixed(values=values), view_of(14), 8, 4, np.arange(14))
    assert evicted.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    # A budget one block's worth lower than live stops after the cheapest block.
    evicted = select_blocks(Fixed(values=values), view_of(14), 10, 4, np.arange(14))
    assert evicted.tolist() == [8, 9, 10, 11]


def test_stops_as_soon_as_live_fits_so_it_can_end_under_budget():
    values = np.arange(16, dtype=np.float64)  # older blocks score lower
    evicted = select_blocks(Fixed(values=values), view_of(16), 13, 4, np.arange(16))
    assert evicted.tolist() == [0, 1, 2, 3]  # 3 tokens due, a whole block of 4 goes: 12 live
    assert select_blocks(Fixed(values=values), view_of(16), 16, 4, np.arange(16)).size == 0


def test_sinks_and_the_recent_window_keep_their_whole_blocks():
    values = np.zeros(20)  # all tie: older blocks would go first
    policy = Fixed(values=values, sinks=1, recent=5)  # window 15..19 straddles blocks 3, 4
    evicted = select_blocks(policy, view_of(20), 0, 4, np.arange(20))
    assert evicted.tolist() == list(range(4, 12))  # blocks 1 and 2; 0, 3 and 4 kept


def test_the_last_partially_filled_block_is_kept_without_a_window():
    values = np.concatenate([np.ones(8), np.zeros(2)])  # the tail scores lowest
    evicted = select_blocks(Fixed(values=values), view_of(10), 0, 4, np.arange(10))
    assert evicted.tolist() == list(range(8))


def test_ties_drop_the_older_block_first():
    values = np.array([0.25] * 4 + [0.0, 0.0, 0.0, 1.0] + [0.25] * 4 + [5.0] * 2)  # 1, 1, 1
    evicted = select_blocks(Fixed(values=values), view_of(14), 10, 4, np.arange(14))
    assert evicted.tolist() == [0, 1, 2, 3]
    evicted = select_blocks(Fixed(values=values), view_of(14), 6, 4, np.arange(14))
    assert evicted.tolist() == list(range(8))


def test_a_closed_gate_or_nothing_due_evicts_nothing_and_a_bad_budget_raises():
    policy = Fixed(values=np.zeros(8))
    assert select_blocks(policy, view_of(8), 8, 4, np.arange(8)).size == 0
    with pytest.raises(ValueError, match="budget"):
        select_blocks(policy, view_of(8), -1, 4, np.arange(8))


def test_blocks_follow_slots_not_logical_ids():
    # Block mode after a drop: logical 8..15 live in slots 0..7 (blocks 0, 1).
    ids = np.arange(8, 20)
    values = np.zeros(20)
    values[12:16] = -1.0  # slot block 1
    view = PolicyView(logical_ids=ids, num_logical=20, prompt_len=20, step=1)
    evicted = select_blocks(Fixed(values=values), view, 8, 4, np.arange(12))
    assert evicted.tolist() == [12, 13, 14, 15]


def test_protected_blocks_count_whole_blocks_per_region():
    protection = Protection(sinks=4, recent=5)
    assert num_protected_blocks(protection, 100, 0, 16) == 1 + 1 + 1
    assert num_protected_blocks(protection, 100, 20, 16) == 2 + 1 + 1  # pinned prefix
    assert num_protected_blocks(Protection(recent_fraction=0.5), 64, 0, 16) == 2 + 1
    assert num_protected_blocks(Protection(), 64, 0, 16) == 1  # the tail block


def block_manager(num_blocks: int = 16, block_size: int = 4) -> VTokenManager:
    return VTokenManager(StandaloneBlockPool(num_blocks), block_size, ReclaimMode.BLOCK)


def test_block_mode_frees_the_dropped_blocks_without_moves():
    manager = block_manager()
    policy = Fixed(values=np.array([5.0] * 4 + [0.0] * 4 + [5.0] * 4 + [1.0] * 2))
    manager.add_request("r", 14, policy=policy)
    manager.allocate("r", 14)
    blocks_before = list(manager.requests["r"].table.block_ids)
    evicted = manager.evict("r", 10)
    assert evicted.tolist() == [4, 5, 6, 7]
    (plan,) = manager.reclaim(["r"])
    table = manager.requests["r"].table
    assert plan.num_moves == 0 and manager.num_repack_moves == 0
    assert plan.free_block_ids == [blocks_before[1]]
    assert table.block_ids == [blocks_before[0], blocks_before[2], blocks_before[3]]
    assert table.num_slots == table.num_live == 10
    assert table.live_logical_ids().tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    assert manager.pool.num_free_blocks == 16 - 3
    manager.check_invariants()
    # The next token goes after the tail, in the tail block.
    assert manager.allocate("r", 1) == []
    assert table.slot_of(np.array([14])).tolist() == [10]
    manager.check_invariants()


def test_block_mode_reports_whole_blocks_and_refuses_holes():
    manager = block_manager()
    manager.add_request("r", 12, policy=make_policy("h2o", recent_fraction=0.0, sinks=1))
    manager.allocate("r", 12)
    # At a budget of 4 the sinks' block and the tail stay: 2 blocks (vtoken mode: 1).
    assert manager.report("r", budget_tokens=4).floor_blocks == 2
    assert manager.report("r", budget_tokens=40).floor_blocks == 3  # all it holds
    manager.evict_ids("r", np.array([5]))
    with pytest.raises(ValueError, match="whole blocks"):
        manager.reclaim(["r"])


def test_block_mode_cuts_a_dead_tail_and_a_dead_tail_block():
    table = TokenTable(4)
    table.append(10, [7, 8, 9])
    table.evict(np.array([8, 9]))
    plan = plan_block_drop(table)
    assert plan.free_block_ids == [9] and plan.num_slots_after == 8
    assert table.drop_blocks(plan.free_block_indices, plan.num_slots_after) == [9]
    table.check_invariants()
    assert table.block_ids == [7, 8] and table.num_slots == 8


class BlockHarness:
    """A block-mode manager writing tagged KV, so a drop that moved bytes would show."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.kv = TaggedKV(32, block_size)
        self.manager = block_manager(32, block_size)
        self.manager.add_request("r", 0, policy=make_policy("random", seed=seed, sinks=2))

    def append(self, count: int) -> bool:
        table = self.manager.requests["r"].table
        first_logical, first_slot = table.num_logical, table.num_slots
        if self.manager.allocate("r", count) is None:
            return False
        slots = table.global_slots(np.arange(first_slot, first_slot + count))
        self.kv.write(slots, np.arange(first_logical, first_logical + count))
        return True

    def check(self) -> None:
        table = self.manager.requests["r"].table
        self.manager.check_invariants()
        self.manager.pool.check_invariants()
        assert table.num_slots == table.num_live and len(table.block_ids) == (
            table.num_ideal_blocks
        )
        live = table.live_logical_ids()
        assert (np.diff(live) > 0).all(), "block mode keeps slot order == logical order"
        self.kv.assert_intact(table.global_slots(table.slot_of(live)), live)


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(1, 20), st.floats(0.0, 1.0)), min_size=1, max_size=20),
    block_size=st.sampled_from([4, 16]),
    seed=st.integers(0, 2**16),
)
def test_random_block_evictions_keep_bytes_in_place(steps, block_size, seed):
    harness = BlockHarness(block_size, seed)
    for count, keep in steps:
        if not harness.append(count):
            break
        table = harness.manager.requests["r"].table
        live_before = table.num_live
        budget = int(keep * live_before)
        harness.manager.evict("r", budget, StepAttention())
        (plan,) = harness.manager.reclaim(["r"])
        assert plan.num_moves == 0
        # Down to the budget, unless only the sinks' block and the tail are left ...
        assert table.num_live <= budget or len(table.block_ids) <= 2
        # ... and not a whole block further than it had to.
        assert table.num_live > min(budget, live_before) - block_size
        harness.check()
    assert harness.manager.num_repack_moves == 0
