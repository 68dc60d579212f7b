from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from controlplane.models import (
    EngineCounters,
    ReplicaReport,
    RoutingPlan,
    TenantLimits,
    TenantQuota,
    TenantUsage,
)
from tests.controlplane.builders import quota, report


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tenant_id": "", "kv_budget_blocks": 1}, "tenant_id"),
        ({"tenant_id": "has space", "kv_budget_blocks": 1}, "tenant_id"),
        ({"tenant_id": "a", "kv_budget_blocks": 0}, "kv_budget_blocks"),
        ({"tenant_id": "a", "kv_budget_blocks": 1, "weight": 0}, "weight"),
        ({"tenant_id": "a", "kv_budget_blocks": 1, "max_concurrent_requests": 0}, "max_concurrent"),
        ({"tenant_id": "a", "kv_budget_blocks": 1, "prompt_tokens_per_s": -1}, "prompt_tokens"),
        ({"tenant_id": "a", "kv_budget_blocks": 1, "color": "red"}, "color"),
    ],
)
def test_bad_quota_names_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TenantQuota.model_validate(fields)


@pytest.mark.parametrize("group", ["", "has space", "x" * 65, "a/b", "trailing\n", "ümlaut"])
def test_a_bad_prefix_group_is_refused_with_what_a_group_name_is(group: str) -> None:
    with pytest.raises(ValidationError, match=r"prefix_group\n.*1-64 characters: letters"):
        TenantQuota.model_validate({"tenant_id": "a", "kv_budget_blocks": 1, "prefix_group": group})


def test_a_prefix_group_is_optional_and_kept() -> None:
    assert quota("a").prefix_group is None
    named = quota("a", prefix_group="support-bots.v2_x")
    assert TenantQuota.model_validate_json(named.model_dump_json()) == named
    assert named.model_dump()["prefix_group"] == "support-bots.v2_x"


def test_queue_limits_default_on_and_zero_turns_the_queue_off() -> None:
    limits = TenantLimits.model_validate({"kv_budget_blocks": 8})
    assert (limits.max_queue_depth, limits.max_queue_wait_s) == (16, 10.0)
    off = TenantLimits.model_validate({"kv_budget_blocks": 8, "max_queue_depth": 0})
    assert off.max_queue_depth == 0


def test_quota_is_immutable() -> None:
    with pytest.raises(ValidationError):
        quota("a").kv_budget_blocks = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"total_blocks": 10, "free_blocks": 4, "used_blocks": 5}, "must equal total_blocks"),
        (
            {"total_blocks": 10, "free_blocks": 4, "used_blocks": 6, "reclaimable_blocks": 7},
            "exceeds",
        ),
        (
            {
                "total_blocks": 10,
                "free_blocks": 8,
                "used_blocks": 2,
                "tenants": {"a": {"blocks": 3}},
            },
            "tenants hold 3",
        ),
        ({"total_blocks": 0, "free_blocks": 0, "used_blocks": 0}, "total_blocks"),
    ],
)
def test_inconsistent_counters_are_rejected(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineCounters.model_validate({"block_size": 16, **fields})


def test_report_json_round_trip() -> None:
    original = report("replica-1", 12.5, {"a": 3, "b": 4}, reclaimable=2, draining=True)
    assert ReplicaReport.model_validate_json(original.model_dump_json()) == original
    assert original.available_blocks == original.free_blocks + 2


def test_plan_json_round_trip_and_bad_weight() -> None:
    plan = RoutingPlan.model_validate(
        {
            "version": 3,
            "fence": 1,
            "created_s": 1.0,
            "tenants": {"a": {"replicas": [{"replica_id": "r1", "weight": 1.0}]}},
            "pressure": {"r1": {"a": {"keep_fraction": 0.5, "target_blocks": 4}}},
        }
    )
    assert RoutingPlan.model_validate_json(plan.model_dump_json()) == plan
    with pytest.raises(ValidationError, match="weight"):
        RoutingPlan.model_validate(
            {
                "version": 1,
                "fence": 1,
                "created_s": 1.0,
                "tenants": {"a": {"replicas": [{"replica_id": "r1", "weight": 1.5}]}},
            }
        )
    assert TenantUsage().blocks == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("prompt_tokens_per_s", float("inf")),
        ("prompt_tokens_per_s", float("nan")),
        ("weight", float("nan")),
        ("kv_budget_blocks", True),
        ("kv_budget_blocks", "5"),
        ("max_concurrent_requests", 2.0),
        ("eviction_budget_tokens", "64"),
        ("kv_budget_blocks", 10**310),
        ("eviction_budget_tokens", 2**31),
        ("max_concurrent_requests", 10**20),
        ("prompt_tokens_per_s", 1e-300),
        ("prompt_tokens_per_s", 1e300),
        ("max_queue_depth", -1),
        ("max_queue_depth", 10_001),
        ("max_queue_depth", 2.0),
        ("max_queue_wait_s", -0.5),
        ("max_queue_wait_s", 601),
        ("max_queue_wait_s", float("nan")),
    ],
)
def test_limits_refuse_non_finite_numbers_and_loose_integers(field: str, value: object) -> None:
    """JSON's `Infinity` once passed `gt=0` and made the stored quota unreadable by the
    admission script; `true` and `"5"` once passed as integers."""
    body = {"kv_budget_blocks": 8, field: value}
    with pytest.raises(ValidationError, match=field):
        TenantLimits.model_validate(body)
    with pytest.raises(ValidationError, match=field):
        TenantLimits.model_validate_json(json.dumps(body))
