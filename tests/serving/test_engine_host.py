"""Pure pieces of the replica: pressure overrides, counter mapping, tenant salts."""

from __future__ import annotations

import pytest

from controlplane.models import EngineCounters
from serving.engine_host import cache_salt, counters_from_snapshot, request_spec
from workers.config import PolicySpec


def test_request_spec_enforces_the_tenant_cap_and_pressure():
    h2o = {"policy": "h2o", "policy_args": {"recent": 8}, "keep_ratio": 0.5}
    # pressure alone scales the engine's own budget
    assert request_spec(h2o, None, 0.5) == {
        "policy": "h2o",
        "policy_args": {"recent": 8},
        "keep_ratio": 0.25,
    }
    assert request_spec(h2o, None, None) is None
    assert request_spec(h2o, None, 1.0) is None
    # the tenant's cap becomes the budget, under the engine's per-step policy
    assert request_spec(h2o, 300, None) == {
        "policy": "h2o",
        "policy_args": {"recent": 8},
        "budget_tokens": 300,
    }
    assert request_spec(h2o, 300, 0.1)["budget_tokens"] == 30
    # engines whose policy cannot hold a cap every step fall back to H2O for capped tenants
    assert request_spec({"policy": "none"}, 64, None) == {"policy": "h2o", "budget_tokens": 64}
    assert request_spec({"policy": "snapkv", "keep_ratio": 0.2}, 64, None) == {
        "policy": "h2o",
        "budget_tokens": 64,
    }
    assert request_spec({"policy": "none"}, None, 0.5) is None  # nothing to tighten
    for override in (request_spec(h2o, 300, 0.5), request_spec({"policy": "none"}, 64, None)):
        PolicySpec.model_validate(override)  # what the engine parses from extra_args


def test_counters_map_the_engine_snapshot_into_a_valid_report():
    snapshot = {
        "block_size": 32,
        "total_blocks": 100,
        "free_blocks": 90,
        "blocks_reclaimed": 7,
        "naive_equivalent_blocks": 16,
        "requests": [
            {"live_tokens": 40, "allocated_blocks": 2, "ideal_blocks": 2},
            {"live_tokens": 100, "allocated_blocks": 6, "ideal_blocks": 4},
        ],
        "tenants": {
            "a": {"num_requests": 1, "live_tokens": 40, "allocated_blocks": 2},
            "b": {"num_requests": 1, "live_tokens": 100, "allocated_blocks": 6},
        },
    }
    counters = counters_from_snapshot(snapshot, running=2)
    assert isinstance(counters, EngineCounters)
    assert (counters.used_blocks, counters.live_tokens, counters.reclaimable_blocks) == (10, 140, 2)
    assert counters.tenants["b"].blocks == 6 and counters.tenants["a"].requests == 1
    assert (counters.blocks_reclaimed, counters.naive_equivalent_blocks) == (7, 16)
    with pytest.raises(ValueError):  # tenants holding more than the pool says is used
        counters_from_snapshot({**snapshot, "free_blocks": 99}, running=2)


def test_cache_salt_separates_tenants_and_is_stable():
    assert cache_salt("a") == cache_salt("a") != cache_salt("b")
