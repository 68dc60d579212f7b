"""An admitted request's KV reservation while its answer runs, as one async context manager.

Entered, it renews the reservation every third of its TTL (a request running longer than
the TTL keeps counting against its tenant's quota); :meth:`HeldReservation.settle` shrinks
it to its steady bound once every sequence is past its prefill; exited, however the answer
ended (complete, failed, or cancelled by a client that went away), it stops renewing and
releases the reservation. Redis errors never reach the answer: a settle Redis refuses keeps
the peak (over-reserving is safe), a refused renewal is retried at the next third (two may
fail before it lapses), a refused release is retried in the background by the
:class:`Releaser`.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType

from controlplane.admission import Admission, Renewal, Reservation
from controlplane.redis_conn import REDIS_ERRORS
from controlplane.releases import Releaser

logger = logging.getLogger(__name__)


class HeldReservation:
    """``reservation`` (admitted by ``admission``) held for the span of an ``async with``;
    :attr:`reservation` is the latest one (settled or not): what the exit releases."""

    def __init__(self, admission: Admission, releaser: Releaser, reservation: Reservation) -> None:
        self.admission = admission
        self.releaser = releaser
        self.reservation = reservation
        self._renewal: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HeldReservation:
        renewal = self._renew_while_running(self.reservation)
        self._renewal = asyncio.get_running_loop().create_task(renewal)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
        # Shielded: a client disconnect cancels the answer, not the release, and the
        # release never raises (a failed one is retried in the background).
        await asyncio.shield(self.releaser.release(self.reservation))

    def release_soon(self) -> None:
        """Release without waiting (idempotent): for paths that cannot await, or that
        are being cancelled."""
        if self._renewal is not None:
            self._renewal.cancel()
        self.releaser.release_soon(self.reservation)

    async def settle(self) -> None:
        """Shrink to the steady bound (once: a settled reservation stays); on a Redis error
        keep the peak (over-reserving is safe), so the next call tries again."""
        reservation = self.reservation
        if reservation.blocks <= reservation.steady:
            return
        try:
            self.reservation = await self.admission.settle(reservation)
        except REDIS_ERRORS as error:
            logger.warning("settle of %s failed: %s", reservation.request_id, type(error).__name__)

    async def _renew_while_running(self, reservation: Reservation) -> None:
        """Renew ``reservation`` every third of its TTL until cancelled. A renewal Redis
        refuses is retried at the next third. Timed with the event loop's clock: it paces
        calls, the deadline is Redis's."""
        period_s = self.admission.config.reservation_ttl_s / 3
        while True:
            await asyncio.sleep(period_s)
            try:
                renewal = await self.admission.renew(reservation)
                if renewal is Renewal.RESERVED_AGAIN:
                    logger.warning(
                        "reservation of %s lapsed before renewal; reserved again",
                        reservation.request_id,
                    )
            except REDIS_ERRORS as error:
                logger.warning(
                    "renewal of %s failed: %s", reservation.request_id, type(error).__name__
                )
