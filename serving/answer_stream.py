"""An answer's chunks from a replica while its reservation is held, and how it is released.

:meth:`AnswerStreams.chunks` calls a replica through Ray Serve (the vtoken router picks
which) inside the request's :class:`~serving.reservation.HeldReservation` (renewed,
settled once no prefill is left, released when the answer ends however it ends), learns
the token paces admission reads from the chunks' timing, and turns a replica's refusal
into a 400 and its failure into a 503 whose text keeps the replica's internals out. A
replica that dies before the request's first chunk is not a failure the client sees: the
request goes to another replica (at most ``REPLICA_ATTEMPTS`` in all).
:class:`ReleasingStream` releases the reservation of an SSE answer even when the response
never starts; :func:`raise_if_cancelled` honours a cancellation a library swallowed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from ray.exceptions import ActorDiedError

from controlplane.clock import Clock
from controlplane.metrics import IngressMetrics
from controlplane.openai_models import GenerateChunk, GenerateRequest
from controlplane.otel_metrics import RequestMetrics
from serving.errors import HTTPError
from serving.reservation import HeldReservation
from serving.stream_progress import ChunkTiming, StreamProgress, TokenPace

logger = logging.getLogger(__name__)

REPLICA_RETRY_AFTER_S = 1
"""Retry-After of a 503 when a replica failed (Serve routes the retry to another)."""
REPLICA_ATTEMPTS = 3
"""Replicas a request is sent to when each dies before its first chunk (then a 503)."""
REPLICA_RETRY_BACKOFF_S = 0.2
"""Wait before the next attempt, times the attempts so far."""


class AnswerStreams:
    """The replicas' answers of one ingress. ``replicas`` is a Ray Serve handle to the
    engine deployment (anything whose ``options(stream=True).generate.remote(dict)`` is an
    async iterator of :class:`GenerateChunk` dicts); ``pace`` (seconds per output token)
    and ``first_token`` (seconds from arrival to the first token) learn from every chunk."""

    def __init__(
        self,
        replicas: Any,
        clock: Clock,
        metrics: IngressMetrics,
        request_metrics: RequestMetrics,
        pace: TokenPace,
        first_token: TokenPace,
    ) -> None:
        self.replicas = replicas
        self.clock = clock
        self.metrics = metrics
        self.request_metrics = request_metrics
        self.pace = pace
        self.first_token = first_token

    async def chunks(
        self, request: GenerateRequest, held: HeldReservation, started: float
    ) -> AsyncIterator[GenerateChunk]:
        """The replica's chunks for ``request`` while ``held`` is held (renewed,
        settled once no prefill is left, released at the end however it ends); a request
        the replica refuses is a 400, a replica that fails or vanishes a 503."""
        stream: Any = None
        try:
            async with held:
                for attempt in range(1, REPLICA_ATTEMPTS + 1):
                    answered = False  # a chunk went on: from there a retry would repeat it
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
                            timing = progress.observe(chunk, self.clock.now())
                            self._observe(request.tenant_id, timing)
                            if progress.past_prefill:  # from here the policy bounds the KV
                                await held.settle()
                            answered = True
                            yield chunk
                        stream = None  # ended: nothing to cancel
                        self._answered(request, progress)
                        return
                    except (HTTPError, asyncio.CancelledError):
                        raise
                    except Exception as error:  # the replica died or refused mid-request
                        # Dead before it answered (a request released from the queue to a
                        # replica just killed): Serve drops a dead replica from its routing,
                        # so another one serves the request. Not an unreachable replica
                        # (``ActorUnavailableError``): it may be alive and still running it.
                        retry = (
                            isinstance(error, ActorDiedError)
                            and not answered
                            and attempt < REPLICA_ATTEMPTS
                        )
                        # Its text (a Ray traceback, addresses) is for the logs, not the client.
                        logger.warning(
                            "request %s: replica failed (attempt %d of %d%s): %r",
                            request.request_id,
                            attempt,
                            REPLICA_ATTEMPTS,
                            ", sent to another" if retry else "",
                            error,
                        )
                        if retry:
                            await asyncio.sleep(REPLICA_RETRY_BACKOFF_S * attempt)
                            continue
                        raise HTTPError(
                            503,
                            "the engine replica failed; retry the request",
                            "server_error",
                            headers={"Retry-After": str(REPLICA_RETRY_AFTER_S)},
                        ) from None
                    finally:
                        if stream is not None and hasattr(stream, "cancel"):
                            stream.cancel()  # the client left or we failed: the engine aborts
                        stream = None
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

    def __init__(
        self,
        held: HeldReservation,
        events: AsyncIterator[str],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
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
