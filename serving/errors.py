"""Every failure of the ingress as an OpenAI error body, and a request id on every response.

Contract: each response carries ``x-request-id`` (a fresh id per request); each error body
is ``{"error": {"message", "type", "code"}}`` with ``code`` the HTTP status and ``type`` one
of :data:`ERROR_TYPES`. Client errors (4xx) keep their message; server errors (5xx) and
unhandled exceptions answer a fixed text with the request id, and the real cause (replica
exceptions, Redis addresses, tracebacks) goes only to the server log, under the same id.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.redis_conn import REDIS_ERRORS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("vtoken.ingress")
T = TypeVar("T")

REQUEST_ID_HEADER = "x-request-id"
_SCOPE_KEY = "vtoken.request_id"
ERROR_TYPES = frozenset(
    {
        "invalid_request",
        "request_too_large",
        "auth",
        "not_found",
        "method_not_allowed",
        "conflict",
        "rate_limit",
        "service_unavailable",
        "server_error",
    }
)
_TYPE_OF_STATUS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
REDIS_RETRY_AFTER_S = 2
"""Retry-After of a 503 while Redis is away (its clients reconnect within ~1 s)."""
_SERVER_MESSAGES = {
    503: "the service is unavailable right now; retry later",
    504: "the request timed out; retry later",
}


class HTTPError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, kind: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """The OpenAI error body, for JSON responses and SSE error events alike."""
    return {"error": {"message": message, "type": kind, "code": status}}


def request_id_of(scope: Scope) -> str:
    return str(scope.get(_SCOPE_KEY, "-"))


def client_message(scope: Scope, status: int, message: str, kind: str) -> str:
    """What the client reads; logs the error under the request id (5xx with the cause)."""
    request_id = request_id_of(scope)
    if status < 500:
        logger.info("request %s: %d %s: %s", request_id, status, kind, message)
        return message
    logger.error("request %s: %d %s: %s", request_id, status, kind, message)
    text = _SERVER_MESSAGES.get(status, "internal server error")
    return f"{text} (request id {request_id})"


def _json(scope: Scope, status: int, message: str, kind: str, headers: Any = None) -> JSONResponse:
    body = error_body(status, client_message(scope, status, message, kind), kind)
    return JSONResponse(body, status_code=status, headers=headers)


async def _http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPError)
    return _json(request.scope, error.status, error.message, error.kind, error.headers)


async def _starlette_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    status = error.status_code
    kind = _TYPE_OF_STATUS.get(status, "invalid_request" if status < 500 else "server_error")
    message = f"{error.detail}: {request.method} {request.url.path}"
    return _json(request.scope, status, message, kind, getattr(error, "headers", None))


async def _validation_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
    )
    return _json(request.scope, 400, f"invalid request: {problems}", "invalid_request")


async def _redis_error(request: Request, error: Exception) -> JSONResponse:
    """Redis away or refusing (an admin route; the OpenAI routes answer this themselves):
    503 with Retry-After, the cause only in the log (its text names Redis's address)."""
    logger.warning(
        "request %s: Redis unavailable: %r", request.scope.get("vtoken.request_id"), error
    )
    message = "the quota store is unavailable; retry later"
    retry = {"Retry-After": str(REDIS_RETRY_AFTER_S)}
    return _json(request.scope, 503, message, "server_error", retry)


async def redis_or_503(call: Awaitable[T]) -> T:
    """``await call``; a Redis error becomes a 503 with Retry-After (quotas fail closed).
    The error's text names Redis's address: it is logged, never answered."""
    try:
        return await call
    except REDIS_ERRORS as error:
        logger.warning("Redis unavailable at the ingress: %r", error)
        raise HTTPError(
            503,
            "the quota store is unavailable; retry the request",
            "server_error",
            headers={"Retry-After": str(REDIS_RETRY_AFTER_S)},
        ) from None


def install_error_handlers(api: FastAPI) -> None:
    """OpenAI error bodies for our errors, FastAPI's and Starlette's (404, 405, 422->400),
    and :class:`RequestIdMiddleware` around the app (unhandled exceptions -> 500)."""
    api.add_exception_handler(HTTPError, _http_error)
    api.add_exception_handler(StarletteHTTPException, _starlette_error)
    api.add_exception_handler(RequestValidationError, _validation_error)
    api.add_exception_handler(RedisError, _redis_error)


class RequestIdMiddleware:
    """Gives each HTTP request an id (``x-request-id`` on its response) and turns an
    exception that escapes the app into a 500 error body, logged with its traceback. When
    the response had already started (a stream), the body is ended instead."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope[_SCOPE_KEY] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message.setdefault("headers", [])
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s: unhandled error", request_id)
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            message = f"internal server error (request id {request_id})"
            body = error_body(500, message, "server_error")
            await send_with_id(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": json.dumps(body).encode()})
