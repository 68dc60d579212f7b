"""The rule that bounds a queued request's wait, as pure logic: a request expected to wait
past its tenant's ``max_queue_wait_s`` is refused at once or at the poll that finds it,
never held until the maximum (fakes for admission and the queue, an injected clock; the
same rule on a real redis-server: ``test_queued_admission.py`` and
``tests/controlplane/test_fair_queue.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.metrics import NoOpMeter

from controlplane import telemetry
from controlplane.admission import AdmissionConfig, AdmissionDecision, AdmissionOutcome
from controlplane.fair_queue import Enqueued, retry_after_wait_s, sheds
from controlplane.kv_bounds import kv_bounds
from controlplane.metrics import IngressMetrics
from controlplane.models import TenantQuota
from controlplane.otel_metrics import RequestMetrics
from controlplane.releases import Releaser
from serving.errors import HTTPError
from serving.queued_admission import AdmitAsk, QueuedAdmission
from serving.stream_progress import TokenPace
from tests.controlplane.builders import quota

MAX_WAIT_S = 60.0
POLL_S = 5.0  # fake seconds each poll takes


def test_a_ticket_is_shed_only_when_its_wait_so_far_and_expected_pass_the_maximum() -> None:
    assert not sheds(10.0, 50.0, MAX_WAIT_S)  # exactly the maximum: it may still make it
    assert sheds(10.0, 50.001, MAX_WAIT_S)
    assert sheds(0.0, 61.0, MAX_WAIT_S)
    assert not sheds(59.0, 0.5, MAX_WAIT_S)
    assert not sheds(59.9, None, MAX_WAIT_S)  # unknown: the maximum decides


def test_retry_after_is_the_expected_wait_past_the_maximum_at_least_a_second() -> None:
    assert retry_after_wait_s(75.0, MAX_WAIT_S) == 15.0
    assert retry_after_wait_s(60.5, MAX_WAIT_S) == 1.0
    assert retry_after_wait_s(None, MAX_WAIT_S) == 1.0  # it would be first: retry soon


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeAdmission:
    """Every ask throttles; a poll takes ``POLL_S`` of the clock and reports the next of
    ``expected`` (a queued ticket's expected wait; ``None``: unknown)."""

    def __init__(self, clock: Clock, expected: list[float | None]) -> None:
        self.config = AdmissionConfig(queue_poll_s=0.001, queue_ticket_ttl_s=0.01)
        self.clock, self.expected, self.asks = clock, expected, 0

    async def admit(self, *_: Any, ticket: str = "", **__: Any) -> AdmissionDecision:
        self.asks += 1
        throttled = AdmissionOutcome.THROTTLED
        if not ticket:
            return AdmissionDecision(throttled, "cluster_full", 1.0, None)
        self.clock.now += POLL_S
        expected = self.expected.pop(0) if self.expected else None
        return AdmissionDecision(throttled, "queued", 1.0, None, 3, expected)

    def bounds(self, *_: Any) -> Any:
        return kv_bounds(100, 100, self.config.block_size, None, None)

    async def kv_retry_after_s(self, *_: Any) -> float:
        return 2.0


class FakeQueue:
    def __init__(self, joined: Enqueued, expected_back_s: float | None) -> None:
        self.joined, self.expected_back_s = joined, expected_back_s
        self.left: list[str] = []

    async def enqueue(self, quota: TenantQuota, ticket: str) -> Enqueued:
        return self.joined

    async def leave(self, tenant_id: str, ticket: str) -> bool:
        self.left.append(ticket)
        return True

    async def expected_wait_s(self, tenant_id: str) -> float | None:
        return self.expected_back_s


class Span:
    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value


async def admit(
    admission: FakeAdmission, queue: FakeQueue, clock: Clock, span: Span
) -> tuple[HTTPError, float | None]:
    admitter = QueuedAdmission(
        admission,  # type: ignore[arg-type]
        queue,  # type: ignore[arg-type]
        Releaser(admission),  # type: ignore[arg-type]
        IngressMetrics(),
        RequestMetrics(NoOpMeter("test")),
        TokenPace(),
        TokenPace(),
        clock=clock,
    )
    ask = AdmitAsk(quota("acme", max_queue_wait_s=MAX_WAIT_S), "r-1", 100, 100)
    with pytest.raises(HTTPError) as refused:
        await admitter.admit_waited(ask, span)  # type: ignore[arg-type]
    return refused.value, span.attributes.get(telemetry.ATTR_QUEUE_WAIT_S)


async def test_a_queued_request_is_refused_at_the_first_poll_that_expects_it_late() -> None:
    clock = Clock()
    # Polls at 5, 10, 15 s: 5 + 50 and 10 + 50 fit 60, 15 + 50 does not.
    admission = FakeAdmission(clock, [50.0, 50.0, 50.0, 10.0])
    queue = FakeQueue(Enqueued(True, 4, 0.0, 40.0), expected_back_s=72.4)
    span = Span()
    refused, waited_s = await admit(admission, queue, clock, span)
    assert refused.status == 429
    # Retry-After: 72.4 - 60, rounded up; and how long it waited before the refusal.
    assert refused.headers == {"Retry-After": "13", "X-VToken-Queue-Wait": "15.000"}
    assert "expected to wait in its queue longer than its max_queue_wait_s" in refused.message
    assert waited_s == pytest.approx(15.0)  # not the 60 s maximum
    assert admission.asks == 1 + 3
    assert queue.left == ["r-1"]  # its ticket left with it
    assert span.attributes[telemetry.ATTR_QUEUE_OUTCOME] == "shed"


async def test_a_request_expected_late_at_joining_is_refused_without_a_wait() -> None:
    clock = Clock()
    admission = FakeAdmission(clock, [])
    queue = FakeQueue(Enqueued(False, 6, 0.0, 75.0, too_long=True), expected_back_s=None)
    span = Span()
    refused, waited_s = await admit(admission, queue, clock, span)
    assert refused.status == 429 and refused.headers == {"Retry-After": "15"}  # no wait
    assert "expected to wait" in refused.message
    assert waited_s is None and clock.now == 1000.0 and admission.asks == 1
    assert queue.left == []  # it never joined
    assert span.attributes[telemetry.ATTR_QUEUE_OUTCOME] == "late"


async def test_without_an_expected_wait_the_maximum_still_decides() -> None:
    """An unknown expected wait (no pace yet, or the ticket is first) is never shed: it is
    refused at the maximum, as before, with the throttle's own reason."""
    clock = Clock()
    admission = FakeAdmission(clock, [])
    queue = FakeQueue(Enqueued(True, 1, 0.0, None), expected_back_s=None)
    span = Span()
    refused, waited_s = await admit(admission, queue, clock, span)
    assert refused.status == 429
    assert "expected to wait" not in refused.message
    assert refused.headers is not None and refused.headers["Retry-After"] == "2"
    assert float(refused.headers["X-VToken-Queue-Wait"]) >= MAX_WAIT_S
    assert waited_s is not None and waited_s >= MAX_WAIT_S
    assert span.attributes[telemetry.ATTR_QUEUE_OUTCOME] == "timeout"
    assert queue.left == ["r-1"]
