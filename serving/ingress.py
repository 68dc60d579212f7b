"""The ingress: the FastAPI app and all its routes, and the Ray Serve deployment that runs it.

The OpenAI API is served by :mod:`serving.openai_http`'s pipeline; the admin API (tenants,
status) sits behind an admin token. :func:`build_api` makes the app around an
:class:`IngressState` (tests call it with their own); the deployment :class:`Ingress`
builds the real dependencies from its settings.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from pydantic import Field, ValidationError
from ray import serve

from controlplane import telemetry
from controlplane.auth import admin_token_ok, bearer, new_api_key
from controlplane.clock import SystemClock
from controlplane.models import TenantLimits, TenantQuota
from controlplane.redis_conn import RedisConfig, connect
from controlplane.status import cluster_status
from controlplane.tracing import configure_tracing
from serving.openai_http import HTTPError, IngressSettings, IngressState, parse_body


class TenantUpdate(TenantLimits):
    """``PUT /admin/tenants/{id}`` body: the quota fields, and optionally the tenant's key.

    Without ``api_key`` a new tenant gets a generated key, returned once in the response.
    """

    api_key: str | None = Field(default=None, min_length=16, max_length=256)


def _state(request: Request) -> IngressState:
    state: IngressState = request.app.state.ingress
    return state


def _admin_state(request: Request) -> IngressState:
    """The state, once the request carries the admin token (403 otherwise)."""
    state = _state(request)
    token = bearer(request.headers.get("authorization"))
    if not admin_token_ok(token, state.settings.admin_token):
        raise HTTPError(403, "admin token missing or wrong", "auth")
    return state


State = Annotated[IngressState, Depends(_state)]
AdminState = Annotated[IngressState, Depends(_admin_state)]
openai_routes = APIRouter()
admin_routes = APIRouter()


async def _http_error(_: Request, error: HTTPError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "code": error.status}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def build_api(state: IngressState) -> FastAPI:
    """The ingress app serving ``state``: OpenAI API, health, metrics, admin API."""
    api = FastAPI(title="vtoken", description="OpenAI-compatible serving with per-tenant KV quotas")
    api.state.ingress = state
    api.exception_handler(HTTPError)(_http_error)
    api.include_router(openai_routes)
    api.include_router(admin_routes)
    return api


# ---------------------------------------------------------------------- OpenAI API
@openai_routes.post("/v1/completions")
async def completions(request: Request, state: State) -> Response:
    return await state.serve(request, chat=False)


@openai_routes.post("/v1/chat/completions")
async def chat_completions(request: Request, state: State) -> Response:
    return await state.serve(request, chat=True)


@openai_routes.get("/v1/models")
async def models(request: Request, state: State) -> dict[str, Any]:
    await state.tenant(request)
    name = state.settings.model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "vtoken"}]}


@openai_routes.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


# ---------------------------------------------------------------------- admin API
@admin_routes.get("/metrics")
async def metrics(state: AdminState) -> Response:
    # Per-tenant series name every tenant: operators only.
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@admin_routes.put("/admin/tenants/{tenant_id}")
async def put_tenant(tenant_id: str, request: Request, state: AdminState) -> JSONResponse:
    update = await parse_body(request, TenantUpdate)
    try:
        quota = TenantQuota(tenant_id=tenant_id, **update.model_dump(exclude={"api_key"}))
    except ValidationError as error:
        raise HTTPError(
            400, f"invalid tenant: {error.errors()[0]['msg']}", "invalid_request"
        ) from None
    existed = await state.store.get_quota(tenant_id) is not None
    api_key = update.api_key or (None if existed else new_api_key())
    # The key first: a key owned by another tenant is refused before anything changes.
    if api_key is not None and not await state.tenant_keys.set_key(tenant_id, api_key):
        raise HTTPError(409, "this API key belongs to another tenant", "conflict")
    await state.store.put_quota(quota)
    body: dict[str, Any] = quota.model_dump()
    if api_key is not None:
        body["api_key"] = api_key
    return JSONResponse(body, status_code=200 if existed else 201)


@admin_routes.get("/admin/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, state: AdminState) -> dict[str, Any]:
    quota = await state.store.get_quota(tenant_id)
    if quota is None:
        raise HTTPError(404, f"no tenant {tenant_id!r}", "not_found")
    return quota.model_dump()


@admin_routes.get("/admin/tenants")
async def list_tenants(state: AdminState) -> dict[str, Any]:
    quotas = await state.store.list_quotas()
    return {"tenants": [quota.model_dump() for _, quota in sorted(quotas.items())]}


@admin_routes.delete("/admin/tenants/{tenant_id}")
async def delete_tenant(tenant_id: str, state: AdminState) -> dict[str, Any]:
    if not await state.store.delete_quota(tenant_id):
        raise HTTPError(404, f"no tenant {tenant_id!r}", "not_found")
    revoked = await state.tenant_keys.delete_tenant(tenant_id)
    return {"deleted": tenant_id, "revoked_keys": revoked}


@admin_routes.get("/admin/status")
async def status(state: AdminState) -> dict[str, Any]:
    return await cluster_status(state.store)


# ---------------------------------------------------------------------- deployment
@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0.1})
@serve.ingress()
class Ingress:
    """One ingress replica: builds the real Redis client, clock, tokenizer and tracer from
    ``settings`` (an :class:`IngressSettings` as a dict); Serve then asks it for its app."""

    def __init__(self, replicas: Any, settings: dict[str, Any], controller: Any = None) -> None:
        from transformers import AutoTokenizer

        configure_tracing("vtoken-ingress")
        config = IngressSettings(**settings)
        self.state = IngressState(
            config,
            replicas,
            redis=connect(RedisConfig(url=config.redis_url)),
            clock=SystemClock(),
            tokenizer=AutoTokenizer.from_pretrained(config.tokenizer_path),
            tracer=trace.get_tracer(telemetry.TRACER_INGRESS),
        )
        self.controller = controller  # bound so the controller deploys with the app

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.state)
