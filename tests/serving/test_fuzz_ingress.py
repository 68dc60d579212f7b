"""Schemathesis over the ingress's /openapi.json: every operation, without credentials,
with a tenant key and with the admin token. No response may be a 5xx, and every 4xx must
be an OpenAI error body. Bounded (a few examples per operation and credential) to stay
well under a minute on two cores."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from serving.errors import ERROR_TYPES
from tests.redis_server import RedisServer
from tests.serving.fuzz_server import FuzzServer, ServerThread
from tests.serving.ingress_harness import ADMIN, MODEL

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def fuzz_server(redis_server: RedisServer, tokenizer: Any) -> Iterator[FuzzServer]:
    thread = ServerThread(redis_server.url, tokenizer)
    yield thread.start()
    thread.stop()


@pytest.fixture(scope="module")
def operations(fuzz_server: FuzzServer) -> list[Any]:
    """Every operation of the served /openapi.json."""
    url = f"{fuzz_server.url}/openapi.json"
    schema = schemathesis.openapi.from_url(url, headers=_credentials("admin", fuzz_server))
    return [result.ok() for result in schema.get_all_operations()]


def _credentials(kind: str, server: FuzzServer) -> dict[str, str]:
    token = {"none": None, "tenant": server.tenant_key, "admin": ADMIN}[kind]
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def check_error_body(response: Any, label: str) -> None:
    """No 5xx; a 4xx is ``{"error": {"message", "type", "code"}}`` with a known type."""
    assert response.status_code < 500, (label, response.status_code, response.text[:500])
    assert response.headers.get("x-request-id")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] in ERROR_TYPES, error
        assert error["code"] == response.status_code, error


def fuzz_operation(operation: Any, mode: GenerationMode, server: FuzzServer) -> int:
    """Send up to ``MAX_EXAMPLES`` generated requests to ``operation`` with each credential;
    returns how many were sent (0 when ``mode`` cannot generate any: an operation without
    inputs has no schema-violating request)."""
    sent = 0

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        nonlocal sent
        for credentials in ("none", "tenant", "admin"):
            headers = _credentials(credentials, server)
            response = case.call(base_url=server.url, headers=headers)
            check_error_body(response, f"{operation.label} as {credentials}")
            sent += 1
        if isinstance(case.body, dict) and "model" in case.body:
            # The served model's name, so generated bodies get past the model check.
            case.body = {**case.body, "model": MODEL}
            response = case.call(base_url=server.url, headers=_credentials("tenant", server))
            check_error_body(response, f"{operation.label} as tenant, model {MODEL}")
            sent += 1

    try:
        fuzz()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE and sent == 0, operation.label
    return sent


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_operation_fails_or_answers_a_non_openai_error(
    operations: list[Any], fuzz_server: FuzzServer, mode: GenerationMode
) -> None:
    """Valid (positive) and schema-violating (negative) requests to every operation, each
    sent without credentials, with the tenant's key and with the admin token."""
    assert len(operations) >= 12, [operation.label for operation in operations]
    sent = {op.label: fuzz_operation(op, mode, fuzz_server) for op in operations}
    print(mode.value, sent)
    assert sum(sent.values()) >= 3 * len(operations), sent


def test_every_documented_body_is_in_the_schema(fuzz_server: FuzzServer) -> None:
    import httpx

    url = f"{fuzz_server.url}/openapi.json"
    document = httpx.get(url, headers=_credentials("admin", fuzz_server)).json()
    for path, method in [
        ("/v1/completions", "post"),
        ("/v1/chat/completions", "post"),
        ("/admin/tenants/{tenant_id}", "put"),
        ("/admin/tenants/{tenant_id}/keys", "post"),
    ]:
        reference = document["paths"][path][method]["requestBody"]["content"]["application/json"]
        name = reference["schema"]["$ref"].rsplit("/", 1)[-1]
        assert name in document["components"]["schemas"], name
