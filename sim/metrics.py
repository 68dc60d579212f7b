"""A cluster run as one JSONL row: goodput, SLO attainment, latency percentiles, counts."""

from __future__ import annotations

from typing import Any

from bench.common import Quantiles, Slo
from sim.cluster import ClusterRun


def summarise(
    run: ClusterRun, slo: Slo, ideal_hits: dict[str, int], duration_s: float
) -> dict[str, Any]:
    """The row's measured fields.

    ``goodput_rps``: requests that finished within their SLO per second of the workload's
    duration; ``slo_attainment``: their share of the requests that arrived (refused ones
    included, as misses). ``hit_rate``: prompt tokens served from vLLM's prefix cache over
    prompt tokens of the admitted requests; ``hit_share_of_ideal``: hits over what an
    unbounded cache with perfect routing would have served (``ideal_hit_tokens``).
    """
    ttft, tpot, met = [], [], 0
    prompt_tokens = hits = ideal = 0
    completed = 0
    for request_id, times in run.requests.items():
        prompt_tokens += times.prompt_len
        hits += times.cached_tokens
        ideal += ideal_hits.get(request_id, 0)
        if times.first_token_s is None:
            continue
        first = times.first_token_s - times.arrival_s
        ttft.append(first)
        if times.finish_s is None:
            continue
        completed += 1
        per_token = (
            (times.finish_s - times.first_token_s) / (times.max_tokens - 1)
            if times.max_tokens > 1
            else None
        )
        if per_token is not None:
            tpot.append(per_token)
        met += slo.meets(first, per_token, times.prompt_len)
    arrived = len(run.requests) + run.refused
    replicas = run.replicas
    states = [r.state for r in replicas if r.state is not None]
    steps = max(run.steps, 1)
    return {
        "arrived": arrived,
        "admitted": len(run.requests),
        "refused_429": run.refused,
        "refused_429_by_tenant": dict(run.admission.refused) if run.admission else {},
        "completed": completed,
        "goodput_rps": round(met / duration_s, 4),
        "slo_attainment": round(met / arrived, 4) if arrived else None,
        "ttft_s": _quantiles(ttft),
        "tpot_s": _quantiles(tpot),
        "slo": {
            "ttft_base_s": slo.ttft_base_s,
            "ttft_per_token_s": slo.ttft_per_token_s,
            "tpot_s": slo.tpot_s,
        },
        "preemptions": sum(r.num_preemptions for r in replicas),
        "recomputed_tokens": sum(r.recomputed_tokens for r in replicas),
        "evictions_under_pressure": sum(s.num_evictions_under_pressure for s in states),
        "evictions_below_budget": sum(s.num_evictions_below_budget for s in states),
        "hit_rate": round(hits / prompt_tokens, 4) if prompt_tokens else None,
        "hit_share_of_ideal": round(hits / ideal, 4) if ideal else None,
        "steps": run.steps,
        "kv_bytes_read_per_step": round(run.kv_bytes / steps),
        "step_time_breakdown_s": {k: round(v / steps, 7) for k, v in run.step_cost.items()},
        "replica_busy_share": round(run.busy_s / (len(replicas) * max(run.end_s, 1e-9)), 4),
        "wall_s": round(run.wall_s, 2),
        "scheduler_wall_s": round(run.scheduler_s, 2),
    }


def _quantiles(values: list[float]) -> dict[str, float | None]:
    q = Quantiles.of(values)
    return {"p50": q.p50, "p90": q.p90, "p99": q.p99}
