"""The ingress: the FastAPI app and all its routes, as a Ray Serve deployment.

The OpenAI API is served by :mod:`serving.openai_http`'s pipeline; the admin API (tenants,
status) sits behind an admin token."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from controlplane.auth import admin_token_ok, bearer, new_api_key
from controlplane.models import TenantQuota
from controlplane.status import cluster_status
from serving.openai_http import HTTPError, IngressSettings, IngressState, parse_body

api = FastAPI(title="vtoken", description="OpenAI-compatible serving with per-tenant KV quotas")


@api.exception_handler(HTTPError)
async def _http_error(_: Request, error: HTTPError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "code": error.status}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class TenantUpdate(BaseModel):
    """``PUT /admin/tenants/{id}`` body: the quota fields, and optionally the tenant's key.

    Without ``api_key`` a new tenant gets a generated key, returned once in the response.
    """

    model_config = ConfigDict(extra="forbid")

    kv_budget_blocks: int = Field(gt=0)
    weight: float = Field(default=1.0, gt=0, le=1000)
    max_concurrent_requests: int | None = Field(default=None, gt=0)
    prompt_tokens_per_s: float | None = Field(default=None, gt=0)
    eviction_budget_tokens: int | None = Field(default=None, gt=0)
    api_key: str | None = Field(default=None, min_length=16, max_length=256)


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Ingress:
    def __init__(self, replicas: Any, settings: dict[str, Any], controller: Any = None) -> None:
        self.state = IngressState(IngressSettings(**settings), replicas)
        self.controller = controller  # bound so the controller deploys with the app

    # ------------------------------------------------------------------ OpenAI API
    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.state.serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.state.serve(request, chat=True)

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        await self.state.tenant(request)
        name = self.state.settings.model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "vtoken"}]}

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._admin(request)  # per-tenant series name every tenant: operators only
        return Response(self.state.metrics.render(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ admin API
    def _admin(self, request: Request) -> None:
        token = bearer(request.headers.get("authorization"))
        if not admin_token_ok(token, self.state.settings.admin_token):
            raise HTTPError(403, "admin token missing or wrong", "auth")

    @api.put("/admin/tenants/{tenant_id}")
    async def put_tenant(self, tenant_id: str, request: Request) -> JSONResponse:
        self._admin(request)
        update = await parse_body(request, TenantUpdate)
        fields = update.model_dump(exclude={"api_key"})
        try:
            quota = TenantQuota(tenant_id=tenant_id, **fields)
        except ValidationError as error:
            raise HTTPError(
                400, f"invalid tenant: {error.errors()[0]['msg']}", "invalid_request"
            ) from None
        existed = await self.state.store.get_quota(tenant_id) is not None
        api_key = update.api_key or (None if existed else new_api_key())
        # The key first: a key owned by another tenant is refused before anything changes.
        if api_key is not None and not await self.state.tenant_keys.set_key(tenant_id, api_key):
            raise HTTPError(409, "this API key belongs to another tenant", "conflict")
        await self.state.store.put_quota(quota)
        body: dict[str, Any] = quota.model_dump()
        if api_key is not None:
            body["api_key"] = api_key
        return JSONResponse(body, status_code=200 if existed else 201)

    @api.get("/admin/tenants/{tenant_id}")
    async def get_tenant(self, tenant_id: str, request: Request) -> dict[str, Any]:
        self._admin(request)
        quota = await self.state.store.get_quota(tenant_id)
        if quota is None:
            raise HTTPError(404, f"no tenant {tenant_id!r}", "not_found")
        return quota.model_dump()

    @api.get("/admin/tenants")
    async def list_tenants(self, request: Request) -> dict[str, Any]:
        self._admin(request)
        quotas = await self.state.store.list_quotas()
        return {"tenants": [quota.model_dump() for _, quota in sorted(quotas.items())]}

    @api.delete("/admin/tenants/{tenant_id}")
    async def delete_tenant(self, tenant_id: str, request: Request) -> dict[str, Any]:
        self._admin(request)
        if not await self.state.store.delete_quota(tenant_id):
            raise HTTPError(404, f"no tenant {tenant_id!r}", "not_found")
        revoked = await self.state.tenant_keys.delete_tenant(tenant_id)
        return {"deleted": tenant_id, "revoked_keys": revoked}

    @api.get("/admin/status")
    async def status(self, request: Request) -> dict[str, Any]:
        self._admin(request)
        return await cluster_status(self.state.store)
