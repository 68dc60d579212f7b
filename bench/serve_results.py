"""The results of `vtoken bench serve`: its rows (``CaseResult``: a case on a workload),
the ratios of vToken's goodput to Naive-Evict's and vanilla's (``ratios``), the summary a
reader compares (``summary``: on_demand over every other engine, per workload and policy)
and the figure (SLO attainment against rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import SLO_ATTAINMENT, pyplot, ratio, save_figure
from bench.serve_trial import ENGINES, TrialSummary


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One row of the results: a case on one workload, its goodput (``goodput_bound``: see
    ``search_goodput``), its attainment curve over the sweep (keyed by rate) and every
    trial's figures, by rate."""

    engine: str
    policy: str
    keep: float | None
    workload: str
    goodput_rps: float
    goodput_bound: str
    slo_attainment: dict[str, float]
    preemptions: int
    preempted_requests: int
    peak_blocks: int
    per_rate: list[TrialSummary]


@dataclass(frozen=True, slots=True)
class GoodputRatio:
    """A vToken engine's goodput over Naive-Evict's (same policy) and vanilla's; ``exact``:
    both goodputs were bisected (otherwise the ratio is only a bound)."""

    engine: str
    policy: str
    keep: float | None
    workload: str
    vtoken_over_naive: float | None
    vtoken_over_naive_exact: bool
    vtoken_over_vanilla: float | None
    vtoken_over_vanilla_exact: bool


def _ratio(row: CaseResult, other: CaseResult | None) -> tuple[float | None, bool]:
    """``row``'s goodput over ``other``'s, and whether both were bisected (otherwise the
    ratio is only a bound)."""
    if other is None or other.goodput_rps == 0:
        return None, False
    exact = row.goodput_bound == other.goodput_bound == "bisected"
    return ratio(row.goodput_rps, other.goodput_rps, 3), exact


def ratios(results: Sequence[CaseResult]) -> list[GoodputRatio]:
    """Goodput of each vToken engine over Naive-Evict (same policy) and over vanilla."""
    by_key = {(r.engine, r.policy, r.keep, r.workload): r for r in results}
    rows = []
    for r in results:
        if r.engine not in ("eager", "on_demand"):
            continue
        over_naive, naive_exact = _ratio(r, by_key.get(("naive", r.policy, r.keep, r.workload)))
        over_vanilla, vanilla_exact = _ratio(r, by_key.get(("vanilla", "none", None, r.workload)))
        rows.append(
            GoodputRatio(
                r.engine,
                r.policy,
                r.keep,
                r.workload,
                over_naive,
                naive_exact,
                over_vanilla,
                vanilla_exact,
            )
        )
    return rows


@dataclass(frozen=True, slots=True)
class GoodputSummary:
    """What a reader compares, per workload and policy: on_demand's goodput, and its
    ratio over each other engine's (vanilla's has no policy; ``None``: that engine did
    not run or had no goodput); ``exact`` per engine: both goodputs were bisected."""

    workload: str
    policy: str
    keep: float
    on_demand_rps: float
    on_demand_bound: str
    over: dict[str, float | None]
    exact: dict[str, bool]


def summary(results: Sequence[CaseResult]) -> list[GoodputSummary]:
    """One ``GoodputSummary`` per on_demand row, over every other engine of ``ENGINES``."""
    by_key = {(r.engine, r.policy, r.keep, r.workload): r for r in results}
    rows = []
    for r in results:
        if r.engine != "on_demand" or r.keep is None:
            continue
        over, exact = {}, {}
        for engine in (e for e in ENGINES if e != "on_demand"):
            key = ("vanilla", "none", None) if engine == "vanilla" else (engine, r.policy, r.keep)
            other = by_key.get((*key, r.workload))
            if other is not None:
                over[engine], exact[engine] = _ratio(r, other)
        rows.append(
            GoodputSummary(
                r.workload, r.policy, r.keep, r.goodput_rps, r.goodput_bound, over, exact
            )
        )
    return rows


def summary_lines(document: dict[str, Any]) -> list[str]:
    """The summary as the CLI prints it: one line per workload and policy."""
    lines = []
    for row in document["summary"]:
        ratios_text = ", ".join(
            f"{'-' if value is None else f'{value}x'} {engine}"
            f"{'' if row['exact'][engine] else ' (bound)'}"
            for engine, value in row["over"].items()
        )
        lines.append(
            f"{row['workload']} {row['policy']}:{row['keep']}: on_demand "
            f"{row['on_demand_rps']} req/s ({row['on_demand_bound']}); over {ratios_text}"
        )
    return lines


def plot(document: dict[str, Any], path: Path) -> None:
    """SLO attainment against rate, one panel per policy and workload, a line per engine."""
    plt = pyplot()
    results = document["results"]
    panels = sorted({(r["policy"], r["keep"], r["workload"]) for r in results if r["keep"]})
    figure, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 4), sharey=True, squeeze=False
    )
    for axis, (policy, keep, workload) in zip(axes[0], panels, strict=True):
        for r in results:
            if r["workload"] == workload and (
                r["keep"] is None or (r["policy"], r["keep"]) == (policy, keep)
            ):
                points = [
                    (p["rate"], p["slo_attainment"])
                    for p in r["per_rate"]
                    if p["slo_attainment"] is not None  # a stopped trial: only "below"
                ]
                axis.plot(*zip(*points, strict=True), marker="o", label=r["engine"])
        axis.axhline(SLO_ATTAINMENT, color="grey", linestyle=":", linewidth=1)
        axis.set_xscale("log")
        axis.set_title(f"{policy} keep {keep}, {workload}")
        axis.set_xlabel("arrival rate (per s)")
    axes[0][0].set_ylabel("SLO attainment")
    axes[0][0].legend()
    save_figure(figure, path)
