"""Replica reports as read from Redis, and their parsing (pure, so a caller may run it
off its event loop: 1,000 reports take ~25 ms to validate).

A report hash holds `report` (the report's JSON without its prefix keys), `heartbeat_s`
and `prefix_tag`; the prefix keys (up to 1,024: ~8x the rest of the report) live in a
key of their own (`KeySpace.replica_prefix_keys`: their tag, then the keys, separated by
spaces), written only when they changed. The controller and `/admin/status` read `report`
only; routers read the prefix keys, and only when the tag moved
(`RedisStore.read_prefix_keys`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from controlplane.models import ReplicaReport
from controlplane.prefix import MAX_REPORTED_KEYS
from controlplane.store_scripts import WRONG_TYPE

logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 64  # a stored key longer than this is not one of ours


@dataclass(frozen=True, slots=True)
class ReportRows:
    """Registered replicas at `now_s` (registry order), their last heartbeats, and each
    one's raw `report` field (None where its hash expired; `WRONG_TYPE` where the key
    holds something else)."""

    now_s: float
    replica_ids: list[str]
    last_heartbeat_s: dict[str, float]
    raw_reports: list[str | None]


@dataclass(frozen=True, slots=True)
class ReportSnapshot:
    """Reports read at `now_s`: `fresh` ones have a heartbeat within `max_age_s`;
    `stale_ids` are registered replicas whose report is older or already expired;
    `invalid_ids` had a hash that failed validation (treated as stale). Reports carry no
    prefix keys (`prefix_keys == ()`): see `RedisStore.read_prefix_keys`."""

    now_s: float
    fresh: dict[str, ReplicaReport]
    stale_ids: frozenset[str]
    invalid_ids: frozenset[str]
    last_heartbeat_s: dict[str, float] = field(default_factory=dict)
    """Each registered replica's last heartbeat (its registry score), stale ones too."""


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    """A replica's prefix keys as stored, and the tag they were stored under."""

    tag: str
    keys: tuple[str, ...]


def parse_reports(rows: ReportRows, max_age_s: float) -> ReportSnapshot:
    """Validate `rows`; a report that does not validate, or a key of another type, is
    counted invalid (logged for the latter), never an error."""
    fresh: dict[str, ReplicaReport] = {}
    stale: set[str] = set()
    invalid: set[str] = set()
    for replica_id, raw in zip(rows.replica_ids, rows.raw_reports, strict=True):
        if raw is None:
            stale.add(replica_id)
            continue
        if raw == WRONG_TYPE:
            logger.error("store: replica %r's report key holds another type", replica_id)
            invalid.add(replica_id)
            continue
        try:
            report = ReplicaReport.model_validate_json(raw, extra="ignore")
        except ValueError:
            invalid.add(replica_id)
            continue
        if rows.now_s - report.heartbeat_s > max_age_s:
            stale.add(replica_id)
        else:
            fresh[replica_id] = report
    return ReportSnapshot(
        rows.now_s, fresh, frozenset(stale | invalid), frozenset(invalid), rows.last_heartbeat_s
    )


def parse_prefix_keys(replica_id: str, raw: str) -> PrefixKeys:
    """`<tag> <key> <key> ...` as stored (hex keys: splitting 1,024 takes ~20 us, JSON
    took ~0.8 ms to validate). More than `MAX_REPORTED_KEYS` keys, or one longer than
    `MAX_KEY_CHARS`, is logged and read as none, under the same tag, so a bad record is
    parsed once, not every refresh."""
    tag, *keys = raw.split() or [""]
    if len(keys) > MAX_REPORTED_KEYS or max(map(len, keys), default=0) > MAX_KEY_CHARS:
        logger.error("store: prefix keys of replica %r are invalid, ignored", replica_id)
        return PrefixKeys(tag, ())
    return PrefixKeys(tag, tuple(keys))
