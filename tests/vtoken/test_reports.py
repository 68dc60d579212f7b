from __future__ import annotations

import numpy as np

from vtoken import ReclaimMode, StandaloneBlockPool, VTokenManager


def test_request_and_tenant_reports_count_reclaimable_blocks():
    pool = StandaloneBlockPool(32)
    manager = VTokenManager(pool, block_size=4, mode=ReclaimMode.NAIVE)
    manager.add_request("a", prompt_len=8, tenant="t1")
    manager.add_request("b", prompt_len=8, tenant="t1")
    manager.add_request("c", prompt_len=4, tenant="t2")
    for request_id, count in (("a", 8), ("b", 8), ("c", 4)):
        manager.allocate(request_id, count)
    manager.evict_ids("a", np.array([0, 2, 5, 7]))  # 4 live in 2 blocks: ideal 1
    manager.reclaim()
    report = manager.report("a")
    assert (report.allocated_blocks, report.live_tokens, report.ideal_blocks) == (2, 4, 1)
    assert report.reclaimable_blocks == 1
    tenants = manager.tenant_reports()
    assert tenants["t1"].num_requests == 2
    assert tenants["t1"].allocated_blocks == 4
    assert tenants["t1"].reclaimable_blocks == 1
    assert tenants["t2"].reclaimable_blocks == 0
    manager.free_request("a")
    assert "a" not in manager.requests
    assert pool.num_free_blocks == 32 - 3
    manager.check_invariants()
