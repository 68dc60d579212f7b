"""The request pipeline behind the ingress: OpenAI-compatible completions and tenant admission.

Every request: authenticate the tenant from ``Authorization: Bearer <key>``; refuse it
(429 + Retry-After) when the tenant is at its concurrency limit or its prompt-token bucket
is in debt (both :mod:`serving.tenant_gate`: before any CPU is spent on its body or
prompt); read and validate the body (:mod:`serving.input_limits`); tokenize
(:mod:`serving.replica_request`) on the ingress's tokenizer pool, fair between tenants
(:mod:`serving.tokenize_pool`; so admission knows the prompt size and an oversize prompt
is a 400 before any engine sees it); admit against the tenant's KV budget for all ``n``
sequences of the answer (429 + Retry-After when over); call a replica through Ray Serve
(the vtoken router picks which) while the reservation is held
(:class:`serving.reservation.HeldReservation`: renewed every third of its TTL, settled
to its steady bound once no prefill is left, released when the answer is complete
whatever happens; :mod:`serving.answer_stream`); shape the chunks as an OpenAI answer
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
import math
import uuid
from typing import Any

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.metrics import Meter

from controlplane import telemetry
from controlplane.admission import Admission, AdmissionDecision, AdmissionOutcome, Reservation
from controlplane.auth import TenantKeys
from controlplane.clock import Clock
from controlplane.keys import KeySpace
from controlplane.metrics import IngressMetrics
from controlplane.models import TenantQuota
from controlplane.openai_models import ChatCompletionRequest, CompletionRequest
from controlplane.otel_metrics import RequestMetrics
from controlplane.precheck import AdmissionPrecheck
from controlplane.releases import Releaser
from controlplane.store import RedisStore
from serving.answer_stream import AnswerStreams, ReleasingStream, raise_if_cancelled
from serving.errors import HTTPError, redis_or_503
from serving.input_limits import read_request
from serving.openai_answers import Answer, collect, sse
from serving.replica_request import PromptEncoder, Tokenizer, generate_request
from serving.reservation import HeldReservation
from serving.settings import IngressSettings
from serving.stream_progress import TokenPace
from serving.tenant_gate import TenantGate, throttled
from serving.tokenize_pool import TokenizerPool


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
        self.clock = clock
        self.tracer = tracer
        keys = KeySpace(settings.key_prefix)
        self.store = RedisStore(redis, keys)
        self.tenant_keys = TenantKeys(redis, keys)
        self.admission = Admission(redis, settings.admission, keys, tracer=tracer)
        limits = settings.limits
        self.tokenize_pool = TokenizerPool(
            limits.tokenizer_threads, limits.max_tokenizing_per_tenant, limits.max_tokenizing
        )
        self.prompts = PromptEncoder(tokenizer, settings.model_name, settings.max_model_len)
        self.releaser = Releaser(self.admission)
        self.metrics = IngressMetrics()
        # OpenTelemetry (admissions, TTFT, TPOT per tenant): the global meter provider's
        # meter unless one is given; a no-op until ``configure_metrics`` set a provider.
        self.request_metrics = RequestMetrics(
            meter or otel_metrics.get_meter(telemetry.TRACER_INGRESS)
        )
        precheck = AdmissionPrecheck(redis, settings.admission, keys)
        self.gate = TenantGate(
            self.tenant_keys, self.store, precheck, self.metrics, self.request_metrics
        )
        self.pace = TokenPace()  # decode: seconds per output token
        self.first_token = TokenPace()  # seconds from arrival to first token (one "token")
        self.answers = AnswerStreams(
            replicas, clock, self.metrics, self.request_metrics, self.pace, self.first_token
        )

    async def serve(self, request: Request, chat: bool) -> Response:
        server = trace.SpanKind.SERVER
        with self.tracer.start_as_current_span(telemetry.SPAN_INGRESS, kind=server) as span:
            started = self.clock.now()
            quota = await self.gate.tenant(request)
            raise_if_cancelled()
            span.set_attribute(telemetry.ATTR_TENANT_ID, quota.tenant_id)
            precheck = await self.gate.before_tokenizing(quota)
            settings = self.settings
            model: type[CompletionRequest | ChatCompletionRequest] = (
                ChatCompletionRequest if chat else CompletionRequest
            )
            with self.gate.in_flight(quota, settings.limits.max_tokenizing_per_tenant):
                body = await read_request(
                    request, model, settings.limits, settings.max_prompt_chars
                )
                if body.n > settings.max_n:
                    raise HTTPError(
                        400,
                        f"invalid request: n: at most {settings.max_n} choices are served "
                        f"per request (got {body.n})",
                        "invalid_request",
                    )
                # Tokenizing is CPU work: on the pool, at most as many of the tenant's at
                # once as its concurrency limit leaves room for.
                limit = quota.max_concurrent_requests
                ids = await self.tokenize_pool.run(
                    quota.tenant_id,
                    self.prompts.ids,
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
                generate = generate_request(
                    quota, request_id, ids, body, reservation, settings.block_size
                )
                chunks = self.answers.chunks(generate, held, started)
                answer = Answer.of(request_id, body, chat, int(started))
                if body.stream:
                    return ReleasingStream(held, sse(chunks, answer))
                return JSONResponse(await collect(chunks, answer))
            except BaseException:
                # Cancelled or failed before or while answering: released either way
                # (idempotent; the answer's own exit may have released it already).
                held.release_soon()
                raise

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
            raise throttled(quota.tenant_id, decision.reason, retry)
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
