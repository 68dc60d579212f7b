"""Macro-steps of a fast replica: ``k`` decode-only steps planned at once.

A plan is made when every running request is decoding (one token each), nothing in the
waiting queue can be admitted (the sequence cap is reached, or its head's blocks do not
fit, which stays so while the running requests only grow; ``on_demand`` would evict to
admit it, so it plans only with the cap reached or nothing waiting), no request finishes
before the plan's last step ends (the finishing step runs alone, as vLLM releases a
finished request's slot at the start of that step) and every step's blocks fit. Its
steps are exactly the single steps' (the same hold rules, vectorised over requests and
steps with numpy); the cost model is applied to each. The cluster commits the plan when
it ends, or cuts it at the first step boundary after an arrival routed to the replica.
"""

from __future__ import annotations

import numpy as np

from sim.cost_model import CostModel, KVReads, StepCost
from sim.fast_plan import MacroPlan
from sim.fast_replica import FastReplica
from sim.replica import StepRecord

MAX_MACRO_STEPS = 64  # planned steps past a cut are wasted: a short plan, replanned


def plan_macro(
    replica: FastReplica, cost: CostModel, reads: KVReads, now: float, horizon: float
) -> MacroPlan | None:
    """The replica's next steps as one plan (module docstring), or ``None`` (step once)."""
    running, config = replica.running, replica.config
    n = len(running)
    if n == 0 or n > config.max_num_batched_tokens:
        return None
    # Decoding: one token to compute and the first one sampled already (a prompt with one
    # token left to prefill also has one to compute, and its step reports the first token).
    if any(r.num_tokens - r.computed != 1 or r.output == 0 for r in running):
        return None
    if replica.waiting and n < config.max_num_seqs:
        if replica.engine == "on_demand":
            return None
        head = replica.waiting[0]
        if head.computed == 0:
            replica._prefix_hit(head)
        new = min(head.num_tokens - head.computed, config.max_num_batched_tokens - n)
        need = replica._need(head, new) - head.held - replica._warm_hits(head)
        if new > 0 and need <= replica.free:
            return None
    steps = min(min(r.max_tokens - r.output for r in running) - 1, MAX_MACRO_STEPS)
    if steps < 2:
        return None
    bs = replica.bs
    j = np.arange(steps + 1)[:, None]  # one row more: the last step's evictions
    computed = np.array([r.computed for r in running])[None, :] + j
    live0 = np.array([r.live for r in running])[None, :]
    held0 = np.array([r.held for r in running])
    engine = replica.engine
    if engine == "vanilla":
        live = computed
    elif engine == "on_demand":
        live = live0 + j
    else:
        live = np.minimum(computed, np.ceil(replica.keep * computed).astype(np.int64))
        live[0] = live0[0]
    # Step j copies what step j - 1 evicted (vToken mode: eager; on_demand evicts only
    # under pressure, never in a plan).
    moves = np.zeros(steps + 1, dtype=np.int64)
    moves[0] = replica.pending_moves
    if engine == "eager":
        moves[1:] = np.minimum(live[:-1] + 1 - live[1:], live[1:]).sum(axis=1)
    live, computed = live[:steps], computed[:steps]
    held = -(-(live + 1) // bs)
    if engine in ("naive", "block"):
        vanilla = -(-(computed + 1) // bs)
        held = np.maximum(held, np.ceil(replica.fraction * vanilla).astype(np.int64))
    fits = held.sum(axis=1) <= replica.free + int(held0.sum())
    if not fits.all():
        steps = int(np.argmin(fits))
        if steps < 2:
            return None
        live, held, computed = live[:steps], held[:steps], computed[:steps]
        moves = moves[: steps + 1]
    context = (computed + 1).sum(axis=1)
    reads_live = (live + 1).sum(axis=1)
    held_sum = held.sum(axis=1)
    starts: list[float] = []
    costs: list[StepCost] = []
    time = now
    for step in range(steps):
        if time > horizon:
            break
        record = StepRecord(
            prefill_tokens=0,
            decode_tokens=n,
            num_requests=n,
            context_tokens=int(context[step]),
            live_tokens=int(reads_live[step]),
            held_blocks=int(held_sum[step]),
            attention_pairs=int(reads_live[step]),
            num_moves=int(moves[step]),
            scored_tokens=int(reads_live[step]) if replica.scored else 0,
            finished=(),
            first_tokens=(),
        )
        step_cost = cost.step(record, reads)
        starts.append(time)
        costs.append(step_cost)
        time += step_cost.total_s
    if len(starts) < 2:
        return None
    planned = len(starts)
    return MacroPlan(starts, costs, time, live[:planned], held[:planned], moves[1 : planned + 1])


def cut(plan: MacroPlan, arrival_s: float) -> float | None:
    """Keep the steps that start before ``arrival_s``; the new end (``None``: the arrival
    came during the last step, which ends the plan anyway)."""
    keep = next((i for i, start in enumerate(plan.starts) if start >= arrival_s), None)
    if keep is None:
        return None
    keep = max(keep, 1)
    plan.end_s = plan.starts[keep]
    del plan.starts[keep:], plan.costs[keep:]
    return plan.end_s


def commit(replica: FastReplica, plan: MacroPlan) -> None:
    """Apply the plan's steps to the replica's requests and blocks."""
    steps = len(plan.starts)
    bs, engine = replica.bs, replica.engine
    for index, request in enumerate(replica.running):
        if request.publishes:
            start = request.computed // bs
            replica._insert(request.hashes[start : (request.computed + steps) // bs])
        request.computed += steps
        request.output += steps
        if engine in ("vanilla", "on_demand"):
            request.live += steps
        else:
            request.live = min(request.computed, replica.budget(request.computed))
        held = int(plan.held[steps - 1, index])
        if engine != "on_demand" and engine != "vanilla":  # evicted after the step
            held = -(-request.live // bs)
            if engine != "eager":
                held = max(held, replica._share_of_vanilla(request.computed))
        replica.private += held - request.held
        request.held = held
    replica.num_steps += steps
    replica.pending_moves = int(plan.moves[steps - 1])
    replica.macro = None
