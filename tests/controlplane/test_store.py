from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from redis.exceptions import AuthenticationError

from controlplane.models import TenantQuota
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from tests.controlplane.builders import quota, report
from tests.redis_server import RedisServer, unique_keys


async def test_quota_create_read_update_delete(store: RedisStore) -> None:
    assert await store.get_quota("acme") is None
    await store.put_quota(quota("acme", 100, weight=2.0))
    assert await store.get_quota("acme") == quota("acme", 100, weight=2.0)
    await store.put_quota(quota("acme", 50, max_concurrent_requests=3))
    updated = await store.get_quota("acme")
    assert updated is not None and updated.kv_budget_blocks == 50
    assert updated.max_concurrent_requests == 3 and updated.weight == 1.0
    await store.put_quota(quota("beta", 10))
    assert sorted(await store.list_quotas()) == ["acme", "beta"]
    assert await store.delete_quota("acme") is True
    assert await store.delete_quota("acme") is False
    assert list(await store.list_quotas()) == ["beta"]


async def test_invalid_quota_never_reaches_redis(store: RedisStore) -> None:
    with pytest.raises(ValidationError, match="kv_budget_blocks"):
        await store.put_quota(TenantQuota(tenant_id="acme", kv_budget_blocks=-1))
    assert await store.list_quotas() == {}


async def test_reports_fresh_stale_and_expired(store: RedisStore) -> None:
    now = 1000.0
    await store.publish_reports(
        [report("r1", now, {"a": 2}), report("r2", now - 5.0), report("r3", now - 0.2)], ttl_s=60
    )
    await store.publish_report(report("gone", now), ttl_s=0.01)
    await asyncio.sleep(0.03)  # its hash expires; the registry still lists it
    await store.redis.hset(store.keys.replica("junk"), mapping={"report": "{not json"})
    await store.redis.zadd(store.keys.replicas, {"junk": now})
    snapshot = await store.read_reports(now, max_age_s=1.0, forget_after_s=60.0)
    assert sorted(snapshot.fresh) == ["r1", "r3"]
    assert snapshot.fresh["r1"] == report("r1", now, {"a": 2})
    assert snapshot.stale_ids == {"r2", "gone", "junk"}
    assert snapshot.invalid_ids == {"junk"}
    forgotten = await store.read_reports(now + 30, max_age_s=1.0, forget_after_s=10.0)
    assert forgotten.fresh == {} and forgotten.stale_ids == set()


async def test_a_wrong_typed_report_key_is_skipped_not_fatal(store: RedisStore) -> None:
    """A registered replica whose key holds a string, a list or a set once failed the
    whole read with WRONGTYPE (no plan, /admin/status 503): now it is counted invalid."""
    now = 1000.0
    await store.publish_report(report("good", now), ttl_s=60)
    await store.redis.set(store.keys.replica("text"), "not a hash")
    await store.redis.rpush(store.keys.replica("list"), "x")
    await store.redis.sadd(store.keys.replica("set"), "x")
    await store.redis.zadd(store.keys.replicas, {"text": now, "list": now, "set": now})
    snapshot = await store.read_reports(now, max_age_s=1.0, forget_after_s=60.0)
    assert sorted(snapshot.fresh) == ["good"]
    assert snapshot.invalid_ids == {"text", "list", "set"}


async def test_report_hash_has_a_ttl(store: RedisStore) -> None:
    await store.publish_report(report("r1", 1.0), ttl_s=0.3)
    ttl_ms = await store.redis.pttl(store.keys.replica("r1"))
    assert 0 < ttl_ms <= 300
    with pytest.raises(ValueError, match="ttl_s"):
        await store.publish_report(report("r1", 1.0), ttl_s=0)


@pytest.mark.parametrize("url", ["http://localhost:6379", "localhost:6379", "tcp://x"])
def test_bad_redis_url_is_rejected(url: str) -> None:
    with pytest.raises(ValueError, match="scheme"):
        RedisConfig(url=url)


def test_tls_url_is_accepted() -> None:
    client = connect(RedisConfig(url="rediss://:secret@redis.example:6380/0"))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["password"] == "secret" and kwargs["port"] == 6380
    assert "SSL" in client.connection_pool.connection_class.__name__


async def test_password_from_url_or_config(tmp_path: Path) -> None:
    with RedisServer(tmp_path, password="s3cret", persistent=False) as server:
        keys = unique_keys()
        for config in (
            RedisConfig(url=server.url),
            RedisConfig(url=f"redis://127.0.0.1:{server.port}/0", password="s3cret"),
        ):
            client = connect(config)
            await RedisStore(client, keys).put_quota(quota("a"))
            await client.aclose()
        wrong = connect(RedisConfig(url=f"redis://127.0.0.1:{server.port}/0", password="no"))
        with pytest.raises(AuthenticationError):
            await RedisStore(wrong, keys).get_quota("a")
        await wrong.aclose()


async def test_an_invalid_stored_quota_is_skipped(store: RedisStore) -> None:
    await store.put_quota(quota("good"))
    await store.redis.hset(store.keys.quotas, "bad", '{"tenant_id": "bad"}')
    assert list(await store.list_quotas()) == ["good"]


async def test_records_from_a_newer_version_are_read_by_an_older_one(store: RedisStore) -> None:
    """A rolling upgrade: fields this version does not know (written by a newer one) are
    ignored when quotas, reports and plans are read back, never a reason to drop them."""
    redis, keys = store.redis, store.keys
    await redis.hset(keys.quotas, "acme", '{"tenant_id": "acme", "kv_budget_blocks": 8, "x": 1}')
    assert (await store.get_quota("acme")) == quota("acme", 8)
    assert set(await store.list_quotas()) == {"acme"}
    plan = {
        "version": 3, "fence": 1, "created_s": 1.0, "future": {"r1": 2},
        "tenants": {"acme": {"replicas": [{"replica_id": "r1", "weight": 1.0, "y": 0}]}},
    }  # fmt: skip
    await redis.set(keys.plan, json.dumps(plan))
    read = await store.read_plan()
    assert read is not None and read.version == 3 and "acme" in read.tenants
    await store.publish_reports([report("r1", 100.0, {"acme": 4})], ttl_s=60)
    raw = json.loads(await redis.hget(keys.replica("r1"), "report"))
    raw["newer_counter"] = 7
    raw["tenants"]["acme"]["newer"] = 1
    await redis.hset(keys.replica("r1"), "report", json.dumps(raw))
    snapshot = await store.read_reports(100.0, max_age_s=5.0, forget_after_s=60.0)
    assert snapshot.fresh["r1"].tenants["acme"].blocks == 4


async def test_prefix_keys_live_in_their_own_key_written_and_read_only_when_changed(
    store: RedisStore,
) -> None:
    """Reports carried up to 1,024 prefix keys (2.1 kB -> 21.5 kB) that the controller and
    `/admin/status` validated every read without using them."""
    now = 1000.0
    keys = tuple(f"{i:016x}" for i in range(1024))
    await store.publish_reports([report("r1", now, prefix_keys=keys), report("r2", now)], 60)
    stored = await store.redis.hget(store.keys.replica("r1"), "report")
    assert stored is not None and "prefix_keys" not in stored and len(stored) < 2000
    snapshot = await store.read_reports(now, max_age_s=1.0, forget_after_s=60.0)
    assert snapshot.fresh["r1"].prefix_keys == ()  # the controller's read has none
    changed = await store.read_prefix_keys({"r1": "", "r2": ""})
    assert changed["r1"].keys == keys and changed["r2"].keys == ()
    tags = {r: held.tag for r, held in changed.items()}
    assert await store.read_prefix_keys(tags) == {}  # nothing changed: nothing sent back
    # Unchanged keys are not written again; changed ones are, under a new tag, at most
    # once per `prefix_keys_period_s` of the reports' clock.
    marked = f"{tags['r1']} marker"
    await store.redis.set(store.keys.replica_prefix_keys("r1"), marked)
    await store.publish_reports([report("r1", now + 0.5, prefix_keys=keys)], 60)
    assert await store.redis.get(store.keys.replica_prefix_keys("r1")) == marked
    await store.publish_reports([report("r1", now + 1, prefix_keys=keys[:5])], 60, 1.0)
    await store.publish_reports([report("r1", now + 1.5, prefix_keys=keys[:3])], 60, 1.0)
    assert (await store.read_prefix_keys(tags))["r1"].keys == keys[:5]  # 3: too soon
    await store.publish_reports([report("r1", now + 2, prefix_keys=keys[:3])], 60, 1.0)
    moved = await store.read_prefix_keys(tags)
    assert list(moved) == ["r1"] and moved["r1"].keys == keys[:3]
    assert moved["r1"].tag != tags["r1"]


async def test_prefix_keys_lost_with_their_key_are_sent_again(store: RedisStore) -> None:
    keys = ("a" * 16, "b" * 16)
    await store.publish_report(report("r1", 1.0, prefix_keys=keys), ttl_s=60)
    await store.redis.delete(store.keys.replica_prefix_keys("r1"))  # expired meanwhile
    await store.publish_report(report("r1", 2.0, prefix_keys=keys), ttl_s=60)  # noticed
    assert await store.read_prefix_keys({"r1": ""}) == {}
    await store.publish_report(report("r1", 3.0, prefix_keys=keys), ttl_s=60)  # resent
    assert (await store.read_prefix_keys({"r1": ""}))["r1"].keys == keys
    ttl_ms = await store.redis.pttl(store.keys.replica_prefix_keys("r1"))
    assert 0 < ttl_ms <= 60_000  # and they expire with their report


async def test_bad_prefix_keys_or_a_foreign_key_are_skipped(store: RedisStore) -> None:
    for replica_id in ("r1", "r2", "r3"):
        await store.redis.hset(store.keys.replica(replica_id), "prefix_tag", "t")
    await store.redis.set(store.keys.replica_prefix_keys("r1"), "t " + "k" * 65)
    await store.redis.rpush(store.keys.replica_prefix_keys("r2"), "x")
    await store.redis.set(store.keys.replica("r4"), "not a hash")
    changed = await store.read_prefix_keys({"r1": "", "r2": "", "r3": "", "r4": ""})
    assert list(changed) == ["r1"] and changed["r1"].keys == () and changed["r1"].tag == "t"
