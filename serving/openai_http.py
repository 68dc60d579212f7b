"""The request pipeline behind the ingress: OpenAI-compatible completions and tenant admission.

Every request: authenticate the tenant from ``Authorization: Bearer <key>``; validate the
body; tokenize (so admission knows the prompt size and an oversize prompt is a 400 before
any engine sees it); admit against the tenant's KV budget for all ``n`` sequences of the
answer (429 + Retry-After when over);
call a replica through Ray Serve (the vtoken router picks which); renew the reservation
every third of its TTL while the answer runs; release it when the answer is complete,
whatever happens (best-effort: a release Redis cannot take now is retried in the
background, never turned into an error for a finished answer). Prompts and keys never
reach spans or logs.

Faults reach clients as OpenAI error bodies (``{"error": {"message", "type", "code"}}``),
never as plain-text 500s and never with internals (Redis's address, a traceback, a Ray
error's text): Redis away or refusing (any ``RedisError``) before the answer starts, or
a replica that fails, is a 503 ``server_error`` with ``Retry-After`` (quotas fail closed);
once a stream has started, an SSE ``error`` event with ``type`` comes before ``[DONE]``.

:class:`IngressState` gets its Redis client, clock, tokenizer, tracer and replica handle
from its caller (the Serve deployment in :mod:`serving.ingress` builds the real ones), so
tests drive it with a local Redis, a fake clock and a fake replica handle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.metrics import Meter
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from controlplane import telemetry
from controlplane.admission import Admission, AdmissionConfig, AdmissionOutcome, Reservation
from controlplane.auth import TenantKeys, bearer
from controlplane.clock import Clock
from controlplane.keys import KeySpace
from controlplane.metrics import IngressMetrics
from controlplane.models import TenantQuota
from controlplane.openai_models import (
    DEFAULT_MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateChunk,
    GenerateRequest,
    TokenLogprob,
)
from controlplane.otel_metrics import RequestMetrics
from controlplane.prefix import cache_salt, prefix_keys
from controlplane.redis_conn import REDIS_ERRORS
from controlplane.releases import Releaser
from controlplane.store import RedisStore
from controlplane.tracing import inject_context

logger = logging.getLogger(__name__)
T = TypeVar("T")

REDIS_RETRY_AFTER_S = 2
"""Retry-After of a 503 while Redis is away (its clients reconnect within ~1 s)."""
REPLICA_RETRY_AFTER_S = 1
"""Retry-After of a 503 when a replica failed (Serve routes the retry to another)."""

THROTTLE_REASONS = {
    "kv_budget": "over its KV budget",
    "max_concurrent_requests": "at its concurrent-request limit",
    "prompt_token_rate": "over its prompt-token rate",
}


class HTTPError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, kind: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


@dataclass(frozen=True, slots=True)
class IngressSettings:
    """What the ingress serves. ``tokenizer_path`` and ``redis_url`` are read only where the
    real dependencies are built (:class:`serving.ingress.Ingress`)."""

    model_name: str
    tokenizer_path: str
    max_model_len: int
    block_size: int
    admin_token: str
    redis_url: str
    key_prefix: str = "vtoken"
    keep_ratio: float | None = None  # the engines' policy budget (admission's steady bound)
    floor_tokens: int | None = None  # what the policy always keeps (squeeze_to_floor tenants)
    protected_tokens: int = 0  # what the policy keeps past any budget B: these tokens ...
    protected_fraction: float = 0.0  # ... plus this share of B (admission's steady bound)
    reservation_ttl_s: float = 600.0  # a running request renews it every third of this
    max_n: int = DEFAULT_MAX_N  # choices one request may ask for (each is a sequence's KV)


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the ingress uses."""

    def __call__(self, text: str) -> Any: ...

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, add_generation_prompt: bool, tokenize: bool
    ) -> Any: ...


class IngressState:
    """Everything a request handler needs; built once per ingress replica.

    ``replicas`` is a Ray Serve handle to the engine deployment (anything whose
    ``options(stream=True).generate.remote(dict)`` is an async iterator of
    :class:`GenerateChunk` dicts); ``redis`` holds quotas, keys and reservations.
    """

    def __init__(
        self,
        settings: IngressSettings,
        replicas: Any,
        redis: aioredis.Redis,
        clock: Clock,
        tokenizer: Tokenizer,
        tracer: trace.Tracer,
        meter: Meter | None = None,
    ) -> None:
        self.settings = settings
        self.replicas = replicas
        self.clock = clock
        self.tokenizer = tokenizer
        self.tracer = tracer
        keys = KeySpace(settings.key_prefix)
        self.store = RedisStore(redis, keys)
        self.tenant_keys = TenantKeys(redis, keys)
        self.admission = Admission(
            redis,
            AdmissionConfig(
                block_size=settings.block_size,
                keep_ratio=settings.keep_ratio,
                floor_tokens=settings.floor_tokens,
                protected_tokens=settings.protected_tokens,
                protected_fraction=settings.protected_fraction,
                reservation_ttl_s=settings.reservation_ttl_s,
            ),
            keys,
            tracer=tracer,
        )
        self.releaser = Releaser(self.admission)
        self.metrics = IngressMetrics()
        # OpenTelemetry (admissions, TTFT, TPOT per tenant): the global meter provider's
        # meter unless one is given; a no-op until ``configure_metrics`` set a provider.
        self.request_metrics = RequestMetrics(
            meter or otel_metrics.get_meter(telemetry.TRACER_INGRESS)
        )
        self.pace = TokenPace()  # decode: seconds per output token
        self.first_token = TokenPace()  # seconds from arrival to first token (one "token")

    # ----------------------------------------------------------------- request pipeline
    async def tenant(self, request: Request) -> TenantQuota:
        api_key = bearer(request.headers.get("authorization"))
        if api_key is None:
            raise HTTPError(401, "missing API key: send 'Authorization: Bearer <key>'", "auth")
        tenant_id = await redis_or_503(self.tenant_keys.tenant_for(api_key))
        quota = await redis_or_503(self.store.get_quota(tenant_id)) if tenant_id else None
        if quota is None:
            raise HTTPError(401, "unknown API key", "auth")
        return quota

    def prompt_ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if body.model != self.settings.model_name:
            raise HTTPError(404, f"model {body.model!r} is not served here", "not_found")
        if isinstance(body, ChatCompletionRequest):
            messages = [m.model_dump() for m in body.messages]
            encoded: Any = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            encoded = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        else:
            encoded = self.tokenizer(body.prompt)["input_ids"]
        ids = [int(token) for token in encoded]
        limit = self.settings.max_model_len
        if len(ids) + body.max_tokens > limit:
            raise HTTPError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({body.max_tokens}) exceeds the "
                f"model's context of {limit} tokens",
                "invalid_request",
            )
        return ids

    async def serve(self, request: Request, chat: bool) -> Response:
        server = trace.SpanKind.SERVER
        with self.tracer.start_as_current_span(telemetry.SPAN_INGRESS, kind=server) as span:
            started = self.clock.now()
            quota = await self.tenant(request)
            span.set_attribute(telemetry.ATTR_TENANT_ID, quota.tenant_id)
            body = await parse_body(request, ChatCompletionRequest if chat else CompletionRequest)
            if body.n > self.settings.max_n:
                raise HTTPError(
                    400,
                    f"invalid request: n: at most {self.settings.max_n} choices are served "
                    f"per request (got {body.n})",
                    "invalid_request",
                )
            ids = await asyncio.to_thread(self.prompt_ids, body)  # tokenizing is CPU work
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            span.set_attribute(telemetry.ATTR_REQUEST_ID, request_id)
            reservation = await self.admit(quota, request_id, len(ids), body.max_tokens, body.n)
            generate = GenerateRequest(
                request_id=request_id,
                tenant_id=quota.tenant_id,
                prompt_token_ids=ids,
                max_tokens=body.max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stop,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                n=body.n,
                logprobs=body.num_logprobs,
                eviction_budget_tokens=quota.eviction_budget_tokens,
                prefix_group=quota.prefix_group,
                prefix_keys=list(
                    prefix_keys(
                        ids,
                        self.settings.block_size,
                        cache_salt(quota.tenant_id, quota.prefix_group),
                    )
                ),
                hold_to_blocks=self.hold_to_blocks(reservation, len(ids), body.max_tokens, body.n),
                trace_context=inject_context(),
            )
            chunks = self._generate(generate, reservation, started)
            answer = Answer(
                request_id,
                body.model,
                chat,
                int(started),
                body.n,
                body.num_logprobs,
                include_usage=body.stream_options is not None and body.stream_options.include_usage,
            )
            if body.stream:
                # The background task releases the reservation even when the client goes
                # away before the stream starts (release is idempotent).
                return StreamingResponse(
                    sse(chunks, answer),
                    media_type="text/event-stream",
                    background=BackgroundTask(self.releaser.release, reservation),
                )
            return JSONResponse(await collect(chunks, answer))

    async def admit(
        self,
        quota: TenantQuota,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        n: int = 1,
    ) -> Reservation:
        """The request's KV reservation, for all ``n`` sequences; 429 with ``Retry-After``
        when the tenant must wait, 400 when the request can never fit its quota."""
        decision = await redis_or_503(
            self.admission.admit(
                quota,
                request_id,
                prompt_tokens,
                max_tokens,
                self.pace.seconds_per_token,
                n=n,
                seconds_to_first_token=self.first_token.seconds_per_token,
            )
        )
        self.metrics.admission(quota.tenant_id, decision.outcome.value)
        self.request_metrics.admission(quota.tenant_id, decision.outcome.value)
        if decision.outcome is AdmissionOutcome.THROTTLED:
            retry = max(1, round(decision.retry_after_s))
            why = THROTTLE_REASONS.get(decision.reason, decision.reason)
            raise HTTPError(
                429,
                f"tenant {quota.tenant_id!r} is {why}; retry after {retry} s",
                "rate_limit",
                headers={"Retry-After": str(retry)},
            )
        if decision.reservation is None:
            raise HTTPError(
                400, f"request cannot be admitted: {decision.reason}", "invalid_request"
            )
        return decision.reservation

    def hold_to_blocks(
        self, reservation: Reservation, prompt_tokens: int, max_tokens: int, n: int
    ) -> int | None:
        """Each sequence's steady bound in blocks when admission counts it below its
        worst case (then the engine holds it there), else ``None``."""
        worst = n * -(-(prompt_tokens + max_tokens) // self.settings.block_size)
        return reservation.steady // n if reservation.steady < worst else None

    async def _generate(
        self, request: GenerateRequest, reservation: Reservation, started: float
    ) -> AsyncIterator[GenerateChunk]:
        renewal = asyncio.get_running_loop().create_task(self._renew_while_running(reservation))
        stream: Any = None
        try:
            stream = self.replicas.options(stream=True).generate.remote(request.model_dump())
            tokens_seen, seen_at = 0, self.clock.now()
            first_token_at: float | None = None
            decoding: set[int] = set()  # choices past their prefill
            finished: set[int] = set()  # choices with their finish reason
            async for raw in stream:
                chunk = GenerateChunk.model_validate(raw)
                if chunk.error:
                    raise HTTPError(400, chunk.error, "invalid_request")
                now = self.clock.now()
                if tokens_seen and chunk.completion_tokens > tokens_seen:  # decode, not prefill
                    # The n sequences decode side by side: each step adds about n tokens.
                    self.pace.observe(
                        now - seen_at, (chunk.completion_tokens - tokens_seen) / request.n
                    )
                if chunk.completion_tokens > tokens_seen:
                    tokens_seen, seen_at = chunk.completion_tokens, now
                    if first_token_at is None:
                        first_token_at = now
                        self.request_metrics.first_token(request.tenant_id, now - started)
                        # Queueing and prefill: when reservations settle.
                        self.first_token.observe(now - started, 1)
                if chunk.completion_tokens:  # a piece of this choice: its prefill is over
                    decoding.add(chunk.index)
                if len(decoding) >= request.n and reservation.blocks > reservation.steady:
                    # Every sequence has a token out, so no prefill is left: from here the
                    # policy bounds the KV.
                    reservation = await self._settle(reservation)
                if chunk.finish_reason is not None:
                    finished.add(chunk.index)
                yield chunk
            stream = None  # ended: nothing to cancel
            if len(finished) < request.n:  # a replica that vanished: not a short answer
                raise RuntimeError("the replica's stream ended without a finish reason")
            if first_token_at is not None:  # answered: its latencies, per sequence
                self.request_metrics.request_done(
                    request.tenant_id,
                    first_token_at - started,
                    seen_at - started,
                    round(tokens_seen / request.n),
                )
        except HTTPError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the replica died or refused mid-request
            # The error's text (a Ray traceback, addresses) is for the logs, not the client.
            logger.warning("request %s: replica failed: %r", request.request_id, error)
            raise HTTPError(
                503,
                "the engine replica failed; retry the request",
                "server_error",
                headers={"Retry-After": str(REPLICA_RETRY_AFTER_S)},
            ) from None
        finally:
            renewal.cancel()
            if stream is not None and hasattr(stream, "cancel"):
                stream.cancel()  # the client left or we failed: the engine aborts, frees KV
            # Shielded: a client disconnect cancels this generator, not the release, and
            # the release never raises (a failed one is retried in the background).
            await asyncio.shield(self.releaser.release(reservation))
            self.metrics.latency(request.tenant_id, self.clock.now() - started)

    async def _settle(self, reservation: Reservation) -> Reservation:
        """Shrink to the steady bound; on a Redis error keep the peak (over-reserving is
        safe) and let the answer go on."""
        try:
            return await self.admission.settle(reservation)
        except REDIS_ERRORS as error:
            logger.warning("settle of %s failed: %s", reservation.request_id, type(error).__name__)
            return reservation

    async def _renew_while_running(self, reservation: Reservation) -> None:
        """Renew the reservation every third of its TTL until cancelled, so a request
        running longer than the TTL keeps counting against its tenant's quota. A renewal
        Redis refuses is retried at the next third (two may fail before it lapses).
        Timed with the event loop's clock: it paces calls, the deadline is Redis's."""
        period_s = self.admission.config.reservation_ttl_s / 3
        while True:
            await asyncio.sleep(period_s)
            try:
                if not await self.admission.renew(reservation):
                    logger.warning(
                        "reservation of %s lapsed before renewal", reservation.request_id
                    )
            except REDIS_ERRORS as error:
                logger.warning(
                    "renewal of %s failed: %s", reservation.request_id, type(error).__name__
                )


async def redis_or_503(call: Awaitable[T]) -> T:
    """``await call``; a Redis error becomes a 503 with Retry-After (quotas fail closed).
    The error's text names Redis's address: it is logged, never answered."""
    try:
        return await call
    except REDIS_ERRORS as error:
        logger.warning("Redis unavailable at the ingress: %r", error)
        raise HTTPError(
            503,
            "the quota store is unavailable; retry the request",
            "server_error",
            headers={"Retry-After": str(REDIS_RETRY_AFTER_S)},
        ) from None


class TokenPace:
    """An exponential moving average of seconds per token. The ingress keeps two: time per
    output token of the answers it streams (over decode chunks; the first chunk, which
    carries the prefill, is left out), and time from arrival to first token (per request:
    one "token"). ``seconds_per_token`` is ``None`` until a sample was seen."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.seconds_per_token: float | None = None

    def observe(self, seconds: float, num_tokens: float) -> None:
        sample = max(seconds, 0.0) / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = (
            sample if previous is None else previous + self.weight * (sample - previous)
        )


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HTTPError(
            400, f"request body is not valid JSON: {error}", "invalid_request"
        ) from None
    if not isinstance(raw, dict):
        raise HTTPError(400, "request body must be a JSON object", "invalid_request")
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in error.errors()
        )
        raise HTTPError(400, f"invalid request: {problems}", "invalid_request") from None


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


def _error_event(message: str, kind: str, code: int) -> dict[str, Any]:
    """The OpenAI error body, for JSON responses and SSE error events alike."""
    return {"error": {"message": message, "type": kind, "code": code}}


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
        yield f"data: {json.dumps(_error_event(error.message, error.kind, error.status))}\n\n"
    except Exception as error:  # headers are sent: report in the stream, then end it
        logger.exception("request %s: stream failed", answer.request_id, exc_info=error)
        body = _error_event("internal error; retry the request", "server_error", 500)
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
