"""A serving replica: vLLM ``AsyncLLM`` with the vToken plugin, its report publisher, and
the Ray Serve deployment around them.

The replica streams :class:`GenerateChunk` dicts for the ingress (each for one of the
request's ``n`` choices, with its log-probabilities when asked), salts the prefix cache
with the tenant's prefix group or else the tenant (see :func:`cache_salt`: only tenants of
one group share cached blocks), tags each request with its tenant for vToken's per-tenant
counters, and publishes its counters to Redis every ~100 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import ray
from opentelemetry import metrics, trace
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve

from controlplane import telemetry
from controlplane.clock import SystemClock
from controlplane.keys import KeySpace
from controlplane.metrics_endpoint import MetricsEndpoint
from controlplane.models import EngineCounters, TenantUsage
from controlplane.openai_models import GenerateChunk, GenerateRequest, TokenLogprob
from controlplane.otel_metrics import ReplicaMetrics, configure_metrics
from controlplane.plan_follower import PlanFollower
from controlplane.prefix import MAX_REPORTED_KEYS, PrefixMemory, cache_salt
from controlplane.publisher import PublisherConfig, ReportPublisher
from controlplane.redis_conn import RedisConfig, connect
from controlplane.store import RedisStore
from controlplane.tracing import (
    ENGINE_TRACES_PROTOCOL,
    configure_tracing,
    engine_traces_endpoint,
    extract_context,
    inject_context,
)
from policies import CAP_POLICY
from vtoken.reports import EngineReport
from workers.config import HOLD_TO_BLOCKS_KEY, REQUEST_KEY, VTokenConfig, request_policy_spec

logger = logging.getLogger(__name__)
PLAN_POLL_S = 0.1  # one GET of the plan version: pressure lands within a report period
# of its plan (1,000 replicas: 10,000 GETs/s, a tenth of one Redis core)
PLAN_MAX_AGE_S = 30.0  # an older plan's pressure is dropped: no controller is measuring
COUNTERS_TIMEOUT_S = 2.0
METRICS_ADVERTISE_S = 10.0  # how often a replica rewrites where its /metrics is
COUNTERS_MAX_AGE_PERIODS = 5  # older counters are not published: the replica goes stale
MIN_LOGPROB = -9999.0  # what vLLM's OpenAI server answers for -inf (JSON has no infinity)


class ReplicaSettings(BaseModel):
    """One replica's engine and reporting settings (from the Serve config)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2"
    served_name: str | None = None  # the model id clients send (default: ``model``)
    block_size: int = Field(default=32, gt=0)
    max_model_len: int = Field(default=2048, gt=0)
    max_num_seqs: int = Field(default=16, gt=0)
    num_blocks: int | None = Field(default=None, gt=0)
    dtype: str = "auto"
    kv_cache_space_gib: int = Field(default=1, gt=0)
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    """Share of each GPU vLLM may use (weights, activations, then the KV pool); CPU: unused."""
    enforce_eager: bool | None = None
    """``None``: eager on CPU (vLLM's CPU build has no graphs to replay), CUDA graphs on
    GPUs (a vToken engine's are piecewise: ``workers.vllm_patches.fall_back_to_piecewise``)."""
    kv_cache_dtype: str = "auto"  # vLLM's names: auto (the model's dtype), fp8, fp8_e5m2, ...
    tensor_parallel_size: int = Field(default=1, gt=0)
    """GPUs per replica: the deployment's ``replica_num_gpus`` must be at least this."""
    enable_prefix_caching: bool = True
    """vLLM's automatic prefix caching: a prompt prefix already computed on this replica
    under the same salt (the tenant's, or its prefix group's: ``cache_salt``) is reused
    instead of recomputed. With vToken a request publishes every full block until it
    first evicts, then keeps those below its first eviction and its pinned prefix
    (``prefix_pin_tokens`` in ``vtoken``; ``pin_cache_hits`` keeps hits too);
    ``False`` turns it off."""
    vtoken: dict[str, Any] = Field(
        default_factory=lambda: {"policy": "none"}, validate_default=True
    )
    """The engines' vToken config; served engines evict ``on_demand`` unless it says
    otherwise (tokens stay until memory or the tenant's budget needs them)."""
    redis_url: str | None = None
    key_prefix: str = "vtoken"
    report_period_s: float = Field(default=0.1, gt=0)
    metrics_port: int | None = Field(default=0, ge=0, le=65535)
    """The replica's Prometheus endpoint (``GET /metrics``) on its node's address: 0 takes
    a free port (every replica of a node needs its own), ``None`` serves none. Each
    replica's address is in its reports, ``/admin/status`` and ``/admin/metrics/targets``
    (Prometheus HTTP service discovery)."""

    @field_validator("vtoken")
    @classmethod
    def _serving_defaults(cls, vtoken: dict[str, Any]) -> dict[str, Any]:
        return {"eviction": "on_demand", **vtoken}

    @property
    def name(self) -> str:
        return self.served_name or self.model

    def eager(self, device_type: str) -> bool:
        """Whether the engine on ``device_type`` ("cuda", "cpu", ...) runs without graphs."""
        return self.enforce_eager if self.enforce_eager is not None else device_type != "cuda"


def published_blocks(settings: ReplicaSettings, extra_args: dict[str, Any] | None) -> int:
    """How many leading blocks of a request's prompt its engine is expected to keep in the
    prefix cache (``workers/scheduler_side.py``): a request publishes every full block
    until it first evicts, then keeps those below its first eviction and never fewer than
    its pinned prefix (``prefix_pin_tokens``). So: all of them under a policy that never
    evicts or when evicting on demand (it evicts only when memory runs short), the pinned
    prefix when evicting eagerly (from its first decoding step); none with caching off."""
    if not settings.enable_prefix_caching:
        return 0
    engine = VTokenConfig.model_validate(settings.vtoken)
    spec = request_policy_spec(extra_args) or engine
    if not spec.make_policy().evicts or engine.eviction == "on_demand":
        return MAX_REPORTED_KEYS  # all of them (a request carries fewer keys)
    return engine.prefix_pin_tokens // settings.block_size


def counters_from_snapshot(
    report: EngineReport, running: int, prefix_keys: Sequence[str] = ()
) -> EngineCounters:
    """The control plane's counters (its report schema) from the engine's ``EngineReport``:
    the one place the two meet; every total is the engine report's own. ``prefix_keys``:
    what the replica's prefix cache was given, most recent first."""
    shared: dict[str, int] = {}
    for request in report.requests:
        shared[request.tenant] = shared.get(request.tenant, 0) + request.shared_blocks
    return EngineCounters(
        prefix_keys=tuple(prefix_keys),
        block_size=report.block_size,
        total_blocks=report.total_blocks,
        free_blocks=report.free_blocks,
        used_blocks=report.total_blocks - report.free_blocks,
        live_tokens=report.total.live_tokens,
        reclaimable_blocks=report.total.reclaimable_blocks,
        running_requests=running,
        blocks_reclaimed=report.blocks_reclaimed,
        naive_equivalent_blocks=report.total.naive_blocks,
        preemptions=report.num_preemptions,
        evictions_under_pressure=report.num_evictions_under_pressure,
        max_step_s=report.recent_max_step_s,
        recent_steps=report.recent_steps,
        evicted_tokens=report.evicted_tokens_total,
        evictions_to_bound=report.num_evictions_to_bound,
        evictions_below_budget=report.num_evictions_below_budget,
        repack_moves=report.repack_moves_total,
        repack_bytes=report.repack_bytes_total,
        repack_seconds=report.repack_seconds_total,
        tenants={
            tenant: TenantUsage(
                live_tokens=usage.live_tokens,
                blocks=usage.allocated_blocks,
                floor_blocks=usage.floor_blocks,
                requests=usage.num_requests,
                shared_blocks=shared.get(tenant, 0),
            )
            for tenant, usage in report.tenants.items()
        },
    )


def request_spec(spec: dict[str, Any], budget_tokens: int | None) -> dict[str, Any] | None:
    """A per-request override of the engine's vToken spec (``extra_args["vtoken_policy"]``).

    ``budget_tokens`` is the tenant's per-request KV cap (``TenantQuota.
    eviction_budget_tokens``, which admission counted on): it becomes the request's token
    budget, under the engine's policy when that policy instance holds its budget every step
    and protects fewer tokens than the cap (SnapKV and PAGE compress once, ``none`` never
    evicts, StreamingLLM with a fixed window keeps it), else under ``policies.CAP_POLICY``.
    ``None``: nothing to override. Controller pressure is not applied here: the engine
    applies it to every running request of the tenant (``EngineHost.apply_pressure``). A
    cap that makes no valid spec (e.g. 0 tokens) raises ``ValueError``: the request is
    refused (HTTP 400), never run without its cap.
    """
    if budget_tokens is None:
        return None
    engine = VTokenConfig.model_validate(spec)
    policy = engine.make_policy()
    # This instance must hold a budget every step and protect fewer tokens than the cap
    # (StreamingLLM with a fixed window limits itself and would keep its window).
    holds_cap = (
        policy.holds_budget_every_step
        and policy.needs_budget
        and policy.sinks + policy.recent < budget_tokens
    )
    override: dict[str, Any]
    if holds_cap:
        override = {"policy": engine.policy, "policy_args": engine.policy_args}
    else:
        override = {"policy": CAP_POLICY.name}
    override["budget_tokens"] = budget_tokens
    request_policy_spec({REQUEST_KEY: override})  # raises ValueError when it is bad
    return override


def token_logprobs(
    token_ids: Sequence[int], steps: Sequence[Any] | None, decode: Callable[[int], str]
) -> list[TokenLogprob]:
    """The engine's log-probabilities of ``token_ids`` (vLLM's ``CompletionOutput.logprobs``:
    per token a dict of token id -> ``Logprob``, the sampled token first) as the chunk
    carries them; ``decode`` names a token the engine did not decode."""
    entries = []
    for position, token_id in enumerate(token_ids):
        step = steps[position] if steps is not None and position < len(steps) else None
        chosen = step.get(token_id) if step else None
        if step is None or chosen is None:  # the engine gave none: the token alone
            entries.append(TokenLogprob(token=decode(token_id)))
            continue
        top = [
            (lp.decoded_token or decode(other), max(lp.logprob, MIN_LOGPROB))
            for other, lp in step.items()
        ]
        token = chosen.decoded_token or decode(token_id)
        entries.append(TokenLogprob(token=token, logprob=max(chosen.logprob, MIN_LOGPROB), top=top))
    return entries


def engine_request_ids(request_id: str, n: int) -> list[str]:
    """The ids the engine core knows a request's sequences by, up to vLLM's ``-<8 chars>``
    suffix (which ``request_report`` matches): the request's own id, or with ``n > 1``
    one child per choice, ``<index>_<id>`` (vLLM's ``ParentRequest.get_child_info``)."""
    if n == 1:
        return [request_id]
    return [f"{index}_{request_id}" for index in range(n)]


class EngineHost:
    """Owns one ``AsyncLLM``; usable without Ray Serve (tests, benchmarks)."""

    def __init__(
        self,
        settings: ReplicaSettings,
        replica_id: str,
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
        self.tracer = tracer
        common = engine_args(
            str(resolve_model(settings.model)),
            settings.vtoken,
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
        args = AsyncEngineArgs(
            **common, served_model_name=settings.name, disable_log_stats=not tracing
        )
        self.llm = AsyncLLM.from_engine_args(args)
        self.counters_at: float | None = None  # monotonic time of the last successful read
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
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        refused = (ValueError, OverflowError, VLLMClientError)  # the request, not the engine
        try:
            params = SamplingParams(
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
            )
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
            span.set_attribute(telemetry.ATTR_TENANT_ID, request.tenant_id)
            span.set_attribute(telemetry.ATTR_REPLICA_ID, self.replica_id)
            span.set_attribute(telemetry.ATTR_REQUEST_ID, request.request_id)
            override = (params.extra_args or {}).get(REQUEST_KEY)
            if override is not None:
                budget = override.get("budget_tokens", override.get("keep_ratio"))
                span.add_event(telemetry.EVENT_REQUEST_BUDGET, {telemetry.ATTR_BUDGET: budget})
            completion_tokens = 0
            self.running += 1
            # vLLM's own request span joins this trace (when it traces: otlp_traces_endpoint).
            trace_headers = inject_context()
            first_token: trace.Span | None = self.tracer.start_span(
                telemetry.SPAN_ENGINE_FIRST_TOKEN
            )
            try:
                async for output in self.llm.generate(
                    prompt, params, request.request_id, trace_headers=trace_headers
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
                        logprobs = None
                        if request.logprobs is not None:
                            logprobs = token_logprobs(piece.token_ids, piece.logprobs, self.decode)
                        yield GenerateChunk(
                            index=piece.index,
                            text=piece.text,
                            finish_reason=piece.finish_reason,  # set when this choice ends
                            prompt_tokens=len(request.prompt_token_ids),
                            cached_tokens=output.num_cached_tokens or 0,
                            completion_tokens=completion_tokens,
                            logprobs=logprobs,
                            replica_id=self.replica_id,
                        )
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
        """The request's tenant, and its own eviction budget: the tenant's cap."""
        extra: dict[str, Any] = {"tenant": request.tenant_id}
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
        self.counters_at = time.monotonic()
        return self.counters

    def fresh_counters(self) -> EngineCounters:
        """The latest counters for the report; ``ValueError`` (report skipped, so the replica
        turns stale for the controller) when none were read recently - a wedged engine core
        must not look healthy."""
        max_age = COUNTERS_MAX_AGE_PERIODS * self.settings.report_period_s
        if self.counters_at is None or time.monotonic() - self.counters_at > max_age:
            raise ValueError(f"replica {self.replica_id}: engine counters are not fresh")
        return self.counters

    async def check_health(self) -> None:
        if self.llm.errored:
            raise RuntimeError(f"engine is dead: {self.llm.dead_error!r}")
        await self.llm.check_health()

    def shutdown(self) -> None:
        self.llm.shutdown()


class ReplicaReporter:
    """Polls the engine's counters and publishes them, both every ``report_period_s``."""

    def __init__(
        self,
        host: EngineHost,
        redis_url: str,
        key_prefix: str,
        tracer: trace.Tracer = telemetry.NOOP_TRACER,
        metrics_address: str = "",
    ) -> None:
        self.host = host
        store = RedisStore(connect(RedisConfig(url=redis_url)), KeySpace(key_prefix))
        config = PublisherConfig(
            replica_id=host.replica_id,
            model_id=host.settings.name,
            metrics_address=metrics_address,
            period_s=host.settings.report_period_s,
        )
        self.publisher = ReportPublisher(store, host.fresh_counters, SystemClock(), config, tracer)
        self.plan = PlanFollower(store, host.replica_id, SystemClock(), PLAN_MAX_AGE_S)
        self.store = store
        self.metrics_address = metrics_address
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async def poll() -> None:
            while not self.stop.is_set():
                try:
                    await asyncio.wait_for(self.host.refresh_counters(), timeout=COUNTERS_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - a failed poll keeps the last counters
                    logger.exception("replica %s: reading counters failed", self.host.replica_id)
                await asyncio.sleep(self.host.settings.report_period_s)

        async def follow_plan() -> None:
            while not self.stop.is_set():
                # One GET per poll; the plan itself only when its version moved.
                pressure = await self.plan.poll()
                try:
                    await self.host.apply_pressure(pressure, self.plan.allowance_now())
                except Exception:  # noqa: BLE001 - a dead engine fails its own health check
                    logger.exception("replica %s: applying pressure failed", self.host.replica_id)
                await asyncio.sleep(PLAN_POLL_S)

        async def advertise_metrics() -> None:
            # Where Prometheus finds this replica (``/admin/metrics/targets``); rewritten
            # now and then, so a Redis that lost it (restart, flush) learns it again.
            while self.metrics_address and not self.stop.is_set():
                try:
                    await self.store.advertise_metrics(
                        self.host.replica_id, self.metrics_address, self.host.settings.name
                    )
                except Exception as error:  # noqa: BLE001 - retried at the next period
                    logger.warning("replica: advertising metrics failed: %r", error)
                with contextlib.suppress(TimeoutError):  # stops at once when asked to
                    await asyncio.wait_for(self.stop.wait(), METRICS_ADVERTISE_S)

        await asyncio.gather(
            poll(), follow_plan(), advertise_metrics(), self.publisher.run(self.stop)
        )

    def status(self) -> dict[str, Any]:
        """What the reporter did: reports written and failed, the last error, and the age of
        the last report that reached Redis (None before the first): visible here and in
        the controller's view of the replica, never a reason to restart the engine."""
        stats = self.publisher.stats
        return {
            "report_age_s": self.publisher.report_age_s(),
            "published": stats.published,
            "failed": stats.failed,
            "last_error": stats.last_error,
        }


@serve.deployment(name="engine", health_check_period_s=5, health_check_timeout_s=30)
class EngineReplica:
    def __init__(self, settings: dict[str, Any], metrics_token: str | None = None) -> None:
        """``metrics_token``: the admin token, which the replica's Prometheus endpoint asks
        for (``None``: the endpoint is not served)."""
        configure_tracing("vtoken-replica")
        replica_settings = ReplicaSettings(**settings)
        replica_id = serve.get_replica_context().replica_id.unique_id
        # Bound before the engine loads, so a taken port fails in seconds, not minutes.
        self._metrics_endpoint = self._serve_metrics(replica_settings, metrics_token)
        tracer = trace.get_tracer(telemetry.TRACER_REPLICA)
        try:
            self.host = EngineHost(replica_settings, replica_id, tracer)
        except BaseException:
            if self._metrics_endpoint is not None:
                self._metrics_endpoint.close()
            raise
        metrics_address = ""
        if self._metrics_endpoint is not None:
            metrics_address = self._metrics_endpoint.address
            logger.info("replica %s: Prometheus metrics on %s", replica_id, metrics_address)
        meter = metrics.get_meter(telemetry.TRACER_REPLICA)
        host = self.host
        self.metrics = ReplicaMetrics(
            meter, replica_id, lambda: host.counters if host.counters_at is not None else None
        )
        self.reporter: ReplicaReporter | None = None
        self._task: asyncio.Task | None = None
        if self.host.settings.redis_url:
            self.reporter = ReplicaReporter(
                self.host,
                self.host.settings.redis_url,
                self.host.settings.key_prefix,
                tracer,
                metrics_address,
            )
            self._task = asyncio.get_event_loop().create_task(self.reporter.run())

    @staticmethod
    def _serve_metrics(settings: ReplicaSettings, token: str | None) -> MetricsEndpoint | None:
        """The replica's Prometheus endpoint on its node's address (what Prometheus on
        another node reaches), or ``None``: not asked for, no admin token to guard it, or
        OpenTelemetry disabled (``OTEL_SDK_DISABLED``: nothing to serve)."""
        serves = settings.metrics_port is not None
        if not configure_metrics("vtoken-replica", prometheus=serves) or not serves:
            return None
        if token is None:
            logger.warning("replica: no admin token to guard its Prometheus endpoint: not served")
            return None
        node = ray.util.get_node_ip_address()
        return MetricsEndpoint(node, settings.metrics_port or 0, token)

    async def generate(self, request: dict[str, Any]):  # type: ignore[no-untyped-def]
        async for chunk in self.host.generate(GenerateRequest.model_validate(request)):
            yield chunk.model_dump()

    async def counters(self) -> dict[str, Any]:
        return (await self.host.refresh_counters()).model_dump()

    async def check_health(self) -> None:
        """The engine's health only. The report loop never decides it: a loop that stopped
        (it should not: it survives every Redis error) is logged and started again, and its
        report age shows in :meth:`report_status` and goes stale in the controller's view."""
        await self.host.check_health()
        if self.reporter is not None and self._task is not None and self._task.done():
            if not self._task.cancelled() and self._task.exception() is not None:
                logger.error("replica report loop stopped: %r", self._task.exception())
            self._task = asyncio.get_running_loop().create_task(self.reporter.run())

    async def report_status(self) -> dict[str, Any]:
        """The reporter's status (:meth:`ReplicaReporter.status`); empty without Redis."""
        return self.reporter.status() if self.reporter is not None else {}

    def record_routing_stats(self) -> dict[str, Any]:
        counters = self.host.counters
        return {"free_blocks": counters.free_blocks, "reclaimable": counters.reclaimable_blocks}

    async def __del__(self) -> None:
        if self.reporter is not None:
            self.reporter.stop.set()
        if self._metrics_endpoint is not None:
            await asyncio.to_thread(self._metrics_endpoint.close)
        self.host.shutdown()
