"""Redis connection settings, the client factory and the retry backoff the loops share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

_SCHEMES = ("redis", "rediss", "unix")

REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, OSError)
"""Everything a Redis command may raise: a lost or unreachable server, and every error
reply (`ResponseError` and its subclasses `OutOfMemoryError` at `maxmemory` with
`noeviction`, `ReadOnlyError` on a replica, `BusyLoadingError` while it loads its
append-only file). The loops catch all of them, back off and retry; a capacity or
failover problem in Redis must never stop a loop (nor restart an engine)."""


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """How to reach Redis. `redis://`, `rediss://` (TLS) and `unix://` URLs are accepted;
    a password may sit in the URL (`redis://:secret@host:6379/0`) or in `password`,
    which wins. Short timeouts keep a dead Redis from stalling a loop for long. At most
    `max_connections` commands are in flight per client; more wait up to
    `connect_timeout_s` for a free connection instead of failing at once (redis-py's
    default pool refuses the 101st concurrent command with `MaxConnectionsError`)."""

    url: str = "redis://127.0.0.1:6379/0"
    password: str | None = field(default=None, repr=False)
    socket_timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    command_retries: int = 2
    max_connections: int = 512

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(
                f"unsupported Redis URL scheme {scheme!r} in {self.url!r}; use one of {_SCHEMES}"
            )
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("Redis timeouts must be positive")
        if self.command_retries < 0:
            raise ValueError("command_retries must be >= 0")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")


def connect(config: RedisConfig) -> aioredis.Redis:
    """A lazily connecting client with `decode_responses=True` (the store expects str).

    redis-py reconnects on the next command after a lost connection; each command is
    retried `command_retries` times with exponential backoff before the error surfaces.
    """
    kwargs: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.02), config.command_retries),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "health_check_interval": 10,
    }
    if config.password is not None:
        kwargs["password"] = config.password
    pool = aioredis.BlockingConnectionPool.from_url(
        config.url,
        max_connections=config.max_connections,
        timeout=config.connect_timeout_s,
        **kwargs,
    )
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


class Backoff:
    """Exponential backoff for loops that lost Redis: base, 2x base, ... up to `cap_s`."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0) -> None:
        if base_s <= 0 or cap_s < base_s:
            raise ValueError("backoff needs 0 < base_s <= cap_s")
        self._base_s = base_s
        self._cap_s = cap_s
        self._failures = 0

    @property
    def failures(self) -> int:
        return self._failures

    def next_delay_s(self) -> float:
        delay = min(self._cap_s, self._base_s * (2**self._failures))
        self._failures += 1
        return delay

    def reset(self) -> None:
        self._failures = 0
