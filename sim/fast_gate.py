"""The fast mode's gate: the same seeded workload on the same cluster in both fidelities.

Each engine's case runs exact (vLLM's scheduler per replica) and fast (block counts,
``sim/fast_replica.py``); the gate compares goodput, SLO attainment, TTFT p50, TPOT p50,
preemptions and the prefix cache's hit rate. Rule: a metric passes when
``|fast - exact| <= tolerance x |exact|`` (5% by default); preemptions, a count, may also
differ by one (``0`` against ``1`` is not a 100% error). The gate passes when every metric
of every engine does.
"""

from __future__ import annotations

from typing import Any

from sim.experiment import Case, Deployment, run_case

METRICS = (
    "goodput_rps", "slo_attainment", "ttft_p50_s", "tpot_p50_s", "preemptions", "hit_rate",
)  # fmt: skip


def _metrics(row: dict[str, Any]) -> dict[str, float]:
    return {
        "goodput_rps": row["goodput_rps"],
        "slo_attainment": row["slo_attainment"] or 0.0,
        "ttft_p50_s": row["ttft_s"]["p50"] or 0.0,
        "tpot_p50_s": row["tpot_s"]["p50"] or 0.0,
        "preemptions": row["preemptions"],
        "hit_rate": row["hit_rate"] or 0.0,
    }


def within(metric: str, exact: float, fast: float, tolerance: float) -> bool:
    """The gate's rule for one metric (module docstring)."""
    slack = tolerance * abs(exact)
    if metric == "preemptions":
        slack = max(slack, 1.0)
    return abs(fast - exact) <= slack + 1e-12


def fast_gate(deployment: Deployment, cases: list[Case], tolerance: float = 0.05) -> dict[str, Any]:
    """Run every case in both fidelities (``deployment.fidelity`` is ignored)."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    rows = []
    for case in cases:
        measured = {}
        for fidelity in ("exact", "fast"):
            chosen = _with_fidelity(deployment, fidelity)
            row = run_case(case, chosen)
            measured[fidelity] = _metrics(row) | {"wall_s": row["wall_s"]}
        checks = {
            metric: {
                "exact": measured["exact"][metric],
                "fast": measured["fast"][metric],
                "rel_error": _relative(measured["exact"][metric], measured["fast"][metric]),
                "within": within(
                    metric, measured["exact"][metric], measured["fast"][metric], tolerance
                ),
            }
            for metric in METRICS
        }
        rows.append(
            {
                **case.row_fields(),
                "metrics": checks,
                "wall_s": {f: measured[f]["wall_s"] for f in ("exact", "fast")},
                "passed": all(check["within"] for check in checks.values()),
            }
        )
    return {
        "passed": all(row["passed"] for row in rows),
        "tolerance": tolerance,
        "rule": "|fast - exact| <= tolerance x |exact| (preemptions: or <= 1)",
        "rows": rows,
    }


def _relative(exact: float, fast: float) -> float | None:
    if exact == 0:
        return 0.0 if fast == 0 else None
    return round(abs(fast - exact) / abs(exact), 4)


def _with_fidelity(deployment: Deployment, fidelity: str) -> Deployment:
    from dataclasses import replace

    return replace(deployment, fidelity=fidelity)


def measure_held_fraction(config: Any, requests: list[Any]) -> float:
    """Held blocks over vanilla's (context tokens / block size), summed over the decode
    steps of an exact replica of ``config`` serving ``requests`` (``SimRequest``) at once:
    ``HELD_FRACTION`` of the fast replica for Naive-Evict and block eviction."""
    from controlplane.prefix import cache_salt
    from sim.replica import ExactReplica

    exact = ExactReplica(config)
    for request in requests:
        exact.add_request(
            request.request_id,
            request.prompt,
            request.max_tokens,
            output_tokens=request.output_tokens,
            cache_salt=cache_salt(request.tenant),
        )
    held = vanilla = 0.0
    while (record := exact.step()) is not None:
        if record.decode_tokens and not record.prefill_tokens:
            held += record.held_blocks
            vanilla += record.context_tokens / config.block_size
    if not vanilla:
        raise ValueError("no decode-only step: give requests with more than one output")
    return round(held / vanilla, 3)
