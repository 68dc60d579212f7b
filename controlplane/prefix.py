"""Prompt-prefix keys for prefix-affinity routing, and where each replica's prefixes live.

A prompt's *prefix keys* are chained hashes of its first full blocks, built like vLLM's
block hashes: key ``i`` hashes key ``i - 1`` with the tokens of block ``i``, and the first
also hashes the prefix-cache salt (tenant or prefix group), so two prompts share key
``i`` exactly when they share their first ``i + 1`` blocks and salt, which is when vLLM
could serve those blocks from one request's cache to the other. They are computed once
per request, at the ingress, with the replicas' block size; replicas remember the keys of
the prompts they served (:class:`PrefixMemory`, as many as their KV pool has blocks,
least recently used forgotten first) and publish them in their reports; the router
(``controlplane/router.py``) sends a request to the replica holding its longest prefix.

The keys are this module's own (vLLM's hashes live in the engine process and use its
hash function and seed); routing only ever compares keys made here, so they need to
agree with each other, not with vLLM's.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

MAX_PREFIX_BLOCKS = 64  # a request carries at most this many keys (2,048 tokens at 32)
MAX_REPORTED_KEYS = 1024  # a replica's report carries at most this many
KEY_HEX_CHARS = 16  # 64-bit keys: collisions are a routing miss, never a wrong answer


def cache_salt(tenant_id: str, prefix_group: str | None = None) -> str:
    """The prefix-cache salt of a tenant's prompts (vLLM's ``cache_salt``): blocks are
    shared only between prompts of one salt. With ``prefix_group`` it is the group's,
    ``sha256("vtoken-group:" + group)``, the same for every tenant of the group; without,
    the tenant's own, ``sha256("vtoken-tenant:" + tenant_id)``. The two namespaces differ,
    so a group named like a tenant never shares that tenant's blocks. 32 hex digits."""
    if prefix_group is not None:
        key = f"vtoken-group:{prefix_group}"
    else:
        key = f"vtoken-tenant:{tenant_id}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def prefix_keys(
    token_ids: Sequence[int],
    block_size: int,
    salt: str,
    max_blocks: int = MAX_PREFIX_BLOCKS,
) -> tuple[str, ...]:
    """Chained keys of the prompt's first full blocks (at most ``max_blocks``), in order.

    A prompt shorter than one block has none. vLLM never serves a prompt's last token
    from the cache, so the block holding it would be recomputed anyway; it is keyed only
    when full, as vLLM's hashes are.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[str] = []
    parent = hashlib.sha256(f"vtoken-prefix:{salt}".encode()).digest()
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.sha256(parent + b",".join(str(t).encode() for t in block)).digest()
        keys.append(digest.hex()[:KEY_HEX_CHARS])
        parent = digest
    return tuple(keys)


class PrefixMemory:
    """A replica's recently served prefix keys, least recently used first out.

    ``capacity``: the most keys kept (a replica's prefix cache holds at most its KV pool's
    blocks, one key per cached block).
    """

    def __init__(self, capacity: int) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """Keep at most ``capacity`` keys from now on (the least recently used go first)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._trim()

    def add(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        self._trim()

    def _trim(self) -> None:
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def snapshot(self, limit: int | None = None) -> tuple[str, ...]:
        """The keys, most recently used first (at most ``limit``)."""
        keys = reversed(self._keys)
        if limit is None:
            return tuple(keys)
        return tuple(key for key, _ in zip(keys, range(limit), strict=False))


class PrefixIndex:
    """Which replicas hold which prefix keys: from their latest reports, or from what a
    router sent them since (``add`` and ``remove`` count, so a key stays matched on a
    replica while any request that added it there is remembered)."""

    def __init__(self, held: Mapping[str, Iterable[str]] | None = None) -> None:
        self._replicas_of: dict[str, dict[str, int]] = {}
        for replica_id, keys in (held or {}).items():
            self.add(replica_id, keys)

    def __bool__(self) -> bool:
        return bool(self._replicas_of)

    def add(self, replica_id: str, keys: Iterable[str]) -> None:
        for key in keys:
            holders = self._replicas_of.setdefault(key, {})
            holders[replica_id] = holders.get(replica_id, 0) + 1

    def remove(self, replica_id: str, keys: Iterable[str]) -> None:
        """Undo one ``add(replica_id, keys)``."""
        for key in keys:
            holders = self._replicas_of.get(key)
            if holders is None or replica_id not in holders:
                continue
            holders[replica_id] -= 1
            if holders[replica_id] <= 0:
                del holders[replica_id]
                if not holders:
                    del self._replicas_of[key]

    def longest_match(self, keys: Sequence[str], candidates: Iterable[str]) -> dict[str, int]:
        """Blocks of the prompt each candidate holds: the longest run of ``keys`` from the
        start (keys are chained, so key ``i`` held means the whole run up to it). Only
        candidates holding at least one block appear."""
        allowed = set(candidates)
        matched: dict[str, int] = {}
        for depth in range(len(keys), 0, -1):  # deepest first: most prompts stop early
            for replica_id in self._replicas_of.get(keys[depth - 1], ()):
                if replica_id in allowed and replica_id not in matched:
                    matched[replica_id] = depth
            if len(matched) == len(allowed):
                break
        return matched


def within_load_bound(load: float, loads: Iterable[float], factor: float, slack: int = 0) -> bool:
    """Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA
    2018): with ``m`` requests over ``n`` replicas (this one counted), a replica takes one
    more only while it then holds at most ``ceil(factor * m / n)``, plus ``slack``
    requests (an absolute allowance, as SGLang's cache-aware router has: at low load the
    relative cap alone would turn a cache hit away for one queued request). ``loads``
    are the candidates' request counts, ``load`` is this replica's."""
    values = list(loads)
    capacity = math.ceil(factor * (sum(values) + 1) / max(1, len(values))) + slack
    return load + 1 <= capacity
