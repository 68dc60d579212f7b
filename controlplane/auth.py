"""Tenant API keys: stored as SHA-256 digests, never in clear, each listed under a key id.

Generated keys carry 256 random bits; a key an admin chooses must have at least 32
characters and no short repeated pattern, so its unsalted digest cannot be reversed by
guessing. A key id (``key-`` + 16 hex digits of the digest) names a key in listings and
revocations without revealing it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import redis.asyncio as aioredis

from controlplane.keys import KeySpace

MIN_CHOSEN_KEY_CHARS = 32
MAX_KEY_CHARS = 256
MIN_DISTINCT_KEY_CHARS = 10

# KEYS: api keys, the tenant's key ids. ARGV: digest, tenant id, key id.
# 0 (and nothing written) when the digest belongs to another tenant.
_ADD_KEY = """
local owner = redis.call('HGET', KEYS[1], ARGV[1])
if owner and owner ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[1])
return 1
"""

# KEYS: api keys, the tenant's key ids. ARGV: tenant id, key id. 1 when the id existed.
_REVOKE_KEY = """
local digest = redis.call('HGET', KEYS[2], ARGV[2])
if not digest then return 0 end
if redis.call('HGET', KEYS[1], digest) == ARGV[1] then redis.call('HDEL', KEYS[1], digest) end
redis.call('HDEL', KEYS[2], ARGV[2])
return 1
"""


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def key_id(api_key: str) -> str:
    """The public name of a key: stable, and useless for recovering the key."""
    return "key-" + digest(api_key)[:16]


def new_api_key() -> str:
    """A fresh tenant key: ``vt-`` and 256 random bits (43 URL-safe characters)."""
    return "vt-" + secrets.token_urlsafe(32)


def check_chosen_key(api_key: str) -> str:
    """``api_key`` when an admin may give it to a tenant; ``ValueError`` (the message never
    repeats the key) when it is shorter than 32 or longer than 256 characters, or a pattern
    of fewer than 10 distinct characters."""
    if not MIN_CHOSEN_KEY_CHARS <= len(api_key) <= MAX_KEY_CHARS:
        raise ValueError(
            f"api_key must have {MIN_CHOSEN_KEY_CHARS} to {MAX_KEY_CHARS} characters "
            f"(got {len(api_key)}); omit it to have a random key generated"
        )
    if len(set(api_key)) < MIN_DISTINCT_KEY_CHARS:
        raise ValueError("api_key is a repeated pattern, not a secret")
    return api_key


def admin_token_ok(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else ``None``."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class TenantKeys:
    """``digest -> tenant id`` in ``KeySpace.api_keys`` (what authentication reads) and
    ``key id -> digest`` per tenant in ``KeySpace.tenant_api_keys`` (what listing and
    revocation read). Both change together, in one script. Removing a whole tenant is
    :func:`controlplane.tenants.remove_tenant`."""

    def __init__(self, redis: aioredis.Redis, keys: KeySpace | None = None) -> None:
        self._redis = redis
        self._keys = keys if keys is not None else KeySpace()
        self._add = redis.register_script(_ADD_KEY)
        self._revoke = redis.register_script(_REVOKE_KEY)

    async def set_key(self, tenant_id: str, api_key: str) -> bool:
        """Give ``tenant_id`` this key (other keys of the tenant stay valid). ``False``, and
        nothing changes, when the key already belongs to another tenant."""
        return await self.add_key(tenant_id, api_key) is not None

    async def add_key(self, tenant_id: str, api_key: str) -> str | None:
        """Give ``tenant_id`` this key; its key id, or ``None`` (nothing changed) when the
        key belongs to another tenant. Adding a key the tenant holds again is a no-op."""
        keys = [self._keys.api_keys, self._keys.tenant_api_keys(tenant_id)]
        added = await self._add(keys=keys, args=[digest(api_key), tenant_id, key_id(api_key)])
        return key_id(api_key) if added else None

    async def key_ids(self, tenant_id: str) -> list[str]:
        """The ids of the tenant's keys, sorted (never the keys or their digests)."""
        ids = await self._redis.hkeys(self._keys.tenant_api_keys(tenant_id))
        return sorted(i.decode() if isinstance(i, bytes) else i for i in ids)

    async def revoke(self, tenant_id: str, revoked_id: str) -> bool:
        """Revoke one key of the tenant by its id; ``False`` when it has no such key."""
        keys = [self._keys.api_keys, self._keys.tenant_api_keys(tenant_id)]
        return bool(await self._revoke(keys=keys, args=[tenant_id, revoked_id]))

    async def tenant_for(self, api_key: str) -> str | None:
        value = await self._redis.hget(self._keys.api_keys, digest(api_key))
        return value.decode() if isinstance(value, bytes) else value
