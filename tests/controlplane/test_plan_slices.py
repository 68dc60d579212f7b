"""`slice_update`: which slices a plan write replaces, adds and removes."""

from __future__ import annotations

from controlplane.models import PlanSlice, RoutingPlan
from controlplane.plan_slices import slice_update


def plan(version: int, allowance: dict[str, dict[str, int]], drained: tuple[str, ...] = ()):
    return RoutingPlan.model_validate(
        {
            "version": version,
            "fence": 1,
            "created_s": float(version),
            "replica_ids": sorted(allowance),
            "drained_replica_ids": list(drained),
            "allowance": allowance,
        }
    )


def test_without_a_known_base_every_slice_is_written_and_the_hash_replaced() -> None:
    update = slice_update(plan(3, {"r1": {"a": 4}, "r2": {}}, drained=("r9",)), None)
    assert update.replace and sorted(update.upserts) == ["r1", "r2", "r9"]
    piece = PlanSlice.model_validate_json(update.upserts["r1"])
    assert (piece.version, piece.created_s, piece.allowance, piece.pressure) == (
        3,
        3.0,
        {"a": 4},
        {},
    )


def test_a_difference_writes_changed_and_new_slices_and_removes_gone_ones() -> None:
    before = plan(3, {"r1": {"a": 4}, "r2": {"b": 1}, "r3": {}})
    after = plan(4, {"r1": {"a": 4}, "r2": {"b": 2}, "r4": {}})
    update = slice_update(after, before)
    assert not update.replace and update.expected_count == 3
    assert sorted(update.upserts) == ["r2", "r4"] and update.removed == ("r3",)
    assert slice_update(after, after).upserts == {}  # same content: nothing to write
