"""Admission at the ingress, with a wait in the fair queue instead of an immediate 429.

:meth:`QueuedAdmission.admit` asks admission once. A request that its tenant's limits or
the cluster cannot admit now (:data:`controlplane.fair_queue.QUEUEABLE_REASONS`) takes a
ticket in its tenant's queue and asks again every ``queue_poll_s`` with it, in the order
:mod:`controlplane.fair_queue` keeps between ingresses. Past the tenant's
``max_queue_depth`` (at joining) or ``max_queue_wait_s`` it is today's 429, with the
``Retry-After`` admission computes (a ticket whose lease lapsed while its ingress still
polls joins again at the back of its queue: a late poll loses no request); a request
that can never fit is a 400 at once, and a prompt-token rate throttle a 429 at once. A
client that leaves while queued takes its ticket with it (the leave is shielded from the
cancellation; so is the enqueue, whose ticket is taken away once it is in); an admission
that completes after its caller was cancelled is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from opentelemetry import trace

from controlplane import telemetry
from controlplane.admission import Admission, AdmissionDecision, AdmissionOutcome, Reservation
from controlplane.fair_queue import QUEUEABLE_REASONS, Enqueued, FairQueue
from controlplane.metrics import IngressMetrics
from controlplane.models import TenantQuota
from controlplane.otel_metrics import RequestMetrics
from controlplane.releases import Releaser
from serving.errors import HTTPError, redis_or_503
from serving.stream_progress import TokenPace
from serving.tenant_gate import throttled

QUEUE_WAIT_HEADER = "X-VToken-Queue-Wait"
"""Response header of an answer whose request waited in its tenant's queue: the seconds
it waited (absent when it was admitted without queueing)."""


@dataclass(frozen=True, slots=True)
class AdmitAsk:
    """One request's admission: its tenant, id (also its ticket) and sizes."""

    quota: TenantQuota
    request_id: str
    prompt_tokens: int
    max_tokens: int
    n: int = 1


class QueuedAdmission:
    """Admission with the fair queue, for one ingress; ``waiting`` is what this ingress
    holds queued (tenant -> ticket -> ``time.monotonic()`` when it joined): its metrics' view."""

    def __init__(
        self,
        admission: Admission,
        queue: FairQueue,
        releaser: Releaser,
        metrics: IngressMetrics,
        request_metrics: RequestMetrics,
        pace: TokenPace,
        first_token: TokenPace,
    ) -> None:
        self.admission, self.queue, self.releaser = admission, queue, releaser
        self.metrics, self.request_metrics = metrics, request_metrics
        self.pace, self.first_token = pace, first_token
        self.waiting: dict[str, dict[str, float]] = {}

    async def admit(self, ask: AdmitAsk, span: trace.Span) -> Reservation:
        """The request's KV reservation, after a wait in the queue if it must; 429 with
        ``Retry-After`` past the queue's bounds, 400 when it can never fit."""
        return (await self.admit_waited(ask, span))[0]

    async def admit_waited(
        self, ask: AdmitAsk, span: trace.Span
    ) -> tuple[Reservation, float | None]:
        """:meth:`admit`, and the seconds the request waited in the queue (``None`` when
        it never joined it)."""
        decision, waited_s = await self._ask(ask, ""), None
        if decision.outcome is AdmissionOutcome.THROTTLED and self._may_queue(ask, decision):
            decision, waited_s = await self._wait(ask, decision, span)
        return await self._answer(ask, decision, waited_s is not None), waited_s

    @staticmethod
    def _may_queue(ask: AdmitAsk, decision: AdmissionDecision) -> bool:
        quota = ask.quota
        return (
            decision.reason in QUEUEABLE_REASONS
            and quota.max_queue_depth > 0
            and quota.max_queue_wait_s > 0
        )

    async def _wait(
        self, ask: AdmitAsk, decision: AdmissionDecision, span: trace.Span
    ) -> tuple[AdmissionDecision, float | None]:
        """Queue ``ask`` and poll until admitted, refused for good, or out of time; the
        last decision (throttled when it never got in) and the seconds it waited queued
        (``None``: the queue was full, the decision is the first ask's)."""
        quota, ticket = ask.quota, ask.request_id
        # Shielded like an admission: a client that leaves while the ticket is being taken
        # must not leave it queued (it would hold its tenant's turn until its lease lapses).
        enqueue = asyncio.ensure_future(self.queue.enqueue(quota, ticket))
        try:
            joined = await redis_or_503(asyncio.shield(enqueue))
        except asyncio.CancelledError:
            enqueue.add_done_callback(lambda done: self._leave_if_queued(done, quota, ticket))
            raise
        span.set_attribute(telemetry.ATTR_QUEUE_DEPTH, joined.depth)
        if not joined.queued:
            span.set_attribute(telemetry.ATTR_QUEUE_OUTCOME, "full")
            return decision, None
        started = time.monotonic()
        deadline = started + quota.max_queue_wait_s
        outcome = "timeout"
        with self._holding(quota.tenant_id, ticket, started):
            try:
                while (left := deadline - time.monotonic()) > 0:
                    await asyncio.sleep(min(self._pause_s(decision), left))
                    decision = await self._ask(ask, ticket)
                    if decision.outcome is not AdmissionOutcome.THROTTLED:
                        outcome = decision.outcome.value
                        break
                    if decision.reason == "ticket_lost" and not await self._rejoin(ask):
                        outcome = "lost"
                        break
            except BaseException:  # the client left (or Redis failed): no ticket stays
                outcome = "left"
                self._leave_soon(quota.tenant_id, ticket)
                raise
            finally:
                waited_s = time.monotonic() - started
                span.set_attribute(telemetry.ATTR_QUEUE_WAIT_S, waited_s)
                span.set_attribute(telemetry.ATTR_QUEUE_OUTCOME, outcome)
                self.metrics.queue_wait(quota.tenant_id, waited_s)
                self.request_metrics.queue_wait(quota.tenant_id, waited_s)
        if not decision.admitted:
            await redis_or_503(self.queue.leave(quota.tenant_id, ticket))
        return decision, waited_s

    async def _rejoin(self, ask: AdmitAsk) -> bool:
        """Take a new ticket for a request whose lease lapsed while this ingress still
        waits for it (its poll came a whole lease late: a starved event loop, a Redis
        failover): the request is not lost, it queues again at the back of its tenant's
        queue. False when the queue is full now (then it is the 429 of a full queue)."""
        rejoined = await redis_or_503(self.queue.enqueue(ask.quota, ask.request_id))
        return rejoined.queued

    def _pause_s(self, decision: AdmissionDecision) -> float:
        """Until the next poll: ``queue_poll_s``, times the tickets ahead of this one when
        its tenant's earlier tickets hold it back (so a tenant's queue of ``d`` polls
        about ``1 + ln d`` times per period, not ``d``), within a third of a lease."""
        config = self.admission.config
        ahead = decision.queue_position if decision.reason == "queued" else 0
        return min(config.queue_poll_s * max(1, ahead), config.queue_ticket_ttl_s / 3)

    @contextlib.contextmanager
    def _holding(self, tenant_id: str, ticket: str, started: float) -> Iterator[None]:
        self.waiting.setdefault(tenant_id, {})[ticket] = started
        try:
            yield
        finally:
            held = self.waiting[tenant_id]
            del held[ticket]
            if not held:
                del self.waiting[tenant_id]

    def _leave_if_queued(
        self, enqueue: asyncio.Future[Enqueued], quota: TenantQuota, ticket: str
    ) -> None:
        """Done callback of an enqueue whose caller was cancelled."""
        if not enqueue.cancelled() and enqueue.exception() is None and enqueue.result().queued:
            self._leave_soon(quota.tenant_id, ticket)

    def _leave_soon(self, tenant_id: str, ticket: str) -> None:
        """Leave the queue in the background (the caller is being cancelled); a ticket
        Redis cannot take away lapses after ``queue_ticket_ttl_s``."""
        task = asyncio.ensure_future(self.queue.leave(tenant_id, ticket))
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _ask(self, ask: AdmitAsk, ticket: str) -> AdmissionDecision:
        """One admission call, cancellation-safe: it runs as its own task, so a caller
        cancelled while it runs never leaves a reservation behind (released when done).
        Only a first ask (no ticket) estimates a budget throttle's Retry-After; polls
        leave it to :meth:`_answer`."""
        call = asyncio.ensure_future(
            self.admission.admit(
                ask.quota,
                ask.request_id,
                ask.prompt_tokens,
                ask.max_tokens,
                self.pace.seconds_per_token if not ticket else None,
                n=ask.n,
                seconds_to_first_token=self.first_token.seconds_per_token,
                ticket=ticket,
            )
        )
        try:
            return await redis_or_503(asyncio.shield(call))
        except asyncio.CancelledError:
            call.add_done_callback(self._release_if_admitted)
            raise

    async def _answer(
        self, ask: AdmitAsk, decision: AdmissionDecision, polled: bool
    ) -> Reservation:
        tenant_id = ask.quota.tenant_id
        self.metrics.admission(tenant_id, decision.outcome.value)
        self.request_metrics.admission(tenant_id, decision.outcome.value)
        if decision.outcome is AdmissionOutcome.THROTTLED:
            retry_after_s = decision.retry_after_s
            # When its budget has room (a poll or a queued refusal did not estimate it).
            if decision.reason == "queued" or (polled and decision.reason == "kv_budget"):
                blocks = self.admission.bounds(
                    ask.quota, ask.prompt_tokens, ask.max_tokens, ask.n
                ).peak
                retry_after_s = await redis_or_503(
                    self.admission.kv_retry_after_s(
                        ask.quota,
                        blocks,
                        self.pace.seconds_per_token,
                        self.first_token.seconds_per_token,
                    )
                )
            retry = max(1, math.ceil(retry_after_s))  # never before it fits
            raise throttled(tenant_id, decision.reason, retry)
        if decision.reservation is None:
            raise HTTPError(400, self._rejection(ask, decision.reason), "invalid_request")
        return decision.reservation

    def _rejection(self, ask: AdmitAsk, reason: str) -> str:
        """Why a request can never be admitted as asked, with the limit it exceeds."""
        quota = ask.quota
        peak = self.admission.bounds(quota, ask.prompt_tokens, ask.max_tokens, ask.n).peak
        if reason == "exceeds_cluster_capacity":
            return (
                f"the request needs {peak} KV blocks at its peak, more than the cluster's "
                f"capacity of {self.admission.config.cluster_kv_blocks} blocks: ask for "
                "fewer prompt or output tokens, or fewer choices (n)"
            )
        if reason == "exceeds_budget":
            return (
                f"the request needs {peak} KV blocks at its peak, more than tenant "
                f"{quota.tenant_id!r}'s KV budget of {quota.kv_budget_blocks} blocks: ask "
                "for fewer prompt or output tokens, or fewer choices (n)"
            )
        if reason == "exceeds_max_concurrent_requests":
            limit = quota.max_concurrent_requests
            return (
                f"the request asks for {ask.n} choices (n), more than tenant "
                f"{quota.tenant_id!r} may run at once"
                + ("" if limit is None else f" (max_concurrent_requests: {limit})")
            )
        return f"request cannot be admitted: {reason}"

    def _release_if_admitted(self, call: asyncio.Future[AdmissionDecision]) -> None:
        """Done callback of an admission whose caller was cancelled."""
        if call.cancelled() or call.exception() is not None:
            return
        reservation = call.result().reservation
        if reservation is not None:
            self.releaser.release_soon(reservation)

    def waiting_now(self, now: float) -> Iterator[tuple[str, int, float]]:
        """``(tenant, requests this ingress holds queued, oldest wait in s)`` at
        ``time.monotonic()`` ``now``; safe from another thread (the metrics exporter's):
        it reads copies."""
        for tenant_id, tickets in self.waiting.copy().items():
            joined = list(tickets.copy().values())
            if joined:
                yield tenant_id, len(joined), max(0.0, now - min(joined))
