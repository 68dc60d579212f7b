"""The Ray Serve application: ingress -> (vtoken router) -> engine replicas, plus the
controller. ``build_app`` is the Serve config's ``import_path`` target."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from controlplane.openai_models import GenerateRequest
from controlplane.serve_controller import ControllerDeployment
from controlplane.serve_ingress import Ingress
from controlplane.serve_router import VTokenRequestRouter
from controlplane.tracing import configure_tracing
from workers.replica import EngineHost, ReplicaReporter, ReplicaSettings


@serve.deployment(name="engine", health_check_period_s=5, health_check_timeout_s=30)
class EngineReplica:
    def __init__(self, settings: dict[str, Any]) -> None:
        configure_tracing("vtoken-replica")
        replica_id = serve.get_replica_context().replica_id.unique_id
        self.host = EngineHost(ReplicaSettings(**settings), replica_id)
        self.reporter: ReplicaReporter | None = None
        self._task: asyncio.Task | None = None
        if self.host.settings.redis_url:
            self.reporter = ReplicaReporter(
                self.host, self.host.settings.redis_url, self.host.settings.key_prefix
            )
            self._task = asyncio.get_event_loop().create_task(self.reporter.run())

    async def generate(self, request: dict[str, Any]):  # type: ignore[no-untyped-def]
        async for chunk in self.host.generate(GenerateRequest.model_validate(request)):
            yield chunk.model_dump()

    async def counters(self) -> dict[str, Any]:
        return (await self.host.refresh_counters()).model_dump()

    async def check_health(self) -> None:
        await self.host.check_health()
        if self._task is not None and self._task.done():
            raise RuntimeError("report loop stopped")

    def record_routing_stats(self) -> dict[str, Any]:
        counters = self.host.counters
        return {"free_blocks": counters.free_blocks, "reclaimable": counters.reclaimable_blocks}

    async def __del__(self) -> None:
        if self.reporter is not None:
            self.reporter.stop.set()
        self.host.shutdown()


class AppArgs(BaseModel):
    """Arguments of ``build_app`` (the ``args`` of a Serve config application)."""

    model_config = ConfigDict(extra="forbid")

    redis_url: str
    admin_token: str = Field(default_factory=lambda: secrets.token_urlsafe(16), min_length=8)
    key_prefix: str = "vtoken"
    num_replicas: int = Field(default=1, ge=1)
    replica_num_cpus: float = Field(default=1.0, ge=0)
    replica_num_gpus: float = Field(default=0.0, ge=0)
    max_ongoing_requests: int = Field(default=16, ge=1)
    controller_period_s: float = Field(default=0.5, gt=0)
    engine: ReplicaSettings = Field(default_factory=ReplicaSettings)


def build_app(args: dict[str, Any]) -> Application:
    """Serve builder: validates ``args`` (a bad value fails ``serve run`` with its field)."""
    from vtoken.models import resolve_model

    config = AppArgs.model_validate(args)
    engine_settings = config.engine.model_copy(
        update={
            "redis_url": config.engine.redis_url or config.redis_url,
            "key_prefix": config.key_prefix,
        }
    )
    router = RequestRouterConfig(
        request_router_class=VTokenRequestRouter,  # type: ignore[arg-type]
        request_router_kwargs={"redis_url": config.redis_url, "key_prefix": config.key_prefix},
    )
    engine = EngineReplica.options(  # type: ignore[attr-defined]
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": config.replica_num_cpus,
            "num_gpus": config.replica_num_gpus,
        },
        request_router_config=router,
    ).bind(engine_settings.model_dump())
    controller = ControllerDeployment.bind(  # type: ignore[attr-defined]
        config.redis_url, config.key_prefix, config.controller_period_s
    )
    ingress_settings = {
        "model_name": engine_settings.name,
        "tokenizer_path": str(resolve_model(engine_settings.model)),
        "max_model_len": engine_settings.max_model_len,
        "block_size": engine_settings.block_size,
        "admin_token": config.admin_token,
        "redis_url": config.redis_url,
        "key_prefix": config.key_prefix,
    }
    return Ingress.bind(engine, ingress_settings, controller)  # type: ignore[attr-defined]
