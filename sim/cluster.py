"""N exact replicas on one virtual clock, behind a router and per-tenant admission.

Events, in time order: a request's arrival (admission, then the router picks a replica and
the request joins its waiting queue) and a replica's step. A replica with work runs a step
at time ``t``: vLLM's ``schedule()`` sees every request that arrived by ``t``; the step's
tokens appear at ``t + cost`` (``sim/cost_model.py``), when the replica's next step
starts. Requests arriving while a step is in flight wait for the next one, as in an engine.

Per request: TTFT (arrival to the step that made its first token), TPOT ((finish - first
token) / (outputs - 1)), SLO met or not (``bench.common.Slo``: the serving benchmarks'
factors times the unloaded TTFT and TPOT, which the cost model gives). A request still
unfinished at the horizon (the last arrival plus ``drain_s``, by default twice the last
arrival's time plus a second) misses its SLO.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import Slo
from controlplane.prefix import cache_salt, prefix_keys
from sim.cost_model import ENGINE_READS, CostModel, StepCost
from sim.fast_macro import commit, cut, plan_macro
from sim.fast_replica import FastReplica
from sim.replica import ExactReplica, ReplicaConfig, StepRecord
from sim.routing import Admission, VirtualClock, make_router
from sim.workloads import SimRequest
from workers.config import parse_config

ARRIVAL, STEP = 0, 1
FIDELITIES = ("exact", "fast")


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """One simulated deployment: ``num_replicas`` engines of ``engine`` (``vtoken`` its
    engine config, ``None`` for vanilla) behind ``router``."""

    num_replicas: int
    engine: str
    router: str
    replica: ReplicaConfig
    seed: int = 0
    tenant_budget_blocks: int | None = None
    drain_s: float | None = None  # None: twice the last arrival's time, plus 1 s
    fidelity: str = "exact"  # or "fast": block counts (sim/fast_replica.py)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")
        if self.fidelity not in FIDELITIES:
            raise ValueError(f"fidelity must be one of {FIDELITIES}, got {self.fidelity!r}")
        if self.engine not in ENGINE_READS:
            raise ValueError(f"engine must be one of {sorted(ENGINE_READS)}, got {self.engine!r}")


@dataclass(slots=True)
class RequestTimes:
    arrival_s: float
    prompt_len: int
    max_tokens: int
    replica: int
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0


@dataclass(slots=True)
class ClusterRun:
    """What a run measured (``sim.metrics.summarise`` turns it into a row)."""

    requests: dict[str, RequestTimes] = field(default_factory=dict)
    refused: int = 0
    steps: int = 0
    step_cost: dict[str, float] = field(default_factory=dict)  # summed StepCost fields
    kv_bytes: float = 0.0
    busy_s: float = 0.0
    horizon_s: float = 0.0
    end_s: float = 0.0  # the last event's time
    wall_s: float = 0.0
    scheduler_s: float = 0.0  # wall time in vLLM's scheduler and vToken (host, measured)
    replicas: list[Any] = field(default_factory=list)  # ExactReplica or FastReplica
    admission: Admission | None = None


def unloaded_slo(cost: CostModel, engine: str, chunk: int, block_size: int) -> Slo:
    """The SLO of the serving benchmarks from the cost model's unloaded figures: TTFT of a
    prompt alone (base and per token over one ``chunk``), TPOT of one request at 1k."""
    reads = ENGINE_READS[engine]

    def seconds(prefill: int, decode: int, context: int) -> float:
        tokens = prefill + decode
        record = StepRecord(
            prefill_tokens=prefill,
            decode_tokens=decode,
            num_requests=1,
            context_tokens=context,
            live_tokens=context,
            held_blocks=-(-context // block_size),
            attention_pairs=tokens * context,
            num_moves=0,
            scored_tokens=0,
            finished=(),
            first_tokens=(),
        )
        return cost.step(record, reads).total_s

    base = seconds(1, 0, 1)
    per_token = (seconds(chunk, 0, chunk) - base) / chunk
    return Slo.from_unloaded(base, per_token, seconds(0, 1, 1024))


def run_cluster(spec: ClusterSpec, cost: CostModel, requests: list[SimRequest]) -> ClusterRun:
    """Serve ``requests`` (arrival order) on the cluster of ``spec`` (module docstring)."""
    started = time.perf_counter()
    clock = VirtualClock()
    fast = spec.fidelity == "fast"
    replicas: list[Any] = [
        FastReplica(spec.replica, spec.engine) if fast else ExactReplica(spec.replica)
        for _ in range(spec.num_replicas)
    ]
    generation = [0] * spec.num_replicas  # a fast replica's macro-step cut makes a new one
    router = make_router(spec.router, spec.num_replicas, clock, spec.replica.block_size, spec.seed)
    config = parse_config({"vtoken": spec.replica.vtoken} if spec.replica.vtoken else {})
    admission = Admission(
        spec.replica.block_size,
        config,
        spec.replica.max_num_batched_tokens,
        spec.tenant_budget_blocks,
    )
    reads = ENGINE_READS[spec.engine]
    run = ClusterRun(replicas=replicas, admission=admission)
    events: list[tuple[float, int, int, Any]] = []
    for index, request in enumerate(requests):
        heapq.heappush(events, (request.arrival_s, ARRIVAL, index, request))
    stepping = [False] * spec.num_replicas
    last = max((r.arrival_s for r in requests), default=0.0)
    horizon = last + (spec.drain_s if spec.drain_s is not None else 2 * last + 1.0)
    run.horizon_s = horizon
    while events:
        now, kind, index, payload = heapq.heappop(events)
        if now > horizon:
            break
        if kind == STEP and payload != generation[index]:
            continue  # a macro-step's end that a cut moved earlier
        clock.time_s = run.end_s = now
        if kind == ARRIVAL:
            chosen = _arrive(payload, replicas, router, admission, run)
            if chosen is not None and not stepping[chosen]:
                stepping[chosen] = True
                heapq.heappush(events, (now, STEP, chosen, generation[chosen]))
            elif chosen is not None and fast and replicas[chosen].macro is not None:
                end = cut(replicas[chosen].macro, now)
                if end is not None:
                    generation[chosen] += 1
                    heapq.heappush(events, (end, STEP, chosen, generation[chosen]))
            continue
        replica = replicas[index]
        tick = time.perf_counter()
        if fast:
            if replica.macro is not None:
                _commit(run, replica, admission)
            plan = plan_macro(replica, cost, reads, now, horizon)
            if plan is not None:
                replica.macro = plan
                run.scheduler_s += time.perf_counter() - tick
                heapq.heappush(events, (plan.end_s, STEP, index, generation[index]))
                continue
        record = replica.step()
        run.scheduler_s += time.perf_counter() - tick
        if record is None or (record.num_requests == 0 and not replica.num_running):
            # Nothing left, or nothing that fits: the next arrival restarts the replica.
            stepping[index] = False
            continue
        if record.num_requests == 0:  # vLLM's step that only reports finished requests
            heapq.heappush(events, (now, STEP, index, generation[index]))
            continue
        step = cost.step(record, reads)
        end = now + step.total_s
        _account(run, record, step, end, admission)
        heapq.heappush(events, (end, STEP, index, generation[index]))
    for replica in replicas if fast else ():
        if replica.macro is not None:  # planned steps that start by the horizon
            run.end_s = max(run.end_s, replica.macro.starts[-1])
            _commit(run, replica, admission)
    run.wall_s = time.perf_counter() - started
    return run


def _commit(run: ClusterRun, replica: FastReplica, admission: Admission) -> None:
    plan = replica.macro
    assert plan is not None
    commit(replica, plan)
    for step in plan.costs:
        _account(run, _NO_TOKENS, step, 0.0, admission)


_NO_TOKENS = StepRecord(0, 0, 0, 0, 0, 0, 0, 0, 0, (), ())


def _arrive(
    request: SimRequest,
    replicas: list[Any],
    router: Any,
    admission: Admission,
    run: ClusterRun,
) -> int | None:
    if not admission.admit(request):
        run.refused += 1
        return None
    loads = [r.num_running + r.num_waiting for r in replicas]
    chosen = router.choose(request, loads)
    replicas[chosen].add_request(
        request.request_id,
        request.prompt,
        request.max_tokens,
        arrival_time=request.arrival_s,
        output_tokens=request.output_tokens,
        cache_salt=cache_salt(request.tenant),
    )
    run.requests[request.request_id] = RequestTimes(
        request.arrival_s, len(request.prompt), request.max_tokens, chosen
    )
    return chosen


def _account(
    run: ClusterRun, record: StepRecord, step: StepCost, end: float, admission: Admission
) -> None:
    run.steps += 1
    run.kv_bytes += step.kv_bytes
    run.busy_s += step.total_s
    for name in ("host_s", "weights_s", "kv_s", "compute_s", "scores_s", "repack_s", "allreduce_s"):
        run.step_cost[name] = run.step_cost.get(name, 0.0) + getattr(step, name)
    for request_id in record.first_tokens:
        times = run.requests[request_id]
        times.first_token_s = end
        times.cached_tokens = record.cached_tokens.get(request_id, 0)
        admission.first_token(request_id)
    for request_id in record.finished:
        run.requests[request_id].finish_s = end
        admission.finished(request_id)


def ideal_hit_tokens(requests: list[SimRequest], block_size: int) -> dict[str, int]:
    """Per request, the prompt tokens an unbounded cache with perfect routing would serve:
    the leading full blocks some earlier request of its tenant (prompt then output)
    also began with, less the prompt's last token (vLLM recomputes it)."""
    seen: set[str] = set()
    ideal = {}
    for request in requests:
        salt = cache_salt(request.tenant)
        keys = prefix_keys(request.prompt, block_size, salt, max_blocks=1 << 30)
        hits = 0
        for key in keys:
            if key not in seen:
                break
            hits += 1
        ideal[request.request_id] = min(hits * block_size, len(request.prompt) - 1)
        full = (*request.prompt, *request.output_tokens)
        seen.update(prefix_keys(full, block_size, salt, max_blocks=1 << 30))
    return ideal
