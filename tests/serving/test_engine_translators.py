"""Translations between the engine and the control plane: a tenant's cap as a request's
policy, log-probabilities, the engine's ids of a request's sequences, the engine report as
counters, and which prompt blocks the engine keeps cached."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import policies
from controlplane.models import EngineCounters
from serving.engine_translators import (
    MIN_LOGPROB,
    counters_from_snapshot,
    engine_request_ids,
    published_blocks,
    request_spec,
    token_logprobs,
)
from serving.settings import ReplicaSettings
from vtoken.policy import EvictionPolicy, PolicyView
from vtoken.repack_planner import ReclaimMode
from vtoken.reports import EngineReport, RequestReport
from workers.config import PolicySpec, VTokenConfig


def test_request_spec_enforces_the_tenant_cap():
    h2o = VTokenConfig(policy="h2o", policy_args={"recent": 8}, keep_ratio=0.5)
    assert request_spec(h2o, None) is None  # no cap: the engine's spec (pressure is its job)
    # the tenant's cap becomes the budget, under the engine's per-step policy
    assert request_spec(h2o, 300) == {
        "policy": "h2o",
        "policy_args": {"recent": 8},
        "budget_tokens": 300,
    }
    # engines whose policy cannot hold a cap every step fall back to H2O for capped tenants
    assert request_spec(VTokenConfig(policy="none"), 64) == {"policy": "h2o", "budget_tokens": 64}
    assert request_spec(VTokenConfig(policy="snapkv", keep_ratio=0.2), 64) == {
        "policy": "h2o",
        "budget_tokens": 64,
    }
    for override in (request_spec(h2o, 300), request_spec(VTokenConfig(policy="none"), 64)):
        PolicySpec.model_validate(override)  # what the engine parses from extra_args


def test_a_policy_instance_that_keeps_more_than_the_cap_is_not_trusted_with_it():
    """StreamingLLM with a fixed window limits itself (it would keep sinks + 256 tokens), and
    any policy whose protected tokens reach the cap could not hold it: H2O takes the cap."""
    window = VTokenConfig(policy="streaming_llm", policy_args={"sinks": 4, "recent": 256})
    assert request_spec(window, 64) == {"policy": "h2o", "budget_tokens": 64}
    h2o = VTokenConfig(policy="h2o", policy_args={"recent": 64}, keep_ratio=0.5)
    assert request_spec(h2o, 64) == {"policy": "h2o", "budget_tokens": 64}
    assert request_spec(h2o, 65)["policy_args"] == {"recent": 64}


@pytest.mark.parametrize("cap", [0, -8])
def test_request_spec_refuses_a_cap_that_makes_no_valid_spec(cap):
    with pytest.raises(ValueError, match=r"vtoken_policy.*budget_tokens"):
        request_spec(VTokenConfig(policy="h2o", keep_ratio=0.5), cap)


@dataclass
class _EveryStep(EvictionPolicy):
    name = "test_every_step"

    def score(self, view: PolicyView) -> np.ndarray:
        return np.zeros(view.num_live)


@dataclass
class _Once(_EveryStep):
    name = "test_once"
    holds_budget_every_step = False


def test_the_caps_policy_follows_the_trait_not_the_name(monkeypatch):
    for cls in (_EveryStep, _Once):
        monkeypatch.setitem(policies.REGISTRY, cls.name, cls)
    every_step = request_spec(VTokenConfig(policy="test_every_step", keep_ratio=0.5), 64)
    assert every_step == {"policy": "test_every_step", "policy_args": {}, "budget_tokens": 64}
    once = request_spec(VTokenConfig(policy="test_once", keep_ratio=0.5), 64)
    assert once == {"policy": policies.CAP_POLICY.name, "budget_tokens": 64}


def test_token_logprobs_keep_the_engines_order_and_clamp_minus_infinity():
    from vllm.logprobs import Logprob

    steps = [
        {7: Logprob(-0.5, 2, " b"), 3: Logprob(-0.1, 1, " a"), 9: Logprob(-9.0, 3, None)},
        None,  # the engine gave none for this token
        {4: Logprob(float("-inf"), 1, "d")},
    ]
    entries = token_logprobs([7, 8, 4], steps, decode=lambda token_id: f"<{token_id}>")
    assert [(e.token, e.logprob) for e in entries] == [(" b", -0.5), ("<8>", None), ("d", -9999.0)]
    assert entries[0].top == [(" b", -0.5), (" a", -0.1), ("<9>", -9.0)]  # sampled first
    assert entries[1].top is None and entries[2].top == [("d", MIN_LOGPROB)]
    assert token_logprobs([1], None, str)[0].logprob is None


def test_engine_ids_of_a_requests_sequences():
    """vLLM's ids for the engine core (before its ``-<8 chars>`` suffix): the request's
    own, or with n > 1 one child per choice, ``<index>_<id>``."""
    assert engine_request_ids("cmpl-1", 1) == ["cmpl-1"]
    assert engine_request_ids("cmpl-1", 3) == ["0_cmpl-1", "1_cmpl-1", "2_cmpl-1"]


def test_counters_map_the_engine_report_into_a_valid_report():
    def request(request_id: str, tenant: str, live: int, allocated: int, ideal: int):
        return RequestReport(
            request_id=request_id,
            tenant=tenant,
            live_tokens=live,
            allocated_blocks=allocated,
            ideal_blocks=ideal,
            naive_blocks=allocated + 4,
        )

    report = EngineReport(
        mode=ReclaimMode.VTOKEN,
        policy="h2o",
        block_size=32,
        total_blocks=100,
        free_blocks=90,
        blocks_reclaimed=7,
        num_preemptions=3,
        num_evictions_under_pressure=5,
        tenant_counters={"a": 40.5, "idle": 3.0},
        requests=(
            request("r1", "a", 40, 2, 2),
            request("r2", "b", 100, 6, 4).model_copy(update={"floor_blocks": 3}),
            # b's second request holds 3 prefix blocks r2 pays for, and 1 of its own
            request("r3", "b", 100, 1, 1).model_copy(update={"shared_blocks": 3}),
        ),
    )
    counters = counters_from_snapshot(report, running=2)
    assert (counters.preemptions, counters.evictions_under_pressure) == (3, 5)
    assert counters.tenants["b"].floor_blocks == 4 and counters.tenants["b"].reclaimable_blocks == 3
    assert counters.tenants["a"].reclaimable_blocks == 0  # no budget given: floor = ideal
    assert isinstance(counters, EngineCounters)
    assert (counters.used_blocks, counters.live_tokens, counters.reclaimable_blocks) == (10, 240, 3)
    assert counters.tenants["b"].blocks == 7 and counters.tenants["a"].requests == 1
    assert (counters.tenants["b"].shared_blocks, counters.tenants["a"].shared_blocks) == (3, 0)
    assert (counters.blocks_reclaimed, counters.naive_equivalent_blocks) == (7, 21)
    assert counters.tenant_counters == {"a": 40.5, "idle": 3.0}  # idle tenants' too
    with pytest.raises(ValueError):  # tenants holding more than the pool says is used
        counters_from_snapshot(report.model_copy(update={"free_blocks": 99}), running=2)


def test_published_blocks_follow_the_pinning_rule():
    """What the replica remembers for prefix affinity is what its engine publishes."""
    keep_all = ReplicaSettings(model="m", vtoken={"policy": "none"})
    assert published_blocks(keep_all, None) >= 64  # every full block
    evicting = ReplicaSettings(
        model="m",
        block_size=16,
        vtoken={"policy": "h2o", "keep_ratio": 0.5, "prefix_pin_tokens": 40, "eviction": "eager"},
    )
    assert published_blocks(evicting, None) == 2  # the pinned prefix's full blocks
    on_demand = ReplicaSettings(model="m", vtoken={"policy": "h2o", "keep_ratio": 0.5})
    assert published_blocks(on_demand, None) >= 64  # serving's default: evicts under pressure
    override = {"vtoken_policy": {"policy": "none"}}
    assert published_blocks(evicting, override) >= 64
    off = ReplicaSettings(model="m", enable_prefix_caching=False, vtoken={"policy": "none"})
    assert published_blocks(off, None) == 0


def test_a_tenants_active_kv_counts_every_kv_cache_group():
    """A hybrid model: the requests' sliding-window blocks (``window_blocks``) are in their
    tenant's active KV and floor (never evicted), none of them reclaimable; the pool is
    one, so the engine's used blocks count them already."""
    report = EngineReport(
        mode=ReclaimMode.VTOKEN,
        policy="h2o",
        block_size=32,
        total_blocks=100,
        free_blocks=80,
        requests=(
            RequestReport(
                request_id="r1",
                tenant="a",
                live_tokens=200,
                allocated_blocks=7,
                ideal_blocks=7,
                floor_blocks=3,
                window_blocks=4,
            ),
            RequestReport(
                request_id="r2",
                tenant="b",
                live_tokens=40,
                allocated_blocks=2,
                ideal_blocks=2,
                window_blocks=2,
            ),
        ),
    )
    counters = counters_from_snapshot(report, running=2)
    a, b = counters.tenants["a"], counters.tenants["b"]
    assert (a.blocks, a.floor_blocks, a.reclaimable_blocks) == (11, 7, 4)
    assert (b.blocks, b.floor_blocks, b.reclaimable_blocks) == (4, 4, 0)
    assert (a.window_blocks, b.window_blocks) == (4, 2)  # what pressure cannot take
    assert (counters.used_blocks, counters.reclaimable_blocks) == (20, 4)
    assert a.blocks + b.blocks <= counters.used_blocks
