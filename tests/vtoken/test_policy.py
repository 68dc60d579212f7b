"""What a policy protects past its budget (``Protection``), and the base policy's mask."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from vtoken.policy import EvictionPolicy, Gate, PolicyView, Protection


@dataclass
class Oldest(EvictionPolicy):
    name = "oldest"

    def score(self, view: PolicyView) -> np.ndarray:
        return view.logical_ids.astype(np.float64)


@dataclass
class Wrapper(Gate):
    name = "wrapper"


def test_the_recent_window_is_the_larger_of_the_fixed_one_and_the_budget_share():
    protection = Protection(sinks=4, recent=8, recent_fraction=0.25)
    assert protection.num_recent(16) == 8  # 0.25 x 16 = 4 < 8
    assert protection.num_recent(100) == 25
    assert protection.num_recent(37) == 9  # int(9.25): the engine rounds down
    assert [protection.num_protected(b) for b in (16, 100, 37)] == [12, 29, 13]
    assert (protection.tokens, protection.fraction) == (12, 0.25)


def test_a_gate_adds_what_its_inner_policy_protects():
    inner = Protection(sinks=1, recent=2, recent_fraction=0.5)
    gate = Protection(sinks=3, recent=5, recent_fraction=0.25, inner=inner)
    assert gate.num_protected(40) == (3 + 10) + (1 + 20)
    assert gate.num_recent(40) == 10  # its own window only
    assert (gate.tokens, gate.fraction) == (11, 0.75)


def test_a_pinned_prefix_replaces_fewer_sinks_on_the_outer_level_only():
    gate = Protection(sinks=3, inner=Protection(sinks=2))
    assert gate.pinned(10) == Protection(sinks=10, inner=Protection(sinks=2))
    assert gate.pinned(1) == gate  # more sinks than the prefix: unchanged
    assert gate.pinned(10).tokens == 12


@pytest.mark.parametrize("budget", [0, 1, 7, 33, 100, 1000])
@pytest.mark.parametrize(
    ("sinks", "recent", "fraction"), [(0, 0, 0.0), (4, 0, 0.5), (0, 16, 0.1), (3, 5, 0.25)]
)
def test_admissions_rounding_up_never_counts_fewer_than_the_engine_keeps(
    budget, sinks, recent, fraction
):
    inner = Protection(sinks=1, recent=recent, recent_fraction=fraction / 2)
    for protection in (Protection(sinks, recent, fraction), Protection(sinks, 2, 0.3, inner)):
        upper = protection.tokens + math.ceil(protection.fraction * budget)
        assert protection.num_protected(budget) <= upper


def test_a_policys_protection_is_its_fields_and_its_mask_counts_it():
    policy = Oldest(sinks=3, recent=5, recent_fraction=0.25)
    assert policy.protection() == Protection(sinks=3, recent=5, recent_fraction=0.25)
    view = PolicyView(logical_ids=np.arange(200), num_logical=200, prompt_len=200, step=1)
    for budget in (8, 40, 100):
        assert policy.protected(view, budget).sum() == policy.num_protected(budget)
    policy.sinks = 20  # the engine pins a prefix this way: the protection follows
    assert policy.protection().sinks == 20 and policy.num_protected(40) == 30


def test_a_gates_protection_nests_its_inner_policys():
    gate = Wrapper(sinks=2, recent=4, inner=Oldest(sinks=1, recent_fraction=0.5))
    expected = Protection(sinks=2, recent=4, inner=Protection(sinks=1, recent_fraction=0.5))
    assert gate.protection() == expected
    assert gate.num_protected(40) == expected.num_protected(40) == 6 + 21
    view = PolicyView(logical_ids=np.arange(200), num_logical=200, prompt_len=200, step=1)
    # The windows overlap (both from the start and the end): the mask counts each once.
    assert gate.protected(view, 40).sum() == 2 + 20 <= gate.num_protected(40)
