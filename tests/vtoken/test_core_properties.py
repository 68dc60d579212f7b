"""Property tests: random append / evict / repack sequences on a real CPU_ATTN KV tensor."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken import ReclaimMode, StandaloneBlockPool, VTokenManager
from vtoken.reclaimer import Reclaimer
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
    """One manager over its own pool and KV tensor; ``check`` asserts every invariant."""

    def __init__(self, mode: ReclaimMode, block_size: int) -> None:
        self.pool = StandaloneBlockPool(NUM_BLOCKS)
        self.kv = TaggedKV(NUM_BLOCKS, block_size)
        reclaimer = Reclaimer(self.pool, self.kv.caches, self.kv.layout)
        self.manager = VTokenManager(self.pool, block_size, mode, reclaimer)
        self.manager.add_request("r", prompt_len=0)

    @property
    def table(self) -> TokenTable:
        return self.manager.requests["r"].table

    def append(self, count: int) -> bool:
        first = self.table.num_logical
        slots = self.manager.allocate("r", count)
        if slots is None:
            return False
        self.kv.write(slots, np.arange(first, first + count))
        return True

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
    harnesses = {mode: Harness(mode, block_size) for mode in ReclaimMode}
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
            dead_blocks = set(naive.table.blocks_without_live_tokens().tolist())
            held_before = naive.table.num_held_blocks
            (plan,) = vtoken.manager.reclaim() or (None,)
            if plan is not None:
                assert plan.num_moves <= holes
            assert vtoken.table.num_held_blocks == vtoken.table.num_ideal_blocks
            naive.manager.reclaim()
            assert naive.table.num_held_blocks == held_before - len(dead_blocks)
            assert naive.table.blocks_without_live_tokens().size == 0
        for harness in harnesses.values():
            harness.check()
    for harness in harnesses.values():
        harness.manager.free_request("r")
        assert harness.pool.num_free_blocks == NUM_BLOCKS


def test_worked_example_from_the_planner_docstring():
    harness = Harness(ReclaimMode.VTOKEN, block_size=4)
    harness.append(10)
    harness.manager.evict_ids("r", np.array([1, 4, 5, 8]))
    plan = harness.manager.plan("r")
    assert plan.src_local.tolist() == [6, 7, 9]
    assert plan.dst_local.tolist() == [1, 4, 5]
    assert plan.free_block_ids == [2]
    harness.manager.reclaim()
    assert harness.table.block_ids == [0, 1]
    assert harness.table.live_logical_ids().tolist() == [0, 6, 2, 3, 7, 9]
    assert harness.pool.num_free_blocks == NUM_BLOCKS - 2
    harness.check()


def test_naive_mode_frees_a_dead_middle_block_and_keeps_numbering():
    harness = Harness(ReclaimMode.NAIVE, block_size=4)
    harness.append(12)
    harness.manager.evict_ids("r", np.array([4, 5, 6, 7, 9]))
    harness.manager.reclaim()
    assert harness.table.held_block_ids == [0, 2]
    assert harness.table.slot_of(np.array([8, 10, 11])).tolist() == [8, 10, 11]
    harness.append(3)  # continues after slot 11, in a new block
    assert harness.table.held_block_ids == [0, 2, 3]
    harness.check()


def test_new_tokens_land_after_the_repacked_live_tokens():
    harness = Harness(ReclaimMode.VTOKEN, block_size=4)
    harness.append(8)
    harness.manager.evict_ids("r", np.array([0, 1, 2]))
    harness.manager.reclaim()
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
