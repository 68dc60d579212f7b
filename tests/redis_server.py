"""A real `redis-server` for tests: started on a free loopback port in a temp dir.

Reusable from any test package:

    from tests.redis_server import RedisServer, unique_keys

`RedisServer` is `controlplane.local_redis.LocalRedis` (persistent by default, so
`restart()` keeps every key). Tests sharing one server isolate themselves with a unique
key prefix from `unique_keys()` instead of flushing.
"""

from __future__ import annotations

import uuid

from controlplane.keys import KeySpace
from controlplane.local_redis import LocalRedis, LocalRedisError, free_port

RedisServer = LocalRedis

__all__ = ["LocalRedisError", "RedisServer", "free_port", "unique_keys"]


def unique_keys() -> KeySpace:
    """A key space no other test uses."""
    return KeySpace(prefix=f"test-{uuid.uuid4().hex[:12]}")
