"""The serving system end to end: real Redis, real Ray Serve, real vLLM CPU engines (a tiny
random Llama with SmolLM2's tokenizer), vToken + H2O in the engines, OTLP traces received
by a real HTTP collector from every process."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from serving.demo import ADMIN_TOKEN
from tests.otlp_sink import OTLPSink
from workers.models import make_tiny_llama

pytestmark = pytest.mark.slow
ADMIN = ADMIN_TOKEN  # what serving.demo.local_cluster deploys with
MODEL = "tiny"


@dataclass(frozen=True)
class Cluster:
    url: str
    sink: OTLPSink
    redis_url: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2_path):
    from serving.demo import local_cluster

    folder = tmp_path_factory.mktemp("serving")
    model = make_tiny_llama(folder / "tiny", smollm2_path)
    with OTLPSink() as sink:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
        with local_cluster(
            2,
            {"policy": "h2o", "keep_ratio": 0.5},
            engine={
                "model": str(model),
                "served_name": MODEL,
                "max_model_len": 512,
                "num_blocks": 64,
            },
            app_args={"replica_num_cpus": 1, "controller_period_s": 0.2},
            ray_init={"num_cpus": 4, "runtime_env": {"env_vars": env}},
            folder=folder,
        ) as local:
            yield Cluster(local.url, sink, local.redis_url)


@pytest.fixture(scope="module")
def checker_key(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        return make_tenant(client, "checker", 200)


def admin_headers():
    return {"Authorization": f"Bearer {ADMIN}"}


def make_tenant(client, tenant_id, blocks, **extra):
    body = {"kv_budget_blocks": blocks, **extra}
    response = client.put(f"/admin/tenants/{tenant_id}", json=body, headers=admin_headers())
    assert response.status_code in (200, 201), response.text
    return response.json().get("api_key")


def prompt_of(words):
    return " ".join(["The for statement iterates over the items of a sequence."] * words)


def test_admin_round_trip(cluster):
    url = cluster.url
    with httpx.Client(base_url=url, timeout=60) as client:
        key = make_tenant(client, "roundtrip", 40)
        assert key and key.startswith("vt-")
        got = client.get("/admin/tenants/roundtrip", headers=admin_headers()).json()
        assert got["kv_budget_blocks"] == 40 and "api_key" not in got
        updated = client.put(
            "/admin/tenants/roundtrip", json={"kv_budget_blocks": 50}, headers=admin_headers()
        )
        assert updated.status_code == 200 and "api_key" not in updated.json()
        listed = client.get("/admin/tenants", headers=admin_headers()).json()["tenants"]
        assert any(t["tenant_id"] == "roundtrip" and t["kv_budget_blocks"] == 50 for t in listed)
        stolen = client.put(
            "/admin/tenants/thief",
            json={"kv_budget_blocks": 5, "api_key": key},
            headers=admin_headers(),
        )
        assert stolen.status_code == 409
        assert client.get("/admin/tenants/thief", headers=admin_headers()).status_code == 404
        assert client.delete("/admin/tenants/roundtrip", headers=admin_headers()).status_code == 200
        assert client.get("/admin/tenants/roundtrip", headers=admin_headers()).status_code == 404
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        revoked = client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert revoked.status_code == 401


def test_completions_and_streaming_agree(cluster):
    url = cluster.url
    with httpx.Client(base_url=url, timeout=120) as client:
        key = make_tenant(client, "reader", 200)
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": MODEL, "prompt": prompt_of(8), "max_tokens": 12, "temperature": 0.0}
        plain = client.post("/v1/completions", json=body, headers=headers)
        assert plain.status_code == 200, plain.text
        answer = plain.json()
        assert answer["object"] == "text_completion"
        assert answer["usage"]["completion_tokens"] == 12
        text = answer["choices"][0]["text"]
        assert text
        pieces = []
        with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
        ) as stream:
            assert stream.status_code == 200
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(pieces) == text
        chat = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            headers=headers,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        models = client.get("/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == [MODEL]


def test_tenant_over_quota_gets_429_while_others_are_served(cluster):
    url = cluster.url
    with httpx.Client(base_url=url, timeout=60) as client:
        small = make_tenant(client, "small", 12, max_queue_depth=0)  # no queue: a 429 at once
        big = make_tenant(client, "big", 400)
    # one request: ~110 prompt tokens + 350 new under H2O keep 0.5, evicting every step:
    # ceil(0.5 * 460 / 32) + 1 = 9 blocks of 32 (not the 15 it would hold unevicted); two
    # exceed 12
    body = {"model": MODEL, "prompt": prompt_of(10), "max_tokens": 350, "temperature": 0.0}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            small_auth = {"Authorization": f"Bearer {small}"}
            both = asyncio.gather(
                client.post("/v1/completions", json=body, headers=small_auth),
                client.post("/v1/completions", json=body, headers=small_auth),
            )
            other = await client.post(
                "/v1/completions",
                json={**body, "max_tokens": 8},
                headers={"Authorization": f"Bearer {big}"},
            )
            return await both, other

    (first, second), other = asyncio.run(scenario())
    statuses = sorted([first.status_code, second.status_code])
    assert statuses == [200, 429], (first.text, second.text)
    throttled = first if first.status_code == 429 else second
    assert int(throttled.headers["Retry-After"]) >= 1
    assert "KV budget" in throttled.json()["error"]["message"]
    assert other.status_code == 200, other.text


def test_status_shows_blocks_reclaimed_under_h2o(cluster):
    url = cluster.url
    with httpx.Client(base_url=url, timeout=60) as client:
        key = make_tenant(client, "reclaimer", 200)
        body = {"model": MODEL, "prompt": prompt_of(12), "max_tokens": 16}
        answer = client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert answer.status_code == 200, answer.text
        deadline = time.time() + 30
        while time.time() < deadline:
            status = client.get("/admin/status", headers=admin_headers()).json()
            fresh = [r for r in status["replicas"] if r.get("fresh")]
            if len(fresh) == 2 and status["blocks_reclaimed"] > 0:
                break
            time.sleep(0.5)
        assert len(fresh) == 2
        assert status["blocks_reclaimed"] > 0
        assert status["plan_version"] is not None


def scrape(address: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One replica's ``/metrics``: series name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://{address}/metrics"
    assert httpx.get(url, timeout=10).status_code == 401  # the admin token guards it
    text = httpx.get(url, headers=admin_headers(), timeout=10).text
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append((sample.labels, sample.value))
    return series


def repack_bytes_by_replica(client) -> dict[str, int]:
    status = client.get("/admin/status", headers=admin_headers()).json()
    return {r["id"]: r["repack_bytes"] for r in status["replicas"] if r.get("fresh")}


def test_every_replica_serves_prometheus_metrics_found_by_service_discovery(cluster):
    """``/admin/metrics/targets`` (Prometheus HTTP SD) lists each replica's endpoint; each
    serves its KV blocks and repack cost, the same figures as its report, and this
    request's repack shows there."""
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        key = make_tenant(client, "scraped", 200)
        before = repack_bytes_by_replica(client)
        body = {"model": MODEL, "prompt": prompt_of(12), "max_tokens": 16}
        answer = client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert answer.status_code == 200, answer.text
        assert client.get("/admin/metrics/targets").status_code == 403  # admin only
        deadline = time.time() + 30
        while time.time() < deadline:
            targets = client.get("/admin/metrics/targets", headers=admin_headers()).json()
            after = repack_bytes_by_replica(client)
            if len(targets) == 2 and sum(after.values()) > sum(before.values()):
                break
            time.sleep(0.5)
        time.sleep(1.0)  # the replicas' counters settle after the answer
        status = client.get("/admin/status", headers=admin_headers()).json()
    assert len(targets) == 2, targets
    assert sum(after.values()) > sum(before.values())  # H2O at keep 0.5 repacked this prompt
    by_address = {r["metrics_address"]: r for r in status["replicas"] if r.get("fresh")}
    for group in targets:
        (address,) = group["targets"]
        assert group["labels"] == {"vtoken_model_id": MODEL}
        replica = by_address[address]
        series = scrape(address)
        blocks = {
            labels["vtoken_block_state"]: value
            for labels, value in series["vtoken_replica_kv_blocks"]
            if labels["vtoken_replica_id"] == replica["id"]
        }
        assert blocks["total"] == replica["blocks_total"]
        assert blocks["free"] + blocks["held"] == blocks["total"]
        ((_, repack_bytes),) = series["vtoken_replica_kv_repack_bytes_total"]
        ((_, repack_seconds),) = series["vtoken_replica_kv_repack_duration_seconds_total"]
        assert repack_bytes == replica["repack_bytes"]
        assert (repack_seconds > 0) == (repack_bytes > 0)


@pytest.mark.parametrize(
    ("body", "headers", "status", "needle"),
    [
        ("{not json", "tenant", 400, "not valid JSON"),
        ({"model": "gpt-4", "prompt": "hi"}, "tenant", 404, "not served"),
        ({"model": MODEL, "prompt": prompt_of(60), "max_tokens": 8}, "tenant", 400, "exceeds"),
        # Over 8 characters per token of the context: refused before tokenizing.
        ({"model": MODEL, "prompt": prompt_of(200)}, "tenant", 400, "more than the limit"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "tenant", 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "stop": [""]}, "tenant", 400, "stop"),
        ({"model": MODEL, "prompt": "hi", "seed": 2**70}, "tenant", 400, "seed"),
        ({"model": MODEL, "prompt": "hi"}, None, 401, "missing API key"),
        ({"model": MODEL, "prompt": "hi"}, "Bearer vt-unknown-key-123456", 401, "unknown API key"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_service_continues(
    cluster, checker_key, body, headers, status, needle
):
    url = cluster.url
    key = checker_key
    with httpx.Client(base_url=url, timeout=60) as client:
        auth = {"tenant": {"Authorization": f"Bearer {key}"}, None: {}}.get(
            headers, {"Authorization": headers}
        )
        content = body if isinstance(body, str) else json.dumps(body)
        response = client.post(
            "/v1/completions", content=content, headers={**auth, "Content-Type": "application/json"}
        )
        assert response.status_code == status, response.text
        assert needle in response.json()["error"]["message"]
        good = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        ok = client.post("/v1/completions", json=good, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200


def test_wrong_admin_token_is_refused(cluster):
    url = cluster.url
    with httpx.Client(base_url=url, timeout=60) as client:
        response = client.get("/admin/tenants", headers={"Authorization": "Bearer nope"})
        assert response.status_code == 403
        bad = client.put("/admin/tenants/x", json={"kv_budget_blocks": 0}, headers=admin_headers())
        assert bad.status_code == 400


JOINED = ("vtoken.admission", "vtoken.route", "vtoken.replica.generate")


def test_one_request_is_one_connected_trace(cluster):
    url, sink = cluster.url, cluster.sink
    with httpx.Client(base_url=url, timeout=60) as client:
        key = make_tenant(client, "traced", 200)
        body = {"model": MODEL, "prompt": "trace me", "max_tokens": 3}
        response = client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200
    request_id = response.json()["id"]
    deadline = time.time() + 20
    while time.time() < deadline:
        spans = sink.snapshot()
        roots = [
            s
            for s in spans
            if s.name == "vtoken.ingress" and s.attributes.get("vtoken.request.id") == request_id
        ]
        if roots:
            trace = [s for s in spans if s.trace_id == roots[0].trace_id]
            names = {s.name for s in trace}
            if {*JOINED, "llm_request"} <= names:
                break
        time.sleep(0.5)
    assert roots, "no ingress span arrived"
    by_name = {s.name: s for s in trace}
    root = by_name["vtoken.ingress"]
    for name in JOINED:
        assert by_name[name].parent_span_id == root.span_id, name
        assert by_name[name].attributes.get("vtoken.tenant.id") == "traced"
    generate = by_name["vtoken.replica.generate"]
    # vLLM's own request span (its otlp_traces_endpoint) is a child of the replica's span.
    engine = by_name["llm_request"]
    assert engine.parent_span_id == generate.span_id
    assert engine.attributes.get("gen_ai.request.id") == request_id
    assert generate.attributes.get("vtoken.replica.id")
    kv = generate.events["vtoken.kv"]  # what vToken did to this request's KV
    assert kv["vtoken.kv.allocated_blocks"] == kv["vtoken.kv.ideal_blocks"]
    assert "trace me" not in json.dumps([s.attributes for s in trace], default=str)


def test_client_disconnect_releases_the_reservation(cluster):
    import redis

    from controlplane.keys import KeySpace

    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        key = make_tenant(client, "leaver", 200)
        body = {"model": MODEL, "prompt": prompt_of(4), "max_tokens": 300, "stream": True}
        headers = {"Authorization": f"Bearer {key}"}
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as stream:
            assert stream.status_code == 200
            next(stream.iter_lines())  # one event, then hang up
    reservations = KeySpace().reservations("leaver")
    store = redis.Redis.from_url(cluster.redis_url)
    deadline = time.time() + 15
    while store.hlen(reservations) and time.time() < deadline:
        time.sleep(0.2)
    assert store.hlen(reservations) == 0


def test_tenant_eviction_budget_caps_its_requests_kv(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        key = make_tenant(client, "capped", 200, eviction_budget_tokens=48)
        body = {"model": MODEL, "prompt": prompt_of(16), "max_tokens": 8}
        response = client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    deadline = time.time() + 20
    generate = None
    while generate is None and time.time() < deadline:
        spans = [
            s
            for s in cluster.sink.snapshot()
            if s.name == "vtoken.replica.generate"
            and s.attributes.get("vtoken.request.id") == request_id
        ]
        generate = spans[0] if spans else None
        time.sleep(0.3)
    assert generate is not None
    assert generate.events["vtoken.request_budget"]["vtoken.budget"] == 48
    kv = generate.events["vtoken.kv"]
    assert kv["vtoken.kv.live_tokens"] <= 48 < len(prompt_of(16).split())
    assert kv["vtoken.kv.evicted_tokens"] > 0


def test_cli_tenant_set_keeps_unchanged_fields_and_status_renders(cluster):
    from typer.testing import CliRunner

    from serving.cli import app

    runner = CliRunner()
    auth = ["--url", cluster.url, "--admin-token", ADMIN]
    created = runner.invoke(
        app,
        [
            "tenant",
            "set",
            "cli-t",
            "--kv-budget-blocks",
            "30",
            "--max-concurrent-requests",
            "3",
            *auth,
        ],
    )
    assert created.exit_code == 0, created.output
    changed = runner.invoke(app, ["tenant", "set", "cli-t", "--weight", "2", *auth])
    assert changed.exit_code == 0, changed.output
    printed = runner.invoke(app, ["tenant", "get", "cli-t", *auth]).output
    quota, _ = json.JSONDecoder().raw_decode(printed)  # Ray may log after the JSON
    assert (quota["kv_budget_blocks"], quota["max_concurrent_requests"], quota["weight"]) == (
        30,
        3,
        2.0,
    )
    new = runner.invoke(app, ["tenant", "set", "cli-new", "--weight", "2", *auth])
    assert new.exit_code == 2 and "--kv-budget-blocks is required" in new.output
    wrong = runner.invoke(app, ["tenant", "list", "--url", cluster.url, "--admin-token", "bad"])
    assert wrong.exit_code == 1 and "403" in wrong.output
    status = runner.invoke(app, ["status", *auth])
    assert status.exit_code == 0 and "cli-t" in status.output


def test_deploy_serve_configs_validate():
    from serving.config import load_serve_config

    for name in ("serve-local.yaml", "serve-gpu.yaml"):
        config = load_serve_config(Path(__file__).parents[2] / "deploy" / name)
        (application,) = config.applications
        assert application.import_path == "serving.app:build_app"
        from serving.app import AppArgs

        AppArgs.model_validate(application.args)
