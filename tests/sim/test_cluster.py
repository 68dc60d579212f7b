"""The virtual-time cluster: routers, admission, latencies and rows."""

from __future__ import annotations

import pytest

from sim.cluster import ClusterSpec, ideal_hit_tokens, run_cluster
from sim.cost_model import gpu_cost_model
from sim.experiment import Case, gpu_deployment, run_case
from sim.model_configs import model_folder
from sim.replica import ReplicaConfig
from sim.workloads import WorkloadSpec, generate

POLICY = {"policy": "h2o", "keep_ratio": 0.2}


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> str:
    return model_folder("llama-3.1-8b", tmp_path_factory.mktemp("models"))


def deployment(llama8b: str, **fields):
    cost = gpu_cost_model("h200", "llama-3.1-8b")
    settings = {"duration_s": 8.0, "num_blocks": 4096, "model_dir": llama8b} | fields
    return gpu_deployment(cost, "llama-3.1-8b", "h200", POLICY, **settings)


def test_a_light_load_meets_every_slo_and_is_deterministic(llama8b):
    case = Case("vanilla", "project", 2, "sharegpt", 2.0, 0)
    row = run_case(case, deployment(llama8b))
    assert row["arrived"] == row["completed"] > 5
    assert row["slo_attainment"] == 1.0 and row["preemptions"] == 0
    # A token costs at least the weights' read: 16 GB at 4.8 TB/s x 0.8.
    assert row["tpot_s"]["p50"] >= 8.03e9 * 2 / (4.8e12 * 0.8)
    again = run_case(case, deployment(llama8b))
    assert {k: v for k, v in again.items() if "wall" not in k} == {
        k: v for k, v in row.items() if "wall" not in k
    }


def test_prefix_affinity_beats_round_robin_on_chat(llama8b):
    shares = {}
    for router in ("project", "round_robin"):
        row = run_case(Case("vanilla", router, 4, "chat", 6.0, 1), deployment(llama8b))
        shares[router] = row["hit_share_of_ideal"]
    assert shares["project"] > shares["round_robin"]
    assert shares["project"] > 0.8


def test_a_small_pool_preempts_vanilla_and_on_demand_evicts_instead(llama8b):
    rows = {
        engine: run_case(Case(engine, "round_robin", 1, "sharegpt", 6.0, 0),
                         deployment(llama8b, num_blocks=160))
        for engine in ("vanilla", "on_demand")
    }  # fmt: skip
    assert rows["vanilla"]["preemptions"] > 0
    assert rows["on_demand"]["evictions_under_pressure"] > 0
    assert rows["on_demand"]["preemptions"] < rows["vanilla"]["preemptions"]
    assert rows["on_demand"]["step_time_breakdown_s"]["scores_s"] > 0


def test_admission_refuses_what_the_budget_cannot_hold(llama8b):
    requests = generate(WorkloadSpec("long-context", 4.0, 8.0, num_tenants=2))
    vtoken = {"eviction": "eager"} | POLICY
    replica = ReplicaConfig(llama8b, vtoken, num_blocks=8192, block_size=16, max_model_len=32768,
                            max_num_seqs=256, max_num_batched_tokens=8192)  # fmt: skip
    budget = 1500  # blocks of 16: about one 24k prompt per tenant at a time
    spec = ClusterSpec(2, "eager", "power_of_two", replica, tenant_budget_blocks=budget)
    run = run_cluster(spec, gpu_cost_model("h200", "llama-3.1-8b"), requests)
    assert run.refused > 0 and run.requests
    assert all(times.finish_s is not None for times in run.requests.values())
    admission = run.admission
    assert admission is not None and sum(admission.refused.values()) == run.refused
    assert 0 < max(admission.peak_held.values()) <= budget
    assert all(held == 0 for held in admission.held.values())  # all released at the end


def test_the_ideal_hits_count_whole_shared_blocks():
    requests = generate(WorkloadSpec("chat", 3.0, 30.0, num_tenants=1))
    ideal = ideal_hit_tokens(requests, 16)
    assert ideal[requests[0].request_id] == 0  # nothing came before it
    # Every later request of the one tenant shares at least its system prompt.
    assert all(ideal[r.request_id] >= 256 // 16 * 16 for r in requests[1:])
