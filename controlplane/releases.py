"""Best-effort reservation release: a finished answer never fails because Redis did.

A request's reservation is given back when its answer is complete. If Redis cannot take
the release right then (unreachable, read-only after a failover, or too slow: one attempt
is bounded by `attempt_timeout_s`), the answer is still delivered: the release is queued
and retried in the background, with backoff, until Redis accepts it. Releases are
idempotent (`Admission.release`), so a retry of one that did land changes nothing. Should
the ingress die with releases queued, the reservations lapse after their TTL.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from controlplane.admission import Admission, Reservation
from controlplane.redis_conn import REDIS_ERRORS, Backoff

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReleaserConfig:
    """`attempt_timeout_s` bounds how long a finished answer waits for Redis; retries
    back off from `retry_base_s` to `retry_cap_s`; at most `max_pending` releases wait
    (beyond that the oldest is dropped and left to lapse by its TTL)."""

    attempt_timeout_s: float = 0.5
    retry_base_s: float = 0.1
    retry_cap_s: float = 2.0
    max_pending: int = 100_000

    def __post_init__(self) -> None:
        if self.attempt_timeout_s <= 0 or self.retry_base_s <= 0:
            raise ValueError("attempt_timeout_s and retry_base_s must be positive")
        if self.retry_cap_s < self.retry_base_s or self.max_pending < 1:
            raise ValueError("need retry_cap_s >= retry_base_s and max_pending >= 1")


class Releaser:
    """Releases reservations now when Redis answers, else later; never raises.

    Invariant: a reservation is either released in Redis, pending here, or dropped
    (logged) once more than `max_pending` wait; `pending` keeps one entry per request.
    """

    def __init__(self, admission: Admission, config: ReleaserConfig | None = None) -> None:
        self.config = config if config is not None else ReleaserConfig()
        self._admission = admission
        self._pending: dict[str, Reservation] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        """Releases waiting for Redis."""
        return len(self._pending)

    async def release(self, reservation: Reservation) -> bool:
        """One attempt now; True when Redis took it, False when it was queued for retry."""
        if await self._attempt(reservation):
            self._pending.pop(reservation.request_id, None)
            return True
        self._queue(reservation)
        return False

    def release_soon(self, reservation: Reservation) -> None:
        """Queue a release without waiting (from a callback, or a task being cancelled):
        the background retry loop attempts it at once."""
        self._queue(reservation)

    async def _attempt(self, reservation: Reservation) -> bool:
        try:
            await asyncio.wait_for(
                self._admission.release(reservation), self.config.attempt_timeout_s
            )
        except REDIS_ERRORS as error:  # OSError covers the attempt's TimeoutError
            logger.warning(
                "release of %s failed (%s); retrying in the background",
                reservation.request_id,
                type(error).__name__,
            )
            return False
        return True

    def _queue(self, reservation: Reservation) -> None:
        if reservation.request_id not in self._pending and self.pending >= self.config.max_pending:
            dropped = next(iter(self._pending))
            del self._pending[dropped]
            logger.error("release queue full: %s is left to lapse by its TTL", dropped)
        self._pending[reservation.request_id] = reservation
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._retry_forever(), name="vtoken-release-retry"
            )

    async def _retry_forever(self) -> None:
        """Retry the queued releases, oldest first, backing off while Redis refuses."""
        backoff = Backoff(self.config.retry_base_s, self.config.retry_cap_s)
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            for request_id, reservation in list(self._pending.items()):
                if not await self._attempt(reservation):
                    break
                if self._pending.get(request_id) is reservation:
                    del self._pending[request_id]
            if self._pending:
                await asyncio.sleep(backoff.next_delay_s())
            else:
                backoff.reset()

    async def close(self) -> None:
        """Stop retrying (what is still pending lapses by its TTL)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
