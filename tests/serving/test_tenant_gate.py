"""The throttle answer shared by the pre-check and admission, the pre-check's Retry-After
and the bound on a tenant's requests in flight before admission (the gate's other Redis
paths are driven end to end in ``test_ingress.py`` and ``test_input_limits.py``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from serving.tenant_gate import THROTTLE_REASONS, throttled
from tests.serving.ingress_harness import MODEL, Ingress, bearer


def test_a_known_reason_is_said_in_words_with_its_retry_after() -> None:
    error = throttled("acme", "kv_budget", 3)
    assert (error.status, error.kind) == (429, "rate_limit")
    assert error.message == "tenant 'acme' is over its KV budget; retry after 3 s"
    assert error.headers == {"Retry-After": "3"}


def test_an_unknown_reason_is_said_as_is() -> None:
    assert "unexplained" not in THROTTLE_REASONS
    error = throttled("acme", "unexplained", 1)
    assert error.message == "tenant 'acme' is unexplained; retry after 1 s"


async def test_a_tenants_bodies_in_flight_are_bounded_before_admission(ingress: Ingress) -> None:
    """Admission counts a request once admitted; before that its body is read, decoded and
    tokenized. A tenant whose bodies are all still arriving holds its places: one more is a
    429 at once (its body never read), and another tenant is not held up."""
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=64)
    other = await ingress.add_tenant("beta", kv_budget_blocks=64)
    limit = ingress.state.settings.limits.max_tokenizing_per_tenant
    arrive = asyncio.Event()
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()

    async def slow_body() -> AsyncIterator[bytes]:
        yield body[:5]
        await arrive.wait()
        yield body[5:]

    async def slow_request() -> httpx.Response:
        return await ingress.client.post(
            "/v1/completions", content=slow_body(), headers=bearer(api_key)
        )

    slow = [asyncio.create_task(slow_request()) for _ in range(limit)]
    await asyncio.sleep(0.3)  # each is in the middle of its body
    refused = await ingress.complete(api_key)
    assert refused.status_code == 429, refused.text
    assert "reading and tokenizing" in refused.json()["error"]["message"]
    assert (await ingress.complete(other)).status_code == 200
    arrive.set()
    assert [response.status_code for response in await asyncio.gather(*slow)] == [200] * limit
    assert (await ingress.complete(api_key)).status_code == 200  # its places are back


async def test_the_precheck_retry_after_is_never_early(ingress: Ingress) -> None:
    """A bucket 1.4 s in debt: Retry-After is 2 (rounded up), and a client that waits
    that long gets past the pre-check (1, rounded, once sent it back into a 429)."""
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=64, prompt_tokens_per_s=10)
    ids = list(range(100, 124))  # 24 tokens against a bucket of 10
    assert (await ingress.complete(api_key, prompt=ids)).status_code == 200
    throttled_again = await ingress.complete(api_key, prompt=ids)
    assert throttled_again.status_code == 429
    assert throttled_again.headers["Retry-After"] == "2"
