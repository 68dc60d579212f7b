"""Who is asking, and may it start: the tenant of a request, checked before its body costs CPU.

:meth:`TenantGate.tenant` authenticates ``Authorization: Bearer <key>`` (401 when missing or
unknown; 503 when the tenant's stored quota no longer validates: not the client's fault);
:meth:`TenantGate.before_tokenizing` refuses (429 + Retry-After) a tenant at its concurrency
limit or with its prompt-token bucket in debt (:mod:`controlplane.precheck`), before its
body is read or its prompt tokenized. Redis away is a 503 (quotas fail closed).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import Iterator

from fastapi import Request

from controlplane.admission import AdmissionOutcome
from controlplane.auth import TenantKeys, bearer
from controlplane.metrics import IngressMetrics
from controlplane.models import TenantQuota
from controlplane.otel_metrics import RequestMetrics
from controlplane.precheck import AdmissionPrecheck, Precheck
from controlplane.store import InvalidQuotaError, RedisStore
from serving.errors import HTTPError, redis_or_503

logger = logging.getLogger(__name__)

THROTTLE_REASONS = {
    "kv_budget": "over its KV budget",
    "max_concurrent_requests": "at its concurrent-request limit",
    "prompt_token_rate": "over its prompt-token rate",
    "requests_in_flight": "reading and tokenizing as many requests as it may at once",
    "queued": "behind as many of its own queued requests as it may queue",
    "cluster_full": "waiting for room in the cluster, which serves tenants in weighted turn",
    "ticket_lost": "waiting on a queue ticket that lapsed",
}


def throttled(tenant_id: str, reason: str, retry_after_s: int) -> HTTPError:
    """The 429 of a tenant admission throttles for ``reason`` (a key of
    :data:`THROTTLE_REASONS`, else said as is), with ``Retry-After``."""
    why = THROTTLE_REASONS.get(reason, reason)
    return HTTPError(
        429,
        f"tenant {tenant_id!r} is {why}; retry after {retry_after_s} s",
        "rate_limit",
        headers={"Retry-After": str(retry_after_s)},
    )


class TenantGate:
    """Authentication and the pre-check of one ingress; counts the throttled admissions
    in ``metrics`` (Prometheus) and ``request_metrics`` (OpenTelemetry)."""

    def __init__(
        self,
        tenant_keys: TenantKeys,
        store: RedisStore,
        precheck: AdmissionPrecheck,
        metrics: IngressMetrics,
        request_metrics: RequestMetrics,
    ) -> None:
        self.tenant_keys = tenant_keys
        self.store = store
        self.precheck = precheck
        self.metrics = metrics
        self.request_metrics = request_metrics
        self._in_flight: Counter[str] = Counter()  # tenant -> requests reading or tokenizing

    async def tenant(self, request: Request) -> TenantQuota:
        """The quota of the tenant whose key ``request`` carries."""
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

    async def before_tokenizing(self, quota: TenantQuota) -> Precheck:
        """The tenant's concurrency and prompt-rate limits, read before its body and prompt
        cost any CPU: 429 with ``Retry-After`` when admission would throttle any prompt
        (at its concurrency limit only when the tenant has no queue to wait in)."""
        precheck = await redis_or_503(self.precheck.check(quota))
        if precheck.reason is None:
            return precheck
        queues = quota.max_queue_depth > 0 and quota.max_queue_wait_s > 0
        if precheck.reason == "max_concurrent_requests" and queues:
            return precheck  # it may wait in the tenant's queue once tokenized
        outcome = AdmissionOutcome.THROTTLED.value
        self.metrics.admission(quota.tenant_id, outcome)
        self.request_metrics.admission(quota.tenant_id, outcome)
        retry_after_s = max(1, math.ceil(precheck.retry_after_s))  # never before it may
        raise throttled(quota.tenant_id, precheck.reason, retry_after_s)

    @contextlib.contextmanager
    def in_flight(self, quota: TenantQuota, limit: int) -> Iterator[None]:
        """Hold one of the tenant's ``limit`` places for a request whose body is being read,
        decoded and tokenized on this ingress; 429 when all are taken. Admission counts a
        request only once admitted, so without this a tenant's concurrent bodies could cost
        any amount of CPU before its limits apply."""
        tenant_id = quota.tenant_id
        if self._in_flight[tenant_id] >= limit:
            outcome = AdmissionOutcome.THROTTLED.value
            self.metrics.admission(tenant_id, outcome)
            self.request_metrics.admission(tenant_id, outcome)
            raise throttled(tenant_id, "requests_in_flight", 1)
        self._in_flight[tenant_id] += 1
        try:
            yield
        finally:
            self._in_flight[tenant_id] -= 1
            if not self._in_flight[tenant_id]:
                del self._in_flight[tenant_id]
