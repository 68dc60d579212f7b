"""A replica's view of the routing plan: the eviction pressure the controller put on it.

Each poll reads the replica's own slice of the plan (`controlplane/plan_slices.py`) and
the leader's heartbeat: one script call of a few hundred bytes, where the whole plan is
1.5 MB and ~150 ms of parsing at 1,000 replicas x 10,000 tenants (on the engine's event
loop, every controller cycle: the plan's usage-derived fields change every cycle under
traffic). The slice is parsed only when its bytes changed. A slice is current while it
is stored (the leader rewrites or removes it atomically with each plan); it is as fresh
as the leader's heartbeat (or, before any, its own `created_s`; both on the controller's
clock) and carries no pressure once that is older than `max_age_s`: no controller is
measuring any more.
"""

from __future__ import annotations

import logging

from controlplane.clock import Clock
from controlplane.models import PlanSlice
from controlplane.redis_conn import REDIS_ERRORS
from controlplane.store import RedisStore, SliceRead

logger = logging.getLogger(__name__)


class PlanFollower:
    """Follows the plan for one replica. Invariant: `pressure_now` is the pressure of the
    slice last read (or {} before any, while no plan names this replica, and once that
    slice is stale). A slice that does not validate is logged once and leaves the last
    valid one in place, no longer freshened: its pressure ends `max_age_s` later."""

    def __init__(
        self, store: RedisStore, replica_id: str, clock: Clock, max_age_s: float = 30.0
    ) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s}")
        self.replica_id = replica_id
        self.max_age_s = max_age_s
        self.slice_reads = 0  # how often a slice was parsed (its bytes changed)
        self._store = store
        self._clock = clock
        self._raw: str | None = None  # the slice last seen
        self._valid = False  # whether it validated
        self._version: int | None = None
        self._created_s = 0.0
        self._pressure: dict[str, float] = {}
        self._allowance: dict[str, int] = {}

    @property
    def version(self) -> int | None:
        """The version of the plan that last changed the slice held (None before any)."""
        return self._version

    def _fresh(self) -> bool:
        return self._clock.now() - self._created_s <= self.max_age_s

    def pressure_now(self) -> dict[str, float]:
        """Tenant -> keep fraction on this replica; {} once the plan is stale."""
        return dict(self._pressure) if self._fresh() else {}

    def allowance_now(self) -> dict[str, int]:
        """Tenant -> the most blocks it may hold on this replica; {} once the plan is stale
        (no limit: nothing measures the tenants any more)."""
        return dict(self._allowance) if self._fresh() else {}

    async def poll(self) -> dict[str, float]:
        """Read this replica's slice and the heartbeat; then :meth:`pressure_now`. Redis
        errors and any bad value are logged and keep what was known: the loop that polls
        never dies of them."""
        try:
            self._adopt(await self._store.read_plan_slice(self.replica_id))
        except REDIS_ERRORS as error:
            logger.warning("replica %s: plan not read (%s)", self.replica_id, error)
        except Exception:  # noqa: BLE001 - a bad value must not end the engine's loop
            logger.exception("replica %s: plan slice not applied", self.replica_id)
        return self.pressure_now()

    def _adopt(self, read: SliceRead) -> None:
        if read.raw_slice is None:  # no plan names this replica (or no plan yet)
            self._raw, self._valid, self._pressure, self._allowance = None, False, {}, {}
            return
        if read.raw_slice != self._raw:
            self._raw = read.raw_slice
            self.slice_reads += 1
            try:
                piece = PlanSlice.model_validate_json(read.raw_slice, extra="ignore")
            except ValueError as error:  # written by an incompatible controller
                logger.error("replica %s: plan slice is invalid: %s", self.replica_id, error)
                self._valid = False
                return
            self._valid = True
            self._pressure = {tenant: p.keep_fraction for tenant, p in piece.pressure.items()}
            self._allowance = dict(piece.allowance)
            self._version = piece.version
            self._created_s = piece.created_s
        if self._valid and read.heartbeat_s is not None:
            # A stored slice is the leader's current one: it is as fresh as its heartbeat.
            self._created_s = max(self._created_s, read.heartbeat_s)
