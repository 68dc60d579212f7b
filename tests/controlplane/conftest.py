"""Fixtures: one real redis-server per test session, a fresh key space per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from controlplane.keys import KeySpace
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from tests.controlplane.fakes import FakeClock
from tests.redis_server import RedisServer, unique_keys


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def keys() -> KeySpace:
    return unique_keys()


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = connect(RedisConfig(url=redis_server.url))
    yield client
    await client.aclose()


@pytest.fixture
def store(redis: aioredis.Redis, keys: KeySpace) -> RedisStore:
    return RedisStore(redis, keys)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
