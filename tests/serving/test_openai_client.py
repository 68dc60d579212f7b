"""The official ``openai`` Python client against the ingress (in-process): every served
field works (``n`` choices and log-probabilities too, against a fake replica that answers
them as the engine host does), every refused one is a ``BadRequestError`` naming the
field, and responses carry the request id the client exposes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from tests.serving.ingress_harness import BLOCK_SIZE, MODEL, PROMPT, Ingress

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
        ("n", 9),  # over the ingress's max_n
        ("logprobs", 6),
        ("best_of", 2),
        ("echo", True),
        ("suffix", "!"),
        ("use_beam_search", True),
        ("vllm_xargs", {"vtoken_policy": "none"}),
        ("made_up_field", 1),
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
        ("n", 0),
        ("top_logprobs", 2),  # without logprobs: true
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


VLLM_EXTENSIONS = {
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "min_tokens": 1,
    "ignore_eos": True,
    "stop_token_ids": [2],
    "skip_special_tokens": False,
    "logit_bias": {"42": -100},
    "use_beam_search": False,  # vLLM's default: asks for nothing refused
}


@pytest.mark.parametrize("chat", [False, True])
async def test_vllm_sampling_extensions_reach_the_replica(
    client: openai.AsyncOpenAI, ingress: Ingress, chat: bool
) -> None:
    """What vLLM's clients send through ``extra_body`` (``vllm bench serve`` sends
    ``repetition_penalty``) is served and passed on, as vLLM's OpenAI server does."""
    if chat:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_completion_tokens=4,
            extra_body=VLLM_EXTENSIONS,
        )
    else:
        await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=VLLM_EXTENSIONS
        )
    sent = _sent(ingress)
    assert sent["max_tokens"] == 4
    expected = {k: v for k, v in VLLM_EXTENSIONS.items() if k != "use_beam_search"}
    assert {k: sent["sampling"][k] for k in expected} == expected


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4], [[1, 2, 3, 4]]])
async def test_token_id_prompts_skip_tokenizing(
    client: openai.AsyncOpenAI, ingress: Ingress, prompt: Any
) -> None:
    completion = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert completion.choices[0].text == "Hello there"
    assert completion.usage is not None and completion.usage.prompt_tokens == 4
    assert _sent(ingress)["prompt_token_ids"] == [1, 2, 3, 4]


async def test_token_id_prompts_meet_the_same_limits(
    client: openai.AsyncOpenAI, ingress: Ingress, tokenizer: Any
) -> None:
    """Ids outside the vocabulary, and ids that with ``max_tokens`` exceed the context,
    are 400s naming the problem; nothing reaches a replica or stays reserved."""
    vocabulary = len(tokenizer)
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
        await client.completions.create(model=MODEL, prompt=[1, vocabulary], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context of 128 tokens"):
        await client.completions.create(model=MODEL, prompt=[1] * 125, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        await client.completions.create(model=MODEL, prompt=[1, -5], max_tokens=4)
    assert ingress.replicas.requests == []


# ------------------------------------------------------------ several choices, logprobs
WORDS = ("Hello", " there")


def _answer_every_choice(ingress: Ingress) -> None:
    """The harness's replica, answering as the engine host does for ``n`` and
    ``logprobs``: two tokens per choice (choice i says "Hello" then " there<i>"), pieces of
    the choices interleaved last index first, each token's log-probability with the
    engine's alternatives (the sampled token first, then ``logprobs`` others)."""
    replicas = ingress.replicas

    async def answer(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        held = await ingress.state.admission.reserved_blocks(request["tenant_id"])
        replicas.reserved_while_answering.append(held)
        n, alternatives = request["n"], request["logprobs"]
        total = 0
        for step, word in enumerate(WORDS):
            for index in reversed(range(n)):
                text = word if step == 0 else f"{word}{index}"
                total += 1
                logprobs = None
                if alternatives is not None:
                    top = [(text, -0.5)] + [(f"alt{j}", -2.0 - j) for j in range(alternatives)]
                    logprobs = [{"token": text, "logprob": -0.5, "top": top}]
                yield {
                    "index": index,
                    "text": text,
                    "finish_reason": "length" if step == len(WORDS) - 1 else None,
                    "prompt_tokens": len(request["prompt_token_ids"]),
                    "completion_tokens": total,
                    "logprobs": logprobs,
                }

    replicas._answer = answer  # type: ignore[method-assign]


async def test_completions_return_n_choices_with_logprobs(
    client: openai.AsyncOpenAI, ingress: Ingress
) -> None:
    _answer_every_choice(ingress)
    completion = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, n=2, logprobs=2
    )
    assert [choice.index for choice in completion.choices] == [0, 1]
    assert [choice.text for choice in completion.choices] == ["Hello there0", "Hello there1"]
    assert {choice.finish_reason for choice in completion.choices} == {"length"}
    for index, choice in enumerate(completion.choices):
        logprobs = choice.logprobs
        assert logprobs is not None
        assert logprobs.tokens == ["Hello", f" there{index}"]
        assert logprobs.token_logprobs == [-0.5, -0.5]
        assert logprobs.text_offset == [0, len("Hello")]
        assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == 2
        # the sampled token and the 2 alternatives asked for, as vLLM answers
        assert logprobs.top_logprobs[0] == {"Hello": -0.5, "alt0": -2.0, "alt1": -3.0}
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    sent = _sent(ingress)
    assert (sent["n"], sent["logprobs"]) == (2, 2)


async def test_completions_stream_n_choices_with_logprobs(
    client: openai.AsyncOpenAI, ingress: Ingress
) -> None:
    _answer_every_choice(ingress)
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, n=2, logprobs=0, stream=True
    )
    texts: dict[int, str] = {}
    offsets: dict[int, list[int]] = {}
    async for chunk in stream:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
        assert all(len(top) == 1 for top in choice.logprobs.top_logprobs)  # the sampled one
        offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset or [])
    assert texts == {0: "Hello there0", 1: "Hello there1"}
    # Offsets run on across the pieces of each choice.
    assert offsets == {0: [0, len("Hello")], 1: [0, len("Hello")]}


async def test_chat_returns_n_choices_with_logprobs(
    client: openai.AsyncOpenAI, ingress: Ingress
) -> None:
    _answer_every_choice(ingress)
    completion = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert [choice.index for choice in completion.choices] == [0, 1]
    for index, choice in enumerate(completion.choices):
        assert choice.message.content == f"Hello there{index}"
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert [item.token for item in content] == ["Hello", f" there{index}"]
        assert [item.logprob for item in content] == [-0.5, -0.5]
        assert content[0].bytes == list(b"Hello")
        # the first top_logprobs of the engine's list, as vLLM answers
        assert [top.token for top in content[0].top_logprobs] == ["Hello", "alt0"]
    assert _sent(ingress)["logprobs"] == 2


async def test_chat_streams_n_choices_with_logprobs(
    client: openai.AsyncOpenAI, ingress: Ingress
) -> None:
    _answer_every_choice(ingress)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        n=3,
        logprobs=True,
        stream=True,
    )
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    async for chunk in stream:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        assert choice.logprobs is not None and choice.logprobs.content is not None
        tokens.setdefault(choice.index, []).extend(c.token for c in choice.logprobs.content)
        assert all(c.top_logprobs == [] for c in choice.logprobs.content)  # top_logprobs 0
    assert texts == {i: f"Hello there{i}" for i in range(3)}
    assert tokens == {i: ["Hello", f" there{i}"] for i in range(3)}
    assert _sent(ingress)["logprobs"] == 0


async def test_no_logprobs_unless_asked(client: openai.AsyncOpenAI, ingress: Ingress) -> None:
    _answer_every_choice(ingress)
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2)
    assert [choice.logprobs for choice in completion.choices] == [None, None]
    assert _sent(ingress)["logprobs"] is None


async def test_n_choices_reserve_n_sequences(
    client: openai.AsyncOpenAI, ingress: Ingress, tokenizer: Any
) -> None:
    """Each choice is its own sequence in vLLM with its own KV: n=3 holds three times what
    n=1 holds (prompt + max_tokens each, the tenant having no cap), and gives it back."""
    _answer_every_choice(ingress)
    for n in (1, 3):
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=n)
    one_sequence = math.ceil((len(tokenizer(PROMPT)["input_ids"]) + 8) / BLOCK_SIZE)
    assert ingress.replicas.reserved_while_answering == [one_sequence, 3 * one_sequence]
    assert await ingress.state.admission.reserved_blocks("acme") == 0


async def test_max_n_is_the_ingress_setting(client: openai.AsyncOpenAI, ingress: Ingress) -> None:
    ingress.state.settings = dataclasses.replace(ingress.state.settings, max_n=2)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.completions.create(model=MODEL, prompt=PROMPT, n=3)
    assert "n: at most 2 choices" in raised.value.message
    assert ingress.replicas.requests == []


async def test_n_sequences_hold_their_worst_case_to_the_end(
    ingress: Ingress, tokenizer: Any
) -> None:
    """A capped tenant's request for n choices is counted at n worst cases (prompt +
    ``max_tokens`` each) from admission to its end, never settled to its cap: the choices
    share the prompt's blocks through the prefix cache, and a block another choice reads
    is never evicted, so the cap does not bound what they hold."""
    api_key = await ingress.add_tenant("capped", kv_budget_blocks=64, eviction_budget_tokens=16)
    prompt = "word " * 60
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    worst = math.ceil((prompt_tokens + 8) / BLOCK_SIZE)  # the harness asks for 8 tokens
    assert worst > 2  # the cap's steady bound: 16 tokens + a block = 2 blocks
    held: list[int] = []

    async def answer(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        admission = ingress.state.admission
        common = {"prompt_tokens": len(request["prompt_token_ids"])}
        held.append(await admission.reserved_blocks("capped"))
        yield {"index": 0, "text": "Hi", "completion_tokens": 1, **common}
        held.append(await admission.reserved_blocks("capped"))  # choice 1 still in prefill
        yield {"index": 1, "text": "Yo", "completion_tokens": 2, **common}
        held.append(await admission.reserved_blocks("capped"))
        for index in range(2):
            yield {"index": index, "finish_reason": "stop", "completion_tokens": 2, **common}

    ingress.replicas._answer = answer  # type: ignore[method-assign]
    response = await ingress.complete(api_key, prompt=prompt, n=2)
    assert response.status_code == 200, response.text
    assert [choice["text"] for choice in response.json()["choices"]] == ["Hi", "Yo"]
    assert held == [2 * worst] * 3
