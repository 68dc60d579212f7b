"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``): a head and two worker
nodes that alone offer the custom resource the engine replicas ask for, Redis with a
password reached through the deployed URL, requests served, reports from every replica,
and a lost node's replica shown unhealthy (not fresh, its report ageing) in
``/admin/status`` instead of vanishing or staying green."""

from __future__ import annotations

import time

import httpx
import pytest

from serving.demo import ADMIN_TOKEN, local_cluster
from workers.models import make_tiny_llama

pytestmark = pytest.mark.slow
ENGINE_NODE = "engine_node"
PASSWORD = "multi-node-test-password"


def _paths_holding(node: object, secret: str, path: str = "") -> list[str]:
    """Where in a nested dict/list ``secret`` appears, as dotted paths."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _paths_holding(v, secret, f"{path}.{k}")]
    if isinstance(node, list | tuple):
        return [p for i, v in enumerate(node) for p in _paths_holding(v, secret, f"{path}[{i}]")]
    return [path] if secret in str(node) else []


def _status(client: httpx.Client) -> dict:
    response = client.get("/admin/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    response.raise_for_status()
    return response.json()


def _wait_for(client: httpx.Client, check, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(client)
        if check(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def test_engines_on_worker_nodes_serve_report_and_a_lost_node_shows(tmp_path, smollm2_path):
    import ray
    from ray.cluster_utils import Cluster

    model = make_tiny_llama(tmp_path / "tiny", smollm2_path)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=2)  # the head: Serve, the ingress, the controller
        # Worker nodes offer no CPU, only the engines' resource: nothing else lands there.
        workers = [cluster.add_node(num_cpus=0, resources={ENGINE_NODE: 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        with local_cluster(
            2,
            {"policy": "h2o", "keep_ratio": 0.5},
            engine={"model": str(model), "served_name": "tiny", "max_model_len": 512,
                    "num_blocks": 64},
            app_args={"replica_num_cpus": 0, "replica_resources": {ENGINE_NODE: 1}},
            ray_init={"address": cluster.address, "runtime_env": {"env_vars": env}},
            folder=tmp_path,
            redis_password=PASSWORD,
        ) as stack:  # fmt: skip
            # The password reaches every process through $VTOKEN_REDIS_URL: Serve shows it
            # only as that environment variable, never in a deployment's arguments or the
            # router's (which a config would otherwise carry in plain text).
            from ray.serve.context import _get_global_client

            details = ray.get(_get_global_client()._controller.get_serve_instance_details.remote())
            leaks = _paths_holding(details, PASSWORD)
            assert leaks, "the password should reach the actors through their environment"
            assert all(p.endswith("runtime_env.env_vars.VTOKEN_REDIS_URL") for p in leaks), leaks
            # Both engine replicas hold the resource only the worker nodes offer.
            assert ray.cluster_resources().get(ENGINE_NODE) == 2
            assert ray.available_resources().get(ENGINE_NODE, 0) == 0
            with httpx.Client(base_url=stack.url, timeout=120) as client:
                created = client.put(
                    "/admin/tenants/nodes",
                    json={"kv_budget_blocks": 60},
                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                )
                assert created.status_code in (200, 201), created.text
                key = created.json()["api_key"]
                for n in range(4):
                    answer = client.post(
                        "/v1/completions",
                        json={"model": "tiny", "prompt": f"request {n} " * 20, "max_tokens": 4},
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["usage"]["completion_tokens"] == 4

                def both_fresh(status: dict) -> bool:
                    fresh = [r for r in status["replicas"] if r["fresh"]]
                    return len(fresh) == 2 and all(r["blocks_total"] > 0 for r in fresh)

                status = _wait_for(client, both_fresh, 30)
                assert both_fresh(status), status["replicas"]
                assert all(r["report_age_s"] < 3 for r in status["replicas"])

                cluster.remove_node(workers[0])  # its engine replica goes with it

                def one_silent(status: dict) -> bool:
                    silent = [r for r in status["replicas"] if not r["fresh"]]
                    return len(silent) == 1 and (silent[0]["report_age_s"] or 0) > 3

                status = _wait_for(client, one_silent, 60)
                assert one_silent(status), status["replicas"]
                assert sum(r["fresh"] for r in status["replicas"]) == 1  # the other still reports
                # The surviving replica still serves.
                answer = client.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "after the loss " * 10, "max_tokens": 2},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert answer.status_code == 200, answer.text
    finally:
        cluster.shutdown()
