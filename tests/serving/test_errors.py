"""Every error is an OpenAI error body with a stable type and code, never internal text;
every response carries an x-request-id that the server log repeats with the error."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serving.errors import ERROR_TYPES
from tests.redis_server import RedisServer
from tests.serving.ingress_harness import MODEL, PROMPT, Ingress, admin, bearer, running_ingress

INTERNAL = "redis://10.1.2.3:6379 Traceback (most recent call last)"


class BrokenTokenizer:
    """A dependency failing with internal text (an address, a traceback)."""

    def __call__(self, text: str) -> Any:
        raise RuntimeError(INTERNAL)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        raise RuntimeError(INTERNAL)


@pytest.fixture
async def broken(redis_server: RedisServer) -> AsyncIterator[Ingress]:
    async with running_ingress(redis_server.url, BrokenTokenizer()) as under_test:
        yield under_test


def assert_error_body(response: Any, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["type"] == kind and error["type"] in ERROR_TYPES and error["code"] == status
    assert response.headers["x-request-id"]
    return dict(error)


async def test_every_response_has_a_fresh_request_id(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    responses = [
        await ingress.client.get("/health"),
        await ingress.complete(api_key),
        await ingress.complete("vt-unknown"),
        await ingress.client.get("/admin/tenants", headers=admin()),
    ]
    ids = [response.headers["x-request-id"] for response in responses]
    assert all(ids) and len(set(ids)) == len(ids)


async def test_framework_errors_are_openai_bodies(ingress: Ingress) -> None:
    assert_error_body(await ingress.client.get("/v1/nothing-here"), 404, "not_found")
    assert_error_body(await ingress.client.get("/v1/completions"), 405, "method_not_allowed")
    assert_error_body(
        await ingress.client.delete("/admin/tenants", headers=admin()), 405, "method_not_allowed"
    )
    assert_error_body(await ingress.client.get("/admin/tenants"), 403, "auth")


async def test_an_unhandled_exception_is_a_500_body_without_internals(
    broken: Ingress, caplog: pytest.LogCaptureFixture
) -> None:
    api_key = await broken.add_tenant("acme", kv_budget_blocks=8)
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    with caplog.at_level(logging.ERROR, logger="vtoken.ingress"):
        response = await broken.client.post(
            "/v1/chat/completions", json=body, headers=bearer(api_key)
        )
    error = assert_error_body(response, 500, "server_error")
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"]
    assert "10.1.2.3" not in response.text and "Traceback" not in response.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the cause, server-side only
