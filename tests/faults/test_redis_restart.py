"""Every Redis the project starts runs with `appendonly yes`: tenants, API keys and
reservations survive a restart, and a crash (SIGKILL) loses at most the last second."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controlplane.admission import Admission, AdmissionConfig
from controlplane.auth import TenantKeys
from controlplane.keys import KeySpace
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from tests.controlplane.builders import quota
from tests.redis_server import RedisServer

API_KEY = "vt-restart-suite-key-0123456789"


@pytest.mark.parametrize("how", ["restart", "kill"])
async def test_tenants_keys_and_reservations_survive(how: str, tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    keys = KeySpace("restart")
    client = connect(RedisConfig(url=server.url))
    try:
        store, tenant_keys = RedisStore(client, keys), TenantKeys(client, keys)
        admission = Admission(client, AdmissionConfig(block_size=16), keys)
        tenant = quota("acme", budget=10)
        await store.put_quota(tenant)
        await tenant_keys.set_key("acme", API_KEY)
        held = await admission.admit(tenant, "running", 64, 16)
        assert held.reservation is not None
        if how == "kill":
            await asyncio.sleep(1.2)  # appendfsync everysec: the writes are on disk
            server.kill()
            server.start()
        else:
            server.restart()
        assert await store.get_quota("acme") == tenant
        assert await tenant_keys.tenant_for(API_KEY) == "acme"
        assert await admission.reserved_blocks("acme") == held.reservation.blocks
        await admission.check_invariants("acme")
        assert await admission.release(held.reservation)
    finally:
        await client.aclose()
        server.stop()
