"""Removing a tenant in one script: keys (indexed or stored before key ids existed),
reservations, the rate bucket and its place in the fair queue go with the quota; other
tenants keep theirs."""

from __future__ import annotations

import redis.asyncio as aioredis

from controlplane.admission import Admission, AdmissionConfig
from controlplane.auth import TenantKeys, digest, new_api_key
from controlplane.fair_queue import FairQueue
from controlplane.keys import KeySpace
from controlplane.models import TenantQuota
from controlplane.store import RedisStore
from controlplane.tenants import (
    TenantWrite,
    TenantWriteOutcome,
    remove_tenant,
    write_tenant,
)


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


async def test_a_key_for_a_deleted_tenant_is_never_written(
    redis: aioredis.Redis, store: RedisStore, keys: KeySpace
) -> None:
    """The admin API looked the tenant up, then a DELETE ran: the key must not be stored,
    or it would authenticate as a tenant re-created later under the same id."""
    tenant_keys = TenantKeys(redis, keys)
    await store.put_quota(TenantQuota(tenant_id="acme", kv_budget_blocks=8))
    await remove_tenant(redis, keys, "acme")
    late = new_api_key()
    written = await write_tenant(redis, keys, "acme", None, late, chosen=True)
    assert written == TenantWrite(TenantWriteOutcome.NO_TENANT, False, None)
    await store.put_quota(TenantQuota(tenant_id="acme", kv_budget_blocks=8))  # re-created
    assert await tenant_keys.tenant_for(late) is None


async def test_writing_a_tenant_gives_a_generated_key_to_a_new_tenant_only(
    redis: aioredis.Redis, store: RedisStore, keys: KeySpace
) -> None:
    """A PUT that saw the tenant, raced by a DELETE, once re-created it with no key: the
    script decides on existence itself, so a tenant it creates always gets its key."""
    tenant_keys = TenantKeys(redis, keys)
    quota = TenantQuota(tenant_id="acme", kv_budget_blocks=8)
    first, second = new_api_key(), new_api_key()
    created = await write_tenant(redis, keys, "acme", quota, first, chosen=False)
    assert created.outcome is TenantWriteOutcome.KEY and not created.existed
    replaced = await write_tenant(redis, keys, "acme", quota, second, chosen=False)
    assert replaced == TenantWrite(TenantWriteOutcome.NO_KEY, True, None)
    assert await tenant_keys.tenant_for(first) == "acme"
    assert await tenant_keys.tenant_for(second) is None
    await remove_tenant(redis, keys, "acme")
    again = await write_tenant(redis, keys, "acme", quota, second, chosen=False)
    assert again.outcome is TenantWriteOutcome.KEY and not again.existed
    assert await tenant_keys.tenant_for(second) == "acme"
    assert await tenant_keys.tenant_for(first) is None  # revoked with the old tenant
    other = TenantQuota(tenant_id="globex", kv_budget_blocks=8)
    conflict = await write_tenant(redis, keys, "globex", other, second, chosen=True)
    assert conflict.outcome is TenantWriteOutcome.KEY_CONFLICT
    assert await store.get_quota("globex") is None  # nothing written


async def test_remove_tenant_takes_its_place_in_the_fair_queue(
    redis: aioredis.Redis, store: RedisStore, keys: KeySpace
) -> None:
    """A deleted tenant's tickets stop contending for the cluster at once (not after their
    lease), and a tenant later created under its id starts without its counter."""
    config = AdmissionConfig(block_size=16, cluster_kv_blocks=3, queue_ticket_ttl_s=60.0)
    admission, queue = Admission(redis, config, keys), FairQueue(redis, config, keys)
    acme, globex = (TenantQuota(tenant_id=t, kv_budget_blocks=100) for t in ("acme", "globex"))
    for tenant in (acme, globex):
        await store.put_quota(tenant)
    await queue.enqueue(acme, "a-0")
    assert (await admission.admit(acme, "a-0", 32, 16, ticket="a-0")).admitted
    await queue.enqueue(acme, "a-1")
    assert (await admission.admit(acme, "a-1", 32, 16, ticket="a-1")).reason == "cluster_full"
    assert await queue.counter("acme") == 3

    await remove_tenant(redis, keys, "acme")

    assert await queue.queues() == {}
    assert await queue.counter("acme") == 0
    assert not await redis.exists(keys.queue_tickets("acme"), keys.queue_leases("acme"))
    for sorted_set in (keys.queue_active, keys.queue_contending, keys.queue_tenant_leases):
        assert await redis.zscore(sorted_set, "acme") is None
    assert (await admission.admit(globex, "g-0", 32, 16)).admitted  # acme's room is free
    await queue.check_invariants()
