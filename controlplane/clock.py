"""The injected clock: wall time for cross-process timestamps, plus an awaitable sleep.

Tests pass a fake whose `sleep` advances its own time; production code uses `SystemClock`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch; comparable across processes (heartbeats, leases)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
