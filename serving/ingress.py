"""The ingress: the FastAPI app and all its routes, and the Ray Serve deployment that runs it.

The OpenAI API is served by :mod:`serving.openai_http`'s pipeline; the admin API (tenants,
status) sits behind an admin token. :func:`build_api` makes the app around an
:class:`IngressState` (tests call it with their own); the deployment :class:`Ingress`
builds the real dependencies from its settings.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from opentelemetry import trace
from ray import serve

from controlplane import telemetry
from controlplane.clock import SystemClock
from controlplane.openai_models import ChatCompletionRequest, CompletionRequest
from controlplane.otel_metrics import configure_metrics
from controlplane.redis_conn import RedisConfig, connect
from controlplane.tracing import configure_tracing
from serving.admin_api import AdminState, NewKey, TenantUpdate, admin_routes
from serving.errors import RequestIdMiddleware, install_error_handlers
from serving.openai_http import IngressState
from serving.openapi_bodies import body_of, openapi_with_bodies
from serving.settings import IngressSettings


def _state(request: Request) -> IngressState:
    state: IngressState = request.app.state.ingress
    return state


State = Annotated[IngressState, Depends(_state)]
openai_routes = APIRouter()


def build_api(state: IngressState) -> FastAPI:
    """The ingress app serving ``state``: OpenAI API, health, metrics, admin API.

    Each route authenticates its caller before it reads a body, then reads it under the
    settings' ``limits`` (:mod:`serving.input_limits`); every error is an OpenAI error
    body and every response has an ``x-request-id`` (:mod:`serving.errors`).
    ``/openapi.json`` documents the JSON bodies the routes read, served as the settings'
    ``api_docs`` say (none by default)."""
    public = state.settings.api_docs == "public"
    api = FastAPI(
        title="vtoken",
        description="OpenAI-compatible serving with per-tenant KV quotas",
        openapi_url="/openapi.json" if public else None,
        docs_url="/docs" if public else None,
        redoc_url="/redoc" if public else None,
    )
    api.state.ingress = state
    install_error_handlers(api)
    api.add_middleware(RequestIdMiddleware)
    api.include_router(openai_routes)
    api.include_router(admin_routes)
    if state.settings.api_docs == "admin":
        api.include_router(admin_docs)
    documented = (CompletionRequest, ChatCompletionRequest, TenantUpdate, NewKey)
    api.openapi = functools.partial(openapi_with_bodies, api, documented)  # type: ignore[method-assign]
    return api


# ---------------------------------------------------------------------- OpenAI API
@openai_routes.post("/v1/completions", openapi_extra=body_of(CompletionRequest))
async def completions(request: Request, state: State) -> Response:
    return await state.serve(request, chat=False)


@openai_routes.post("/v1/chat/completions", openapi_extra=body_of(ChatCompletionRequest))
async def chat_completions(request: Request, state: State) -> Response:
    return await state.serve(request, chat=True)


@openai_routes.get("/v1/models")
async def models(request: Request, state: State) -> dict[str, Any]:
    await state.gate.tenant(request)
    name = state.settings.model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "vtoken"}]}


@openai_routes.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


admin_docs = APIRouter()


@admin_docs.get("/openapi.json", include_in_schema=False)
async def openapi_document(request: Request, state: AdminState) -> dict[str, Any]:
    """The OpenAPI document, for the admin token only (``api_docs: admin``)."""
    return request.app.openapi()  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- deployment
@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0.1})
@serve.ingress()
class Ingress:
    """One ingress replica: builds the real Redis client, clock, tokenizer and tracer from
    ``settings``; Serve then asks it for its app."""

    def __init__(self, replicas: Any, settings: IngressSettings, controller: Any = None) -> None:
        from transformers import AutoTokenizer

        configure_tracing("vtoken-ingress")
        configure_metrics("vtoken-ingress")
        self.state = IngressState(
            settings,
            replicas,
            redis=connect(RedisConfig(url=settings.redis_url)),
            clock=SystemClock(),
            tokenizer=AutoTokenizer.from_pretrained(settings.tokenizer_path),
            tracer=trace.get_tracer(telemetry.TRACER_INGRESS),
        )
        self.controller = controller  # bound so the controller deploys with the app

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.state)
