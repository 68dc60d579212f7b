"""The Ray Serve application: ingress -> (vtoken router) -> engine replicas, plus the
controller. ``build_app`` is the Serve config's ``import_path`` target."""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from serving.controller import ControllerDeployment
from serving.engine_host import EngineReplica, ReplicaSettings
from serving.ingress import Ingress
from serving.router import VTokenRequestRouter


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


def policy_keep_ratio(vtoken: dict[str, Any]) -> float | None:
    """The engines' keep ratio when their policy holds it every step, eagerly (admission
    bounds a request without a tenant cap by it); ``None`` otherwise: on-demand eviction
    keeps tokens beyond the ratio while memory is free, so only the request's own length
    bounds it (a tenant's cap is held every step in both modes)."""
    from workers.config import VTokenConfig

    config = VTokenConfig.model_validate(vtoken)
    policy = config.make_policy()
    if config.eviction == "on_demand":
        return None  # requests keep more than the ratio while memory is free
    if not (policy.holds_budget_every_step and policy.needs_budget):
        return None
    return config.keep_ratio


def build_app(args: dict[str, Any]) -> Application:
    """Serve builder: validates ``args`` (a bad value fails ``serve run`` with its field)."""
    from workers.models import resolve_model

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
        "keep_ratio": policy_keep_ratio(engine_settings.vtoken),
    }
    return Ingress.bind(engine, ingress_settings, controller)  # type: ignore[attr-defined]
