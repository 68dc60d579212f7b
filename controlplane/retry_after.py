"""When a throttled request will fit: a tenant's held reservations as arrays, walked in
the order they are expected to free their blocks (`Admission.kv_retry_after_s`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HELD_SCHEDULE_TTL_S = 1.0
HELD_SCHEDULE_MIN_AGE_S = 0.1
"""A tenant's parsed reservations answer Retry-After for HELD_SCHEDULE_TTL_S while their
total holds, and for HELD_SCHEDULE_MIN_AGE_S whatever changed: a flood of 429s reads them
at most ten times a second per tenant, one read at a time, not once per 429 (388 ms per
429 at 20k reservations, on the event loop, when each one read and walked them all). The
committed KV is read fresh each time; only the expected frees may be that old."""
MAX_CACHED_SCHEDULES = 1024
PARSE_INLINE_MAX = 1000  # fewer reservations parse faster than a hop to a thread


@dataclass(frozen=True, slots=True)
class HeldSchedule:
    """A tenant's held reservations as arrays, one entry per request: admitted at
    ``admitted_s`` (Redis's clock), answering ``max_tokens``, holding ``held`` blocks now
    and ``steady`` once settled; read at ``read_at_s``, when their total was ``total``."""

    read_at_s: float
    total: int
    admitted_s: np.ndarray  # [n], float64
    max_tokens: np.ndarray  # [n], float64
    held: np.ndarray  # [n], int64
    steady: np.ndarray  # [n], int64

    def current(self, total: int, now_s: float) -> bool:
        age_s = now_s - self.read_at_s
        return age_s < HELD_SCHEDULE_MIN_AGE_S or (
            total == self.total and age_s < HELD_SCHEDULE_TTL_S
        )

    @classmethod
    def parse(
        cls, held: dict[str, str], starts: dict[str, str], now_s: float, total: int
    ) -> HeldSchedule:
        """From the reservations hash and their starts (``admitted_ms max_tokens prompt
        steady``; a request without one counts as admitted now, ending at once)."""
        rows = []
        for request_id, value in held.items():
            start = (starts.get(request_id) or f"{now_s * 1000} 0").split()
            steady = int(start[3]) if len(start) > 3 else int(value)
            rows.append((float(start[0]) / 1000, float(start[1]), int(value), steady))
        columns = np.array(rows, dtype=np.float64).reshape(-1, 4)
        return cls(
            now_s,
            total,
            columns[:, 0],
            columns[:, 1],
            columns[:, 2].astype(np.int64),
            columns[:, 3].astype(np.int64),
        )

    def room_at_s(
        self, excess: int, seconds_per_token: float, seconds_to_first_token: float | None
    ) -> float | None:
        """When the held requests will have freed ``excess`` blocks: each frees what it
        holds above its steady bound at its first token (``seconds_to_first_token`` after
        admission; without it the first token is taken at admission and only ends count)
        and the rest when it ends, ``max_tokens * seconds_per_token`` later. ``None`` when
        all of them together free less."""
        first_token_s = self.admitted_s + (seconds_to_first_token or 0.0)
        ends_s = first_token_s + self.max_tokens * seconds_per_token
        if seconds_to_first_token is None:
            times, freed = ends_s, self.held
        else:
            settles = self.held > self.steady
            times = np.concatenate([first_token_s[settles], ends_s])
            freed = np.concatenate(
                [(self.held - self.steady)[settles], np.minimum(self.held, self.steady)]
            )
        order = np.argsort(times, kind="stable")
        index = int(np.searchsorted(np.cumsum(freed[order]), excess))
        return float(times[order][index]) if index < len(times) else None
