"""One simulated case end to end: the engine's config, the cost model, the workload, the
cluster run and its row (``vtoken sim cluster`` runs one per combination)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serve_trial import ENGINE_CONFIGS
from sim.cluster import ClusterSpec, ideal_hit_tokens, run_cluster, unloaded_slo
from sim.cost_model import CostModel, GpuCostModel
from sim.metrics import summarise
from sim.model_configs import model_folder
from sim.replica import ReplicaConfig
from sim.workloads import WorkloadSpec, generate

ENGINES = tuple(ENGINE_CONFIGS)


@dataclass(frozen=True, slots=True)
class Case:
    engine: str
    router: str
    num_replicas: int
    workload: str
    rate: float
    seed: int

    def row_fields(self) -> dict[str, Any]:
        """The fields naming this case in a JSONL row."""
        return {
            "engine": self.engine,
            "router": self.router,
            "replicas": self.num_replicas,
            "workload": self.workload,
            "rate": self.rate,
            "seed": self.seed,
        }


@dataclass(frozen=True, slots=True)
class Deployment:
    """What every case of one command shares. ``policy``: the engines' eviction policy
    (``workers.config`` fields: ``policy``, ``keep_ratio``...; vanilla ignores it)."""

    model: str
    gpu: str
    cost: CostModel
    policy: dict[str, Any]
    duration_s: float
    num_tenants: int
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tenant_budget_blocks: int | None = None
    enable_prefix_caching: bool = True
    length_scale: float = 1.0
    model_dir: str | None = None  # a folder with the model's config.json (default: written)
    drain_s: float | None = None  # virtual seconds after the last arrival (ClusterSpec)
    fidelity: str = "exact"  # or "fast" (ClusterSpec)


def engine_vtoken(engine: str, policy: dict[str, Any]) -> dict[str, Any] | None:
    """The engine-wide vToken section of ``engine`` (bench serve's kinds) with ``policy``."""
    if engine not in ENGINE_CONFIGS:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    config = ENGINE_CONFIGS[engine]
    return None if config is None else config | policy


def run_case(case: Case, deployment: Deployment, scratch: Path | None = None) -> dict[str, Any]:
    """Simulate ``case`` and return its JSONL row."""
    folder = deployment.model_dir or model_folder(
        deployment.model, scratch or Path(tempfile.gettempdir()) / "vtoken-sim-models"
    )
    replica = ReplicaConfig(
        folder,
        engine_vtoken(case.engine, deployment.policy),
        num_blocks=deployment.num_blocks,
        block_size=deployment.block_size,
        max_model_len=deployment.max_model_len,
        max_num_seqs=deployment.max_num_seqs,
        max_num_batched_tokens=deployment.max_num_batched_tokens,
        enable_prefix_caching=deployment.enable_prefix_caching,
    )
    spec = ClusterSpec(
        case.num_replicas, case.engine, case.router, replica, case.seed,
        deployment.tenant_budget_blocks, deployment.drain_s, deployment.fidelity,
    )  # fmt: skip
    workload = WorkloadSpec(
        case.workload,
        case.rate,
        deployment.duration_s,
        case.seed,
        deployment.num_tenants,
        max_model_len=deployment.max_model_len,
        length_scale=deployment.length_scale,
    )
    requests = generate(workload)
    run = run_cluster(spec, deployment.cost, requests)
    # One SLO for every engine: vanilla's unloaded figures (as bench serve's).
    slo = unloaded_slo(
        deployment.cost, "vanilla", deployment.max_num_batched_tokens, deployment.block_size
    )
    ideal = ideal_hit_tokens(requests, deployment.block_size)
    row = {
        **case.row_fields(),
        "fidelity": deployment.fidelity,
        "model": deployment.model,
        "gpu": deployment.gpu,
        "policy": deployment.policy if case.engine != "vanilla" else None,
        "duration_s": deployment.duration_s,
        "num_tenants": deployment.num_tenants,
        "num_blocks_per_replica": deployment.num_blocks,
        "block_size": deployment.block_size,
    }
    return row | summarise(run, slo, ideal, deployment.duration_s)


def gpu_deployment(
    cost: GpuCostModel, model: str, gpu: str, policy: dict[str, Any], **fields: Any
) -> Deployment:
    """A GPU replica: its KV pool from the cost model (``kv_pool_blocks``), vLLM's GPU
    defaults otherwise (block 16, 256 sequences, 8,192 tokens per step)."""
    defaults: dict[str, Any] = {
        "duration_s": 60.0,
        "num_tenants": 8,
        "block_size": cost.block_size,
        "num_blocks": cost.kv_pool_blocks(),
        "max_model_len": 32_768,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
    }
    return Deployment(model, gpu, cost, policy, **(defaults | fields))
