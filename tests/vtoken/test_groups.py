"""A set per layer or per (layer, KV head): grouped selection, token table, repack plans.

Every group evicts the same count, keeps protected tokens, breaks ties to the older
token; the table keeps a map per group with the invariants per group; a repack compacts
each group on its own map, and the KV it moves (``kernels.grouped_repack``) leaves each
(layer, head) holding exactly its group's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kernels import KVLayout
from kernels.grouped_repack import grouped_repack
from policies import make_policy
from vtoken import StandaloneBlockPool, VTokenManager
from vtoken.groups import GroupedMoves, ModelGeometry
from vtoken.policy import EvictionPolicy, PolicyView, StepAttention
from vtoken.repack_planner import plan_repack
from vtoken.token_table import TokenTable

GEOMETRY = ModelGeometry(num_layers=3, num_kv_heads=2)


@dataclass
class Scored(EvictionPolicy):
    """Scores given per test, of any group shape."""

    granularities = ("request", "layer", "head")
    values: np.ndarray | None = None

    def score(self, view: PolicyView) -> np.ndarray:
        assert self.values is not None
        return self.values


def _view(group_shape: tuple[int, ...], num_live: int) -> PolicyView:
    ids = np.broadcast_to(np.arange(num_live), (*group_shape, num_live)).copy()
    return PolicyView(logical_ids=ids, num_logical=num_live, prompt_len=num_live, step=1)


def test_each_group_evicts_its_lowest_and_the_same_count() -> None:
    scores = np.random.default_rng(0).random((3, 2, 12))
    policy = Scored(sinks=1, recent=2, granularity="head", values=scores)
    evicted = policy.select(_view((3, 2), 12), budget=8)
    assert evicted.shape == (6, 4)
    for group, row in enumerate(evicted):
        candidates = np.arange(1, 10)
        expected = candidates[np.argsort(scores.reshape(6, 12)[group, 1:10])[:4]]
        assert np.array_equal(row, np.sort(expected))
    assert len({tuple(row) for row in evicted}) > 1, "random scores: groups should differ"


def test_layer_scores_broadcast_over_heads_and_ties_go_to_the_older() -> None:
    scores = np.zeros((3, 10))
    scores[1, :5] = 1.0  # layer 1 keeps its first half: evicts the newer ties
    policy = Scored(granularity="head", values=scores)
    evicted = policy.select(_view((3, 2), 10), budget=6).reshape(3, 2, 4)
    assert np.array_equal(evicted[0], [[0, 1, 2, 3]] * 2)
    assert np.array_equal(evicted[1, 1], [5, 6, 7, 8])
    with pytest.raises(ValueError, match="scores of shape"):
        Scored(granularity="layer", values=np.zeros((2, 10))).select(_view((3,), 10), 6)


def test_protected_tokens_limit_every_group_alike() -> None:
    view = _view((3,), 10)
    view.logical_ids[0, 4] = 99  # group 0 holds one unprotected token fewer (99 is recent)
    view.num_logical = 100
    scores = np.arange(30, dtype=float).reshape(3, 10)
    evicted = Scored(recent=1, granularity="layer", values=scores).select(view, budget=0)
    assert evicted.shape == (3, 9)  # the fewest candidates any group has (group 0: 9)
    assert 99 not in evicted[0]


def test_granularity_is_checked() -> None:
    with pytest.raises(ValueError, match="granularity"):
        make_policy("tova", granularity="token")
    with pytest.raises(ValueError, match="selects at granularity request"):
        make_policy("streaming_llm", granularity="head")
    assert make_policy("h2o", granularity="layer").score_needs().groups == "layer"
    assert make_policy("snapkv", granularity="head").score_needs().groups == "head"


@dataclass
class Ragged(EvictionPolicy):
    """Evicts one token more in its first group than in the others: invalid."""

    granularities = ("request", "layer", "head")

    def select(self, view: PolicyView, budget: int) -> np.ndarray:
        return [np.array([0, 1]), *[np.array([0])] * (view.logical_ids.shape[0] - 1)]  # type: ignore[return-value]


def test_unequal_counts_are_refused() -> None:
    manager = VTokenManager(StandaloneBlockPool(8), 4, geometry=GEOMETRY)
    manager.add_request("r", 6, policy=Ragged(granularity="layer"))
    manager.allocate("r", 6)
    with pytest.raises(ValueError):
        manager.evict("r", 4)
    table = manager.requests["r"].table
    table.evict(np.array([[0], [1], [2]]))
    table.check_invariants()
    table._live_at_slot[0, 3] = False  # group 0 one token short: the invariants say so
    with pytest.raises(AssertionError):
        table.check_invariants()


def test_grouped_table_compacts_each_group_and_keeps_its_stats() -> None:
    table = TokenTable(4, ("score",), group_shape=(3,))
    table.append(10, [5, 6, 7])
    table.stats["score"][:, :10] = np.arange(30).reshape(3, 10) % 10 + 100 * np.arange(3)[:, None]
    evicted = np.array([[0, 1, 2], [3, 5, 9], [1, 4, 8]])
    table.evict(evicted)
    table.check_invariants()
    assert table.num_live == 7 and table.num_naive_blocks() == 3
    plan = plan_repack(table)
    assert plan.group_ids is not None and plan.num_slots_after == 7
    released = table.move(plan.src_local, plan.dst_local, plan.num_slots_after, plan.group_ids)
    table.check_invariants()
    assert released == [7] and table.num_ideal_blocks == 2
    held = table.group_logical_ids()
    for group in range(3):
        assert sorted(held[group]) == sorted(set(range(10)) - set(evicted[group]))
        assert np.array_equal(table.view_stats()["score"][group], held[group] + 100 * group)
    assert table.view_logical_ids().shape == (3, 7)
    assert not table.holds_in_place(1) and TokenTable(4, (), (3,)).holds_in_place(0)


def test_naive_blocks_count_a_block_any_group_still_reads() -> None:
    table = TokenTable(4, group_shape=(2,))
    table.append(8, [0, 1])
    table.evict(np.array([[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert table.num_naive_blocks() == 2  # each logical block is live in one group


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_grouped_repack_leaves_each_head_its_groups_tokens(
    layout: KVLayout, granularity: str
) -> None:
    """Tokens tagged per (layer, head, K/V, dim); random per-group evictions; after the
    planned grouped moves every (layer, head) reads its group's tokens at slots 0..n-1."""
    block_size, head_dim, num_heads = 16, 32, GEOMETRY.num_kv_heads
    shape = GEOMETRY.group_shape(granularity)
    pool = StandaloneBlockPool(12)
    manager = VTokenManager(pool, block_size, geometry=GEOMETRY)
    caches = [
        layout.new_cache(12, block_size, num_heads, head_dim).zero_()
        for _ in range(GEOMETRY.num_layers)
    ]
    manager.add_request("r", 45, policy=Scored(granularity=granularity))
    manager.allocate("r", 45)
    table = manager.requests["r"].table
    slots = torch.from_numpy(table.global_slots(np.arange(45)))

    def tag(ids: torch.Tensor, layer: int) -> torch.Tensor:  # [n, 2, heads, dim]
        part = torch.arange(2.0).view(1, 2, 1, 1)
        head = torch.arange(float(num_heads)).view(1, 1, -1, 1)
        dim = torch.arange(float(head_dim)).view(1, 1, 1, -1)
        return ids.view(-1, 1, 1, 1) * 1e4 + layer * 1e3 + part * 500 + head * 100 + dim

    for layer, cache in enumerate(caches):
        layout.scatter(cache, slots, tag(torch.arange(45.0), layer))
    rng = np.random.default_rng(3)
    evicted = np.sort([rng.choice(45, 20, replace=False) for _ in range(table.num_groups)])
    manager.evict_ids("r", evicted)
    (plan,) = manager.reclaim()
    assert plan.group_ids is not None
    moves = GroupedMoves.of_groups(plan.group_ids, plan.src_slots, plan.dst_slots, shape, num_heads)
    arrays = (moves.layers, moves.heads, moves.src_slots, moves.dst_slots)
    grouped_repack(caches, *(torch.from_numpy(a) for a in arrays), layout)
    manager.check_invariants()
    held = table.group_logical_ids().reshape(GEOMETRY.num_layers, -1, 25)
    live = torch.from_numpy(table.global_slots(np.arange(25)))
    for layer, cache in enumerate(caches):
        stored = layout.gather(cache, live)  # [25, 2, heads, dim]
        for head in range(num_heads):
            ids = torch.from_numpy(held[layer, head % held.shape[1]]).float()
            assert torch.equal(stored[:, :, head], tag(ids, layer)[:, :, head])


def test_grouped_statistics_view_shapes_feed_the_policies() -> None:
    manager = VTokenManager(StandaloneBlockPool(8), 4, geometry=GEOMETRY)
    manager.add_request("r", 8, policy=make_policy("h2o", granularity="head"))
    manager.allocate("r", 8)
    step = np.random.default_rng(1).random((3, 2, 8)).astype(np.float32)
    evicted = manager.evict("r", 6, StepAttention(step_scores=step))
    assert evicted.shape == (6, 2)
    manager.reclaim()
    stats = manager.view("r").stats["h2o_score"]
    assert stats.shape == (3, 2, 6)
    assert np.allclose(np.sort(stats, axis=-1)[..., -1], step.max(axis=-1))


def test_a_step_that_evicts_nothing_answers_one_empty_array() -> None:
    """Every group's candidates protected: the answer is empty (size and length 0), so the
    scheduler side counts no eviction for it."""
    scores = np.random.default_rng(2).random((3, 2, 10))
    policy = Scored(sinks=2, recent=8, granularity="head", values=scores)
    evicted = policy.select(_view((3, 2), 10), budget=5)
    assert evicted.size == 0 and len(evicted) == 0
    manager = VTokenManager(StandaloneBlockPool(8), 4, geometry=GEOMETRY)
    manager.add_request("r", 10, policy=Scored(sinks=2, recent=8, granularity="layer"))
    manager.allocate("r", 10)
    manager.requests["r"].policy.values = scores[:, 0]  # type: ignore[union-attr]
    assert len(manager.evict("r", 5)) == 0
    assert manager.requests["r"].table.num_live == 10


def _kept_lowest_evicted(scores: np.ndarray, protected: np.ndarray, num_evict: int) -> set[int]:
    """One group's kept ids, on its own: the ``num_evict`` lowest unprotected scores go
    (ties to the older token)."""
    candidates = [i for i in range(len(scores)) if not protected[i]]
    order = sorted(candidates, key=lambda i: (scores[i], i))
    return set(range(len(scores))) - set(order[:num_evict])


def _snapkv_scores(window_rows: np.ndarray, window: int, kernel: int) -> np.ndarray:
    """SnapKV's votes of one group: its window rows summed, average-pooled (zero padding)
    over the tokens before the window; the window scores infinity (it is kept)."""
    n = window_rows.shape[-1]
    votes = window_rows.sum(axis=0)
    scores = np.full(n, np.inf)
    before = n - window
    padded = np.concatenate([np.zeros(kernel // 2), votes[:before], np.zeros(kernel // 2)])
    scores[:before] = [padded[i : i + kernel].mean() for i in range(before)]
    return scores


@pytest.mark.parametrize("name", ["tova", "h2o", "snapkv"])
def test_each_layer_and_head_keeps_what_its_own_statistics_choose(name: str) -> None:
    """Per-(layer, KV head) statistics, different in every group: each group's kept set
    equals the one computed from that group's statistics alone (never a neighbour's row,
    another layer's votes or a mean over groups)."""
    layers, heads, n, budget, window = GEOMETRY.num_layers, GEOMETRY.num_kv_heads, 24, 12, 4
    rng = np.random.default_rng(7)
    rows = rng.random((window, layers, heads, n)).astype(np.float32)
    step = rng.random((layers, heads, n)).astype(np.float32)
    policy = {
        "tova": lambda: make_policy("tova", granularity="head"),
        "h2o": lambda: make_policy("h2o", recent_fraction=0.0, granularity="head"),
        "snapkv": lambda: make_policy("snapkv", window=window, kernel_size=3, granularity="head"),
    }[name]()
    manager = VTokenManager(StandaloneBlockPool(16), 4, geometry=GEOMETRY)
    manager.add_request("r", n, policy=policy)
    manager.allocate("r", n)
    evicted = manager.evict("r", budget, StepAttention(step_scores=step, window_rows=rows))
    assert evicted.shape == (layers * heads, n - budget)
    kept = manager.requests["r"].table.group_logical_ids().reshape(layers, heads, -1)
    sets = set()
    for layer in range(layers):
        for head in range(heads):
            protected = np.zeros(n, dtype=bool)
            if name == "tova":
                scores = rows[-1, layer, head]
            elif name == "h2o":
                scores = step[layer, head]
            else:
                scores = _snapkv_scores(rows[:, layer, head], window, 3)
                protected[n - window :] = True
            expected = _kept_lowest_evicted(scores, protected, n - budget)
            assert set(kept[layer, head].tolist()) == expected, (name, layer, head)
            sets.add(frozenset(expected))
    assert len(sets) == layers * heads, "every group should keep its own set: vacuous"
