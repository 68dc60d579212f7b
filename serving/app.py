"""The Ray Serve application: ingress -> (vtoken router) -> engine replicas, plus the
controller. ``build_app`` is the Serve config's ``import_path`` target."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, model_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from controlplane.admin_token import AdminTokenSource, check_admin_token
from controlplane.openai_models import DEFAULT_MAX_N, MAX_N
from controlplane.redis_conn import RedisConfig
from serving.controller import ControllerDeployment
from serving.engine_host import EngineReplica, ReplicaSettings
from serving.ingress import Ingress
from serving.input_limits import InputLimits
from serving.router import VTokenRequestRouter


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


def build_app(args: dict[str, Any], *, admin_token: str | None = None) -> Application:
    """Serve builder: validates ``args`` (a bad value fails ``serve run`` with its field).

    The admin token is ``admin_token`` when a Python caller passes one, else read from the
    environment or the secret file ``args`` name; either way a placeholder or a token under
    32 characters fails here, at start, with a ``ValueError``."""
    from workers.config import VTokenConfig
    from workers.models import resolve_model

    config = AppArgs.model_validate(args)
    token = (
        check_admin_token(admin_token, "build_app(admin_token=...)")
        if admin_token is not None
        else config.read(os.environ)
    )
    redis_url = config.read_redis_url(os.environ)
    engine_settings = config.engine.model_copy(
        update={
            "redis_url": config.engine.redis_url or redis_url,
            "key_prefix": config.key_prefix,
        }
    )
    # The router's kwargs are part of the engine deployment's config (Serve shows it):
    # a URL read from the environment (it may carry a password) is named, not copied.
    where = (
        {"redis_url": config.redis_url}
        if config.redis_url is not None
        else {"redis_url_env": config.redis_url_env}
    )
    routing = {}
    if config.router == "vtoken":
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=VTokenRequestRouter,  # type: ignore[arg-type]
            request_router_kwargs={**where, "key_prefix": config.key_prefix},
        )
    elif config.router == "serve_prefix_cache_affinity":
        from serving.prefix_router import ServePrefixCacheAffinityRouter

        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=ServePrefixCacheAffinityRouter,  # type: ignore[arg-type]
        )
    engine = EngineReplica.options(  # type: ignore[attr-defined]
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": config.replica_num_cpus,
            "num_gpus": config.replica_num_gpus,
            "resources": config.replica_resources,
        },
        **routing,
    ).bind(engine_settings.model_dump(), token)  # the token guards each replica's /metrics
    controller = ControllerDeployment.bind(  # type: ignore[attr-defined]
        redis_url, config.key_prefix, config.controller_period_s
    )
    vtoken = VTokenConfig.model_validate(engine_settings.vtoken)
    active_kv = config.admission == "active_kv"
    # Whatever the admission mode, a tenant's cap bounds its requests (worst_case too).
    protection = vtoken.admission_protection()
    ingress_settings = {
        "model_name": engine_settings.name,
        "tokenizer_path": str(resolve_model(engine_settings.model)),
        "max_model_len": engine_settings.max_model_len,
        "block_size": engine_settings.block_size,
        "admin_token": token,
        "limits": config.limits.model_dump(),
        "redis_url": redis_url,
        "key_prefix": config.key_prefix,
        "keep_ratio": vtoken.admission_keep_ratio() if active_kv else None,
        "max_n": config.max_n,
        "floor_tokens": vtoken.admission_floor_tokens() if active_kv else None,
        "protected_tokens": protection.tokens,
        "protected_fraction": protection.fraction,
    }
    ingress = Ingress.options(  # type: ignore[attr-defined]
        max_ongoing_requests=config.ingress_max_ongoing_requests
    )
    return ingress.bind(engine, ingress_settings, controller)  # type: ignore[no-any-return]
