"""`vtoken bench fairness`'s statistics on injected request records."""

from __future__ import annotations

import pytest

from bench.fairness_stats import (
    B_TTFT_X_SOLO,
    Costs,
    Record,
    jain,
    judged_windows,
    mode_summary,
    mode_targets,
    service_per_window,
    throughput,
)


def served(tenant: str, first: float, done: float, prompt: int, output: int, **kw) -> Record:
    return Record(tenant, "ok", kw.pop("sent", first - 1.0), prompt, output, first, done, **kw)


def test_a_prompt_counts_at_its_first_token_and_output_evenly_to_its_last() -> None:
    # 100 prompt tokens at 5 s; 11 output tokens from 5 s to 25 s: 22 units of output
    # service over 20 s, 1.1 per second: 5.5 in window 0, 11 in window 1, 5.5 in window 2.
    record = served("a", 5.0, 25.0, prompt=100, output=11)
    assert service_per_window([record], 1.0, Costs(1.0, 2.0), 4) == [105.5, 11.0, 5.5, 0.0]
    # Weight 2 halves it; what falls past the last window is not counted.
    assert service_per_window([record], 2.0, Costs(1.0, 2.0), 2) == [52.75, 5.5]
    # A one-token answer counts at its first token; refused requests count nothing.
    short = served("a", 12.0, 12.0, prompt=10, output=1)
    refused = Record("a", "throttled", 1.0, 50, 0)
    assert service_per_window([short, refused], 1.0, Costs(1.0, 2.0), 2) == [0.0, 12.0]


def test_jain_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert jain([5.0, 5.0]) == pytest.approx(1.0)
    assert jain([5.0, 0.0]) == pytest.approx(0.5)
    assert jain([1.0, 2.0]) == pytest.approx(0.9)
    assert jain([0.0, 0.0]) is None and jain([]) is None


def test_judged_windows_skip_the_warmup_and_the_drain() -> None:
    assert list(judged_windows(60.0, 20.0)) == [2, 3, 4, 5]
    assert list(judged_windows(65.0, 15.0)) == [2, 3, 4, 5]
    assert list(judged_windows(20.0, 0.0)) == [0, 1]


def test_mode_summary_weighs_service_and_judges_each_window() -> None:
    records = [
        # a (weight 1) and c (weight 2) each get one request per window; c's are twice as
        # long, so their weighted service is equal, except in window 2 where a got two.
        *(served("a", 10.0 * w + 1, 10.0 * w + 9, 100, 0) for w in range(4)),
        served("a", 22.0, 23.0, 100, 0),
        *(served("c", 10.0 * w + 1, 10.0 * w + 9, 200, 0) for w in range(4)),
        served("b", 3.0, 4.0, 10, 2, sent=2.5, queue_wait_s=0.25, admitted_s=2.75),
        Record("b", "failed", 30.0, error="503: replica gone"),
        Record("a", "throttled", 31.0, throttle_responses=3),
    ]
    weights = {"a": 1.0, "b": 1.0, "c": 2.0}
    summary = mode_summary(
        records, weights, ["a", "c"], 40.0, 10.0, Costs(1.0, 2.0), {"b": 0.2, "a": None}
    )
    assert summary["jain_per_window"] == [1.0, pytest.approx(0.9, abs=1e-4), 1.0]
    assert summary["jain_index"] == pytest.approx(0.9, abs=1e-4)
    assert summary["jain_mean"] == pytest.approx((1.0 + 0.9 + 1.0) / 3, abs=1e-4)
    assert summary["failed"] == 1 and summary["waits_past_max"] == 1  # b waited 0.25 > 0.2
    assert summary["windows_unknown"] == 0
    a, b, c = summary["tenants"]
    assert a["service_per_window"] == [100.0, 100.0, 200.0, 100.0]
    assert c["service_per_window"] == [100.0, 100.0, 100.0, 100.0]
    assert (a["requests_ok"], a["requests_throttled"], a["throttle_responses"]) == (5, 1, 3)
    assert (b["requests_ok"], b["requests_failed"], b["requests_queued"]) == (1, 1, 1)
    assert b["ttft_p99_s"] == 0.5 and b["tpot_p50_s"] == 1.0  # 2 tokens from 3 s to 4 s
    assert b["queue_wait_p99_s"] == 0.25 and b["errors"] == ["503: replica gone"]
    assert a["queue_wait_p99_s"] is None and a["waits_past_max"] == 0


def test_throughput_counts_output_tokens_from_first_send_to_last_token() -> None:
    records = [served("t", 1.0, 5.0, 10, 40, sent=0.0), served("t", 6.0, 10.0, 10, 60)]
    assert throughput(records)["tokens_per_s"] == 10.0
    assert throughput([])["tokens_per_s"] is None


def test_throttled_requests_count_as_an_infinite_ttft_and_fail_the_target() -> None:
    """20 fast answers and 5 requests throttled until the end: the p99 is not 0.1."""
    fast = [
        served("B", 1.0 + i, 1.5 + i, 10, 2, sent=0.9 + i, admitted_s=0.9 + i) for i in range(20)
    ]
    throttled = [Record("B", "throttled", 2.0 + i, throttle_responses=4) for i in range(5)]
    summary = mode_summary(fast + throttled, {"B": 1.0}, [], 30.0, 0.0, Costs(), {"B": None})
    (row,) = summary["tenants"]
    assert row["ttft_p99_s"] is None and row["ttft_unserved"] == 5
    assert row["ttft_p50_s"] == pytest.approx(0.1)
    judged = mode_targets(summary, {"ttft_p99_s": 0.1})["b_ttft_p99_s"]
    assert judged == {"figure": None, "bound": pytest.approx(0.1 * B_TTFT_X_SOLO), "met": False}
    # served alone, the same fast answers meet it
    alone = mode_summary(fast, {"B": 1.0}, [], 30.0, 0.0, Costs(), {"B": None})
    assert mode_targets(alone, {"ttft_p99_s": 0.1})["b_ttft_p99_s"]["met"] is True


def test_a_wait_past_the_max_is_measured_on_the_client_over_retries() -> None:
    """The ingress reported no queue wait (a 429 then a retry): the client saw 70 s."""
    retried = served("A", 71.0, 72.0, 10, 2, sent=0.5, admitted_s=70.5, throttle_responses=2)
    never = Record("A", "throttled", 10.0, throttle_responses=9)
    summary = mode_summary([retried, never], {"A": 1.0}, [], 80.0, 0.0, Costs(), {"A": 60.0})
    (row,) = summary["tenants"]
    assert row["waits_past_max"] == 2 and row["client_wait_max_s"] is None
    assert mode_targets(summary, None)["waits_past_max"]["met"] is False


def test_a_window_where_no_backlogged_tenant_was_served_counts_as_zero() -> None:
    records = [served("a", 5.0, 6.0, 100, 0), served("c", 5.0, 6.0, 200, 0)]
    summary = mode_summary(records, {"a": 1.0, "c": 2.0}, ["a", "c"], 20.0, 0.0, Costs())
    assert summary["jain_per_window"] == [1.0, None]
    assert summary["windows_unknown"] == 1 and summary["jain_index"] == 0.0
    assert mode_targets(summary, None)["jain_index"]["met"] is False


def test_output_tokens_are_credited_when_their_chunks_arrive() -> None:
    """4 tokens over 5 s .. 25 s, all streamed in the first window: all in window 0."""
    record = served("a", 5.0, 25.0, 0, 4, chunk_times_s=(5.0, 6.0, 7.0, 8.0))
    assert service_per_window([record], 1.0, Costs(1.0, 2.0), 3) == [8.0, 0.0, 0.0]
