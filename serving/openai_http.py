"""The request pipeline behind the ingress: OpenAI-compatible completions and tenant admission.

Every request: authenticate the tenant from ``Authorization: Bearer <key>``; refuse it
(429 + Retry-After) when the tenant is at its concurrency limit or its prompt-token bucket
is in debt (:mod:`controlplane.precheck`: before any CPU is spent on its body or prompt);
read and validate the body (:mod:`serving.input_limits`); tokenize on the ingress's
tokenizer pool, fair between tenants (:mod:`serving.tokenize_pool`; so admission knows
the prompt size and an oversize prompt is a 400 before any engine sees it); admit against
the tenant's KV budget for all ``n`` sequences of the answer (429 + Retry-After when over);
call a replica through Ray Serve (the vtoken router picks which) while the reservation
is held (:class:`serving.reservation.HeldReservation`: renewed every third of its TTL,
settled to its steady bound once no prefill is left, released when the answer is
complete whatever happens); shape the chunks as an OpenAI answer
(:mod:`serving.openai_answers`). Prompts and keys never reach spans or logs.

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
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.metrics import Meter

from controlplane import telemetry
from controlplane.admission import Admission, AdmissionDecision, AdmissionOutcome, Reservation
from controlplane.auth import TenantKeys, bearer
from controlplane.clock import Clock
from controlplane.keys import KeySpace
from controlplane.metrics import IngressMetrics
from controlplane.models import TenantQuota
from controlplane.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateChunk,
    GenerateRequest,
)
from controlplane.otel_metrics import RequestMetrics
from controlplane.precheck import AdmissionPrecheck, Precheck
from controlplane.prefix import cache_salt, prefix_keys
from controlplane.redis_conn import REDIS_ERRORS
from controlplane.releases import Releaser
from controlplane.store import InvalidQuotaError, RedisStore
from controlplane.tracing import inject_context
from serving.errors import HTTPError
from serving.input_limits import read_request
from serving.openai_answers import Answer, collect, sse
from serving.reservation import HeldReservation
from serving.settings import IngressSettings
from serving.stream_progress import ChunkTiming, StreamProgress, TokenPace
from serving.tokenize_pool import TokenizerPool

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


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the ingress uses."""

    def __call__(self, text: str) -> Any: ...

    def __len__(self) -> int: ...  # the vocabulary's size, added tokens included

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
        self.admission = Admission(redis, settings.admission, keys, tracer=tracer)
        self.precheck = AdmissionPrecheck(redis, settings.admission, keys)
        limits = settings.limits
        self.tokenize_pool = TokenizerPool(
            limits.tokenizer_threads, limits.max_tokenizing_per_tenant, limits.max_tokenizing
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
        try:
            quota = await redis_or_503(self.store.get_quota(tenant_id)) if tenant_id else None
        except InvalidQuotaError as error:  # known tenant, unusable record: not the client's
            logger.error("%s", error)
            raise HTTPError(
                503,
                f"tenant {tenant_id!r} cannot be served: its stored quota is invalid "
                "(an administrator must set it again)",
                "server_error",
            ) from None
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
        elif isinstance(body.prompt, list):  # token ids: no tokenizing, the same limits
            encoded = body.prompt
            vocabulary = len(self.tokenizer)
            if max(encoded) >= vocabulary:
                raise HTTPError(
                    400,
                    f"prompt: token id {max(encoded)} is outside the model's vocabulary "
                    f"of {vocabulary} tokens",
                    "invalid_request",
                )
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
            raise_if_cancelled()
            span.set_attribute(telemetry.ATTR_TENANT_ID, quota.tenant_id)
            precheck = await self.before_tokenizing(quota)
            settings = self.settings
            model: type[CompletionRequest | ChatCompletionRequest] = (
                ChatCompletionRequest if chat else CompletionRequest
            )
            body = await read_request(request, model, settings.limits, settings.max_prompt_chars)
            if body.n > settings.max_n:
                raise HTTPError(
                    400,
                    f"invalid request: n: at most {settings.max_n} choices are served "
                    f"per request (got {body.n})",
                    "invalid_request",
                )
            # Tokenizing is CPU work: on the pool, at most as many of the tenant's at once
            # as its concurrency limit leaves room for.
            limit = quota.max_concurrent_requests
            ids = await self.tokenize_pool.run(
                quota.tenant_id,
                self.prompt_ids,
                body,
                limit=None if limit is None else limit - precheck.held,
            )
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            span.set_attribute(telemetry.ATTR_REQUEST_ID, request_id)
            raise_if_cancelled()
            reservation = await self.admit(quota, request_id, len(ids), body.max_tokens, body.n)
            held = HeldReservation(self.admission, self.releaser, reservation)
            try:
                raise_if_cancelled()
                generate = self._generate_request(quota, request_id, ids, body, reservation)
                chunks = self._generate(generate, held, started)
                answer = Answer.of(request_id, body, chat, int(started))
                if body.stream:
                    return ReleasingStream(held, sse(chunks, answer))
                return JSONResponse(await collect(chunks, answer))
            except BaseException:
                # Cancelled or failed before or while answering: released either way
                # (idempotent; the answer's own exit may have released it already).
                held.release_soon()
                raise

    def _generate_request(
        self,
        quota: TenantQuota,
        request_id: str,
        ids: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        reservation: Reservation,
    ) -> GenerateRequest:
        """What the replica is asked: the prompt's ids, the body's sampling, the tenant's
        cap and prefix group, the prompt's prefix keys (router affinity), the bound the
        engine holds the request to and the trace to join."""
        return GenerateRequest(
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
            sampling=body.sampling_extensions(),
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

    async def before_tokenizing(self, quota: TenantQuota) -> Precheck:
        """The tenant's concurrency and prompt-rate limits, read before its body and prompt
        cost any CPU: 429 with ``Retry-After`` when admission would throttle any prompt."""
        precheck = await redis_or_503(self.precheck.check(quota))
        if precheck.reason is None:
            return precheck
        outcome = AdmissionOutcome.THROTTLED.value
        self.metrics.admission(quota.tenant_id, outcome)
        self.request_metrics.admission(quota.tenant_id, outcome)
        retry = max(1, round(precheck.retry_after_s))
        why = THROTTLE_REASONS.get(precheck.reason, precheck.reason)
        raise HTTPError(
            429,
            f"tenant {quota.tenant_id!r} is {why}; retry after {retry} s",
            "rate_limit",
            headers={"Retry-After": str(retry)},
        )

    async def admit(
        self,
        quota: TenantQuota,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        n: int = 1,
    ) -> Reservation:
        """The request's KV reservation, for all ``n`` sequences; 429 with ``Retry-After``
        when the tenant must wait, 400 when the request can never fit its quota.

        Cancellation-safe: the admission runs as its own task, so a caller cancelled while
        it runs (the client left) never leaves a committed reservation behind: the task
        finishes and its reservation, if any, is released."""
        call = asyncio.ensure_future(
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
        try:
            decision = await redis_or_503(asyncio.shield(call))
        except asyncio.CancelledError:
            call.add_done_callback(self._release_if_admitted)
            raise
        self.metrics.admission(quota.tenant_id, decision.outcome.value)
        self.request_metrics.admission(quota.tenant_id, decision.outcome.value)
        if decision.outcome is AdmissionOutcome.THROTTLED:
            retry = max(1, math.ceil(decision.retry_after_s))  # never before it fits
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

    def _release_if_admitted(self, call: asyncio.Future[AdmissionDecision]) -> None:
        """Done callback of an admission whose caller was cancelled."""
        if call.cancelled() or call.exception() is not None:
            return
        reservation = call.result().reservation
        if reservation is not None:
            self.releaser.release_soon(reservation)

    def hold_to_blocks(
        self, reservation: Reservation, prompt_tokens: int, max_tokens: int, n: int
    ) -> int | None:
        """Each sequence's steady bound in blocks when admission counts it below its
        worst case (then the engine holds it there), else ``None``."""
        worst = n * -(-(prompt_tokens + max_tokens) // self.settings.block_size)
        return reservation.steady // n if reservation.steady < worst else None

    async def _generate(
        self, request: GenerateRequest, held: HeldReservation, started: float
    ) -> AsyncIterator[GenerateChunk]:
        """The replica's chunks for ``request`` while ``reservation`` is held (renewed,
        settled once no prefill is left, released at the end however it ends); a request
        the replica refuses is a 400, a replica that fails or vanishes a 503."""
        stream: Any = None
        try:
            async with held:
                try:
                    raise_if_cancelled()
                    stream = self.replicas.options(stream=True).generate.remote(
                        request.model_dump()
                    )
                    progress = StreamProgress(request.n, started, seen_at=self.clock.now())
                    async for raw in stream:
                        chunk = GenerateChunk.model_validate(raw)
                        if chunk.error:
                            raise HTTPError(400, chunk.error, "invalid_request")
                        self._observe(request.tenant_id, progress.observe(chunk, self.clock.now()))
                        if progress.past_prefill:  # from here the policy bounds the KV
                            await held.settle()
                        yield chunk
                    stream = None  # ended: nothing to cancel
                    self._answered(request, progress)
                except (HTTPError, asyncio.CancelledError):
                    raise
                except Exception as error:  # the replica died or refused mid-request
                    # Its text (a Ray traceback, addresses) is for the logs, not the client.
                    logger.warning("request %s: replica failed: %r", request.request_id, error)
                    raise HTTPError(
                        503,
                        "the engine replica failed; retry the request",
                        "server_error",
                        headers={"Retry-After": str(REPLICA_RETRY_AFTER_S)},
                    ) from None
                finally:
                    if stream is not None and hasattr(stream, "cancel"):
                        stream.cancel()  # the client left or we failed: the engine aborts
        finally:
            self.metrics.latency(request.tenant_id, self.clock.now() - started)

    def _answered(self, request: GenerateRequest, progress: StreamProgress) -> None:
        """The stream ended: every choice must have its finish reason (a replica that
        vanished is not a short answer); the answer's latencies, per sequence."""
        if not progress.all_finished:
            raise RuntimeError("the replica's stream ended without a finish reason")
        if progress.first_token_at is not None:
            self.request_metrics.request_done(
                request.tenant_id,
                progress.first_token_at - progress.started,
                progress.seen_at - progress.started,
                progress.tokens_per_sequence,
            )

    def _observe(self, tenant_id: str, timing: ChunkTiming) -> None:
        """A chunk's timing into the paces admission reads and the tenant's metrics."""
        if timing.decode_s is not None:
            self.pace.observe(timing.decode_s, timing.decode_tokens)
        if timing.first_token_s is not None:
            self.request_metrics.first_token(tenant_id, timing.first_token_s)
            # Queueing and prefill: when reservations settle.
            self.first_token.observe(timing.first_token_s, 1)


class ReleasingStream(StreamingResponse):
    """An SSE answer that releases its reservation however the response ends, even when
    it never starts (a client gone before the first byte: Starlette then runs no
    background task, and the answer's generator, never started, has nothing to exit)."""

    def __init__(self, held: HeldReservation, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.held = held

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.held.release_soon()


def raise_if_cancelled() -> None:
    """Honour a cancellation of this task that a library swallowed: redis-py 8.1 can lose
    one delivered mid-command (79 of 200 clients that left during admission once had their
    requests run on). ``Task.cancelling()`` still counts the request; raise it here."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


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
