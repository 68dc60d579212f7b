"""The official ``openai`` Python client against the ingress (in-process): every served
field works, every refused one is a ``BadRequestError`` naming the field, and responses
carry the request id the client exposes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from tests.serving.ingress_harness import MODEL, PROMPT, Ingress

SERVED = {
    "max_tokens": 6,
    "temperature": 0.3,
    "top_p": 0.8,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "seed": 11,
    "stop": ["\n\n"],
    "user": "end-user-7",
}


@pytest.fixture
async def client(ingress: Ingress) -> AsyncIterator[openai.AsyncOpenAI]:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=64)
    transport = httpx.ASGITransport(app=ingress.api)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://ingress/v1") as http,
        openai.AsyncOpenAI(
            api_key=api_key, base_url="http://ingress/v1", http_client=http, max_retries=0
        ) as sdk,
    ):
        yield sdk


def _sent(ingress: Ingress) -> dict[str, Any]:
    (sent,) = ingress.replicas.requests
    return sent


async def test_completions_with_every_served_field(
    client: openai.AsyncOpenAI, ingress: Ingress
) -> None:
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, n=1, **SERVED)
    assert completion.choices[0].text == "Hello there"
    assert completion.usage is not None and completion.usage.completion_tokens == 2
    assert completion._request_id  # the x-request-id header
    sent = _sent(ingress)
    for field in ("max_tokens", "temperature", "top_p", "seed", "stop"):
        assert sent[field] == SERVED[field], field


async def test_chat_streams_with_every_served_field(
    client: openai.AsyncOpenAI, ingress: Ingress
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        stream=True,
        **SERVED,
    )
    pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
    assert "".join(p for p in pieces if p) == "Hello there"
    assert _sent(ingress)["temperature"] == SERVED["temperature"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 2),
        ("logprobs", 2),
        ("best_of", 2),
        ("echo", True),
        ("suffix", "!"),
        ("logit_bias", {"50256": -100}),
    ],
)
async def test_completions_refuse_unserved_fields_by_name(
    client: openai.AsyncOpenAI, ingress: Ingress, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={field: value}
        )
    assert field in raised.value.message
    assert isinstance(raised.value.body, dict) and raised.value.body["type"] == "invalid_request"
    assert raised.value.request_id
    assert ingress.replicas.requests == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 3),
        ("logprobs", True),
        ("top_logprobs", 2),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("response_format", {"type": "json_object"}),
    ],
)
async def test_chat_refuses_unserved_fields_by_name(
    client: openai.AsyncOpenAI, ingress: Ingress, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body={field: value},
        )
    assert field in raised.value.message
    assert ingress.replicas.requests == []


async def test_errors_reach_the_client_as_typed_exceptions(ingress: Ingress) -> None:
    transport = httpx.ASGITransport(app=ingress.api)
    async with (
        httpx.AsyncClient(transport=transport) as http,
        openai.AsyncOpenAI(
            api_key="vt-unknown", base_url="http://ingress/v1", http_client=http, max_retries=0
        ) as sdk,
    ):
        with pytest.raises(openai.AuthenticationError) as raised:
            await sdk.models.list()
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == 401
