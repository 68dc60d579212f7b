"""Input limits at the ingress: body size, prompt size (before tokenizing), JSON depth,
stop strings, unserved fields - each a 4xx OpenAI error body, never a 500."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from serving.input_limits import InputLimits, json_depth_exceeds
from tests.redis_server import RedisServer
from tests.serving.ingress_harness import MODEL, Ingress, bearer, running_ingress

LIMITS = InputLimits(max_body_bytes=64 * 1024, max_prompt_chars=2_000, max_json_depth=8)


class CountingTokenizer:
    """The real tokenizer, counting how often the ingress asks it for anything."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, text: str) -> Any:
        self.calls += 1
        return self.tokenizer(text)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.tokenizer.apply_chat_template(conversation, **kwargs)


@pytest.fixture
def counting(tokenizer: Any) -> CountingTokenizer:
    return CountingTokenizer(tokenizer)


@pytest.fixture
async def limited(redis_server: RedisServer, counting: CountingTokenizer) -> AsyncIterator[Ingress]:
    async with running_ingress(redis_server.url, counting, LIMITS) as under_test:
        yield under_test


def _error(response: Any, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and error["code"] == status
    assert response.headers["x-request-id"]
    return str(error["message"])


async def test_a_long_prompt_is_refused_before_it_is_tokenized(
    limited: Ingress, counting: CountingTokenizer
) -> None:
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    response = await limited.complete(api_key, prompt="word " * 1_000)  # 5,000 characters
    assert "prompt" in _error(response, 400, "invalid_request")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3_000}]}
    refused = await limited.client.post("/v1/chat/completions", json=chat, headers=bearer(api_key))
    assert "messages" in _error(refused, 400, "invalid_request")
    assert counting.calls == 0
    assert limited.replicas.requests == []


async def test_too_many_choices_are_refused_before_tokenizing(
    limited: Ingress, counting: CountingTokenizer
) -> None:
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    max_n = limited.state.settings.max_n
    response = await limited.complete(api_key, n=max_n + 1)
    assert f"at most {max_n} choices" in _error(response, 400, "invalid_request")
    assert counting.calls == 0 and limited.replicas.requests == []


async def test_a_large_body_is_413_even_without_content_length(limited: Ingress) -> None:
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    big = b'{"model": "smollm2", "prompt": "' + b"x" * 100_000 + b'"}'
    declared = await limited.client.post(
        "/v1/completions",
        content=big,
        headers={**bearer(api_key), "content-type": "application/json"},
    )
    _error(declared, 413, "request_too_large")

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    streamed = await limited.client.post(
        "/v1/completions", content=chunks(), headers=bearer(api_key)
    )
    _error(streamed, 413, "request_too_large")


async def test_many_tiny_chat_messages_count_their_template_toward_the_prompt_limit(
    limited: Ingress, counting: CountingTokenizer
) -> None:
    """100 one-character messages are 100 characters of text but about 3,300 of prompt
    once the chat template wraps each one: refused before the template runs."""
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    messages = [{"role": "user", "content": "a"}] * 100
    chat = {"model": MODEL, "messages": messages}
    refused = await limited.client.post("/v1/chat/completions", json=chat, headers=bearer(api_key))
    assert "messages" in _error(refused, 400, "invalid_request")
    assert counting.calls == 0


async def test_an_integer_python_will_not_read_is_400_not_500(limited: Ingress) -> None:
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    huge = "9" * 5_000  # over Python's 4,300-digit limit for int(str)
    headers = {**bearer(api_key), "content-type": "application/json"}
    for method, path, body in (
        (
            "POST",
            "/v1/completions",
            f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": {huge}}}',
        ),
        ("PUT", "/admin/tenants/b", f'{{"kv_budget_blocks": {huge}}}'),
    ):
        response = await limited.client.request(method, path, content=body, headers=headers)
        assert "not valid JSON" in _error(response, 400, "invalid_request")


@pytest.mark.parametrize("depth", [9, 20_000])
async def test_deeply_nested_json_is_400_not_500(limited: Ingress, depth: int) -> None:
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    nested = "[" * depth + "]" * depth
    body = f'{{"model": "smollm2", "prompt": "hi", "stop": {nested}}}'
    headers = {**bearer(api_key), "content-type": "application/json"}
    for path in ("/v1/completions", "/admin/tenants/acme"):
        response = await limited.client.request(
            "PUT" if path.startswith("/admin") else "POST", path, content=body, headers=headers
        )
        assert "nests deeper than 8" in _error(response, 400, "invalid_request")


async def test_unserved_fields_and_out_of_range_n_and_logprobs_are_400_naming_the_field(
    ingress: Ingress,
) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=100)
    for field, value in [
        ("best_of", 2),
        ("echo", True),
        ("use_beam_search", True),
        ("suffix", "x"),
        ("made_up", 1),
        ("n", 0),
        ("n", 9),  # over the ingress's max_n (8 unless configured)
        ("logprobs", 6),
        ("top_logprobs", 2),  # a chat field
    ]:
        response = await ingress.complete(api_key, **{field: value})
        assert f"{field}:" in _error(response, 400, "invalid_request"), field
    function = {"type": "function", "function": {"name": "f", "parameters": {}}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [function]}
    tools = await ingress.client.post("/v1/chat/completions", json=chat, headers=bearer(api_key))
    assert "tools" in _error(tools, 400, "invalid_request")
    assert ingress.replicas.requests == []


async def test_stop_strings_are_bounded_in_number_and_length(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=100)
    for stop in (["a", "b", "c", "d", "e"], ["x" * 257]):
        response = await ingress.complete(api_key, stop=stop)
        assert "stop" in _error(response, 400, "invalid_request")
    huge = await ingress.complete(api_key, stop="x" * 5_000_000)  # 5 MB: over the body limit
    _error(huge, 413, "request_too_large")


async def test_served_fields_reach_the_engine(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=100)
    response = await ingress.complete(
        api_key,
        seed=3,
        stop=["\n"],
        temperature=0.2,
        top_p=0.5,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        max_tokens=4,
        user="someone",
        n=1,
    )
    assert response.status_code == 200, response.text
    (sent,) = ingress.replicas.requests
    assert (sent["seed"], sent["stop"], sent["temperature"], sent["top_p"]) == (3, ["\n"], 0.2, 0.5)
    assert sent["max_tokens"] == 4
    assert (sent["presence_penalty"], sent["frequency_penalty"]) == (0.1, 0.2)


def test_json_depth_counts_containers():
    assert not json_depth_exceeds({"a": [1, {"b": 2}]}, 3)
    assert json_depth_exceeds({"a": [1, {"b": [2]}]}, 3)
    assert not json_depth_exceeds("scalar", 1)
