"""The fast replica: hold rules, preemption, on_demand's evictions, macro-steps, the gate."""

from __future__ import annotations

import math

import pytest

from sim.cluster import ClusterSpec
from sim.cost_model import ENGINE_READS, gpu_cost_model
from sim.experiment import Case, gpu_deployment, run_case
from sim.fast_gate import fast_gate, within
from sim.fast_macro import commit, cut, plan_macro
from sim.fast_replica import FastReplica
from sim.model_configs import model_folder
from sim.replica import ReplicaConfig

POLICY = {"policy": "h2o", "keep_ratio": 0.2}
COST = gpu_cost_model("h200", "llama-3.1-8b")


def replica(engine: str, num_blocks: int = 256, **fields) -> FastReplica:
    vtoken = None if engine == "vanilla" else {"eviction": "eager"} | POLICY
    config = ReplicaConfig("unused", vtoken, num_blocks=num_blocks, block_size=16, **fields)
    return FastReplica(config, engine)


def prompt(length: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + 7 * j) % 499 + 1 for j in range(length)]


def run_to_end(fast: FastReplica, limit: int = 10_000) -> list:
    records = []
    for _ in range(limit):
        record = fast.step()
        if record is None:
            return records
        records.append(record)
    raise AssertionError("the replica never drained")


@pytest.mark.parametrize("engine", ["vanilla", "eager"])
def test_each_decode_step_holds_the_engine_s_blocks(engine):
    fast = replica(engine)
    fast.add_request("r", prompt(100), 40)
    records = run_to_end(fast)
    assert len(records) == 40 and records[-1].finished == ("r",)
    assert records[0].prefill_tokens == 100 and records[0].first_tokens == ("r",)
    for step, record in enumerate(records[1:], start=1):
        computed = 100 + step - 1  # before the step
        kept = computed if engine == "vanilla" else min(computed, math.ceil(0.2 * computed))
        assert record.held_blocks == math.ceil((kept + 1) / 16)
        assert record.live_tokens == kept + 1 and record.context_tokens == computed + 1
    assert fast.free == 256 and fast.num_steps == 40


def test_a_full_pool_preempts_the_newest_and_recomputes_it():
    fast = replica("vanilla", num_blocks=20)
    fast.add_request("old", prompt(150, 1), 60)
    fast.add_request("new", prompt(150, 2), 60)
    records = run_to_end(fast)
    assert fast.num_preemptions >= 1 and fast.recomputed_tokens >= 150
    finished = [r for record in records for r in record.finished]
    assert finished[0] == "old" and sorted(finished) == ["new", "old"]
    assert fast.free == 20


def test_on_demand_evicts_to_the_budget_instead_of_preempting():
    outcomes = {}
    for engine in ("vanilla", "on_demand"):
        fast = replica(engine, num_blocks=20)
        fast.add_request("old", prompt(150, 1), 60)
        fast.add_request("new", prompt(150, 2), 60)
        records = run_to_end(fast)
        outcomes[engine] = (fast, records)
    on_demand, records = outcomes["on_demand"]
    assert on_demand.num_preemptions == 0 < outcomes["vanilla"][0].num_preemptions
    assert on_demand.state is not None and on_demand.state.num_evictions_under_pressure > 0
    # Every token is kept while the pool has room: the first decode step reads them all.
    assert records[1].live_tokens == records[1].context_tokens
    assert sum(len(r.finished) for r in records) == 2


@pytest.mark.parametrize("engine", ["vanilla", "eager", "on_demand", "naive", "block"])
def test_a_macro_step_equals_its_single_steps(engine):
    reads = ENGINE_READS[engine]
    pair = [replica(engine, num_blocks=64, max_num_seqs=2) for _ in range(2)]
    for fast in pair:
        for i, length in enumerate((90, 130, 70)):  # the third waits: max_num_seqs
            fast.add_request(f"r{i}", prompt(length, i), 50 + 10 * i)
        fast.step()  # both prompts in one step; the next steps are decodes
    macro, single = pair
    plan = plan_macro(macro, COST, reads, 0.0, horizon=1e9)
    assert plan is not None and len(plan.starts) == 48  # r0 has 49 to go: the last alone
    costs = [COST.step(single.step(), reads).total_s for _ in plan.starts]
    assert [c.total_s for c in plan.costs] == pytest.approx(costs, rel=1e-12)
    commit(macro, plan)
    for a, b in zip(macro.running, single.running, strict=True):
        assert (a.computed, a.output, a.live, a.held) == (b.computed, b.output, b.live, b.held)
    assert macro.free == single.free and macro.num_steps == single.num_steps
    assert macro.step().finished == single.step().finished == ("r0",)


def test_a_cut_keeps_the_steps_that_started_before_the_arrival():
    fast = replica("vanilla")
    fast.add_request("r", prompt(64), 100)
    fast.step()
    plan = plan_macro(fast, COST, ENGINE_READS["vanilla"], 0.0, horizon=1e9)
    assert plan is not None
    arrival = (plan.starts[10] + plan.starts[11]) / 2
    assert cut(plan, arrival) == plan.starts[-1] + plan.costs[-1].total_s
    assert len(plan.starts) == 11  # steps 0-10 started before the arrival
    commit(fast, plan)
    assert fast.requests["r"].output == 12


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="fidelity"):
        ClusterSpec(1, "vanilla", "project", replica("vanilla").config, fidelity="quick")
    with pytest.raises(ValueError, match="keep_ratio"):
        FastReplica(ReplicaConfig("unused", {"eviction": "eager"}, num_blocks=8), "eager")
    with pytest.raises(ValueError, match="max_model_len"):
        replica("vanilla").add_request("r", prompt(2048), 10)


def test_the_gate_rule():
    assert within("goodput_rps", 10.0, 10.49, 0.05)
    assert not within("goodput_rps", 10.0, 10.51, 0.05)
    assert within("preemptions", 0, 1, 0.05) and not within("preemptions", 0, 2, 0.05)


def test_fast_matches_exact_on_eight_replicas(tmp_path):
    """The gate at a small size (vanilla; ``vtoken sim validate`` runs the full one)."""
    folder = model_folder("llama-3.1-8b", tmp_path)
    deployment = gpu_deployment(
        COST, "llama-3.1-8b", "h200", POLICY, duration_s=3.0, num_blocks=512, model_dir=folder
    )
    gate = fast_gate(deployment, [Case("vanilla", "project", 8, "chat", 12.0, 0)])
    row = gate["rows"][0]
    assert row["metrics"]["goodput_rps"]["exact"] > 5  # a loaded run, not an empty one
    assert row["metrics"]["hit_rate"]["exact"] > 0.3  # chat turns hit their history
    assert gate["passed"], row["metrics"]
    fast_row = run_case(Case("vanilla", "project", 8, "chat", 12.0, 0), deployment)
    assert fast_row["fidelity"] == "exact"


@pytest.mark.parametrize("engine", ["vanilla", "eager", "on_demand"])
def test_a_fast_cluster_gives_the_same_row_without_macro_steps(engine, tmp_path, monkeypatch):
    """Macro-steps cut by arrivals change nothing a row reports (only the wall time)."""
    folder = model_folder("llama-3.1-8b", tmp_path)
    deployment = gpu_deployment(
        COST, "llama-3.1-8b", "h200", POLICY, duration_s=4.0, num_blocks=384,
        model_dir=folder, fidelity="fast",
    )  # fmt: skip
    case = Case(engine, "project", 4, "chat", 16.0, 1)
    with_macro = run_case(case, deployment)
    monkeypatch.setattr("sim.fast_macro.MAX_MACRO_STEPS", 1)
    single = run_case(case, deployment)
    assert with_macro["fidelity"] == "fast" and with_macro["completed"] > 20
    assert with_macro["steps"] == single["steps"]
    drop = ("wall_s", "scheduler_wall_s")
    assert {k: v for k, v in with_macro.items() if k not in drop} == {
        k: v for k, v in single.items() if k not in drop
    }
