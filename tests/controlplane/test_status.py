"""``cluster_status``: what ``/admin/status`` and ``vtoken status`` show per tenant."""

from __future__ import annotations

import asyncio
import threading

import pytest

from controlplane import status as status_module
from controlplane.controller import Controller, ControllerConfig
from controlplane.lease import ControllerLease
from controlplane.metrics_endpoint import KEEP_TARGET_S
from controlplane.status import cluster_status, prometheus_targets
from controlplane.store import RedisStore
from tests.controlplane.builders import quota, report
from tests.controlplane.fakes import FakeClock


async def test_status_shows_budget_active_kv_floor_reclaimable_and_pressure(
    store: RedisStore, clock: FakeClock
) -> None:
    await store.put_quota(quota("over", budget=40))
    await store.put_quota(quota("within", budget=40))
    await store.put_quota(quota("idle", budget=10))
    reports = [
        report("r1", clock.now(), {"over": 30, "within": 8}, floors={"over": 12}),
        report("r2", clock.now(), {"over": 20}, floors={"over": 9}),
    ]
    await store.publish_reports(reports, ttl_s=60)
    config = ControllerConfig(period_s=0.5, lease_ttl_s=5.0, report_max_age_s=0.5)
    lease = ControllerLease(store.redis, "ctl", config.lease_ttl_s, store.keys)
    assert (await Controller(store, lease, clock, config).step()).leader

    status = await cluster_status(store, now_s=clock.now())
    tenants = {t["id"]: t for t in status["tenants"]}
    over = tenants["over"]
    assert (over["quota_blocks"], over["kv_blocks"], over["floor_blocks"]) == (40, 50, 21)
    assert over["reclaimable_blocks"] == 29 and over["over_budget"]
    # squeezed on both replicas to 90% of budget / what it holds
    assert set(over["pressure"]) == {"r1", "r2"}
    assert over["pressure"]["r1"] == 0.9 * 40 / 50
    within = tenants["within"]
    assert (within["kv_blocks"], within["reclaimable_blocks"], within["pressure"]) == (8, 0, {})
    assert not within["over_budget"] and within["replicas"]
    assert tenants["idle"]["kv_blocks"] == 0 and tenants["idle"]["running_requests"] == 0
    assert status["plan_version"] is not None


async def test_a_silent_replica_is_listed_unhealthy_with_its_report_age(
    store: RedisStore, clock: FakeClock
) -> None:
    """A replica whose reports stop (a lost node) stays in the view, not fresh, with the
    age of its last report, whether its report is merely old or already expired."""
    await store.publish_reports([report("alive", clock.now(), {"a": 1})], ttl_s=60)
    await store.publish_reports([report("old", clock.now() - 10, {"a": 1})], ttl_s=60)
    await store.publish_reports([report("gone", clock.now() - 20, {"a": 1})], ttl_s=0.001)
    await asyncio.sleep(0.01)  # the report hash of "gone" expires
    status = await cluster_status(store, now_s=clock.now())
    replicas = {r["id"]: r for r in status["replicas"]}
    assert replicas["alive"]["fresh"] and replicas["alive"]["report_age_s"] == 0
    assert not replicas["old"]["fresh"] and replicas["old"]["report_age_s"] == 10
    assert not replicas["gone"]["fresh"] and replicas["gone"]["report_age_s"] == 20


async def test_prometheus_targets_keep_replicas_reporting_within_a_minute(
    store: RedisStore, clock: FakeClock
) -> None:
    """Prometheus' HTTP service discovery: every replica that advertised an endpoint and
    reported within KEEP_TARGET_S (one in a long step, or just lost, is still scraped);
    the entries of replicas silent for longer are dropped from Redis."""
    now = clock.now()
    await store.publish_reports([report("r1", now, {"a": 1})], ttl_s=60)
    await store.publish_reports([report("slow", now - 20, {"a": 1})], ttl_s=0.001)
    await store.publish_reports([report("gone", now - KEEP_TARGET_S - 1, {"a": 1})], ttl_s=60)
    await store.publish_reports([report("no-endpoint", now, {"a": 1})], ttl_s=60)
    await store.advertise_metrics("r1", "10.0.0.5:43121", "smollm2")
    await store.advertise_metrics("slow", "[fd00::6]:40000", "smollm2")
    await store.advertise_metrics("gone", "10.0.0.7:40000", "smollm2")
    await asyncio.sleep(0.01)  # the report hash of "slow" expires: it is inside a long step
    assert await prometheus_targets(store, now_s=now) == [
        {"targets": ["10.0.0.5:43121"], "labels": {"vtoken_model_id": "smollm2"}},
        {"targets": ["[fd00::6]:40000"], "labels": {"vtoken_model_id": "smollm2"}},
    ]
    assert set(await store.redis.hkeys(store.keys.metrics_targets)) == {"r1", "slow"}


async def test_status_sums_each_tenants_shared_prefix_blocks_over_replicas(
    store: RedisStore, clock: FakeClock
) -> None:
    """``shared_blocks``: what a tenant's requests hold that others pay for, per replica
    summed; its active KV (``kv_blocks``) leaves them out. ``window_blocks`` (of a model
    with sliding-window layers), summed the same way, are part of its active KV."""
    await store.put_quota(quota("member", budget=40))
    on_r1 = report("r1", clock.now(), {"member": 5})
    on_r2 = report("r2", clock.now(), {"member": 2})
    for replica in (on_r1, on_r2):
        usage = replica.tenants["member"].model_copy(
            update={"shared_blocks": 3, "window_blocks": 1}
        )
        replica = replica.model_copy(update={"tenants": {"member": usage}})
        await store.publish_reports([replica], ttl_s=60)
    status = await cluster_status(store, now_s=clock.now())
    (member,) = status["tenants"]
    assert (member["kv_blocks"], member["shared_blocks"]) == (7, 6)
    assert member["window_blocks"] == 2


async def test_status_is_parsed_and_assembled_off_the_event_loop(
    store: RedisStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing 1,000 reports, 10,000 quotas and a 1.5 MB plan ran on the ingress's event
    loop (about a second with prefix keys): every request of that ingress waited."""
    await store.put_quota(quota("a"))
    await store.publish_report(report("r1", clock.now(), {"a": 3}, prefix_keys=("k" * 16,)), 60)
    threads: list[str] = []
    parse = status_module.parse_reports

    def recording(*args: object) -> object:
        threads.append(threading.current_thread().name)
        return parse(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(status_module, "parse_reports", recording)
    status = await cluster_status(store, now_s=clock.now())
    assert threads and threads[0] != threading.main_thread().name
    assert [r["id"] for r in status["replicas"]] == ["r1"]


async def test_status_shows_each_tenants_virtual_counters_and_its_lead(
    store: RedisStore, clock: FakeClock
) -> None:
    """The engines' fair order per tenant: its counter on each replica that reports one,
    and how far it is ahead of the least-served tenant where it is furthest ahead."""
    for tenant_id in ("flood", "light", "elsewhere"):
        await store.put_quota(quota(tenant_id, budget=40))
    on_r1 = report("r1", clock.now(), {"flood": 5, "light": 1})
    on_r2 = report("r2", clock.now(), {"flood": 3})
    off = report("r3", clock.now(), {"elsewhere": 2})  # fairness off: no counters
    # "idle" left r1 long ago: its low counter is no lead's reference
    counters = {"r1": {"flood": 1500.0, "light": 300.25, "idle": 3.0}, "r2": {"flood": 800.0}}
    for replica in (on_r1, on_r2, off):
        replica = replica.model_copy(
            update={"tenant_counters": counters.get(replica.replica_id, {})}
        )
        await store.publish_reports([replica], ttl_s=60)
    status = await cluster_status(store, now_s=clock.now())
    tenants = {t["id"]: t for t in status["tenants"]}
    assert tenants["flood"]["virtual_counters"] == {"r1": 1500.0, "r2": 800.0}
    assert tenants["flood"]["virtual_lead"] == 1199.8  # ahead of light on r1
    assert tenants["light"]["virtual_counters"] == {"r1": 300.2}
    assert tenants["light"]["virtual_lead"] == 0.0
    assert tenants["elsewhere"]["virtual_counters"] == {}
    assert tenants["elsewhere"]["virtual_lead"] is None
