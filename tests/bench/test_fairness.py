"""`vtoken bench fairness --smoke` on the real stack (Redis, Ray Serve, a SmolLM2 CPU
engine): the JSON's shape, and figures computed from requests that were really served."""

from __future__ import annotations

import json

import pytest

from bench.fairness import SMOKE, TENANTS, plan, plot, run
from bench.fairness_stats import Costs, Record, service_per_window

pytestmark = pytest.mark.slow
ROW_FIELDS = {
    "id", "weight", "service_per_window", "requests_ok", "requests_queued",
    "requests_throttled", "requests_failed", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
    "tpot_p99_s", "queue_wait_p99_s",
}  # fmt: skip


SMOKE_MODES = ("fair", "priority")  # two deployments: fcfs is vLLM's default path


@pytest.mark.timeout(1800)  # two deployments, one after the other
def test_fair_and_priority_run_on_the_real_stack_and_report_what_was_served(tmp_path) -> None:
    summary = json.loads(json.dumps(run([*SMOKE_MODES, "solo"], SMOKE)))
    assert set(summary) >= {"modes", "solo", "config"}
    assert list(summary["modes"]) == list(SMOKE_MODES)
    for mode, result in summary["modes"].items():
        assert result["failed"] == 0, (mode, result)
        assert len(result["jain_per_window"]) == 2  # 20 s of arrivals, no warm-up
        # Both windows may pass before a slow machine serves a backlogged tenant: then
        # its index is unknown (None), never made up.
        known = [j for j in result["jain_per_window"] if j is not None]
        assert result["jain_index"] == (min(known) if known else None)
        assert all(0.5 <= j <= 1.0 for j in known)
        rows = {row["id"]: row for row in result["tenants"]}
        assert list(rows) == ["A", "B", "C"]
        for tenant in TENANTS:
            row = rows[tenant.tenant_id]
            assert set(row) >= ROW_FIELDS and row["weight"] == tenant.weight
            assert row["requests_ok"] > 0 and row["output_tokens"] > 0, (mode, row)
            assert row["ttft_p99_s"] >= row["ttft_p50_s"] > 0
            assert len(row["service_per_window"]) == 2
        # The windows' service is the listed requests' (a starved machine may serve none
        # of it inside the 20 s: then zeros, never made up).
        records = [
            Record(**dict(zip(result["requests_fields"], r, strict=True)))
            for r in result["requests"]
        ]
        for row in rows.values():
            mine = [r for r in records if r.tenant == row["id"]]
            expected = service_per_window(mine, row["weight"], Costs(), 2)
            assert row["service_per_window"] == pytest.approx(expected, abs=1.0), mode
        # Every figure comes from the requests listed, one row each.
        assert len(result["requests"]) == sum(row["requests"] for row in rows.values())
        served = [r for r in result["requests"] if r[1] == "ok"]
        assert sum(r[7] for r in served) == sum(row["output_tokens"] for row in rows.values())
        if mode == "fair":  # A floods a full cluster: its requests wait in its queue
            assert rows["A"]["requests_queued"] > 0 and rows["A"]["queue_wait_p99_s"] > 0
            assert result["waits_past_max"] == 0
        else:  # no queue: throttled clients retried after Retry-After
            assert all(row["requests_queued"] == 0 for row in rows.values())
    solo = summary["solo"]
    assert solo["id"] == "B" and solo["requests_ok"] > 0 and solo["requests_failed"] == 0
    path = tmp_path / "fairness.png"
    plot(summary, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_the_plan_runs_each_job_on_the_deployment_it_needs() -> None:
    assert plan(["solo"]) == {"fair": {"solo"}}
    assert plan(["priority", "overhead"]) == {
        "fair": {"overhead"},
        "fcfs": {"overhead"},
        "priority": {"mix"},
    }
    with pytest.raises(Exception, match="unknown mode"):
        plan(["wfq"])
