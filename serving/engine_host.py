"""A serving replica's engine: vLLM ``AsyncLLM`` with the vToken plugin, usable without Ray
Serve (tests, benchmarks; the deployment is :class:`serving.engine_replica.EngineReplica`).

The host streams :class:`GenerateChunk` objects for the ingress (each for one of the
request's ``n`` choices, with its log-probabilities when asked), salts the prefix cache
with the tenant's prefix group or else the tenant (see :func:`cache_salt`: only tenants of
one group share cached blocks), tags each request with its tenant for vToken's per-tenant
counters, and reads the engine's counters for the reporter
(:class:`serving.replica_reporter.ReplicaReporter`), which publishes them to Redis every
~100 ms.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import trace

from controlplane import telemetry
from controlplane.clock import Clock
from controlplane.models import EngineCounters
from controlplane.openai_models import GenerateChunk, GenerateRequest
from controlplane.prefix import MAX_REPORTED_KEYS, PrefixMemory, cache_salt
from controlplane.tracing import (
    ENGINE_TRACES_PROTOCOL,
    engine_traces_endpoint,
    extract_context,
    inject_context,
)
from serving.engine_translators import (
    counters_from_snapshot,
    engine_request_ids,
    published_blocks,
    request_spec,
    token_logprobs,
)
from serving.settings import ReplicaSettings
from workers.config import HOLD_TO_BLOCKS_KEY, REQUEST_KEY
from workers.fair_share import TENANT_KEY, WEIGHT_KEY

COUNTERS_MAX_AGE_PERIODS = 5  # older counters are not published: the replica goes stale


class EngineHost:
    """Owns one ``AsyncLLM``; usable without Ray Serve (tests, benchmarks). ``clock`` times
    the counters' freshness (:meth:`fresh_counters`)."""

    def __init__(
        self,
        settings: ReplicaSettings,
        replica_id: str,
        clock: Clock,
        tracer: trace.Tracer = telemetry.NOOP_TRACER,
    ) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_space_gib))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from workers.engine import engine_args
        from workers.models import resolve_model

        self.settings = settings
        self.replica_id = replica_id
        self.clock = clock
        self.tracer = tracer
        common = engine_args(
            str(resolve_model(settings.model)),
            settings.additional_vtoken(),
            block_size=settings.block_size,
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            num_blocks=settings.num_blocks,
            dtype=settings.dtype,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enforce_eager=settings.eager(current_platform.device_type),
            kv_cache_dtype=settings.kv_cache_dtype,
            tensor_parallel_size=settings.tensor_parallel_size,
            enable_prefix_caching=settings.enable_prefix_caching,
            otlp_traces_endpoint=engine_traces_endpoint(),
        )
        if common["otlp_traces_endpoint"] is not None:  # vLLM exports OTLP/gRPC unless told
            os.environ.setdefault(*ENGINE_TRACES_PROTOCOL)
        # vLLM's request spans read each request's stats: tracing needs them kept.
        tracing = common["otlp_traces_endpoint"] is not None
        if settings.max_num_batched_tokens is not None:  # else vLLM's default
            common["max_num_batched_tokens"] = settings.max_num_batched_tokens
        args = AsyncEngineArgs(
            **common,
            served_model_name=settings.name,
            disable_log_stats=not tracing,
            scheduling_policy=settings.scheduling_policy,
        )
        self.llm = AsyncLLM.from_engine_args(args)
        self.counters_at: float | None = None  # clock time of the last successful read
        self.counters = EngineCounters(
            block_size=settings.block_size, total_blocks=1, free_blocks=1, used_blocks=0
        )
        self.running = 0
        # The prefix keys of what this replica's prefix cache was given (router affinity).
        self.prefixes = PrefixMemory(
            min(settings.num_blocks or MAX_REPORTED_KEYS, MAX_REPORTED_KEYS)
        )
        self.pressure: dict[str, float] = {}  # tenant -> keep fraction, from the plan
        self.allowance: dict[str, int] = {}  # tenant -> blocks it may hold here, from the plan

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The request's answer as chunks, each the new piece of one choice; a request the
        engine refuses (its sampling, its cap, its length) is one chunk with ``error``."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        refused = (ValueError, OverflowError, VLLMClientError)  # the request, not the engine
        try:
            params = self._sampling_params(request)
        except refused as error:
            yield GenerateChunk(error=str(error), replica_id=self.replica_id)
            return
        prompt = TokensPrompt(
            prompt_token_ids=request.prompt_token_ids,
            cache_salt=cache_salt(request.tenant_id, request.prefix_group),
        )
        self.prefixes.add(request.prefix_keys[: published_blocks(self.settings, params.extra_args)])
        context = extract_context(request.trace_context)
        span_name = telemetry.SPAN_REPLICA_GENERATE
        with self.tracer.start_as_current_span(span_name, context=context) as span:
            self._annotate(span, request, params.extra_args)
            completion_tokens = 0
            self.running += 1
            # vLLM's own request span joins this trace (when it traces: otlp_traces_endpoint).
            trace_headers = inject_context()
            first_token: trace.Span | None = self.tracer.start_span(
                telemetry.SPAN_ENGINE_FIRST_TOKEN
            )
            try:
                async for output in self.llm.generate(
                    prompt,
                    params,
                    request.request_id,
                    trace_headers=trace_headers,
                    priority=request.priority,
                ):
                    if first_token is not None:  # the SDK warns when a span ends twice
                        first_token.end()
                        first_token = None
                    # With n > 1, vLLM runs n child requests; a (merged) output carries
                    # the new pieces of any of them, each with its choice's index.
                    for piece in output.outputs:
                        completion_tokens += len(piece.token_ids)
                        if not piece.text and not piece.token_ids and not piece.finished():
                            continue  # nothing new for this choice
                        cached_tokens = output.num_cached_tokens or 0
                        yield self._chunk(request, piece, cached_tokens, completion_tokens)
            except refused as error:  # vLLM refuses the request itself (e.g. too long)
                yield GenerateChunk(error=str(error), replica_id=self.replica_id)
            finally:
                if first_token is not None:
                    first_token.end()
                self.running -= 1
            span.set_attribute(telemetry.ATTR_COMPLETION_TOKENS, completion_tokens)
            if span.is_recording():  # one utility call per sequence, only when traced
                for engine_id in engine_request_ids(request.request_id, request.n):
                    await self._kv_event(span, engine_id)

    def _sampling_params(self, request: GenerateRequest) -> Any:
        """vLLM's ``SamplingParams`` of ``request`` (raises what vLLM raises on bad ones, and
        ``ValueError`` for a cap that makes no valid spec)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=request.n,
            logprobs=request.logprobs,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=request.stop,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            output_kind=RequestOutputKind.DELTA,
            extra_args=self.extra_args(request),
            **request.sampling.engine_kwargs(),  # vLLM's extensions, as its server passes them
        )

    def _annotate(
        self, span: trace.Span, request: GenerateRequest, extra_args: dict[str, Any] | None
    ) -> None:
        """The request's span attributes, and its own budget when it runs under one."""
        span.set_attribute(telemetry.ATTR_TENANT_ID, request.tenant_id)
        span.set_attribute(telemetry.ATTR_REPLICA_ID, self.replica_id)
        span.set_attribute(telemetry.ATTR_REQUEST_ID, request.request_id)
        override = (extra_args or {}).get(REQUEST_KEY)
        if override is not None:
            budget = override.get("budget_tokens", override.get("keep_ratio"))
            span.add_event(telemetry.EVENT_REQUEST_BUDGET, {telemetry.ATTR_BUDGET: budget})

    def _chunk(
        self, request: GenerateRequest, piece: Any, cached_tokens: int, completion_tokens: int
    ) -> GenerateChunk:
        """One choice's new piece (vLLM's ``CompletionOutput``, a delta) as the chunk the
        ingress reads; ``completion_tokens``: all choices' tokens so far."""
        logprobs = None
        if request.logprobs is not None:
            logprobs = token_logprobs(piece.token_ids, piece.logprobs, self.decode)
        return GenerateChunk(
            index=piece.index,
            text=piece.text,
            finish_reason=piece.finish_reason,  # set when this choice ends
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            logprobs=logprobs,
            replica_id=self.replica_id,
        )

    def decode(self, token_id: int) -> str:
        """A token's text when the engine gave none (vLLM's OpenAI server's fallback)."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"
        return str(tokenizer.decode([token_id]))

    async def _kv_event(self, span: trace.Span, request_id: str) -> None:
        """A span event with what vToken did to one sequence's KV (evictions, repacks)."""
        from workers.api import async_request_counters

        report = await async_request_counters(self.llm, request_id)
        if report is not None:
            keys = ("evicted_tokens", "repack_moves", "live_tokens", "allocated_blocks")
            span.add_event(
                telemetry.EVENT_KV,
                {telemetry.ATTR_KV_PREFIX + k: getattr(report, k) for k in (*keys, "ideal_blocks")},
            )

    async def apply_pressure(
        self, pressure: dict[str, float], allowance: dict[str, int] | None = None
    ) -> None:
        """The controller's pressure here (``RoutingPlan.pressure``: tenant -> keep fraction)
        and the tenants' allowances (``RoutingPlan.allowance``: tenant -> blocks) reach the
        engine when they change: every running request of a pressured tenant, not only new
        ones, is evicted to that fraction of its budget; a tenant above its allowance is
        evicted to its requests' budgets at the next step."""
        allowance = dict(allowance or {})
        if pressure == self.pressure and allowance == self.allowance:
            return
        from workers.api import async_set_pressure

        await async_set_pressure(self.llm, pressure, allowance)
        self.pressure, self.allowance = dict(pressure), allowance

    def extra_args(self, request: GenerateRequest) -> dict[str, Any]:
        """The request's tenant and its weight (the engine's fair order), and its own
        eviction budget: the tenant's cap."""
        extra: dict[str, Any] = {TENANT_KEY: request.tenant_id, WEIGHT_KEY: request.tenant_weight}
        if request.hold_to_blocks is not None:
            extra[HOLD_TO_BLOCKS_KEY] = request.hold_to_blocks
        override = request_spec(self.settings.vtoken, request.eviction_budget_tokens)
        if override is not None:
            extra[REQUEST_KEY] = override
        return extra

    async def refresh_counters(self) -> EngineCounters:
        """Ask the engine core for its block and vToken counters (a utility call)."""
        from workers.api import async_engine_counters

        report = await async_engine_counters(self.llm)
        if report is None:
            raise RuntimeError("the engine runs without vToken: no counters")
        # A prefix cache holds at most the pool's blocks: one key each.
        self.prefixes.resize(min(MAX_REPORTED_KEYS, max(1, report.total_blocks)))
        self.counters = counters_from_snapshot(report, self.running, self.prefixes.snapshot())
        self.counters_at = self.clock.now()
        return self.counters

    def fresh_counters(self) -> EngineCounters:
        """The latest counters for the report; ``ValueError`` (report skipped, so the replica
        turns stale for the controller) when none were read recently - a wedged engine core
        must not look healthy."""
        max_age = COUNTERS_MAX_AGE_PERIODS * self.settings.report_period_s
        if self.counters_at is None or self.clock.now() - self.counters_at > max_age:
            raise ValueError(f"replica {self.replica_id}: engine counters are not fresh")
        return self.counters

    async def check_health(self) -> None:
        if self.llm.errored:
            raise RuntimeError(f"engine is dead: {self.llm.dead_error!r}")
        await self.llm.check_health()

    def shutdown(self) -> None:
        self.llm.shutdown()
