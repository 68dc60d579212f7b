"""A held reservation: renewed while the answer runs, settled once, released at the end
however the answer ends; Redis errors never reach the answer."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from controlplane.admission import AdmissionConfig, Renewal, Reservation
from controlplane.releases import Releaser
from serving.reservation import HeldReservation

PEAK = Reservation("acme", "cmpl-1", blocks=7, steady=3)


class FakeAdmission:
    """Records what the held reservation asks of admission; ``refuse_settle`` makes
    ``settle`` fail as Redis would."""

    def __init__(self, ttl_s: float = 0.03) -> None:
        self.config = AdmissionConfig(reservation_ttl_s=ttl_s)
        self.renewed: list[Reservation] = []
        self.settled: list[Reservation] = []
        self.released: list[Reservation] = []
        self.refuse_settle = False

    async def renew(self, reservation: Reservation) -> Renewal:
        self.renewed.append(reservation)
        return Renewal.RENEWED

    async def settle(self, reservation: Reservation) -> Reservation:
        if self.refuse_settle:
            raise RedisConnectionError("Redis is away")
        self.settled.append(reservation)
        return dataclasses.replace(reservation, blocks=reservation.steady)

    async def release(self, reservation: Reservation) -> bool:
        self.released.append(reservation)
        return True


def _held(admission: FakeAdmission) -> HeldReservation:
    return HeldReservation(admission, Releaser(admission), PEAK)  # type: ignore[arg-type]


async def test_renewed_while_held_settled_once_released_at_the_end():
    admission = FakeAdmission(ttl_s=0.03)  # renewed every 10 ms
    async with _held(admission) as held:
        await asyncio.sleep(0.05)
        assert len(admission.renewed) >= 2 and set(admission.renewed) == {PEAK}
        await held.settle()
        await held.settle()  # settled: nothing more to shrink
        assert admission.settled == [PEAK] and held.reservation.blocks == 3
    assert admission.released == [held.reservation]
    renewals = len(admission.renewed)
    await asyncio.sleep(0.03)
    assert len(admission.renewed) == renewals  # no renewal after the release


async def test_a_settle_redis_refuses_keeps_the_peak_and_is_tried_again():
    admission = FakeAdmission(ttl_s=60)
    async with _held(admission) as held:
        admission.refuse_settle = True
        await held.settle()  # does not raise
        assert held.reservation == PEAK
        admission.refuse_settle = False
        await held.settle()
        assert held.reservation.blocks == PEAK.steady
    assert admission.released == [held.reservation]


async def test_an_answer_cancelled_or_failed_still_releases():
    admission = FakeAdmission(ttl_s=60)

    async def answer() -> None:
        async with _held(admission):
            await asyncio.sleep(3600)  # the client goes away meanwhile

    task = asyncio.get_running_loop().create_task(answer())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(RuntimeError):
        async with _held(admission):
            raise RuntimeError("the replica failed")
    assert admission.released == [PEAK, PEAK]
