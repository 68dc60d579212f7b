"""The request pipeline behind the ingress: OpenAI-compatible completions and tenant admission.

Every request: authenticate the tenant from ``Authorization: Bearer <key>``; refuse it
(429 + Retry-After) when the tenant is at its concurrency limit or its prompt-token bucket
is in debt (both :mod:`serving.tenant_gate`: before any CPU is spent on its body or
prompt); read and validate the body (:mod:`serving.input_limits`); tokenize
(:mod:`serving.replica_request`) on the ingress's tokenizer pool, fair between tenants
(:mod:`serving.tokenize_pool`; so admission knows the prompt size and an oversize prompt
is a 400 before any engine sees it); admit against the tenant's KV budget for all ``n``
sequences of the answer, waiting in the tenant's bounded queue when it or the cluster is
full (:mod:`serving.queued_admission`; 429 + Retry-After past the queue's bounds; an
answer that waited says how long in ``X-VToken-Queue-Wait``); call a
replica through Ray Serve (the vtoken router picks which) while the reservation is held
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

import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.metrics import Meter

from controlplane import telemetry
from controlplane.admission import Admission
from controlplane.auth import TenantKeys
from controlplane.clock import Clock
from controlplane.fair_queue import FairQueue
from controlplane.keys import KeySpace
from controlplane.metrics import IngressMetrics
from controlplane.openai_models import ChatCompletionRequest, CompletionRequest
from controlplane.otel_metrics import RequestMetrics
from controlplane.precheck import AdmissionPrecheck
from controlplane.releases import Releaser
from controlplane.store import RedisStore
from serving.answer_stream import AnswerStreams, ReleasingStream, raise_if_cancelled
from serving.errors import HTTPError
from serving.input_limits import read_request
from serving.openai_answers import Answer, collect, sse
from serving.queued_admission import QUEUE_WAIT_HEADER, AdmitAsk, QueuedAdmission
from serving.replica_request import PromptEncoder, Tokenizer, generate_request
from serving.reservation import HeldReservation
from serving.settings import IngressSettings
from serving.stream_progress import TokenPace
from serving.tenant_gate import TenantGate
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
        self.queue = FairQueue(redis, settings.admission, keys)
        self.admitter = QueuedAdmission(
            self.admission,
            self.queue,
            self.releaser,
            self.metrics,
            self.request_metrics,
            self.pace,
            self.first_token,
        )
        self.request_metrics.observe_queues(self.waiting_now)

    def waiting_now(self) -> list[tuple[str, int, float]]:
        """``(tenant, requests queued here, oldest wait in s)`` (the queue metrics)."""
        return list(self.admitter.waiting_now(time.monotonic()))

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
                if body.priority and settings.scheduling_policy != "priority":
                    raise HTTPError(
                        400,
                        f"invalid request: priority: {body.priority} is not served: the "
                        "engines schedule first come, first served (scheduling_policy: "
                        "fcfs); send 0 or leave it out",
                        "invalid_request",
                    )
                # Tokenizing is CPU work: on the pool, at most as many of the tenant's at
                # once as its concurrency limit leaves room for.
                limit = quota.max_concurrent_requests
                ids = await self.tokenize_pool.run(
                    quota.tenant_id,
                    self.prompts.ids,
                    body,
                    limit=None if limit is None else max(1, limit - precheck.held),
                )
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            span.set_attribute(telemetry.ATTR_REQUEST_ID, request_id)
            raise_if_cancelled()
            ask = AdmitAsk(quota, request_id, len(ids), body.max_tokens, body.n)
            reservation, waited_s = await self.admitter.admit_waited(ask, span)
            headers = None if waited_s is None else {QUEUE_WAIT_HEADER: f"{waited_s:.3f}"}
            held = HeldReservation(self.admission, self.releaser, reservation)
            try:
                raise_if_cancelled()
                generate = generate_request(
                    quota,
                    request_id,
                    ids,
                    body,
                    reservation,
                    settings.block_size,
                    settings.admission.sliding,
                )
                chunks = self.answers.chunks(generate, held, started)
                answer = Answer.of(request_id, body, chat, int(started))
                if body.stream:
                    return ReleasingStream(held, sse(chunks, answer), headers)
                return JSONResponse(await collect(chunks, answer), headers=headers)
            except BaseException:
                # Cancelled or failed before or while answering: released either way
                # (idempotent; the answer's own exit may have released it already).
                held.release_soon()
                raise
