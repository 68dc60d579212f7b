"""Routers and admission for the simulated cluster, on its virtual clock.

Routers (``make_router``):

- ``project``: the control plane's ``RouterCore`` (``controlplane/router.py``) as the
  ingress runs it: prefix affinity first (the prompt's chained prefix keys,
  ``controlplane.prefix.prefix_keys`` under the tenant's ``cache_salt``; the replica that
  holds the longest run of them within the bounded-load cap), then least loaded by the
  replicas' live queue lengths. It remembers what it routed (``note_routed``) on the
  virtual clock. Not yet driven: replica reports and the controller's plan (warm sets),
  so the ranking below prefix affinity is its no-plan fallback.
- ``round_robin``; ``power_of_two``: two replicas drawn at random (seeded), the one with
  fewer queued + running requests.

Admission (``Admission``): a tenant's requests are counted at their ``kv_bounds`` (the
control plane's; the engine's policy gives the protection and prefill chunk as
``workers.config.VTokenConfig.admission_*`` computes them): the prefill peak until the
first token, then the steady bound, until the request finishes. A request that would put
its tenant over ``budget_blocks`` is refused (a 429). This is the admission rule in
Python: the Redis Lua scripts (``controlplane/admission_scripts.py``) are not run, so
Redis's clock and TTLs are not on virtual time yet.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from controlplane.kv_bounds import kv_bounds
from controlplane.prefix import cache_salt, prefix_keys
from controlplane.router import RouterConfig, RouterCore
from sim.workloads import SimRequest
from workers.config import VTokenConfig

ROUTERS = ("project", "round_robin", "power_of_two")


@dataclass(slots=True)
class VirtualClock:
    """``controlplane.clock.Clock`` on the simulation's time."""

    time_s: float = 0.0

    def now(self) -> float:
        return self.time_s

    async def sleep(self, seconds: float) -> None:
        self.time_s += seconds


class Router:
    """Picks a replica index for a request, given each replica's queued + running count."""

    def choose(self, request: SimRequest, loads: Sequence[int]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request: SimRequest, loads: Sequence[int]) -> int:
        return next(self._next) % len(loads)


class PowerOfTwo(Router):
    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def choose(self, request: SimRequest, loads: Sequence[int]) -> int:
        if len(loads) == 1:
            return 0
        first, second = self._rng.choice(len(loads), 2, replace=False)
        return int(first if loads[first] <= loads[second] else second)


class ProjectRouter(Router):
    """``RouterCore`` without a store: ``rank`` and ``note_routed`` only."""

    def __init__(self, num_replicas: int, clock: VirtualClock, block_size: int) -> None:
        self.core = RouterCore(None, clock, RouterConfig())  # type: ignore[arg-type]
        self.ids = tuple(f"replica-{i}" for i in range(num_replicas))
        self.candidates = frozenset(self.ids)  # one object: RouterCore caches its order
        self.block_size = block_size

    def choose(self, request: SimRequest, loads: Sequence[int]) -> int:
        keys = prefix_keys(request.prompt, self.block_size, cache_salt(request.tenant))
        queues = dict(zip(self.ids, loads, strict=True))
        ranking = self.core.rank(request.tenant, self.candidates, queues, keys)
        chosen = ranking.ranks[0][0]
        self.core.note_routed(chosen, keys)
        return self.ids.index(chosen)


def make_router(
    name: str, num_replicas: int, clock: VirtualClock, block_size: int, seed: int
) -> Router:
    if name == "project":
        return ProjectRouter(num_replicas, clock, block_size)
    if name == "round_robin":
        return RoundRobin()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    raise ValueError(f"router must be one of {ROUTERS}, got {name!r}")


@dataclass(slots=True)
class Admission:
    """Per-tenant active-KV admission at ``kv_bounds`` (module docstring); ``budget_blocks``
    ``None``: every request is admitted (and still counted)."""

    block_size: int
    config: VTokenConfig | None
    max_num_batched_tokens: int
    budget_blocks: int | None = None
    held: dict[str, int] = field(default_factory=dict)  # tenant -> blocks counted
    counted: dict[str, tuple[str, int, int]] = field(
        default_factory=dict
    )  # id -> (tenant, now, steady)
    refused: dict[str, int] = field(default_factory=dict)
    peak_held: dict[str, int] = field(default_factory=dict)  # tenant -> most ever counted

    def _bounds(self, request: SimRequest) -> tuple[int, int]:
        config = self.config
        keep = config.admission_keep_ratio() if config is not None else None
        protection = config.admission_protection(self.block_size) if config is not None else None
        chunk = (
            config.admission_prefill_chunk_tokens(self.max_num_batched_tokens)
            if config is not None
            else None
        )
        bounds = kv_bounds(
            len(request.prompt),
            request.max_tokens,
            self.block_size,
            None,
            keep_ratio=keep,
            protected_tokens=protection.tokens if protection is not None else 0,
            protected_fraction=protection.fraction if protection is not None else 0.0,
            prefill_chunk_tokens=chunk,
        )
        return bounds.peak, bounds.steady

    def admit(self, request: SimRequest) -> bool:
        peak, steady = self._bounds(request)
        held = self.held.get(request.tenant, 0)
        if self.budget_blocks is not None and held + peak > self.budget_blocks:
            self.refused[request.tenant] = self.refused.get(request.tenant, 0) + 1
            return False
        self.held[request.tenant] = held + peak
        self.peak_held[request.tenant] = max(self.peak_held.get(request.tenant, 0), held + peak)
        self.counted[request.request_id] = (request.tenant, peak, steady)
        return True

    def first_token(self, request_id: str) -> None:
        tenant, now, steady = self.counted[request_id]
        self.held[tenant] += steady - now
        self.counted[request_id] = (tenant, steady, steady)

    def finished(self, request_id: str) -> None:
        tenant, now, _ = self.counted.pop(request_id)
        self.held[tenant] -= now
