"""A Ray Serve ``RequestRouter`` that asks the control plane's routing plan.

Ray Serve calls ``choose_replicas`` for each request with the replicas it can reach now;
we rank them with :class:`controlplane.router.RouterCore` for the request's tenant (its
warm set first, then the least loaded). When the plan is stale or Redis is away the core
falls back to load-only ranking, so requests keep flowing.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from opentelemetry import trace
from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from controlplane import telemetry
from controlplane.clock import SystemClock
from controlplane.keys import KeySpace
from controlplane.redis_conn import RedisConfig, connect
from controlplane.router import RouterConfig, RouterCore
from controlplane.store import RedisStore
from controlplane.tracing import configure_tracing, extract_context
from vtoken.reports import DEFAULT_TENANT


def request_fields(pending_request: PendingRequest | None) -> dict[str, Any]:
    """The ingress passes the request as the first positional argument (a dict)."""
    if pending_request is None or not pending_request.args:
        return {}
    first = pending_request.args[0]
    return first if isinstance(first, dict) else {}


class VTokenRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(  # type: ignore[override]
        self,
        redis_url: str | None = None,
        key_prefix: str = "vtoken",
        max_plan_age_s: float = 5.0,
        redis_url_env: str | None = None,
    ) -> None:
        """``redis_url``, or the name of the variable holding it in this process's
        environment (``redis_url_env``): the router's arguments are part of the
        deployment's config, which Serve shows, so a URL with a password never goes there."""
        configure_tracing("vtoken-router")
        self._tracer = trace.get_tracer(telemetry.TRACER_ROUTER)
        if redis_url is None:
            redis_url = os.environ.get(redis_url_env or "")
            if not redis_url:
                raise ValueError(f"no Redis URL for the router: set ${redis_url_env}")
        store = RedisStore(connect(RedisConfig(url=redis_url)), KeySpace(key_prefix))
        self._core = RouterCore(store, SystemClock(), RouterConfig(max_plan_age_s=max_plan_age_s))
        self._stop = asyncio.Event()
        self._refresher: asyncio.Task | None = None
        # Serve passes the same list while the replica set is unchanged; keeping one id
        # set per list lets the core reuse its cached load order (no re-sort per request).
        self._candidates: (
            tuple[list[RunningReplica], frozenset[str], dict[str, RunningReplica]] | None
        ) = None

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._core.run(self._stop))
        fields = request_fields(pending_request)
        tenant_id = str(fields.get("tenant_id", DEFAULT_TENANT))
        context = extract_context(fields.get("trace_context"))
        with self._tracer.start_as_current_span(telemetry.SPAN_ROUTE, context=context) as span:
            if self._candidates is None or self._candidates[0] is not candidate_replicas:
                by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
                self._candidates = (candidate_replicas, frozenset(by_id), by_id)
            _, ids, by_id = self._candidates
            keys = fields.get("prefix_keys") or ()
            ranking = self._core.rank(tenant_id, ids, prefix_keys=keys)
            span.set_attribute(telemetry.ATTR_TENANT_ID, tenant_id)
            span.set_attribute(telemetry.ATTR_ROUTE_SOURCE, ranking.source.value)
            if ranking.ranks and ranking.ranks[0]:
                span.set_attribute(telemetry.ATTR_REPLICA_ID, ranking.ranks[0][0])
            return [[by_id[replica_id] for replica_id in rank] for rank in ranking.ranks]

    def on_request_routed(
        self,
        pending_request: PendingRequest,
        replica_id: ReplicaID,
        result: Any,  # Serve's ReplicaResult, not part of its public API
    ) -> None:
        """Serve calls this once a replica accepted the request: its prompt's prefix is
        matched there from now on, before that replica's next report lists it."""
        keys = request_fields(pending_request).get("prefix_keys")
        if keys:
            self._core.note_routed(replica_id.unique_id, keys)
