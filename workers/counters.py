"""Per-request and per-tenant KV counters of a vToken engine (plain data for reports)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestCounters:
    """One request's KV counters (what the replica publishes; see ``workers/api.py``)."""

    request_id: str
    tenant: str
    policy: str
    live_tokens: int
    allocated_blocks: int  # held from the pool, ballast included (naive mode)
    ideal_blocks: int  # ceil(live_tokens / block_size)
    evicted_tokens: int
    repack_moves: int
    finished: bool = False

    @property
    def reclaimable_blocks(self) -> int:
        return self.allocated_blocks - self.ideal_blocks


@dataclass(frozen=True, slots=True)
class TenantCounters:
    tenant: str
    num_requests: int
    live_tokens: int
    allocated_blocks: int
    ideal_blocks: int
    evicted_tokens: int
    repack_moves: int

    @property
    def reclaimable_blocks(self) -> int:
        return self.allocated_blocks - self.ideal_blocks


def as_dict(counters: RequestCounters | TenantCounters) -> dict[str, Any]:
    values = asdict(counters)
    values["reclaimable_blocks"] = counters.reclaimable_blocks
    return values


def finished_copy(counters: RequestCounters) -> RequestCounters:
    return replace(counters, finished=True)
