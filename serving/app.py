"""The Ray Serve application: ingress -> (vtoken router) -> engine replicas, plus the
controller. ``build_app`` is the Serve config's ``import_path`` target."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, model_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from controlplane.admin_token import AdminTokenSource, check_admin_token
from controlplane.admission import AdmissionConfig
from controlplane.kv_bounds import SlidingWindows
from controlplane.openai_models import DEFAULT_MAX_N, MAX_N
from controlplane.redis_conn import RedisConfig
from serving.controller import ControllerDeployment
from serving.engine_replica import EngineReplica
from serving.ingress import Ingress
from serving.input_limits import InputLimits
from serving.router import VTokenRequestRouter
from serving.settings import ApiDocs, IngressSettings, ReplicaSettings


class AppArgs(AdminTokenSource):
    """Arguments of ``build_app`` (the ``args`` of a Serve config application).

    The admin token is never one of them: it is read from ``$admin_token_env`` or
    ``admin_token_file`` (see :class:`AdminTokenSource`). Nor is a Redis password: a
    ``redis_url`` that carries one is refused; leave ``redis_url`` out and the URL is read
    at start from ``$redis_url_env`` (see :meth:`read_redis_url`)."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    redis_url: str | None = None
    redis_url_env: str = Field(default="VTOKEN_REDIS_URL", min_length=1)
    key_prefix: str = "vtoken"
    num_replicas: int = Field(default=1, ge=1)
    replica_num_cpus: float = Field(default=1.0, ge=0)
    replica_num_gpus: float = Field(default=0.0, ge=0)
    replica_resources: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    """Ray custom resources each engine replica needs (e.g. ``{"engine_node": 1}`` to keep
    engines off the head node, whose start command then does not offer it)."""
    max_ongoing_requests: int = Field(default=16, ge=1)
    """Requests one engine replica runs at once (the engine batches them)."""
    ingress_max_ongoing_requests: int = Field(default=1024, ge=1)
    """Requests one ingress replica holds at once: it only authenticates, admits and
    relays streams, so far more than Serve's default of 5 (which would queue every request
    past the fifth, admin status included, behind long streams)."""
    controller_period_s: float = Field(default=0.5, gt=0)
    engine: ReplicaSettings = Field(default_factory=ReplicaSettings)
    limits: InputLimits = Field(default_factory=InputLimits)
    max_n: int = Field(default=DEFAULT_MAX_N, ge=1, le=MAX_N)
    """Choices one request may ask for (``n``); each is its own sequence with its own KV."""
    router: Literal["vtoken", "serve_default", "serve_prefix_cache_affinity"] = "vtoken"
    """``vtoken``: engine replicas are chosen by the control plane's routing plan and prefix
    affinity (``VTokenRequestRouter``); ``serve_default``: by Ray Serve's default router
    (power of two choices on queue length), the baseline of ``vtoken bench router``;
    ``serve_prefix_cache_affinity``: by Ray Serve's ``PrefixCacheAffinityRouter``, a
    baseline of ``vtoken bench prefix``."""
    admission: Literal["active_kv", "worst_case"] = "active_kv"
    """``active_kv``: a request counts its prompt until prefill ends, then its policy's
    bound; ``worst_case``: it counts prompt + max_tokens for its whole life, no credit for
    eviction (a tenant's own ``eviction_budget_tokens`` still bounds it) - the baseline
    of ``vtoken bench quotas``."""
    cluster_kv_blocks: int | None = Field(default=None, ge=1)
    """The most KV blocks all tenants' admitted requests may reserve together (``None``,
    the default: no bound, tenants' budgets alone decide). Past it requests wait in their
    tenants' queues and are admitted in weighted-fair turn as room frees."""
    api_docs: ApiDocs = "off"
    """Who may read the OpenAPI document (every route and body, the admin API's included):
    ``off``, ``admin`` (``GET /openapi.json`` with the admin token) or ``public`` (it and
    the ``/docs`` and ``/redoc`` pages, to anyone)."""

    @model_validator(mode="before")
    @classmethod
    def _no_token_literal(cls, data: Any) -> Any:
        if isinstance(data, dict) and "admin_token" in data:
            raise ValueError(
                "admin_token must not be written in the Serve config: set "
                "$VTOKEN_ADMIN_TOKEN (or admin_token_env / admin_token_file) instead"
            )
        url = data.get("redis_url") if isinstance(data, dict) else None
        if isinstance(url, str) and urlsplit(url).password:
            raise ValueError(
                "redis_url must not carry a password in the Serve config: leave redis_url "
                "out and set $VTOKEN_REDIS_URL (or name another variable in redis_url_env)"
            )
        return data

    def read_redis_url(self, environ: Mapping[str, str]) -> str:
        """``redis_url`` when the config sets one, else ``$redis_url_env``; ``ValueError``
        when neither is set or the URL's scheme is not Redis's (never the URL itself, which
        may hold a password)."""
        url = self.redis_url if self.redis_url is not None else environ.get(self.redis_url_env)
        if not url:
            raise ValueError(
                f"no Redis URL: set ${self.redis_url_env} (or redis_url in the Serve config)"
            )
        scheme = urlsplit(url).scheme
        try:
            RedisConfig(url=url)
        except ValueError:
            raise ValueError(f"the Redis URL has the unsupported scheme {scheme!r}") from None
        return url

    def engine_settings(self, redis_url: str) -> ReplicaSettings:
        """The engine replicas' settings: ``engine``, reporting to ``redis_url`` (unless it
        names its own) under the app's key prefix."""
        return self.engine.model_copy(
            update={"redis_url": self.engine.redis_url or redis_url, "key_prefix": self.key_prefix}
        )

    def ingress_settings(
        self, engine: ReplicaSettings, admin_token: str, redis_url: str
    ) -> IngressSettings:
        """The ingress replicas' settings, serving ``engine`` replicas."""
        from workers.models import resolve_model

        model_dir = resolve_model(engine.model)
        admission = admission_config(engine, self.admission, model_dir)
        return IngressSettings(
            model_name=engine.name,
            tokenizer_path=str(model_dir),
            max_model_len=engine.max_model_len,
            admin_token=admin_token,
            redis_url=redis_url,
            admission=dataclasses.replace(admission, cluster_kv_blocks=self.cluster_kv_blocks),
            key_prefix=self.key_prefix,
            max_n=self.max_n,
            limits=self.limits,
            api_docs=self.api_docs,
            scheduling_policy=engine.scheduling_policy,
        )

    def routing_options(self) -> dict[str, Any]:
        """The engine deployment's request router (none: Serve's default)."""
        # The router's kwargs are part of the engine deployment's config (Serve shows it):
        # a URL read from the environment (it may carry a password) is named, not copied.
        where = (
            {"redis_url": self.redis_url}
            if self.redis_url is not None
            else {"redis_url_env": self.redis_url_env}
        )
        routing = {}
        if self.router == "vtoken":
            routing["request_router_config"] = RequestRouterConfig(
                request_router_class=VTokenRequestRouter,  # type: ignore[arg-type]
                request_router_kwargs={**where, "key_prefix": self.key_prefix},
            )
        elif self.router == "serve_prefix_cache_affinity":
            from serving.prefix_router import ServePrefixCacheAffinityRouter

            routing["request_router_config"] = RequestRouterConfig(
                request_router_class=ServePrefixCacheAffinityRouter,  # type: ignore[arg-type]
            )
        return routing


def build_app(args: dict[str, Any], *, admin_token: str | None = None) -> Application:
    """Serve builder: validates ``args`` (a bad value fails ``serve run`` with its field)
    and hands each deployment its typed settings whole.

    The admin token is ``admin_token`` when a Python caller passes one, else read from the
    environment or the secret file ``args`` name; either way a placeholder or a token under
    32 characters fails here, at start, with a ``ValueError``."""
    config = AppArgs.model_validate(args)
    token = (
        check_admin_token(admin_token, "build_app(admin_token=...)")
        if admin_token is not None
        else config.read(os.environ)
    )
    redis_url = config.read_redis_url(os.environ)
    engine_settings = config.engine_settings(redis_url)
    engine = EngineReplica.options(  # type: ignore[attr-defined]
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": config.replica_num_cpus,
            "num_gpus": config.replica_num_gpus,
            "resources": config.replica_resources,
        },
        **config.routing_options(),
    ).bind(engine_settings, token)  # the token guards each replica's /metrics
    controller = ControllerDeployment.bind(  # type: ignore[attr-defined]
        redis_url, config.key_prefix, config.controller_period_s
    )
    ingress_settings = config.ingress_settings(engine_settings, token, redis_url)
    ingress = Ingress.options(  # type: ignore[attr-defined]
        max_ongoing_requests=config.ingress_max_ongoing_requests
    )
    return ingress.bind(engine, ingress_settings, controller)  # type: ignore[no-any-return]


def admission_config(
    engine: ReplicaSettings,
    admission: Literal["active_kv", "worst_case"],
    model_dir: str | Path | None = None,
) -> AdmissionConfig:
    """How the ingresses admit requests to ``engine`` replicas: in ``active_kv`` mode, what
    the engines' policy evicts to and keeps (``VTokenConfig.admission_keep_ratio`` and
    ``admission_floor_tokens``) and their prefill chunk when it evicts during prefill
    (``admission_prefill_chunk_tokens``); in either mode, what it protects past any budget
    (``VTokenConfig.admission_protection``), since a tenant's cap bounds its requests in
    both, and a hybrid model's sliding-window groups (read from the config of the model in
    ``model_dir``, by default ``engine.model``'s folder: ``workers.model_windows``), which
    hold up to their window whatever the policy evicts."""
    from workers.model_windows import sliding_windows
    from workers.models import resolve_model

    windows = sliding_windows(model_dir if model_dir is not None else resolve_model(engine.model))
    vtoken = engine.vtoken
    active_kv = admission == "active_kv"
    protection = vtoken.admission_protection(engine.block_size)
    chunk = vtoken.admission_prefill_chunk_tokens(engine.max_num_batched_tokens)
    return AdmissionConfig(
        block_size=engine.block_size,
        keep_ratio=vtoken.admission_keep_ratio() if active_kv else None,
        floor_tokens=vtoken.admission_floor_tokens(engine.block_size) if active_kv else None,
        protected_tokens=protection.tokens,
        protected_fraction=protection.fraction,
        prefill_chunk_tokens=chunk if active_kv else None,
        sliding=SlidingWindows(windows, engine.max_num_batched_tokens, engine.max_model_len),
    )
