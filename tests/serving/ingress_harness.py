"""The ingress app in-process for tests: a real redis-server, SmolLM2's tokenizer, a fake
clock, an in-memory span exporter and a fake engine handle (the e2e tests drive the real
engines). The fixtures that use it are in ``tests/serving/conftest.py``."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import httpx
from fastapi import FastAPI
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from ray.exceptions import ActorDiedError

from controlplane.admission import AdmissionConfig
from controlplane.keys import KeySpace
from controlplane.redis_conn import RedisConfig, connect
from serving.ingress import build_api
from serving.input_limits import InputLimits
from serving.openai_http import IngressState
from serving.settings import IngressSettings
from tests.controlplane.fakes import FakeClock
from tests.redis_server import unique_keys

ADMIN = secrets.token_urlsafe(32)
MODEL = "smollm2"
BLOCK_SIZE = 16
PROMPT = "The secret prompt zebra-42 must never reach a span"


class FakeReplicas:
    """A Serve handle to engines answering "Hello there" in two chunks. Records every
    request; while answering, waits on `prefill_gate` before the first chunk and on `gate`
    before the second, and notes the tenant's reserved blocks. ``dead`` replicas are
    called next: each raises ``dead_with`` (Ray's ``ActorDiedError``) before its first
    chunk; ``fail`` makes a replica fail after its first chunk (``fail_with`` says how)."""

    def __init__(self, state_of: Any) -> None:
        self.requests: list[dict[str, Any]] = []
        self.reserved_while_answering: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.prefill_gate = asyncio.Event()
        self.prefill_gate.set()
        self.arrived = asyncio.Event()
        self.fail = False
        self.fail_with: type[Exception] = RuntimeError
        self.dead = 0
        self.dead_with: Callable[[], Exception] = ActorDiedError
        self._state_of = state_of
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, stream: bool) -> FakeReplicas:
        assert stream
        return self

    def _remote(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.requests.append(request)
        return self._answer(request)

    async def _answer(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        if self.dead > 0:
            self.dead -= 1
            raise self.dead_with()
        admission = self._state_of().admission
        self.reserved_while_answering.append(await admission.reserved_blocks(request["tenant_id"]))
        self.arrived.set()
        await self.prefill_gate.wait()
        prompt_tokens, n = len(request["prompt_token_ids"]), request.get("n", 1)
        for index in range(n):  # two chunks per choice (the request's n)
            yield {
                "index": index,
                "text": "Hello",
                "prompt_tokens": prompt_tokens,
                "completion_tokens": index + 1,
            }
        await self.gate.wait()
        if self.fail:
            raise self.fail_with("replica died")
        for index in range(n):
            yield {
                "index": index,
                "text": " there",
                "finish_reason": "length",
                "prompt_tokens": prompt_tokens,
                "cached_tokens": prompt_tokens // 2,  # the replica's prefix cache served half
                "completion_tokens": n + index + 1,
            }


@dataclass
class Ingress:
    client: httpx.AsyncClient
    state: IngressState
    replicas: FakeReplicas
    clock: FakeClock
    spans: InMemorySpanExporter
    keys: KeySpace
    api: FastAPI
    api_keys: dict[str, str] = field(default_factory=dict)
    metric_reader: InMemoryMetricReader | None = None

    def metric_points(self, name: str) -> list[Any]:
        """The data points of OpenTelemetry metric ``name`` the ingress recorded so far."""
        assert self.metric_reader is not None
        data = self.metric_reader.get_metrics_data()
        return [
            point
            for resource in (data.resource_metrics if data else [])
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    async def add_tenant(self, tenant_id: str, **limits: Any) -> str:
        response = await self.client.put(
            f"/admin/tenants/{tenant_id}", json=limits, headers=admin()
        )
        assert response.status_code == 201, response.text
        self.api_keys[tenant_id] = response.json()["api_key"]
        return self.api_keys[tenant_id]

    async def complete(self, api_key: str, **body: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **body}
        return await self.client.post("/v1/completions", json=body, headers=bearer(api_key))

    def finished(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans.get_finished_spans() if span.name == name]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def admin() -> dict[str, str]:
    return bearer(ADMIN)


@contextlib.asynccontextmanager
async def running_ingress(
    redis_url: str,
    tokenizer: Any,
    limits: InputLimits | None = None,
    admission: AdmissionConfig | None = None,
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs",
) -> AsyncIterator[Ingress]:
    """An ingress on a fresh key space; at exit asserts that every answered or refused
    request gave its reservation back."""
    keys = unique_keys()
    settings = IngressSettings(
        model_name=MODEL,
        tokenizer_path="unused: the tokenizer is injected",
        max_model_len=128,
        admin_token=ADMIN,
        redis_url=redis_url,
        admission=admission if admission is not None else AdmissionConfig(block_size=BLOCK_SIZE),
        key_prefix=keys.prefix,
        limits=limits if limits is not None else InputLimits(),
        scheduling_policy=scheduling_policy,
    )
    redis, clock, spans = connect(RedisConfig(url=redis_url)), FakeClock(), InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    replicas = FakeReplicas(lambda: state)
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    state = IngressState(
        settings, replicas, redis, clock, tokenizer, provider.get_tracer("test"), meter
    )
    api = build_api(state)
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        under_test = Ingress(client, state, replicas, clock, spans, keys, api, metric_reader=reader)
        yield under_test
    for tenant_id in under_test.api_keys:
        assert await state.admission.reserved_blocks(tenant_id) == 0, tenant_id
    assert await state.queue.queues() == {}  # no ticket outlives its request
    await state.queue.check_invariants()
    state.tokenize_pool.check_invariants()
    state.tokenize_pool.shutdown()
    await redis.aclose()
