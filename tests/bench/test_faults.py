"""`vtoken bench faults`: how answers are classified and counted (no stack needed)."""

from __future__ import annotations

import json

import pytest

from bench.faults import (
    FAILURES,
    Outcome,
    Record,
    classify,
    recovery_s,
    summarize,
    targets_met,
)

DONE = "data: [DONE]\n\n"


def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


CHUNK = event({"choices": [{"text": "a", "finish_reason": None}]})
LAST = event({"choices": [{"text": "b", "finish_reason": "length"}]})
ERROR = event({"error": {"message": "the engine replica failed", "type": "server_error"}})
RETRY = {"Retry-After": "1"}


@pytest.mark.parametrize(
    ("status", "stream", "text", "headers", "outcome"),
    [
        (200, True, CHUNK + LAST + DONE, {}, Outcome.OK),
        (200, True, CHUNK + ERROR + DONE, {}, Outcome.ERROR_EVENT),
        (200, True, CHUNK + ERROR, {}, Outcome.ERROR_EVENT),
        (200, True, CHUNK + LAST, {}, Outcome.SILENT_CUT),
        (200, True, "", {}, Outcome.SILENT_CUT),
        (200, False, json.dumps({"choices": [{"finish_reason": "stop"}]}), {}, Outcome.OK),
        (200, False, json.dumps({"choices": [{"finish_reason": None}]}), {}, Outcome.SILENT_CUT),
        (200, False, '{"choices": [{"fin', {}, Outcome.SILENT_CUT),
        (429, False, json.dumps({"error": {}}), RETRY, Outcome.THROTTLED),
        (429, True, json.dumps({"error": {}}), RETRY, Outcome.THROTTLED),
        (503, False, json.dumps({"error": {"type": "server_error"}}), RETRY, Outcome.UNAVAILABLE),
        (503, True, json.dumps({"error": {}}), {"retry-after": "2"}, Outcome.UNAVAILABLE),
        (503, False, json.dumps({"error": {}}), {}, Outcome.FAILED),  # no Retry-After
        (503, False, "Service Unavailable", RETRY, Outcome.FAILED),  # not an OpenAI body
        (500, False, "Internal Server Error", {}, Outcome.FAILED),
        (400, False, json.dumps({"error": {}}), {}, Outcome.FAILED),
    ],
)
def test_classify(status, stream, text, headers, outcome):
    assert classify(status, stream, text, headers) is outcome


def records(*rows: tuple[float, float, Outcome]) -> list[Record]:
    return [Record(started, ended, outcome, stream=False) for started, ended, outcome in rows]


def test_summarize_counts_every_request_once():
    rows = records(
        (0.0, 1.0, Outcome.OK),
        (0.5, 4.0, Outcome.ERROR_EVENT),
        (1.0, 4.1, Outcome.UNAVAILABLE),
        (1.5, 4.2, Outcome.SILENT_CUT),
        (2.0, 4.3, Outcome.FAILED),
        (3.0, 3.5, Outcome.ABORTED),
        (4.5, 5.0, Outcome.OK),
        (4.6, 9.0, Outcome.THROTTLED),
    )
    row = summarize("replica_kill", rows, fault_at=4.0)
    assert row.requests == 8
    assert row.ok == 2
    assert row.failed == 4  # error event, 503, silent cut, other
    assert row.failed_with_error_event == 1
    assert row.failed_503_retry_after == 1
    assert row.silent_cuts == 1
    assert row.failed_other == 1
    assert row.aborted == 1
    assert row.throttled_at_stop == 1
    assert row.recovery_s == 1.0  # the first request sent after 4.3 ended at 5.0
    assert set(FAILURES) == {
        Outcome.ERROR_EVENT,
        Outcome.SILENT_CUT,
        Outcome.UNAVAILABLE,
        Outcome.FAILED,
    }


def test_recovery_counts_from_the_fault_to_the_first_success_after_the_last_failure():
    # Failures before the fault do not count; a success sent before the last failure
    # (a request that was already running) does not end the recovery.
    rows = records(
        (0.0, 1.0, Outcome.FAILED),
        (9.0, 11.0, Outcome.OK),
        (10.0, 12.0, Outcome.UNAVAILABLE),
        (12.5, 13.0, Outcome.OK),
    )
    assert recovery_s(rows, fault_at=10.0) == 3.0
    # Nothing failed: the first success of a request sent after the fault.
    calm = records((9.0, 10.5, Outcome.OK), (10.2, 10.7, Outcome.OK))
    assert recovery_s(calm, fault_at=10.0) == 0.7
    assert recovery_s(records((10.0, 12.0, Outcome.FAILED)), fault_at=10.0) is None
    assert recovery_s(calm, fault_at=None) is None


def row_of(scenario: str, **fields) -> dict:
    base = {
        "scenario": scenario,
        "failed": 0,
        "failed_503_retry_after": 0,
        "silent_cuts": 0,
        "leaked_reservations": 0,
        "leaked_blocks": 0,
        "engine_restarts": 0,
        "recovery_s": 0.5,
    }
    return base | fields


def test_targets():
    assert targets_met(row_of("controller_kill"))
    assert not targets_met(row_of("controller_kill", failed=1))
    assert not targets_met(row_of("client_disconnect", leaked_blocks=2))
    assert not targets_met(row_of("clock_skew", leaked_reservations=1))
    # A killed replica may fail what it was running, and must be back within 30 s.
    assert targets_met(row_of("replica_kill", failed=3, in_flight_on_killed=3, engine_restarts=1))
    assert not targets_met(row_of("replica_kill", failed=4, in_flight_on_killed=3))
    assert not targets_met(row_of("replica_kill", recovery_s=31.0))
    assert not targets_met(row_of("replica_kill", recovery_s=None))
    # Redis away: only 503s with Retry-After, and no engine restarted.
    assert targets_met(row_of("redis_restart", failed=40, failed_503_retry_after=40))
    assert not targets_met(row_of("redis_restart", failed=41, failed_503_retry_after=40))
    assert not targets_met(row_of("redis_oom", engine_restarts=1))
    assert not targets_met(row_of("redis_oom", silent_cuts=1))
    # A leak that could not be measured is not a met target.
    assert not targets_met(row_of("client_disconnect", leaked_blocks=None))
    assert not targets_met(row_of("redis_restart", leaked_reservations=None))
