"""The ingress on a real HTTP port for the fuzzer: uvicorn in a thread with its own event
loop (the Redis client and the app live on that loop), a fake engine, one tenant."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import uvicorn
from opentelemetry.trace import NoOpTracer

from controlplane.admission import AdmissionConfig
from controlplane.auth import TenantKeys, new_api_key
from controlplane.clock import SystemClock
from controlplane.keys import KeySpace
from controlplane.models import TenantQuota
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from serving.ingress import build_api
from serving.openai_http import IngressState
from serving.settings import IngressSettings
from tests.redis_server import free_port, unique_keys
from tests.serving.ingress_harness import ADMIN, BLOCK_SIZE, MODEL, FakeReplicas

TENANT = "fuzz-tenant"


@dataclass(frozen=True, slots=True)
class FuzzServer:
    url: str
    tenant_key: str
    keys: KeySpace


class ServerThread:
    """Starts the ingress on a free loopback port; ``stop()`` ends it."""

    def __init__(self, redis_url: str, tokenizer: Any) -> None:
        self.redis_url, self.tokenizer = redis_url, tokenizer
        self.port, self.keys, self.tenant_key = free_port(), unique_keys(), new_api_key()
        self.server: uvicorn.Server | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    def start(self) -> FuzzServer:
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("the fuzz server did not start")
        return FuzzServer(f"http://127.0.0.1:{self.port}", self.tenant_key, self.keys)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(30)

    async def _serve(self) -> None:
        settings = IngressSettings(
            model_name=MODEL,
            tokenizer_path="unused: the tokenizer is injected",
            max_model_len=128,
            admin_token=ADMIN,
            redis_url=self.redis_url,
            admission=AdmissionConfig(block_size=BLOCK_SIZE),
            key_prefix=self.keys.prefix,
            api_docs="admin",
        )
        redis = connect(RedisConfig(url=self.redis_url))
        clock = SystemClock()
        replicas = FakeReplicas(lambda: state)
        state = IngressState(settings, replicas, redis, clock, self.tokenizer, NoOpTracer())
        await RedisStore(redis, self.keys).put_quota(
            TenantQuota(tenant_id=TENANT, kv_budget_blocks=64)
        )
        await TenantKeys(redis, self.keys).add_key(TENANT, self.tenant_key)
        config = uvicorn.Config(
            build_api(state), host="127.0.0.1", port=self.port, log_level="error", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        serving = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        self.ready.set()
        await serving
        state.tokenize_pool.shutdown()
        await redis.aclose()
