"""Fixtures: a redis-server per fault test file (faults change its config), a client that
takes the faults in and out, and a fresh key space per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from controlplane.keys import KeySpace
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from tests.redis_server import RedisServer, unique_keys


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(Path(tmp_path_factory.mktemp("redis"))) as server:
        yield server


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = connect(RedisConfig(url=redis_server.url, command_retries=0))
    yield client
    await client.aclose()


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A separate connection that puts the server into a fault and takes it out."""
    client = connect(RedisConfig(url=redis_server.url))
    yield client
    await client.aclose()


@pytest.fixture
def keys() -> KeySpace:
    return unique_keys()


@pytest.fixture
def store(redis: aioredis.Redis, keys: KeySpace) -> RedisStore:
    return RedisStore(redis, keys)
