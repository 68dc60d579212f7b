"""OpenAI answers from the replicas' chunks: one response body (:func:`collect`) or server-sent
events (:func:`sse`), shaped as vLLM's OpenAI server shapes them (choices, log-probabilities,
``usage``).

Pure shaping: the chunks come from the request pipeline (:mod:`serving.openai_http`), which
has already turned a failed replica into an :class:`HTTPError`; a stream reports such an
error in an ``error`` event, since its headers are already sent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from controlplane.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateChunk,
    TokenLogprob,
)
from serving.errors import HTTPError, error_body

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Answer:
    """What every piece of one OpenAI answer repeats (``created``: seconds since the epoch),
    and how its choices are shaped: ``n`` of them, with log-probabilities (``logprobs``
    alternatives per token) unless ``logprobs`` is ``None``."""

    request_id: str
    model: str
    chat: bool
    created: int
    n: int = 1
    logprobs: int | None = None
    include_usage: bool = False  # a streamed answer ends with a usage chunk

    @classmethod
    def of(
        cls,
        request_id: str,
        body: CompletionRequest | ChatCompletionRequest,
        chat: bool,
        created: int,
    ) -> Answer:
        """The answer ``body`` asks for."""
        return cls(
            request_id,
            body.model,
            chat,
            created,
            body.n,
            body.num_logprobs,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
        )

    def envelope(self, choices: list[dict[str, Any]], streaming: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if streaming else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(
        self,
        index: int,
        text: str,
        finish: str | None,
        streaming: bool,
        logprobs: list[TokenLogprob] | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """One choice (or a streamed piece of one) in vLLM's OpenAI server's shape; a
        ``logprobs`` key only when the request asked for log-probabilities."""
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = text
        else:
            key = "delta" if streaming else "message"
            choice[key] = {"role": "assistant", "content": text} if text or not streaming else {}
        if self.logprobs is not None:
            entries = logprobs or []
            choice["logprobs"] = (
                chat_logprobs(entries, self.logprobs)
                if self.chat
                else completion_logprobs(entries, self.logprobs, text_offset)
            )
        choice["finish_reason"] = finish
        return choice


def completion_logprobs(
    entries: list[TokenLogprob], num_logprobs: int, text_offset: int = 0
) -> dict[str, Any]:
    """The completions API's ``logprobs`` object (as vLLM's OpenAI server builds it): per
    token its text, log-probability, the sampled token's and the ``num_logprobs`` most
    likely alternatives' log-probabilities, and its character offset in the choice's text
    (from ``text_offset``: where this piece starts)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
        tokens.append(entry.token)
        token_logprobs.append(entry.logprob)
        top = entry.top
        top_logprobs.append(None if top is None else dict(top[: num_logprobs + 1]))
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries: list[TokenLogprob], top_logprobs: int) -> dict[str, Any]:
    """The chat API's ``logprobs`` object: ``content``, per token its text, bytes,
    log-probability and the first ``top_logprobs`` of the engine's alternatives (as
    vLLM's OpenAI server builds it)."""
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": -9999.0 if entry.logprob is None else entry.logprob,
                "bytes": _token_bytes(entry.token),
                "top_logprobs": [
                    {"token": token, "logprob": logprob, "bytes": _token_bytes(token)}
                    for token, logprob in (entry.top or [])[:top_logprobs]
                ],
            }
            for entry in entries
        ]
    }


async def collect(chunks: AsyncIterator[GenerateChunk], answer: Answer) -> dict[str, Any]:
    """The whole answer as one OpenAI response body: its choices by index, with the token
    usage of all of them."""
    texts: dict[int, list[str]] = {}
    finishes: dict[int, str | None] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    last = GenerateChunk()
    cached = 0
    async for chunk in chunks:
        cached = max(cached, chunk.cached_tokens)  # with n > 1: any choice's hit
        texts.setdefault(chunk.index, []).append(chunk.text)
        logprobs.setdefault(chunk.index, []).extend(chunk.logprobs or [])
        if chunk.finish_reason is not None:
            finishes[chunk.index] = chunk.finish_reason
        last = chunk
    choices = [
        answer.choice(index, "".join(texts[index]), finishes.get(index), False, logprobs[index])
        for index in sorted(texts)
    ]
    body = answer.envelope(choices, streaming=False)
    body["usage"] = usage(last, cached)
    return body


def usage(last: GenerateChunk, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` from an answer's last piece; ``prompt_tokens_details.
    cached_tokens``: the prompt tokens served from the replica's prefix cache (the most
    any piece reported)."""
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


async def sse(chunks: AsyncIterator[GenerateChunk], answer: Answer) -> AsyncIterator[str]:
    """Server-sent events, one per chunk, then ``[DONE]``; an error after the headers went
    out is reported as an ``error`` event (the OpenAI error body) before ``[DONE]``: a stream
    never just stops."""
    text_offsets: dict[int, int] = {}  # per choice: where its next piece's text starts
    last = GenerateChunk()
    cached = 0
    try:
        async for chunk in chunks:
            last = chunk
            cached = max(cached, chunk.cached_tokens)
            offset = text_offsets.get(chunk.index, 0)
            choice = answer.choice(
                chunk.index, chunk.text, chunk.finish_reason, True, chunk.logprobs, offset
            )
            # Advanced by the tokens reported, as vLLM does: text held back for a stop
            # string lags its tokens.
            text_offsets[chunk.index] = offset + sum(len(e.token) for e in chunk.logprobs or [])
            yield f"data: {json.dumps(answer.envelope([choice], streaming=True))}\n\n"
        if answer.include_usage:
            body = {**answer.envelope([], streaming=True), "usage": usage(last, cached)}
            yield f"data: {json.dumps(body)}\n\n"
    except HTTPError as error:
        yield f"data: {json.dumps(error_body(error.status, error.message, error.kind))}\n\n"
    except Exception as error:  # headers are sent: report in the stream, then end it
        logger.exception("request %s: stream failed", answer.request_id, exc_info=error)
        body = error_body(500, "internal error; retry the request", "server_error")
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
