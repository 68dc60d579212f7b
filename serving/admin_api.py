"""The admin API: tenants, their API keys, status and metrics, behind the admin token.

Every route answers 403 without ``Authorization: Bearer <admin token>``. Tenant ids that
cannot name a tenant (see :data:`controlplane.models.TenantId`) are 404s. Keys are shown
once, when generated; listings name keys by id only.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from controlplane.auth import admin_token_ok, bearer, check_chosen_key, new_api_key
from controlplane.models import TenantLimits, TenantQuota
from controlplane.status import cluster_status, prometheus_targets
from controlplane.store import InvalidQuotaError
from controlplane.tenants import TenantWriteOutcome, remove_tenant, write_tenant
from serving.errors import HTTPError
from serving.input_limits import decode_body, read_body, read_request
from serving.openai_http import IngressState
from serving.openapi_bodies import body_of

_TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # models.TenantId


ChosenKey = Annotated[str, AfterValidator(check_chosen_key)]


class TenantUpdate(TenantLimits):
    """``PUT /admin/tenants/{id}`` body: the quota fields, and optionally a key to add.

    Without ``api_key`` a new tenant gets a generated key, returned once in the response.
    A chosen key needs 32 to 256 characters (see :func:`controlplane.auth.check_chosen_key`).
    """

    api_key: ChosenKey | None = None


class NewKey(BaseModel):
    """``POST /admin/tenants/{id}/keys`` body: a chosen key, or nothing for a generated one."""

    model_config = ConfigDict(extra="forbid")

    api_key: ChosenKey | None = None


class KeyList(BaseModel):
    tenant_id: str
    key_ids: list[str] = Field(description="Key ids, never the keys")


def _admin_state(request: Request) -> IngressState:
    """The state, once the request carries the admin token (403 otherwise)."""
    state: IngressState = request.app.state.ingress
    token = bearer(request.headers.get("authorization"))
    if not admin_token_ok(token, state.settings.admin_token):
        raise HTTPError(403, "admin token missing or wrong", "auth")
    return state


AdminState = Annotated[IngressState, Depends(_admin_state)]
admin_routes = APIRouter()


async def _existing(state: IngressState, tenant_id: str) -> TenantQuota:
    try:
        quota = await state.store.get_quota(tenant_id) if _TENANT_ID.match(tenant_id) else None
    except InvalidQuotaError as error:  # the record is there but unusable: PUT it again
        raise HTTPError(409, f"{error}; set it again with PUT", "conflict") from None
    if quota is None:
        raise HTTPError(404, f"no tenant {tenant_id!r}", "not_found")
    return quota


@admin_routes.get("/metrics")
async def metrics(state: AdminState) -> Response:
    # Per-tenant series name every tenant: operators only.
    state.metrics.queues(state.waiting_now())
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@admin_routes.put("/admin/tenants/{tenant_id}", openapi_extra=body_of(TenantUpdate))
async def put_tenant(tenant_id: str, request: Request, state: AdminState) -> JSONResponse:
    update = await read_request(request, TenantUpdate, state.settings.limits)
    try:
        quota = TenantQuota(tenant_id=tenant_id, **update.model_dump(exclude={"api_key"}))
    except ValidationError as error:
        raise HTTPError(
            400, f"invalid tenant: {error.errors()[0]['msg']}", "invalid_request"
        ) from None
    api_key = update.api_key or new_api_key()  # a generated one is given to a new tenant only
    store = state.store
    written = await write_tenant(
        store.redis, store.keys, tenant_id, quota, api_key, chosen=update.api_key is not None
    )
    if written.outcome is TenantWriteOutcome.KEY_CONFLICT:
        raise HTTPError(409, "this API key belongs to another tenant", "conflict")
    body: dict[str, Any] = quota.model_dump()
    if written.key_id is not None:
        body["key_id"] = written.key_id
        if update.api_key is None:
            body["api_key"] = api_key  # generated: shown this once
    return JSONResponse(body, status_code=200 if written.existed else 201)


@admin_routes.get("/admin/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, state: AdminState) -> dict[str, Any]:
    return (await _existing(state, tenant_id)).model_dump()


@admin_routes.get("/admin/tenants")
async def list_tenants(state: AdminState) -> dict[str, Any]:
    quotas = await state.store.list_quotas()
    listing: dict[str, Any] = {"tenants": [q.model_dump() for _, q in sorted(quotas.items())]}
    invalid = await state.store.invalid_quotas()
    if invalid:  # listed, not hidden: an operator sets them again with PUT
        listing["invalid_tenants"] = invalid
    return listing


@admin_routes.delete("/admin/tenants/{tenant_id}")
async def delete_tenant(tenant_id: str, state: AdminState) -> dict[str, Any]:
    """Revokes the tenant's keys, drops its reservations, then its quota (one script), and
    the tenant's Prometheus series."""
    if not _TENANT_ID.match(tenant_id):
        raise HTTPError(404, f"no tenant {tenant_id!r}", "not_found")
    removal = await remove_tenant(state.store.redis, state.store.keys, tenant_id)
    state.metrics.forget_tenant(tenant_id)
    if not removal.existed:
        raise HTTPError(404, f"no tenant {tenant_id!r}", "not_found")
    return removal.model_dump(exclude={"existed"})


@admin_routes.post(
    "/admin/tenants/{tenant_id}/keys",
    status_code=201,
    openapi_extra=body_of(NewKey, required=False),
)
async def add_key(tenant_id: str, request: Request, state: AdminState) -> dict[str, Any]:
    """A new key for the tenant: generated (returned once) or the body's ``api_key``."""
    await _existing(state, tenant_id)
    limits = state.settings.limits
    body = await read_body(request, limits)
    chosen = (await decode_body(body, NewKey, limits)).api_key if body else None
    api_key = chosen or new_api_key()
    store = state.store
    written = await write_tenant(store.redis, store.keys, tenant_id, None, api_key, chosen=True)
    if written.outcome is TenantWriteOutcome.NO_TENANT:  # deleted since it was looked up
        raise HTTPError(404, f"no tenant {tenant_id!r}", "not_found")
    if written.outcome is TenantWriteOutcome.KEY_CONFLICT:
        raise HTTPError(409, "this API key belongs to another tenant", "conflict")
    return {"tenant_id": tenant_id, "key_id": written.key_id} | (
        {} if chosen else {"api_key": api_key}
    )


@admin_routes.get("/admin/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: str, state: AdminState) -> KeyList:
    await _existing(state, tenant_id)
    return KeyList(tenant_id=tenant_id, key_ids=await state.tenant_keys.key_ids(tenant_id))


@admin_routes.delete("/admin/tenants/{tenant_id}/keys/{key_id}")
async def revoke_key(tenant_id: str, key_id: str, state: AdminState) -> dict[str, Any]:
    await _existing(state, tenant_id)
    if not await state.tenant_keys.revoke(tenant_id, key_id):
        raise HTTPError(404, f"tenant {tenant_id!r} has no key {key_id!r}", "not_found")
    return {"tenant_id": tenant_id, "revoked": key_id}


@admin_routes.get("/admin/status")
async def status(state: AdminState) -> dict[str, Any]:
    return await cluster_status(state.store, queue=state.queue)


@admin_routes.get("/admin/metrics/targets")
async def metrics_targets(state: AdminState) -> list[dict[str, Any]]:
    """Every replica's Prometheus endpoint, for Prometheus' ``http_sd_configs``."""
    return await prometheus_targets(state.store)
