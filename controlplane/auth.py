"""Tenant API keys: stored as SHA-256 digests in one Redis hash, never in clear."""

from __future__ import annotations

import hashlib
import hmac
import secrets

import redis.asyncio as aioredis

from controlplane.keys import KeySpace


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    return "vt-" + secrets.token_urlsafe(24)


def admin_token_ok(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else ``None``."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class TenantKeys:
    """``api key digest -> tenant id`` in ``<prefix>:apikeys``."""

    def __init__(self, redis: aioredis.Redis, keys: KeySpace | None = None) -> None:
        self._redis = redis
        self._hash = (keys if keys is not None else KeySpace()).prefix + ":apikeys"

    async def set_key(self, tenant_id: str, api_key: str) -> bool:
        """Give ``tenant_id`` this key (other keys of the tenant stay valid). ``False``, and
        nothing changes, when the key already belongs to another tenant."""
        if await self._redis.hsetnx(self._hash, digest(api_key), tenant_id):
            return True
        return await self.tenant_for(api_key) == tenant_id

    async def tenant_for(self, api_key: str) -> str | None:
        value = await self._redis.hget(self._hash, digest(api_key))
        return value.decode() if isinstance(value, bytes) else value

    async def delete_tenant(self, tenant_id: str) -> int:
        """Revoke every key of ``tenant_id``; returns how many."""
        entries = await self._redis.hgetall(self._hash)
        doomed = [
            k
            for k, v in entries.items()
            if (v.decode() if isinstance(v, bytes) else v) == tenant_id
        ]
        return int(await self._redis.hdel(self._hash, *doomed)) if doomed else 0
