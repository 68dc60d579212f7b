"""The OpenAI request bodies: served fields validated, every other field refused by name;
what the ingress sends a replica."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from controlplane.openai_models import (
    MAX_STOP_CHARS,
    MESSAGE_OVERHEAD_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    prompt_chars,
)

BASE = {"model": "m", "prompt": "hi"}


def test_served_sampling_fields_are_accepted():
    body = CompletionRequest.model_validate(
        {
            **BASE,
            "seed": 7,
            "stop": "\n",
            "temperature": 0.5,
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "max_tokens": 12,
            "user": "end-user-1",
            "n": 1,
            "logprobs": None,
            "cache_salt": "ignored",
        }
    )
    assert (body.seed, body.stop, body.temperature, body.top_p) == (7, ["\n"], 0.5, 0.9)
    assert (body.presence_penalty, body.frequency_penalty, body.max_tokens) == (0.5, -0.5, 12)
    assert "cache_salt" not in body.model_dump()


@pytest.mark.parametrize(
    "field", ["best_of", "echo", "tools", "logit_bias", "suffix", "tool_choice", "functions"]
)
def test_an_unserved_field_is_refused_by_name(field):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, field: 1})
    assert raised.value.errors()[0]["loc"] == (field,)


def test_choices_and_completion_logprobs_are_served():
    body = CompletionRequest.model_validate({**BASE, "n": 3, "logprobs": 2})
    assert (body.n, body.logprobs, body.num_logprobs) == (3, 2, 2)
    assert CompletionRequest.model_validate({**BASE, "logprobs": 0}).num_logprobs == 0
    assert CompletionRequest.model_validate({**BASE, "logprobs": None}).num_logprobs is None


def test_chat_logprobs_are_a_flag_with_top_logprobs():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}).num_logprobs == 0
    both = ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 4})
    assert both.num_logprobs == 4
    assert ChatCompletionRequest.model_validate(chat).num_logprobs is None
    off = ChatCompletionRequest.model_validate({**chat, "logprobs": False, "top_logprobs": 0})
    assert off.num_logprobs is None
    with pytest.raises(ValidationError) as raised:  # alternatives without logprobs: vLLM's 400
        ChatCompletionRequest.model_validate({**chat, "top_logprobs": 2})
    assert raised.value.errors()[0]["loc"] == ("top_logprobs",)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 129),
        ("n", "two"),
        ("logprobs", 6),
        ("logprobs", -1),
        ("logprobs", True),  # completions take a count
        ("logprobs", 1.5),
        ("top_logprobs", 3),  # a chat field
        ("best_of", 2),
    ],
)
def test_bad_choices_and_logprobs_are_refused_by_name(field, value):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, field: value})
    assert raised.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize(
    ("field", "value"), [("logprobs", 2), ("logprobs", "yes"), ("top_logprobs", 6)]
)
def test_bad_chat_logprobs_are_refused_by_name(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate({**body, field: value})
    assert raised.value.errors()[0]["loc"] == (field,)


def test_several_choices_need_sampling():
    """Greedy decoding would give n identical choices: vLLM refuses it, so does the body."""
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, "n": 2, "temperature": 0})
    assert raised.value.errors()[0]["loc"] == ("n",)
    assert CompletionRequest.model_validate({**BASE, "n": 1, "temperature": 0}).n == 1


def test_chat_logprobs_false_and_nulls_mean_the_defaults():
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "logprobs": False,
            "temperature": None,
            "stop": None,
        }
    )
    assert body.temperature == 1.0 and body.stop is None
    assert body.messages[0].content == "hi"
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}
        )


@pytest.mark.parametrize("stop", [["a"] * 5, ["x" * (MAX_STOP_CHARS + 1)], "x" * 5_000_000, [""]])
def test_stop_strings_are_bounded(stop):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, "stop": stop})
    assert raised.value.errors()[0]["loc"][0] == "stop"


def test_prompt_chars_counts_text_of_any_shape():
    assert prompt_chars({"prompt": "abc"}) == 3
    assert prompt_chars({"prompt": ["ab", "cd"]}) == 4
    messages = [{"role": "user", "content": "abc"}, {"content": [{"type": "text", "text": "de"}]}]
    assert prompt_chars({"messages": messages}) == 5 + 2 * MESSAGE_OVERHEAD_CHARS  # templates
    assert prompt_chars({"prompt": 5, "messages": {"x": None}}) == 0


def test_a_generate_request_carries_a_valid_prefix_group_or_none():
    fields = {
        "request_id": "cmpl-1",
        "tenant_id": "acme",
        "prompt_token_ids": [1, 2],
        "max_tokens": 4,
        "temperature": 0.0,
        "top_p": 1.0,
    }
    assert GenerateRequest.model_validate(fields).prefix_group is None
    grouped = GenerateRequest.model_validate({**fields, "prefix_group": "bots"})
    assert GenerateRequest.model_validate(grouped.model_dump()).prefix_group == "bots"
    with pytest.raises(ValidationError, match="prefix_group"):
        GenerateRequest.model_validate({**fields, "prefix_group": "a b"})
