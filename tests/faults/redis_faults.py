"""Faults a real `redis-server` can be put into, and taken out of, from a test.

`out_of_memory`: `maxmemory` 1 byte with `noeviction`, so every write is refused with
`OutOfMemoryError` (reads still answer). `read_only`: the server turns into a replica of a
dead primary, so every write is refused with `ReadOnlyError` (a failover's old primary).
Both restore the server on exit, so a test server can be shared by one test file.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import redis.asyncio as aioredis

from tests.redis_server import free_port


@asynccontextmanager
async def out_of_memory(admin: aioredis.Redis) -> AsyncIterator[None]:
    policy = (await admin.config_get("maxmemory-policy"))["maxmemory-policy"]
    await admin.config_set("maxmemory-policy", "noeviction")
    await admin.config_set("maxmemory", 1)
    try:
        yield
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.config_set("maxmemory-policy", policy)


@asynccontextmanager
async def read_only(admin: aioredis.Redis) -> AsyncIterator[None]:
    await admin.replicaof("127.0.0.1", free_port())  # nobody there: it never syncs
    try:
        yield
    finally:
        await admin.execute_command("REPLICAOF", "NO", "ONE")


FAULTS: dict[str, Callable[[aioredis.Redis], AbstractAsyncContextManager[None]]] = {
    "out_of_memory": out_of_memory,
    "read_only": read_only,
}
"""Every fault by name (tests parametrize over these)."""
