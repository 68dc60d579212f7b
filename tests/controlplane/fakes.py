"""The only fake the control-plane tests use: a clock."""

from __future__ import annotations

import asyncio


class FakeClock:
    """Wall time that moves only when told to. `sleep` advances time by the requested
    amount and yields once to the event loop, so loops under test run step by step."""

    def __init__(self, start_s: float = 1_700_000_000.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        self._now += max(0.0, seconds)
        await asyncio.sleep(0)
