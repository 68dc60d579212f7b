"""Removing a tenant in one script: keys (indexed or stored before key ids existed),
reservations and the rate bucket go with the quota; other tenants keep theirs."""

from __future__ import annotations

import redis.asyncio as aioredis

from controlplane.auth import TenantKeys, digest, new_api_key
from controlplane.keys import KeySpace
from controlplane.models import TenantQuota
from controlplane.store import RedisStore
from controlplane.tenants import remove_tenant


async def test_remove_tenant_takes_keys_reservations_and_quota(
    redis: aioredis.Redis, store: RedisStore, keys: KeySpace
) -> None:
    tenant_keys = TenantKeys(redis, keys)
    for tenant_id in ("acme", "globex"):
        await store.put_quota(TenantQuota(tenant_id=tenant_id, kv_budget_blocks=8))
        await redis.hset(keys.reservations(tenant_id), "req-1", 3)
        await redis.zadd(keys.reservation_deadlines(tenant_id), {"req-1": 1})
        await redis.hset(keys.rate_bucket(tenant_id), "tokens", 1)
    indexed, other = new_api_key(), new_api_key()
    legacy = new_api_key()
    await tenant_keys.add_key("acme", indexed)
    await tenant_keys.add_key("globex", other)
    await redis.hset(keys.api_keys, digest(legacy), "acme")  # a key from before key ids
    version = await store.read_quotas_version()

    removal = await remove_tenant(redis, keys, "acme")

    assert removal.existed and removal.revoked_keys == 2 and removal.removed_reservations == 1
    assert await tenant_keys.tenant_for(indexed) is None
    assert await tenant_keys.tenant_for(legacy) is None
    assert await tenant_keys.tenant_for(other) == "globex"
    assert await store.get_quota("acme") is None
    assert await store.read_quotas_version() > version
    assert not await redis.exists(
        keys.reservations("acme"), keys.reservation_deadlines("acme"), keys.rate_bucket("acme")
    )
    assert await redis.hlen(keys.reservations("globex")) == 1
    again = await remove_tenant(redis, keys, "acme")
    assert not again.existed and again.revoked_keys == 0


async def test_keys_are_listed_by_id_and_revoked_alone(
    redis: aioredis.Redis, keys: KeySpace
) -> None:
    tenant_keys = TenantKeys(redis, keys)
    first, second = new_api_key(), new_api_key()
    first_id = await tenant_keys.add_key("acme", first)
    second_id = await tenant_keys.add_key("acme", second)
    assert first_id and second_id and first_id != second_id
    assert await tenant_keys.add_key("globex", first) is None  # owned by acme
    ids = await tenant_keys.key_ids("acme")
    assert ids == sorted([first_id, second_id])
    assert all(digest(key) not in ids for key in (first, second))
    assert await tenant_keys.revoke("acme", first_id)
    assert not await tenant_keys.revoke("acme", first_id)
    assert not await tenant_keys.revoke("globex", second_id)  # not globex's key
    assert await tenant_keys.tenant_for(first) is None
    assert await tenant_keys.tenant_for(second) == "acme"
