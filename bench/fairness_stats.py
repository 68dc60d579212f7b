"""`vtoken bench fairness`'s arithmetic on what its clients saw: per-request records in,
per-tenant rows and Jain's index of weighted service out (no I/O; ``bench/fairness.py``
drives the stack and makes the records).

Service is what the engines' fair order counts (``workers/fair_share.py``): a request's
prompt tokens at ``fair_prompt_cost`` each and its output tokens at ``fair_output_cost``
each, divided by its tenant's weight. From the client's side a request's prompt is served
when its first token arrives, and its output tokens as the stream's chunks carrying text
arrive (``chunk_times_s``: the completion's tokens shared evenly among its chunks; a
record without chunk times spreads them evenly from its first token to its last);
service is summed per window of ``WINDOW_S`` seconds from the start of the load.

Jain's index of the backlogged tenants' weighted service, ``(sum x)^2 / (n * sum x^2)``
(1: equal; ``1/n``: one tenant got everything), is computed per window after the warm-up
and up to the end of the arrivals (afterwards the tenants are no longer backlogged);
``jain_index`` is the smallest of those windows' values (every window must meet the
target), ``jain_mean`` their mean. A judged window in which no backlogged tenant was
served at all is no evidence of fairness: it counts as index 0 and is reported in
``windows_unknown``.

TTFT percentiles count a request never served (throttled until the arrivals ended; a
failed one is counted in ``requests_failed``) as an infinite TTFT, so a light tenant's throttled
requests cannot vanish from its p99 (``None`` in the JSON where the percentile is
infinite, with ``ttft_unserved`` the count). A request's client-side wait
(``client_wait_s``) runs from its first send to its admission (the response's headers),
over all its attempts, 429-then-retry included; ``waits_past_max`` counts the waits over
the tenant's ``max_queue_wait_s``, a request never admitted included. ``requests`` lists
every request's outcome (one row each, ``REQUEST_FIELDS``), to find out why a figure is
what it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from bench.common import percentile

WINDOW_S = 10.0
Outcome = Literal["ok", "throttled", "failed"]


@dataclass(frozen=True, slots=True)
class Record:
    """One request as its client saw it; times in seconds from the start of the load.
    ``sent_s``: its first attempt; ``queue_wait_s``: what the ingress said it waited in
    its tenant's queue (``None``: it never queued); ``first_token_s`` and ``done_s``: when
    its first and last tokens arrived (``None`` unless it was served)."""

    tenant: str
    outcome: Outcome
    sent_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_s: float | None = None
    done_s: float | None = None
    queue_wait_s: float | None = None
    throttle_responses: int = 0
    error: str = ""
    admitted_s: float | None = None
    chunk_times_s: tuple[float, ...] = ()

    @property
    def client_wait_s(self) -> float:
        """From its first send to its admission, over all attempts (``inf``: never)."""
        return math.inf if self.admitted_s is None else self.admitted_s - self.sent_s

    @property
    def ttft_or_inf_s(self) -> float:
        """``ttft_s``, or ``inf`` for a request never served."""
        ttft = self.ttft_s
        return math.inf if ttft is None or self.outcome != "ok" else ttft

    @property
    def ttft_s(self) -> float | None:
        """From its first attempt (429 answers, retries and queueing included)."""
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (``None`` with fewer than two)."""
        if self.first_token_s is None or self.done_s is None or self.completion_tokens < 2:
            return None
        return (self.done_s - self.first_token_s) / (self.completion_tokens - 1)


@dataclass(frozen=True, slots=True)
class Costs:
    """The engines' service per prompt and per output token (``VTokenConfig``'s
    ``fair_prompt_cost`` and ``fair_output_cost``)."""

    prompt: float = 1.0
    output: float = 2.0


def service_per_window(
    records: Sequence[Record], weight: float, costs: Costs, num_windows: int
) -> list[float]:
    """Weighted service of ``records`` (one tenant's) in each of the first ``num_windows``
    windows (module docstring); what falls after them is not counted."""
    windows = [0.0] * num_windows
    horizon = num_windows * WINDOW_S

    def add(at_s: float, amount: float) -> None:
        index = math.floor(at_s / WINDOW_S)
        if 0 <= index < num_windows:
            windows[index] += amount

    for record in records:
        if record.outcome != "ok" or record.first_token_s is None or record.done_s is None:
            continue
        first, done = record.first_token_s, max(record.done_s, record.first_token_s)
        add(first, record.prompt_tokens * costs.prompt)
        if record.completion_tokens <= 0:
            continue
        per_token = costs.output
        if record.chunk_times_s:  # credited as the chunks arrived
            share = record.completion_tokens * per_token / len(record.chunk_times_s)
            for at_s in record.chunk_times_s:
                add(at_s, share)
            continue
        if done == first or record.completion_tokens == 1:
            add(first, record.completion_tokens * per_token)
            continue
        # Output tokens evenly over [first, done]: split that span at window edges.
        rate = record.completion_tokens * per_token / (done - first)
        start = first
        while start < min(done, horizon):
            edge = min(done, (math.floor(start / WINDOW_S) + 1) * WINDOW_S)
            add(start, rate * (edge - start))
            start = edge
    return [round(value / weight, 2) for value in windows]


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index of ``values`` (``None`` when all are zero or none given)."""
    total, squares = sum(values), sum(v * v for v in values)
    if not values or squares == 0:
        return None
    return total * total / (len(values) * squares)


def judged_windows(duration_s: float, warmup_s: float) -> range:
    """Indexes of the windows wholly after the warm-up and within the arrivals."""
    return range(math.ceil(warmup_s / WINDOW_S), math.floor(duration_s / WINDOW_S))


def tenant_row(
    tenant_id: str,
    weight: float,
    records: Sequence[Record],
    costs: Costs,
    num_windows: int,
    max_queue_wait_s: float | None,
) -> dict[str, Any]:
    """One tenant's row of the JSON (``records``: its own)."""
    ok = [r for r in records if r.outcome == "ok"]
    waits = [r.queue_wait_s for r in records if r.queue_wait_s is not None]
    client_waits = [r.client_wait_s for r in records if r.outcome != "failed"]
    ttfts = [r.ttft_or_inf_s for r in records if r.outcome != "failed"]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    return {
        "id": tenant_id,
        "weight": weight,
        "service_per_window": service_per_window(records, weight, costs, num_windows),
        "requests": len(records),
        "requests_ok": len(ok),
        "requests_queued": len(waits),
        "requests_throttled": sum(r.outcome == "throttled" for r in records),
        "requests_failed": sum(r.outcome == "failed" for r in records),
        "throttle_responses": sum(r.throttle_responses for r in records),
        "output_tokens": sum(r.completion_tokens for r in ok),
        "ttft_p50_s": finite(percentile(ttfts, 0.5)),
        "ttft_p99_s": finite(percentile(ttfts, 0.99)),
        "ttft_unserved": sum(math.isinf(t) for t in ttfts),
        "tpot_p50_s": percentile(tpots, 0.5),
        "tpot_p99_s": percentile(tpots, 0.99),
        "queue_wait_p99_s": percentile(waits, 0.99),
        "queue_wait_max_s": round(max(waits), 3) if waits else None,
        "client_wait_max_s": finite(round(max(client_waits), 3) if client_waits else None),
        "max_queue_wait_s": max_queue_wait_s,
        "waits_past_max": sum(
            1 for w in client_waits if max_queue_wait_s is not None and w > max_queue_wait_s
        ),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def mode_summary(
    records: Sequence[Record],
    weights: dict[str, float],
    backlogged: Sequence[str],
    duration_s: float,
    warmup_s: float,
    costs: Costs,
    max_queue_wait_s: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """One mode's figures: Jain's index of the ``backlogged`` tenants' weighted service
    per judged window (minimum and mean), failures, and a row per tenant of ``weights``."""
    num_windows = max(1, math.ceil(duration_s / WINDOW_S))
    waits = max_queue_wait_s or {}
    rows = [
        tenant_row(
            tenant,
            weight,
            [r for r in records if r.tenant == tenant],
            costs,
            num_windows,
            waits.get(tenant),
        )
        for tenant, weight in weights.items()
    ]
    service = {row["id"]: row["service_per_window"] for row in rows}
    per_window = [
        jain([service[tenant][index] for tenant in backlogged])
        for index in judged_windows(duration_s, warmup_s)
    ]
    # a window where no backlogged tenant was served counts as 0, not as skipped
    judged = [0.0 if value is None else value for value in per_window]
    return {
        "jain_index": round(min(judged), 4) if judged else None,
        "jain_index_of": "the minimum over the windows after the warm-up (unserved: 0)",
        "jain_mean": round(sum(judged) / len(judged), 4) if judged else None,
        "jain_per_window": [None if v is None else round(v, 4) for v in per_window],
        "windows_unknown": sum(value is None for value in per_window),
        "backlogged": list(backlogged),
        "window_s": WINDOW_S,
        "warmup_s": warmup_s,
        "duration_s": duration_s,
        "failed": sum(r.outcome == "failed" for r in records),
        "waits_past_max": sum(row["waits_past_max"] for row in rows),
        "tenants": rows,
        "requests_fields": list(REQUEST_FIELDS),
        "requests": [request_row(r) for r in sorted(records, key=lambda r: r.sent_s)],
    }


REQUEST_FIELDS = (
    "tenant", "outcome", "sent_s", "first_token_s", "done_s", "queue_wait_s",
    "prompt_tokens", "completion_tokens", "throttle_responses",
)  # fmt: skip


def finite(value: float | None) -> float | None:
    """``value``, or ``None`` where it is infinite (JSON has no infinity)."""
    return None if value is None or math.isinf(value) else value


def target(figure: float | None, bound: float, at_most: bool = True) -> dict[str, Any]:
    """A target's judgement: the figure, its bound, and whether it is met (an unknown or
    infinite figure never is)."""
    met = figure is not None and (figure <= bound if at_most else figure >= bound)
    return {"figure": figure, "bound": bound, "met": met}


JAIN_BOUND = 0.95  # every judged window's index of the backlogged tenants' service
B_TTFT_X_SOLO = 1.25  # B's TTFT p99 in the mix: at most this times its p99 alone


def mode_targets(result: dict[str, Any], solo: dict[str, Any] | None) -> dict[str, Any]:
    """A mode's targets judged explicitly: Jain's index (``JAIN_BOUND``), no wait past a
    tenant's ``max_queue_wait_s``, and B's TTFT p99 (a request never served: infinite)
    within ``B_TTFT_X_SOLO`` x its p99 alone (unknown without a solo run: not met)."""
    b_row = next((row for row in result["tenants"] if row["id"] == "B"), None)
    solo_p99 = solo.get("ttft_p99_s") if solo else None
    b_p99 = b_row["ttft_p99_s"] if b_row and not b_row["ttft_unserved"] else None
    return {
        "jain_index": target(result["jain_index"], JAIN_BOUND, at_most=False),
        "waits_past_max": target(result["waits_past_max"], 0),
        "b_ttft_p99_s": target(b_p99, B_TTFT_X_SOLO * solo_p99 if solo_p99 else 0.0),
    }


def request_row(record: Record) -> list[Any]:
    """One request's outcome as a compact row (``REQUEST_FIELDS``; times rounded)."""
    row = [getattr(record, name) for name in REQUEST_FIELDS]
    return [round(v, 3) if isinstance(v, float) else v for v in row]


def throughput(records: Sequence[Record]) -> dict[str, Any]:
    """Output tokens per second of ``records`` from the first send to the last token."""
    ok = [r for r in records if r.outcome == "ok" and r.done_s is not None]
    if not ok:
        return {"requests_ok": 0, "output_tokens": 0, "elapsed_s": 0.0, "tokens_per_s": None}
    tokens = sum(r.completion_tokens for r in ok)
    elapsed = max(r.done_s for r in ok if r.done_s is not None) - min(r.sent_s for r in records)
    return {
        "requests_ok": len(ok),
        "output_tokens": tokens,
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 else None,
        "failed": sum(r.outcome == "failed" for r in records),
    }
