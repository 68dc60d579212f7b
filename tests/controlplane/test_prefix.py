"""Prefix keys, the replicas' prefix memory and the router's prefix affinity (pure logic)."""

from __future__ import annotations

import pytest

from controlplane.prefix import PrefixIndex, PrefixMemory, prefix_keys, within_load_bound
from controlplane.router import RouterConfig, RouterCore, RouteSource
from tests.controlplane.builders import report
from tests.controlplane.fakes import FakeClock

BLOCK = 4


def test_keys_are_chained_over_full_blocks_and_salted():
    tokens = list(range(10))
    keys = prefix_keys(tokens, BLOCK, "t1")
    assert len(keys) == 2  # 10 tokens: two full blocks
    assert prefix_keys(tokens[:8] + [99, 98, 97], BLOCK, "t1") == keys  # same first blocks
    diverged = prefix_keys([0, 1, 2, 3, 4, 5, 6, 0], BLOCK, "t1")
    assert diverged[0] == keys[0] and diverged[1] != keys[1]
    changed_first = prefix_keys([7, 1, 2, 3, 4, 5, 6, 7], BLOCK, "t1")
    assert changed_first[1] != keys[1], "a key covers every block before it"
    assert prefix_keys(tokens, BLOCK, "t2")[0] != keys[0], "another salt, another key"
    assert prefix_keys(tokens[:3], BLOCK, "t1") == ()
    assert len(prefix_keys(list(range(100)), BLOCK, "t1", max_blocks=5)) == 5
    with pytest.raises(ValueError):
        prefix_keys(tokens, 0, "t1")


def test_memory_forgets_least_recently_used_first():
    memory = PrefixMemory(capacity=3)
    memory.add(["a", "b", "c"])
    memory.add(["a"])  # used again: now the most recent
    memory.add(["d"])
    assert memory.snapshot() == ("d", "a", "c")
    assert memory.snapshot(limit=2) == ("d", "a")
    memory.resize(1)  # shrinking trims at once
    assert memory.snapshot() == ("d",)
    with pytest.raises(ValueError):
        PrefixMemory(0)


def test_longest_match_per_candidate():
    keys = prefix_keys(list(range(16)), BLOCK, "t")
    index = PrefixIndex({"r1": keys[:1], "r2": keys[:3], "r3": keys, "r4": ()})
    assert index.longest_match(keys, {"r1", "r2", "r4"}) == {"r1": 1, "r2": 3}
    assert index.longest_match(keys, {"r1", "r2", "r3"})["r3"] == 4
    assert index.longest_match(prefix_keys([5] * 8, BLOCK, "t"), {"r1", "r2"}) == {}


def test_bounded_load_cap():
    # 3 replicas carrying 2 + 2 + 2 requests; with the new one m = 7: cap ceil(1.25 * 7 / 3) = 3
    assert within_load_bound(2, [2, 2, 2], 1.25)
    assert not within_load_bound(3, [3, 1, 2], 1.25)  # would hold 4 > cap 3
    assert within_load_bound(0, [0, 0], 1.0)  # an idle cluster takes a request anywhere
    assert not within_load_bound(1, [1, 0, 0], 1.25)  # cap ceil(1.25 * 2 / 3) = 1
    assert within_load_bound(1, [1, 0, 0], 1.25, slack=1)  # one request of slack


@pytest.fixture
def router(store, clock: FakeClock) -> RouterCore:
    core = RouterCore(store, clock, RouterConfig(fallback_width=4))
    return core


def _reports(clock: FakeClock, held: dict[str, tuple[str, ...]], queued: dict[str, int]):
    return {
        r: report(r, clock.now(), queue_depth=queued.get(r, 0), prefix_keys=held.get(r, ()))
        for r in ("r1", "r2", "r3")
    }


ALL = frozenset({"r1", "r2", "r3"})


def test_the_longest_prefix_holder_goes_first(router: RouterCore, clock: FakeClock):
    keys = prefix_keys(list(range(12)), BLOCK, "t")
    router.apply_reports(_reports(clock, {"r2": keys[:1], "r3": keys}, {"r3": 1}))
    ranking = router.rank("t", ALL, prefix_keys=keys)
    assert ranking.source is RouteSource.PREFIX
    assert ranking.ranks[0] == ("r3",)
    assert "r3" not in {r for rank in ranking.ranks[1:] for r in rank}
    assert set().union(*ranking.ranks) == ALL
    # No keys, or keys nobody holds: the ranking without affinity.
    assert router.rank("t", ALL).source is not RouteSource.PREFIX
    assert (
        router.rank("t", ALL, prefix_keys=prefix_keys([9] * 8, BLOCK, "t")).source
        is not RouteSource.PREFIX
    )


def test_an_overloaded_holder_is_passed_over(router: RouterCore, clock: FakeClock):
    keys = prefix_keys(list(range(12)), BLOCK, "t")
    router.apply_reports(_reports(clock, {"r3": keys}, {"r1": 0, "r2": 0, "r3": 4}))
    # 4 queued of 4: cap ceil(1.25 * 5 / 3) + 2 = 5 >= 4 + 1: still taken
    assert router.rank("t", ALL, prefix_keys=keys).ranks[0] == ("r3",)
    router.apply_reports(_reports(clock, {"r3": keys}, {"r1": 0, "r2": 0, "r3": 5}))
    ranking = router.rank("t", ALL, prefix_keys=keys)
    assert ranking.source is not RouteSource.PREFIX
    assert ranking.ranks[0][0] != "r3"
    # The caller's live queue lengths decide the bound when given.
    live = {"r1": 2, "r2": 2, "r3": 2}
    assert router.rank("t", ALL, live, prefix_keys=keys).ranks[0] == ("r3",)


def test_a_bad_load_factor_is_refused():
    with pytest.raises(ValueError, match="prefix_load_factor"):
        RouterConfig(prefix_load_factor=0.5)
    with pytest.raises(ValueError, match="prefix_load_slack"):
        RouterConfig(prefix_load_slack=-1)


def test_a_burst_between_reports_is_spread_by_the_load_bound(router: RouterCore, clock):
    """Reports lag a period: the router counts what it sent since, so a burst for one
    prefix does not all go to its holder."""
    keys = prefix_keys(list(range(12)), BLOCK, "t")
    router.apply_reports(_reports(clock, {"r3": keys}, {}))
    firsts = [router.rank("t", ALL, prefix_keys=keys).ranks[0] for _ in range(30)]
    to_holder = sum(1 for first in firsts if first == ("r3",))
    # idle replicas, factor 1.25, slack 2: the k-th request goes to the holder while
    # k <= ceil(1.25 * k / 3) + 2, i.e. 5 of them; the bound sends the other 25 on
    assert to_holder == 5
    router.apply_reports(_reports(clock, {"r3": keys}, {}))  # fresh reports: counted there
    assert router.rank("t", ALL, prefix_keys=keys).ranks[0] == ("r3",)


def test_equal_holders_are_spread_by_prefix(router: RouterCore, clock):
    held = {}
    prompts = [[p] * 8 for p in range(40)]
    all_keys = [prefix_keys(p, BLOCK, "t") for p in prompts]
    for r in ("r1", "r2", "r3"):
        held[r] = tuple(k for keys in all_keys for k in keys)
    router.apply_reports(_reports(clock, held, {}))
    chosen = set()
    for keys in all_keys:
        router.apply_reports(_reports(clock, held, {}))  # equal loads every time
        chosen.add(router.rank("t", ALL, prefix_keys=keys).ranks[0])
    assert chosen == {("r1",), ("r2",), ("r3",)}


def test_what_the_router_sent_is_matched_before_reports_list_it(router: RouterCore, clock):
    """A conversation's next turn follows its first one to the same replica while that
    replica's report does not list the prompt yet, and for `routed_memory_s` only."""
    system = list(range(8))
    first_turn = prefix_keys(system + [50, 51, 52, 53], BLOCK, "t")
    next_turn = prefix_keys(system + [50, 51, 52, 53, 60, 61, 62, 63, 70], BLOCK, "t")
    router.apply_reports(_reports(clock, {"r1": first_turn[:1]}, {}))
    assert router.rank("t", ALL, prefix_keys=first_turn).ranks[0] == ("r1",)  # from reports
    router.note_routed("r2", first_turn)  # Serve put the first turn on r2 after all
    ranking = router.rank("t", ALL, prefix_keys=next_turn)
    assert ranking.source is RouteSource.PREFIX and ranking.ranks[0] == ("r2",)  # 3 blocks
    # Reports that still do not list it change nothing within the memory...
    clock.advance(router.config.routed_memory_s - 1)
    router.apply_reports(_reports(clock, {"r1": first_turn[:1]}, {}))
    assert router.rank("t", ALL, prefix_keys=next_turn).ranks[0] == ("r2",)
    # ...after it only the reports count: r1's one block is the longest match left.
    clock.advance(2)
    router.apply_reports(_reports(clock, {"r1": first_turn[:1]}, {}))
    assert router.rank("t", ALL, prefix_keys=next_turn).ranks[0] == ("r1",)
    router.note_routed("r3", ())  # a prompt shorter than a block: nothing to remember
    with pytest.raises(ValueError, match="positive"):
        RouterConfig(routed_memory_s=0)


def test_what_the_router_sent_still_obeys_the_load_bound(router: RouterCore, clock):
    keys = prefix_keys(list(range(12)), BLOCK, "t")
    router.apply_reports(_reports(clock, {}, {"r2": 6}))
    router.note_routed("r2", keys)
    ranking = router.rank("t", ALL, prefix_keys=keys)
    assert ranking.source is not RouteSource.PREFIX and ranking.ranks[0][0] != "r2"


def test_what_the_router_sent_expires_without_reports_and_is_capped(router, clock, monkeypatch):
    """No reports read (Redis away): the memory still forgets after `routed_memory_s`,
    and never holds more than `MAX_ROUTED_REMEMBERED` requests."""
    import controlplane.router as router_module

    keys = prefix_keys(list(range(12)), BLOCK, "t")
    router.note_routed("r2", keys)
    assert router.rank("t", ALL, prefix_keys=keys).ranks[0] == ("r2",)
    clock.advance(router.config.routed_memory_s + 1)
    assert router.rank("t", ALL, prefix_keys=keys).source is not RouteSource.PREFIX
    monkeypatch.setattr(router_module, "MAX_ROUTED_REMEMBERED", 3)
    for replica_id in ("r1", "r2", "r3", "r1"):  # the first r1 is forgotten, not the last
        router.note_routed(replica_id, keys)
    assert len(router._sent) == 3
    assert router._sent_index.longest_match(keys, ALL) == {"r1": 3, "r2": 3, "r3": 3}
    router.note_routed("r2", prefix_keys([7] * 8, BLOCK, "t"))  # pushes r2's first out
    assert router._sent_index.longest_match(keys, ALL) == {"r1": 3, "r3": 3}


def test_an_index_counts_what_was_added_until_removed():
    keys = prefix_keys(list(range(8)), BLOCK, "t")
    index = PrefixIndex()
    index.add("r1", keys)
    index.add("r1", keys[:1])
    index.remove("r1", keys)
    assert index.longest_match(keys, {"r1"}) == {"r1": 1}  # the second add still holds
    index.remove("r1", keys[:1])
    index.remove("r9", keys)  # never added: nothing to undo
    assert not index
