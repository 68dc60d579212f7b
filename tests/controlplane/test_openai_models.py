"""The OpenAI request bodies: served fields (OpenAI's and vLLM's sampling extensions, text
and token-id prompts) validated, refused fields of either API refused by name with why,
unknown fields refused by name; what the ingress sends a replica."""

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


@pytest.mark.parametrize("field", ["tools", "tool_choice", "functions", "guided_json", "x"])
def test_a_field_neither_api_serves_here_is_refused_by_name(field):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, field: 1})
    assert raised.value.errors()[0]["loc"] == (field,)
    assert raised.value.errors()[0]["type"] == "extra_forbidden"


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("best_of", 2, "more sequences"),
        ("echo", True, "OpenAI's shape"),
        ("suffix", "!", "insertion"),
        ("use_beam_search", True, "beam search"),
        ("length_penalty", 0.5, "beam search"),
        ("response_format", {"type": "json_object"}, "guided decoding"),
        ("structured_outputs", {"regex": "a+"}, "guided decoding"),
        ("vllm_xargs", {"vtoken_policy": "none"}, "tenant's policy"),
        ("prompt_logprobs", 1, "prompt token"),
        ("add_special_tokens", False, "tokenizes"),
        ("truncate_prompt_tokens", 8, "never truncated"),
        ("kv_transfer_params", {"do_remote_decode": True}, "disaggregated"),
    ],
)
def test_a_refused_vllm_or_openai_field_says_why(field, value, why):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, field: value})
    (error,) = raised.value.errors()
    assert error["type"] == "not_served" and field in error["msg"] and why in error["msg"]


def test_a_refused_field_at_the_value_that_asks_for_nothing_is_dropped():
    """vLLM clients often send its defaults: they ask for nothing the server refuses."""
    defaults = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "best_of": 1,
        "echo": False,
        "add_special_tokens": True,
        "response_format": {"type": "text"},
        "prompt_logprobs": None,
    }
    body = CompletionRequest.model_validate({**BASE, **defaults})
    assert not set(defaults) & set(body.model_dump())
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat_defaults = {"tool_choice": "none", "add_generation_prompt": True, "tools": []}
    ChatCompletionRequest.model_validate({**chat, **chat_defaults})
    with pytest.raises(ValidationError, match="chat_template: not served here"):
        ChatCompletionRequest.model_validate({**chat, "chat_template": "{{ secrets }}"})
    with pytest.raises(ValidationError, match="use_beam_search"):  # a flag is not a number
        CompletionRequest.model_validate({**BASE, "use_beam_search": 0})


def test_vllm_sampling_extensions_reach_the_generate_request_as_vllm_passes_them():
    extensions = {
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [2, 7],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "bad_words": ["zebra"],
        "allowed_token_ids": [1, 2, 3],
        "logit_bias": {"42": -100, "7": 2.5},
        "stream_interval": 4,
    }
    body = CompletionRequest.model_validate({**BASE, **extensions})
    kwargs = body.sampling_extensions().engine_kwargs()
    assert kwargs == {**extensions, "logit_bias": {42: -100.0, 7: 2.5}}
    request = GenerateRequest(**GENERATE, sampling=body.sampling_extensions())
    assert GenerateRequest.model_validate(request.model_dump()).sampling == request.sampling
    assert GenerateRequest(**GENERATE).sampling.engine_kwargs()["repetition_penalty"] == 1.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", "1.0x"),
        ("min_tokens", -1),
        ("min_tokens", 17),  # more than max_tokens (16)
        ("ignore_eos", "yes"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", list(range(65))),
        ("bad_words", [""]),
        ("allowed_token_ids", []),
        ("logit_bias", {"a": 1}),
        ("logit_bias", {"1": 101}),
        ("stream_interval", 0),
    ],
)
def test_bad_sampling_extensions_are_refused_by_name(field, value):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, field: value})
    assert field in str(raised.value)


@pytest.mark.parametrize(
    ("prompt", "ids"),
    [([1, 2, 3], [1, 2, 3]), ([[5, 6]], [5, 6]), (["text"], None), ("text", None)],
)
def test_token_id_prompts_are_taken_as_vllm_takes_them(prompt, ids):
    body = CompletionRequest.model_validate({**BASE, "prompt": prompt})
    assert body.prompt == (ids if ids is not None else "text")


@pytest.mark.parametrize(
    "prompt", [[], [[]], [True, 2], [-1], [1, "a"], [[1], [2]], ["a", "b"], [1.5], [[1, -2]]]
)
def test_bad_token_id_prompts_and_batches_are_refused(prompt):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, "prompt": prompt})
    assert raised.value.errors()[0]["loc"][0] == "prompt"


def test_chat_takes_max_completion_tokens_as_openai_and_vllm_do():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert (
        ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 5}).max_tokens == 5
    )
    both = {**chat, "max_tokens": 9, "max_completion_tokens": 5}
    assert ChatCompletionRequest.model_validate(both).max_tokens == 5  # vLLM's precedence
    with pytest.raises(ValidationError, match="max_"):
        ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 0})


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


GENERATE = {
    "request_id": "cmpl-1",
    "tenant_id": "acme",
    "prompt_token_ids": [1, 2],
    "max_tokens": 4,
    "temperature": 0.0,
    "top_p": 1.0,
}


def test_a_generate_request_carries_a_valid_prefix_group_or_none():
    fields = GENERATE
    assert GenerateRequest.model_validate(fields).prefix_group is None
    grouped = GenerateRequest.model_validate({**fields, "prefix_group": "bots"})
    assert GenerateRequest.model_validate(grouped.model_dump()).prefix_group == "bots"
    with pytest.raises(ValidationError, match="prefix_group"):
        GenerateRequest.model_validate({**fields, "prefix_group": "a b"})


@pytest.mark.parametrize("value", [-3, 0, 7])
def test_priority_is_vllms_integer_and_reaches_the_generate_request(value):
    body = CompletionRequest.model_validate({**BASE, "priority": value})
    assert body.priority == value
    request = GenerateRequest(**GENERATE, priority=body.priority)
    assert GenerateRequest.model_validate(request.model_dump()).priority == value
    assert CompletionRequest.model_validate(BASE).priority == 0


@pytest.mark.parametrize("value", [1.5, "1", True, 2**31, -(2**31)])
def test_a_priority_that_is_not_a_bounded_integer_is_refused_by_name(value):
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({**BASE, "priority": value})
    assert raised.value.errors()[0]["loc"] == ("priority",)
