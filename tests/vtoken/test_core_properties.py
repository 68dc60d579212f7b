"""Property tests: random append / evict / repack sequences on a real CPU_ATTN KV tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from vtoken import ReclaimMode, RepackPlan, StandaloneBlockPool, VTokenManager
from vtoken.token_table import TokenTable

from .kv_store import TaggedKV

NUM_BLOCKS = 48

operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 40)),
        st.tuples(st.just("evict"), st.floats(0.0, 1.0)),
        st.tuples(st.just("reclaim"), st.just(0)),
    ),
    min_size=1,
    max_size=30,
)


class Harness:
    """One manager over its own pool and KV tensor, copying the KV of every repack the way
    an engine does; ``check`` asserts every invariant."""

    def __init__(self, mode: ReclaimMode, block_size: int) -> None:
        self.pool = StandaloneBlockPool(NUM_BLOCKS)
        self.kv = TaggedKV(NUM_BLOCKS, block_size)
        self.manager = VTokenManager(self.pool, block_size, mode)
        self.manager.add_request("r", prompt_len=0)

    @property
    def table(self) -> TokenTable:
        return self.manager.requests["r"].table

    @property
    def num_held_blocks(self) -> int:
        return self.manager.requests["r"].num_held_blocks

    def append(self, count: int) -> bool:
        first_logical, first_slot = self.table.num_logical, self.table.num_slots
        if self.manager.allocate("r", count) is None:
            return False
        slots = self.table.global_slots(np.arange(first_slot, first_slot + count))
        self.kv.write(slots, np.arange(first_logical, first_logical + count))
        return True

    def reclaim(self) -> RepackPlan:
        (plan,) = self.manager.reclaim()
        if plan.num_moves:
            src, dst = torch.from_numpy(plan.src_slots), torch.from_numpy(plan.dst_slots)
            kernels.repack(self.kv.caches, src, dst, self.kv.layout)
        return plan

    def check(self) -> None:
        self.manager.check_invariants()
        self.pool.check_invariants()
        live = self.table.live_logical_ids()
        slots = self.table.global_slots(self.table.slot_of(live))
        assert np.unique(slots).size == slots.size, "a slot is owned twice"
        self.kv.assert_intact(slots, live)


@settings(max_examples=60, deadline=None)
@given(ops=operations, block_size=st.sampled_from([4, 16, 32]), seed=st.integers(0, 2**16))
def test_random_sequences_keep_every_invariant(ops, block_size, seed):
    rng = np.random.default_rng(seed)
    # Token-level evictions: block mode (whole blocks only) has its own property test.
    harnesses = {
        mode: Harness(mode, block_size) for mode in (ReclaimMode.VTOKEN, ReclaimMode.NAIVE)
    }
    for op, arg in ops:
        if op == "append":
            fits = [h.append(arg) for h in harnesses.values()]
            assert fits[0] or not fits[1], "vtoken ran out of blocks before naive"
            if not all(fits):
                break  # the naive pool is full: the paired run stops here
        elif op == "evict":
            live = harnesses[ReclaimMode.VTOKEN].table.live_logical_ids()
            victims = np.sort(rng.choice(live, size=int(arg * live.size), replace=False))
            for harness in harnesses.values():
                harness.manager.evict_ids("r", victims)
        else:
            vtoken, naive = harnesses[ReclaimMode.VTOKEN], harnesses[ReclaimMode.NAIVE]
            holes = vtoken.table.num_slots - vtoken.table.num_live
            assert vtoken.reclaim().num_moves <= holes
            assert vtoken.num_held_blocks == vtoken.table.num_ideal_blocks
            naive.reclaim()
            # Same decisions, same packed layout: only the ballast differs.
            assert np.array_equal(naive.table.live_logical_ids(), vtoken.table.live_logical_ids())
            assert naive.num_held_blocks == naive.table.num_naive_blocks()
        for harness in harnesses.values():
            harness.check()
        naive = harnesses[ReclaimMode.NAIVE]
        if op == "append":  # ballast tops the table up to every logical block with a live token
            expected = max(len(naive.table.block_ids), naive.table.num_naive_blocks())
            assert naive.num_held_blocks == expected
    for harness in harnesses.values():
        request = harness.manager.requests["r"]
        # The engine-wide counters (reported and exported) are the requests' sums.
        assert harness.manager.num_evicted_tokens == request.num_evicted
        assert harness.manager.num_repack_moves == request.num_moves
        harness.manager.free_request("r")
        assert harness.pool.num_free_blocks == NUM_BLOCKS
        assert harness.manager.num_evicted_tokens == request.num_evicted  # kept after the end


def test_worked_example_from_the_planner_docstring():
    harness = Harness(ReclaimMode.VTOKEN, block_size=4)
    harness.append(10)
    harness.manager.evict_ids("r", np.array([1, 4, 5, 8]))
    plan = harness.manager.plan("r")
    assert plan.src_local.tolist() == [6, 7, 9]
    assert plan.dst_local.tolist() == [1, 4, 5]
    assert plan.free_block_ids == [2]
    harness.reclaim()
    assert harness.table.block_ids == [0, 1]
    assert harness.table.live_logical_ids().tolist() == [0, 6, 2, 3, 7, 9]
    assert harness.pool.num_free_blocks == NUM_BLOCKS - 2
    harness.check()


def test_naive_mode_holds_ballast_for_every_logical_block_with_a_live_token():
    """The manager docstring's example: live 0, 6, 8, 9 fill one packed block, but sit in
    logical blocks 0, 1 and 2, so Naive-Evict holds three."""
    harness = Harness(ReclaimMode.NAIVE, block_size=4)
    harness.append(10)
    harness.manager.evict_ids("r", np.array([1, 2, 3, 4, 5, 7]))
    harness.reclaim()
    request = harness.manager.requests["r"]
    assert harness.table.live_logical_ids().tolist() == [0, 6, 8, 9]
    assert len(request.table.block_ids) == 1 and len(request.ballast) == 2
    assert harness.pool.num_free_blocks == NUM_BLOCKS - 3
    harness.append(3)  # logical 10, 11 (block 2) and 12 (block 3): one more block
    assert request.num_held_blocks == 4 and len(request.table.block_ids) == 2
    harness.manager.evict_ids("r", np.array([0, 6]))  # logical blocks 0 and 1 empty
    harness.reclaim()
    assert request.num_held_blocks == 2 and request.ballast == []
    harness.check()
    harness.manager.free_request("r")
    assert harness.pool.num_free_blocks == NUM_BLOCKS


def test_dead_tail_tokens_give_up_their_slots_without_moves():
    harness = Harness(ReclaimMode.VTOKEN, block_size=4)
    harness.append(7)
    harness.manager.evict_ids("r", np.array([5, 6]))
    plan = harness.reclaim()
    assert not plan.touches_blocks and harness.table.num_slots == 5
    harness.append(1)  # lands in slot 5, right after the live tokens
    assert harness.table.slot_of(np.array([7])).tolist() == [5]
    harness.check()


def test_new_tokens_land_after_the_repacked_live_tokens():
    harness = Harness(ReclaimMode.VTOKEN, block_size=4)
    harness.append(8)
    harness.manager.evict_ids("r", np.array([0, 1, 2]))
    harness.reclaim()
    harness.append(2)
    table = harness.table
    assert table.slot_of(np.array([8, 9])).tolist() == [5, 6]
    harness.check()


def test_bad_evictions_are_rejected_and_change_nothing():
    harness = Harness(ReclaimMode.VTOKEN, block_size=4)
    harness.append(6)
    for bad in ([6], [-1], [2, 2]):
        with pytest.raises(ValueError):
            harness.manager.evict_ids("r", np.array(bad))
    harness.manager.evict_ids("r", np.array([2]))
    with pytest.raises(ValueError, match="already evicted"):
        harness.manager.evict_ids("r", np.array([2, 3]))
    assert harness.table.num_live == 5
    harness.check()


def test_pool_exhaustion_returns_none_and_takes_nothing():
    harness = Harness(ReclaimMode.VTOKEN, block_size=32)
    assert harness.append(NUM_BLOCKS * 32 - 1)
    free_before = harness.pool.num_free_blocks
    assert harness.manager.allocate("r", 2) is None
    assert harness.pool.num_free_blocks == free_before
    harness.check()
