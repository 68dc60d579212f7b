from __future__ import annotations

import asyncio

import pytest

from controlplane.redis_conn import RedisConfig, connect
from tests.redis_server import RedisServer


async def test_a_burst_of_commands_waits_for_connections_instead_of_failing(
    redis_server: RedisServer,
) -> None:
    """600 concurrent commands on one client (an ingress at high concurrency: admissions,
    renewals, releases) with 64 connections: they queue, none fails."""
    client = connect(RedisConfig(url=redis_server.url, max_connections=64))
    try:
        replies = await asyncio.gather(*(client.incr("test-burst") for _ in range(600)))
        assert max(replies) - min(replies) == 599
    finally:
        await client.aclose()


def test_bad_redis_config() -> None:
    with pytest.raises(ValueError, match="scheme"):
        RedisConfig(url="http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="max_connections"):
        RedisConfig(max_connections=0)
