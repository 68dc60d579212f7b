"""How long the engine's recent steps took, for the reports (an injected clock)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

STEP_WINDOW_S = 2.0  # reports carry the longest steps that ended this recently
RECENT_STEPS = 16  # how many of them


class StepTimes:
    """How long the engine's recent steps took: from vLLM's ``schedule`` to the end of its
    ``update_from_output`` (the policies, the repack plan and vLLM's own update included).

    Reports carry the longest steps that ended in the last ``window_s``, each with its end
    on the wall clock: a replica's counters are read between steps, so a tenant's KV can
    run over its budget for a report period plus one step before anything acts, and a
    reader of the reports needs the steps to judge an excursion.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        window_s: float = STEP_WINDOW_S,
    ) -> None:
        self._clock = clock
        self._wall = wall
        self._window_s = window_s
        self._started: float | None = None
        self._recent: deque[tuple[float, float, float]] = deque()  # (ended, wall, duration)

    def begin(self) -> None:
        self._started = self._clock()

    def end(self) -> None:
        if self._started is None:
            return
        now = self._clock()
        self._recent.append((now, self._wall(), now - self._started))
        self._started = None
        self._forget(now)

    def recent_max_s(self) -> float:
        self._forget(self._clock())
        return max((duration for _, _, duration in self._recent), default=0.0)

    def recent_longest(self, count: int = RECENT_STEPS) -> tuple[tuple[float, float], ...]:
        """The ``count`` longest recent steps as ``(ended at, wall clock; seconds)``, in
        time order."""
        self._forget(self._clock())
        longest = sorted(self._recent, key=lambda step: step[2], reverse=True)[:count]
        return tuple((wall, duration) for _, wall, duration in sorted(longest))

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()
