"""Input limits at the ingress: body size, prompt size (before tokenizing), JSON depth and
items, lone surrogates, stop strings, unserved fields - each a 4xx OpenAI error body, never
a 500 - and what is checked before the body is read (the caller) or tokenized (the
tenant's concurrency and prompt rate)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serving.input_limits import InputLimits, JsonShape, json_shape
from tests.redis_server import RedisServer
from tests.serving.ingress_harness import ADMIN, MODEL, Ingress, bearer, running_ingress

LIMITS = InputLimits(
    max_body_bytes=64 * 1024, max_prompt_chars=2_000, max_json_depth=8, max_json_items=4_096
)
HOSTILE = b'{"x": [' + b",".join([b"{}"] * 20_000) + b"]}"  # 60 kB: 20,000 objects


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
    for method, path, body, token in (
        (
            "POST",
            "/v1/completions",
            f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": {huge}}}',
            api_key,
        ),
        ("PUT", "/admin/tenants/b", f'{{"kv_budget_blocks": {huge}}}', ADMIN),
    ):
        headers = {**bearer(token), "content-type": "application/json"}
        response = await limited.client.request(method, path, content=body, headers=headers)
        assert "not valid JSON" in _error(response, 400, "invalid_request")


@pytest.mark.parametrize("depth", [9, 20_000])
async def test_deeply_nested_json_is_400_not_500(limited: Ingress, depth: int) -> None:
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    nested = "[" * depth + "]" * depth
    body = f'{{"model": "smollm2", "prompt": "hi", "stop": {nested}}}'
    for method, path, token in (
        ("POST", "/v1/completions", api_key),
        ("PUT", "/admin/tenants/acme", ADMIN),
    ):
        headers = {**bearer(token), "content-type": "application/json"}
        response = await limited.client.request(method, path, content=body, headers=headers)
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


def test_json_shape_counts_containers_and_items_outside_strings():
    assert json_shape(b'{"a": [1, {"b": 2}]}').depth == 3
    assert json_shape(b'{"a": [1, {"b": [2]}]}').depth == 4
    assert json_shape(b'"scalar"') == json_shape(b"7") == json_shape(b"") == JsonShape(1, 0)
    assert json_shape(b"[]") == JsonShape(2, 1)
    # Brackets, commas and colons in strings, escaped quotes and backslashes: not counted.
    assert json_shape(rb'{"p": "[[{,:\"[\\", "q": "\\"}') == JsonShape(5, 1)
    assert json_shape(b'{"x": [' + b",".join([b"{}"] * 1000) + b"]}") == JsonShape(2003, 3)
    assert json_shape(b"[" * 50 + b"]" * 50) == JsonShape(51, 50)


async def test_a_body_is_not_read_before_its_caller_is_authenticated(limited: Ingress) -> None:
    """Issue 34: every body was parsed and walked before authentication (a 2 MiB one of
    empty objects: ~1 s of event-loop CPU per request, no key needed). Without a key, with
    an unknown one, or a tenant's key on the admin API, not a byte is read."""
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for start in range(0, len(HOSTILE), 8192):
            pulled += 1
            yield HOSTILE[start : start + 8192]

    for method, path, headers, status in (
        ("POST", "/v1/completions", {}, 401),
        ("POST", "/v1/chat/completions", bearer("not-a-key"), 401),
        ("PUT", "/admin/tenants/acme", bearer(api_key), 403),
    ):
        response = await limited.client.request(method, path, content=body(), headers=headers)
        _error(response, status, "auth")
    assert pulled == 0
    # With a key, the raw bytes are counted before anything is parsed.
    counted = await limited.client.post("/v1/completions", content=HOSTILE, headers=bearer(api_key))
    assert "more than 4096 JSON items" in _error(counted, 400, "invalid_request")


async def test_a_body_is_parsed_once(limited: Ingress, monkeypatch: pytest.MonkeyPatch) -> None:
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    body = json.dumps({"model": MODEL, "prompt": "count my parses", "max_tokens": 2}).encode()
    parses = 0
    loads = json.loads

    def counting_loads(text: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal parses
        parses += text == body
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting_loads)
    response = await limited.client.post("/v1/completions", content=body, headers=bearer(api_key))
    assert response.status_code == 200, response.text
    assert parses == 1


async def test_a_lone_surrogate_is_400_naming_its_field(
    limited: Ingress, counting: CountingTokenizer
) -> None:
    """Issue 34: ``"\\ud800"`` is valid JSON but no text: the tokenizer's TypeError was
    a 500. A surrogate pair (an emoji) is text."""
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100)
    headers = {**bearer(api_key), "content-type": "application/json"}
    for path, body, field in (
        (
            "/v1/chat/completions",
            rb'"messages": [{"role": "user", "content": "\ud800"}]',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            rb'"messages": [{"role": "user", "content": [{"type": "text", "text": "a\uDC00"}]}]',
            "messages.0.content.0.text",
        ),
        ("/v1/completions", rb'"prompt": "hi \ud83d"', "prompt"),
    ):
        content = b'{"model": "smollm2", ' + body + b"}"
        response = await limited.client.post(path, content=content, headers=headers)
        assert f"{field}: holds a lone UTF-16 surrogate" in _error(response, 400, "invalid_request")
    assert counting.calls == 0
    pair = b'{"model": "smollm2", "prompt": "hi \\ud83d\\ude00", "max_tokens": 2}'
    response = await limited.client.post("/v1/completions", content=pair, headers=headers)
    assert response.status_code == 200, response.text


async def test_the_prompt_limit_follows_the_models_context(
    redis_server: RedisServer, counting: CountingTokenizer
) -> None:
    """Issue 34: 200,000 characters were allowed whatever the context (~25 contexts of
    2,048 tokens, all tokenized). By default a prompt may have 8 characters per token of
    the context: 1,024 for the harness's 128."""
    assert InputLimits().prompt_chars_limit(2048) == 16_384
    assert InputLimits(prompt_chars_per_token=4).prompt_chars_limit(100) == 400
    assert InputLimits(max_prompt_chars=10).prompt_chars_limit(2048) == 10
    async with running_ingress(redis_server.url, counting) as ingress:
        api_key = await ingress.add_tenant("acme", kv_budget_blocks=100)
        response = await ingress.complete(api_key, prompt="x" * 1_025)
        assert "more than the limit of 1024" in _error(response, 400, "invalid_request")
        assert counting.calls == 0


async def test_a_tenant_at_its_concurrency_limit_is_refused_before_tokenizing(
    limited: Ingress, counting: CountingTokenizer
) -> None:
    api_key = await limited.add_tenant(
        "acme", kv_budget_blocks=100, max_concurrent_requests=1, max_queue_depth=0
    )
    limited.replicas.gate.clear()
    first = asyncio.create_task(limited.complete(api_key))
    await limited.replicas.arrived.wait()
    refused = await limited.complete(api_key)
    assert "concurrent-request limit" in _error(refused, 429, "rate_limit")
    assert refused.headers["Retry-After"] == "1"
    assert counting.calls == 1  # the first request's prompt only
    limited.replicas.gate.set()
    assert (await first).status_code == 200


async def test_a_tenant_over_its_prompt_rate_is_refused_before_tokenizing(
    limited: Ingress, counting: CountingTokenizer
) -> None:
    """At 1 token/s, a first prompt of a dozen tokens leaves the bucket in debt for about
    as many seconds: every request meanwhile is a 429 without its prompt tokenized."""
    api_key = await limited.add_tenant("acme", kv_budget_blocks=100, prompt_tokens_per_s=1)
    assert (await limited.complete(api_key)).status_code == 200
    for _ in range(3):
        refused = await limited.complete(api_key, prompt="hi")
        assert "prompt-token rate" in _error(refused, 429, "rate_limit")
        assert int(refused.headers["Retry-After"]) >= 5
    assert counting.calls == 1
