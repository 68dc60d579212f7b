"""Attention statistics for a replica without a model: synthetic, or replayed from a real run.

The vToken worker returns, per scored request and step, the statistics its policy asked
for (``ScoreNeeds``), aligned with the request's live tokens in slot order
(``StepAttention``; ``workers/worker_side.py``). A simulated replica has no queries or
keys, so an ``AttentionSource`` stands in:

- ``SyntheticAttention``: each token gets a fixed weight drawn once from a log-normal
  (seeded by the request id and the token's logical id, so repacks and replicas agree),
  times a sink boost for the first ``num_sinks`` tokens and a recency boost; every query
  row is those weights normalised over the live tokens. Heavy hitters, sinks and recency
  are the structure H2O-like policies react to; the decisions are plausible, not the
  model's.
- ``ReplayedAttention``: the ``StepScores`` a real engine returned, recorded per step
  (``record_scores``) and keyed by the order requests were added, replayed step by step.
  With the same requests, the same schedule follows, so every decision is the real one.

Sampled tokens (``token``) are the same for both: deterministic ids, since a fixed
``max_tokens`` with ``ignore_eos`` makes the schedule independent of the token values
(without a prefix cache shared by generated text).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from vtoken.policy import ScoreNeeds, StepAttention
from workers.messages import StepScores
from workers.scheduler_side import VTokenScheduler


class AttentionSource(Protocol):
    def statistics(
        self,
        request_id: str,
        state: VTokenScheduler,
        needs: ScoreNeeds,
        num_live: int,
        query_len: int,
        step: int,
    ) -> StepAttention: ...

    def token(self, request_id: str, position: int) -> int: ...


def _token(request_id: str, position: int) -> int:
    return (zlib.crc32(request_id.encode()) + 31 * position) % 30_000 + 1


@dataclass(slots=True)
class SyntheticAttention:
    """Log-normal token weights with sinks and recency (module docstring).

    ``sigma``: the log-normal's spread (1.5 puts about half the mass on a tenth of the
    tokens); ``recent_boost``: the weight multiplier of the newest token, decaying over
    ``recent_scale`` tokens; ``num_layers`` x ``num_heads``: the shape of per-head
    statistics.
    """

    seed: int = 0
    sigma: float = 1.5
    num_sinks: int = 4
    sink_boost: float = 20.0
    recent_boost: float = 5.0
    recent_scale: float = 64.0
    num_layers: int = 1
    num_heads: int = 1
    _weights: dict[str, np.ndarray] = field(default_factory=dict)

    def _base(self, request_id: str, size: int) -> np.ndarray:
        known = self._weights.get(request_id)
        if known is None or known.size < size:
            capacity = max(size, 2 * (known.size if known is not None else 1024))
            rng = np.random.default_rng([self.seed, zlib.crc32(request_id.encode())])
            known = np.exp(self.sigma * rng.standard_normal(capacity))
            known[: self.num_sinks] *= self.sink_boost
            self._weights[request_id] = known
        return known[:size]

    def statistics(
        self,
        request_id: str,
        state: VTokenScheduler,
        needs: ScoreNeeds,
        num_live: int,
        query_len: int,
        step: int,
    ) -> StepAttention:
        table = state.manager.requests[request_id].table
        logical = table.live_logical_ids()
        assert logical.size == num_live, "statistics must align with the live tokens"
        newest = table.num_logical - 1
        weights = self._base(request_id, table.num_logical)[logical]
        weights = weights * (
            1.0 + self.recent_boost * np.exp(-(newest - logical) / self.recent_scale)
        )
        row = (weights / weights.sum()).astype(np.float32)
        attention = StepAttention()
        if needs.step_scores or not (needs.query_window or needs.per_head):
            attention.step_scores = row * np.float32(query_len)
        if needs.query_window:
            attention.window_rows = np.tile(row, (min(needs.query_window, query_len), 1))
        if needs.per_head:
            rows = min(needs.query_window or query_len, query_len)
            attention.head_scores = np.broadcast_to(
                row * np.float32(rows), (self.num_layers, self.num_heads, num_live)
            ).copy()
        return attention

    def token(self, request_id: str, position: int) -> int:
        return _token(request_id, position)


def external_id(request_id: str) -> str:
    """The id a request was added with: vLLM's front end appends ``-<8 characters>``."""
    head, _, tail = request_id.rpartition("-")
    return head if head and len(tail) == 8 else request_id


@dataclass(slots=True)
class ReplayedAttention:
    """Statistics recorded from a real engine, replayed: ``steps[k]`` maps the id a request
    was added with to its ``StepAttention`` at the engine's step ``k`` (steps counted from
    the engine's first, as ``ExactReplica.num_steps``). A step asking for statistics the
    recording lacks, or for another number of live tokens, raises ``KeyError``: the runs
    diverged."""

    steps: list[dict[str, StepAttention]]

    def statistics(
        self,
        request_id: str,
        state: VTokenScheduler,
        needs: ScoreNeeds,
        num_live: int,
        query_len: int,
        step: int,
    ) -> StepAttention:
        if step >= len(self.steps) or request_id not in self.steps[step]:
            raise KeyError(f"no recorded statistics for request {request_id} at step {step}")
        attention = self.steps[step][request_id]
        for values in (attention.step_scores, attention.window_rows, attention.head_scores):
            if values is not None and values.shape[-1] != num_live:
                raise KeyError(
                    f"request {request_id} at step {step}: recorded {values.shape[-1]} live"
                    f" tokens, the simulation holds {num_live}"
                )
        return attention

    def token(self, request_id: str, position: int) -> int:
        return _token(request_id, position)


@contextmanager
def recording_scores() -> Iterator[list[list[dict[str, StepAttention]]]]:
    """While open, every vToken engine built in this process records the attention
    statistics its scheduler receives at each step (``VTokenScheduler.after_step``, called
    once per step), keyed by the ids requests were added with. Yields one list of steps
    per engine, in the order the engines took their first step."""
    engines: list[list[dict[str, StepAttention]]] = []
    by_state: dict[int, list[dict[str, StepAttention]]] = {}
    original = VTokenScheduler.after_step

    def after_step(self: VTokenScheduler, *args: Any, **kwargs: Any) -> Any:
        scores: StepScores | None = kwargs.get("scores", args[2] if len(args) > 2 else None)
        steps = by_state.get(id(self))
        if steps is None:
            steps = by_state[id(self)] = []
            engines.append(steps)
        attention = scores.attention if scores is not None else {}
        steps.append({external_id(r): a for r, a in attention.items()})
        return original(self, *args, **kwargs)

    VTokenScheduler.after_step = after_step  # type: ignore[method-assign]
    try:
        yield engines
    finally:
        VTokenScheduler.after_step = original  # type: ignore[method-assign]
