"""The admin API's keys: generated ones are strong, chosen ones are checked, each key can be
listed by id and revoked alone; deleting a tenant revokes its keys and drops its
reservations, so re-creating the id revives nothing."""

from __future__ import annotations

import asyncio
import secrets

from tests.serving.ingress_harness import Ingress, admin, bearer

STRONG = "chosen-" + secrets.token_urlsafe(32)


async def test_generated_keys_are_high_entropy_and_short_chosen_keys_are_refused(
    ingress: Ingress,
) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    assert api_key.startswith("vt-") and len(api_key) >= 3 + 43  # 256 random bits
    for weak in ("sixteen-chars-ok", "a" * 40):
        refused = await ingress.client.put(
            "/admin/tenants/acme", json={"kv_budget_blocks": 8, "api_key": weak}, headers=admin()
        )
        assert refused.status_code == 400, refused.text
        assert "api_key" in refused.json()["error"]["message"]
        assert weak not in refused.text
        assert (await ingress.complete(weak)).status_code == 401


async def test_keys_are_added_listed_by_id_and_revoked_one_at_a_time(ingress: Ingress) -> None:
    first = await ingress.add_tenant("acme", kv_budget_blocks=8)
    generated = await ingress.client.post("/admin/tenants/acme/keys", headers=admin())
    assert generated.status_code == 201, generated.text
    second = generated.json()["api_key"]
    chosen = await ingress.client.post(
        "/admin/tenants/acme/keys", json={"api_key": STRONG}, headers=admin()
    )
    assert chosen.status_code == 201 and "api_key" not in chosen.json()  # never echoed
    listed = await ingress.client.get("/admin/tenants/acme/keys", headers=admin())
    key_ids = listed.json()["key_ids"]
    assert len(key_ids) == 3 and generated.json()["key_id"] in key_ids
    for secret in (first, second, STRONG):
        assert secret not in listed.text
    revoked = await ingress.client.delete(
        f"/admin/tenants/acme/keys/{generated.json()['key_id']}", headers=admin()
    )
    assert revoked.status_code == 200, revoked.text
    assert (await ingress.complete(second)).status_code == 401
    assert (await ingress.complete(first)).status_code == 200
    assert (await ingress.complete(STRONG)).status_code == 200
    again = await ingress.client.delete(
        f"/admin/tenants/acme/keys/{generated.json()['key_id']}", headers=admin()
    )
    assert again.status_code == 404 and again.json()["error"]["type"] == "not_found"
    missing = await ingress.client.post("/admin/tenants/nobody/keys", headers=admin())
    assert missing.status_code == 404


async def test_a_key_of_another_tenant_is_a_conflict(ingress: Ingress) -> None:
    await ingress.add_tenant("acme", kv_budget_blocks=8)
    await ingress.add_tenant("globex", kv_budget_blocks=8)
    url = "/admin/tenants/{}/keys"
    ok = await ingress.client.post(url.format("acme"), json={"api_key": STRONG}, headers=admin())
    assert ok.status_code == 201
    taken = await ingress.client.post(
        url.format("globex"), json={"api_key": STRONG}, headers=admin()
    )
    assert taken.status_code == 409
    assert await ingress.state.tenant_keys.tenant_for(STRONG) == "acme"


async def test_key_routes_need_the_admin_token(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    for headers in ({}, bearer(api_key)):
        assert (
            await ingress.client.get("/admin/tenants/acme/keys", headers=headers)
        ).status_code == 403
        post = await ingress.client.post("/admin/tenants/acme/keys", headers=headers)
        assert post.status_code == 403
        delete = await ingress.client.delete("/admin/tenants/acme/keys/key-0", headers=headers)
        assert delete.status_code == 403


async def test_deleting_a_tenant_revokes_its_keys_and_drops_its_reservations(
    ingress: Ingress,
) -> None:
    old_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.gate.clear()
    running = asyncio.create_task(ingress.complete(old_key))
    await asyncio.wait_for(ingress.replicas.arrived.wait(), 10)
    redis, keys = ingress.state.store.redis, ingress.keys
    assert await redis.hlen(keys.reservations("acme")) == 1
    deleted = await ingress.client.delete("/admin/tenants/acme", headers=admin())
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"deleted": "acme", "revoked_keys": 1, "removed_reservations": 1}
    for name in (
        keys.reservations("acme"),
        keys.reservation_starts("acme"),
        keys.reservation_deadlines("acme"),
        keys.tenant_api_keys("acme"),
        keys.reservation_total("acme"),
    ):
        assert not await redis.exists(name), name
    new_key = await ingress.add_tenant("acme", kv_budget_blocks=8)  # the same id again
    assert (await ingress.complete(old_key)).status_code == 401
    ingress.replicas.gate.set()
    assert (await running).status_code == 200  # its late release finds nothing to free
    assert (await ingress.complete(new_key)).status_code == 200
    gone = await ingress.client.delete("/admin/tenants/nobody", headers=admin())
    assert gone.status_code == 404


async def test_deleting_a_tenant_drops_its_metric_series(ingress: Ingress) -> None:
    for tenant_id in ("acme", "globex"):
        api_key = await ingress.add_tenant(tenant_id, kv_budget_blocks=8)
        assert (await ingress.complete(api_key)).status_code == 200
    before = (await ingress.client.get("/metrics", headers=admin())).text
    assert 'tenant="acme"' in before and 'tenant="globex"' in before
    assert (await ingress.client.delete("/admin/tenants/acme", headers=admin())).status_code == 200
    after = (await ingress.client.get("/metrics", headers=admin())).text
    assert 'tenant="acme"' not in after and 'tenant="globex"' in after


async def test_a_stored_quota_that_no_longer_validates_is_named_not_a_500(
    ingress: Ingress,
) -> None:
    """A quota record an older version (or a hand edit) left behind: its tenant's requests
    get a 503 (the cause is logged under the request id, as every 5xx's), the admin API a
    409 naming the tenant and the field, the listing shows it apart instead of dropping
    it, and a PUT repairs it."""
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    store = ingress.state.store
    await store.redis.hset(
        store.keys.quotas, "acme", '{"tenant_id": "acme", "kv_budget_blocks": -3}'
    )
    served = await ingress.complete(api_key)
    assert served.status_code == 503, served.text
    read = await ingress.client.get("/admin/tenants/acme", headers=admin())
    assert read.status_code == 409 and "kv_budget_blocks" in read.json()["error"]["message"]
    listed = (await ingress.client.get("/admin/tenants", headers=admin())).json()
    assert listed["tenants"] == [] and "kv_budget_blocks" in listed["invalid_tenants"]["acme"]
    repaired = await ingress.client.put(
        "/admin/tenants/acme", json={"kv_budget_blocks": 8}, headers=admin()
    )
    assert repaired.status_code == 200, repaired.text
    assert (await ingress.complete(api_key)).status_code == 200
