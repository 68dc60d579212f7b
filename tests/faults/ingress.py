"""The ingress in-process for fault tests: a real redis-server, SmolLM2's tokenizer, an
injected clock and a fake engine handle whose answers the test holds, fails or cancels."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import redis.asyncio as aioredis

from controlplane import telemetry
from controlplane.admission import AdmissionConfig
from controlplane.clock import Clock
from controlplane.keys import KeySpace
from controlplane.models import TenantQuota
from serving.ingress import build_api
from serving.openai_http import IngressState
from serving.settings import IngressSettings
from tests.redis_server import unique_keys

MODEL = "smollm2"
PROMPT = "Say hello to the fault suite"


class ReplicaStream:
    """One answer: "Hello", then (once `gate` opens) " there", or an exception when the
    handle was told to `fail`, or nothing more when told to `cut`. Records whether the
    caller cancelled it (Serve's `DeploymentResponseGenerator.cancel`, which aborts the
    engine request)."""

    def __init__(self, handle: FakeReplicas, request: dict[str, Any]) -> None:
        self.cancelled = False
        self._chunks = self._answer(handle, request)

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks

    @staticmethod
    async def _answer(
        handle: FakeReplicas, request: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        prompt_tokens = len(request["prompt_token_ids"])
        yield {"text": "Hello", "prompt_tokens": prompt_tokens, "completion_tokens": 1}
        handle.arrived.set()
        await handle.gate.wait()
        if handle.fail:
            raise RuntimeError("replica died: ActorDiedError at 10.1.2.3:6379 Traceback (...)")
        if handle.cut:
            return  # the stream just ends: no finish reason, no error
        yield {
            "text": " there",
            "finish_reason": "length",
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 2,
        }


class FakeReplicas:
    """A Serve handle to the engine deployment (``options(stream=True).generate.remote``)."""

    def __init__(self) -> None:
        self.streams: list[ReplicaStream] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.arrived = asyncio.Event()
        self.fail = False
        self.cut = False
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, stream: bool) -> FakeReplicas:
        assert stream
        return self

    def _remote(self, request: dict[str, Any]) -> ReplicaStream:
        self.streams.append(ReplicaStream(self, request))
        return self.streams[-1]


@dataclass
class Ingress:
    client: httpx.AsyncClient
    state: IngressState
    replicas: FakeReplicas

    async def add_tenant(self, tenant_id: str, **limits: Any) -> TenantQuota:
        """Write the quota and a key (`key-<tenant>`) straight into Redis."""
        quota = TenantQuota(tenant_id=tenant_id, **limits)
        await self.state.store.put_quota(quota)
        await self.state.tenant_keys.set_key(tenant_id, self.api_key(tenant_id))
        return quota

    @staticmethod
    def api_key(tenant_id: str) -> str:
        return f"vt-fault-suite-key-{tenant_id}"

    async def complete(self, tenant_id: str, **body: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **body}
        headers = {"Authorization": f"Bearer {self.api_key(tenant_id)}"}
        return await self.client.post("/v1/completions", json=body, headers=headers)


def make_ingress(
    redis: aioredis.Redis,
    clock: Clock,
    tokenizer: Any,
    keys: KeySpace | None = None,
    reservation_ttl_s: float = 600.0,
) -> tuple[IngressState, FakeReplicas]:
    keys = keys or unique_keys()
    config = IngressSettings(
        model_name=MODEL,
        tokenizer_path="unused: the tokenizer is injected",
        max_model_len=128,
        admin_token="admin-token-of-the-fault-suite",
        redis_url="unused: the client is injected",
        admission=AdmissionConfig(block_size=16, reservation_ttl_s=reservation_ttl_s),
        key_prefix=keys.prefix,
    )
    replicas = FakeReplicas()
    state = IngressState(config, replicas, redis, clock, tokenizer, telemetry.NOOP_TRACER)
    return state, replicas


def client_of(state: IngressState) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_api(state))
    return httpx.AsyncClient(transport=transport, base_url="http://ingress", timeout=30)


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except `[DONE]`."""
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


def leaks_internals(text: str, redis_port: int) -> bool:
    """True when a client-facing text names Redis's address or carries a traceback or a
    replica's exception text."""
    needles = (str(redis_port), "127.0.0.1", "Traceback", "10.1.2.3", "ActorDiedError")
    return any(needle in text for needle in needles)


async def wait_released(admission: Any, tenant_id: str, timeout_s: float) -> int:
    """The tenant's reserved blocks once they reach 0 or `timeout_s` passed."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (held := await admission.reserved_blocks(tenant_id)) and (
        asyncio.get_running_loop().time() < deadline
    ):
        await asyncio.sleep(0.05)
    return int(held)
