"""Report models: request reports from the manager, tenant and engine totals from them."""

from __future__ import annotations

import pickle

import numpy as np

from vtoken import (
    DEFAULT_TENANT,
    EngineReport,
    KVUsage,
    ReclaimMode,
    StandaloneBlockPool,
    VTokenManager,
)


def _engine(num_blocks: int = 32) -> tuple[VTokenManager, StandaloneBlockPool]:
    pool = StandaloneBlockPool(num_blocks)
    manager = VTokenManager(pool, block_size=4, mode=ReclaimMode.NAIVE)
    manager.add_request("a", prompt_len=8, tenant="t1")
    manager.add_request("b", prompt_len=8, tenant="t1")
    manager.add_request("c", prompt_len=4)
    for request_id, count in (("a", 8), ("b", 8), ("c", 4)):
        manager.allocate(request_id, count)
    manager.evict_ids("a", np.array([0, 2, 5, 7]))  # 4 live in logical blocks 0, 1: ideal 1
    manager.reclaim()
    return manager, pool


def _report(manager: VTokenManager, pool: StandaloneBlockPool) -> EngineReport:
    return EngineReport(
        mode=manager.mode,
        policy="none",
        block_size=manager.block_size,
        total_blocks=pool.num_blocks,
        free_blocks=pool.num_free_blocks,
        requests=manager.reports(),
    )


def test_request_reports_count_reclaimable_blocks():
    manager, pool = _engine()
    report = manager.report("a")
    assert (report.allocated_blocks, report.live_tokens, report.ideal_blocks) == (2, 4, 1)
    # Naive-Evict frees no block by evicting: nothing it holds is reclaimable.
    assert (report.reclaimable_blocks, report.naive_blocks, report.evicted_tokens) == (0, 2, 4)
    assert manager.report("a", budget_tokens=1).reclaimable_blocks == 0
    assert manager.report("c").tenant == DEFAULT_TENANT
    manager.free_request("a")
    assert "a" not in manager.requests
    assert pool.num_free_blocks == 32 - 3
    manager.check_invariants()


def test_a_floor_is_the_budget_or_what_the_policy_protects_if_more():
    from policies import make_policy

    pool = StandaloneBlockPool(64)
    manager = VTokenManager(pool, block_size=4)
    for request_id, sinks in (("plain", 0), ("sinks", 12)):
        manager.add_request(request_id, prompt_len=40, policy=make_policy("h2o", sinks=sinks))
        manager.allocate(request_id, 40)
        assert manager.report(request_id).floor_blocks == 10  # no budget: its ideal
    assert manager.report("plain", budget_tokens=8).floor_blocks == 2
    assert manager.report("plain", budget_tokens=8).reclaimable_blocks == 8
    # 12 sinks and H2O's recent half of the budget (4) are never evicted: a budget of 8
    # leaves it at 16 tokens, 4 blocks, not 2
    assert manager.report("sinks", budget_tokens=8).floor_blocks == 4
    manager.add_request("none", prompt_len=40, policy=make_policy("none"))
    manager.allocate("none", 40)
    assert manager.report("none", budget_tokens=8).floor_blocks == 10  # never evicts
    manager.check_invariants()


def test_engine_report_sums_tenants_and_the_engine_once():
    manager, pool = _engine()
    report = _report(manager, pool)
    tenants = report.tenants
    assert tenants["t1"] == KVUsage(
        # naive repacks too: only the ballast differs; Naive-Evict's floor is what it holds
        num_requests=2, live_tokens=12, allocated_blocks=4, ideal_blocks=3, floor_blocks=4,
        naive_blocks=4, evicted_tokens=4, repack_moves=2,
    )  # fmt: skip
    assert tenants["t1"].reclaimable_blocks == 0
    assert tenants[DEFAULT_TENANT].reclaimable_blocks == 0
    assert report.total == tenants["t1"] + tenants[DEFAULT_TENANT]
    assert report.total.allocated_blocks == pool.num_blocks - pool.num_free_blocks


def test_engine_report_round_trips_as_plain_data():
    """What crosses vLLM's utility call: ``model_dump(mode="json")`` and back."""
    manager, pool = _engine()
    report = _report(manager, pool)
    data = report.model_dump(mode="json")
    assert data["mode"] == "naive" and "tenants" not in data
    assert EngineReport.model_validate(data) == report
    assert pickle.loads(pickle.dumps(report)) == report
