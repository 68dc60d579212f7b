"""OpenAI answers shaped from chunks: one body with every choice and its usage, or server-
sent events ending in ``[DONE]`` (with an ``error`` event first when the answer failed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from controlplane.openai_models import GenerateChunk, TokenLogprob
from serving.errors import HTTPError
from serving.openai_answers import Answer, chat_logprobs, collect, completion_logprobs, sse


async def _chunks(*chunks: GenerateChunk, error: Exception | None = None):
    for chunk in chunks:
        yield chunk
    if error is not None:
        raise error


def _events(stream: AsyncIterator[str]) -> list[str]:
    async def read() -> list[str]:
        return [event async for event in stream]

    return asyncio.run(read())


CHUNKS = (
    GenerateChunk(index=1, text="b", prompt_tokens=4, completion_tokens=1, cached_tokens=2),
    GenerateChunk(index=0, text="a", prompt_tokens=4, completion_tokens=2),
    GenerateChunk(index=0, text="c", finish_reason="stop", prompt_tokens=4, completion_tokens=3),
    GenerateChunk(index=1, finish_reason="length", prompt_tokens=4, completion_tokens=4),
)


def test_a_whole_answer_has_its_choices_by_index_and_the_usage_of_all():
    answer = Answer("cmpl-1", "m", chat=False, created=7, n=2)
    body = asyncio.run(collect(_chunks(*CHUNKS), answer))
    assert body["object"] == "text_completion" and body["created"] == 7
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ac", "stop"),
        (1, "b", "length"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_a_chat_stream_ends_with_usage_when_asked_then_done():
    answer = Answer("chatcmpl-1", "m", chat=True, created=7, n=2, include_usage=True)
    events = _events(sse(_chunks(*CHUNKS), answer))
    assert events[-1] == "data: [DONE]\n\n"
    bodies = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": "b"}
    assert bodies[3]["choices"][0]["delta"] == {}  # no text: an empty delta
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["total_tokens"] == 8


def test_a_failed_stream_reports_the_error_before_done():
    answer = Answer("cmpl-1", "m", chat=False, created=7)
    refused = HTTPError(503, "the engine replica failed; retry the request", "server_error")
    events = _events(sse(_chunks(CHUNKS[1], error=refused), answer))
    assert json.loads(events[1].removeprefix("data: ")) == {
        "error": {"message": refused.message, "type": "server_error", "code": 503}
    }
    events = _events(sse(_chunks(error=RuntimeError("a Ray traceback")), answer))
    assert "a Ray traceback" not in events[0] and '"code": 500' in events[0]
    assert events[-1] == "data: [DONE]\n\n"


def test_logprobs_as_vllms_openai_server_shapes_them():
    entries = [
        TokenLogprob(token="a", logprob=-0.5, top=[("a", -0.5), ("b", -1.0), ("c", -2.0)]),
        TokenLogprob(token="é"),  # the engine gave none
    ]
    completion = completion_logprobs(entries, num_logprobs=1, text_offset=3)
    assert completion == {
        "text_offset": [3, 4],
        "token_logprobs": [-0.5, None],
        "tokens": ["a", "é"],
        "top_logprobs": [{"a": -0.5, "b": -1.0}, None],  # the sampled token and 1 more
    }
    chat = chat_logprobs(entries, top_logprobs=1)["content"]
    assert chat[0]["top_logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97]}]
    assert (chat[1]["logprob"], chat[1]["bytes"]) == (-9999.0, [195, 169])
