"""An engine core's reports, from its ``VTokenScheduler``: what the engine holds now
(``engine_snapshot``) and one request's usage (``request_report``). A hybrid model's
sliding-window groups add each request's ``window_blocks`` (vLLM's sliding-window
managers hold them; never evicted from, so never reclaimable)."""

from __future__ import annotations

from typing import Any

from vtoken.reports import EngineReport, RequestReport
from workers.scheduled_request import find_report

# ``state`` below is a ``workers.scheduler_side.VTokenScheduler`` (typed ``Any``: that
# module imports this one, and imports here run one way).
VTokenScheduler = Any


def request_report(state: VTokenScheduler, request_id: str) -> RequestReport | None:
    """One request's report, running or recently finished (:func:`find_report`)."""

    def report_of(running_id: str) -> RequestReport:
        return with_windows(state, (state.manager.report(running_id),))[0]

    return find_report(request_id, state.requests, state.finished, report_of)


def with_windows(
    state: VTokenScheduler, reports: tuple[RequestReport, ...]
) -> tuple[RequestReport, ...]:
    """``reports`` with the blocks each request holds in the sliding groups (hybrid); a
    block several of them share through the prefix cache is charged once, to the first
    of ``reports`` holding it (so a tenant's and the engine's sums count it once)."""
    if state.sliding is None:
        return reports
    charged: set[int] = set()
    with_blocks = []
    for report in reports:
        mine = state.sliding.held_block_ids(report.request_id) - charged
        charged |= mine
        with_blocks.append(report.model_copy(update={"window_blocks": len(mine)}))
    return tuple(with_blocks)


def engine_snapshot(state: VTokenScheduler) -> EngineReport:
    """What the engine holds now (crosses processes as a utility result, dumped)."""
    counters = state.counters
    budgets = {  # in prefill, only a policy that evicts during prefill has a budget yet
        request_id: state.budgets.budget(record)
        for request_id, record in state.requests.items()
        if record.kv.table.num_logical >= record.kv.prompt_len
        or (record.kv.policy is not None and record.kv.policy.evicts_during_prefill)
    }
    return EngineReport(
        mode=state.config.mode,
        policy=state.config.policy,
        block_size=state.block_size,
        total_blocks=state.pool.num_blocks,
        free_blocks=state.pool.num_free_blocks,
        num_preemptions=counters.num_preemptions,
        blocks_reclaimed=state.manager.num_blocks_reclaimed,
        num_evictions_under_pressure=counters.num_evictions_under_pressure,
        num_evictions_to_bound=counters.num_evictions_to_bound,
        num_evictions_below_budget=counters.num_evictions_below_budget,
        shared_copies=counters.num_shared_copies,
        copies_deferred=counters.num_copies_deferred,
        recent_max_step_s=state.step_times.recent_max_s(),
        recent_steps=state.step_times.recent_longest(),
        evicted_tokens_total=state.manager.num_evicted_tokens,
        repack_moves_total=state.manager.num_repack_moves,
        repack_bytes_total=counters.repack_bytes_total,
        repack_seconds_total=counters.repack_seconds_total,
        tenant_counters={} if state.fair is None else state.fair.report(state.requests.values()),
        requests=with_windows(state, state.manager.reports(budgets)),
    )
