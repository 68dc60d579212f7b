"""Redis key names, in one place so every process agrees on them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KeySpace:
    """All keys live under `prefix` (default `vtoken`); tests use a unique prefix each."""

    prefix: str = "vtoken"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in " {}"):
            raise ValueError(f"invalid key prefix {self.prefix!r}")

    @property
    def quotas(self) -> str:
        """Hash: tenant id -> TenantQuota JSON."""
        return f"{self.prefix}:quotas"

    @property
    def quotas_version(self) -> str:
        """Counter: incremented with every quota change, so readers re-read only then."""
        return f"{self.prefix}:quotas:version"

    @property
    def replicas(self) -> str:
        """Sorted set: replica id -> last heartbeat (s since epoch)."""
        return f"{self.prefix}:replicas"

    def replica(self, replica_id: str) -> str:
        """Hash with a TTL: one replica's latest report."""
        return f"{self.prefix}:replica:{replica_id}"

    def replica_prefix_keys(self, replica_id: str) -> str:
        """String with a TTL: `<tag> <key> <key> ...`, the prefix keys of one replica's
        latest report that carried them (the report's hash names their tag)."""
        return f"{self.prefix}:replica-prefix:{replica_id}"

    @property
    def metrics_targets(self) -> str:
        """Hash: replica id -> ``{"address", "model_id"}`` JSON of its Prometheus endpoint."""
        return f"{self.prefix}:metrics:targets"

    @property
    def plan(self) -> str:
        """String: the latest RoutingPlan JSON."""
        return f"{self.prefix}:plan"

    @property
    def plan_version(self) -> str:
        return f"{self.prefix}:plan:version"

    @property
    def plan_heartbeat(self) -> str:
        """String: the leader's clock (s) at its latest plan write. It moves every cycle;
        the plan's version moves only when the plan's content does."""
        return f"{self.prefix}:plan:heartbeat"

    @property
    def plan_slices(self) -> str:
        """Hash: replica id -> its PlanSlice JSON (its pressure and allowances), written
        with the plan; what engines read instead of the whole plan."""
        return f"{self.prefix}:plan:slices"

    @property
    def plan_fence(self) -> str:
        """Highest lease fence that wrote a plan; lower fences are rejected."""
        return f"{self.prefix}:plan:fence"

    @property
    def usage(self) -> str:
        """Hash: tenant id -> reported live KV blocks across the cluster (from the plan)."""
        return f"{self.prefix}:usage"

    @property
    def lease(self) -> str:
        """String `owner|fence` with a PX expiry: the controller lease."""
        return f"{self.prefix}:controller:lease"

    @property
    def lease_fence(self) -> str:
        """Counter: the fencing token, incremented on every new lease."""
        return f"{self.prefix}:controller:fence"

    def reservations(self, tenant_id: str) -> str:
        """Hash: request id -> reserved blocks (the prefill peak, then the steady bound)."""
        return f"{self.prefix}:resv:{tenant_id}"

    def reservation_lapsed(self, tenant_id: str) -> str:
        """Hash: request id -> blocks of a reservation that lapsed (its ingress stopped
        renewing in time) and was purged: a renewal that finds it here re-reserves it,
        while a released request is never re-reserved by a renewal that arrives late."""
        return f"{self.prefix}:resv-lapsed:{tenant_id}"

    def reservation_lapsed_at(self, tenant_id: str) -> str:
        """Sorted set: request id -> when its reservation lapsed (ms, Redis's clock); an
        entry of ``reservation_lapsed`` older than the reservation TTL is forgotten."""
        return f"{self.prefix}:resv-lapsed-at:{tenant_id}"

    def reservation_starts(self, tenant_id: str) -> str:
        """Hash: request id -> `admitted_ms max_tokens prompt steady n` (when it was
        admitted, how long its answer may be, its prompt, its steady bound, its sequences):
        what a throttled request's Retry-After is estimated from."""
        return f"{self.prefix}:resv-start:{tenant_id}"

    def reservation_total(self, tenant_id: str) -> str:
        """String: the sum of the tenant's reservations in blocks (kept by admission)."""
        return f"{self.prefix}:resv-total:{tenant_id}"

    def reservation_sequences(self, tenant_id: str) -> str:
        """String: the sequences (each request's ``n``) the tenant's reservations run, kept
        by admission; stale while none is held (a deleted tenant's)."""
        return f"{self.prefix}:resv-sequences:{tenant_id}"

    def reservation_deadlines(self, tenant_id: str) -> str:
        """Sorted set: request id -> deadline (ms since epoch) after which it lapses."""
        return f"{self.prefix}:resv-deadline:{tenant_id}"

    @property
    def cluster_reservation_total(self) -> str:
        """String: the sum of every tenant's reservation total (blocks), kept by admission
        with them (never below 0) and set again from them by the controller's sweep
        (``controlplane.lapse_sweep``): what the cluster's capacity
        (``AdmissionConfig.cluster_kv_blocks``) bounds."""
        return f"{self.prefix}:resv-total"

    def queue_tickets(self, tenant_id: str) -> str:
        """Sorted set: ticket -> when it joined (ms, Redis's clock): the tenant's waiting
        requests at the ingresses, first come first (``controlplane.fair_queue``)."""
        return f"{self.prefix}:queue-tickets:{tenant_id}"

    def queue_leases(self, tenant_id: str) -> str:
        """Sorted set: ticket -> ms after which it is dead (its ingress renews it)."""
        return f"{self.prefix}:queue-lease:{tenant_id}"

    @property
    def queue_active(self) -> str:
        """Sorted set: tenant -> virtual counter, for every tenant with a waiting ticket."""
        return f"{self.prefix}:queue:active"

    @property
    def queue_contending(self) -> str:
        """Sorted set: tenant -> virtual counter, for the tenants whose first ticket waits
        for the cluster's capacity; the smallest is served next."""
        return f"{self.prefix}:queue:contending"

    @property
    def queue_tenant_leases(self) -> str:
        """Sorted set: tenant -> the latest lease of its tickets (ms)."""
        return f"{self.prefix}:queue:tenant-leases"

    @property
    def queue_counters(self) -> str:
        """Hash: tenant -> virtual counter (blocks admitted from the queue / weight)."""
        return f"{self.prefix}:queue:counters"

    @property
    def queue_virtual_time(self) -> str:
        """String: the largest counter a ticket was admitted at (never moves back): the
        least a tenant that becomes active while none contends starts at."""
        return f"{self.prefix}:queue:vtime"

    @property
    def queue_present_weights(self) -> str:
        """Hash: tenant -> its weight at its latest admission while the cluster had a bound;
        present in the weighted shares while its reservation total is above 0."""
        return f"{self.prefix}:queue:present-weights"

    def rate_bucket(self, tenant_id: str) -> str:
        """Hash `tokens`, `at_ms`: the tenant's prompt-token bucket."""
        return f"{self.prefix}:rate:{tenant_id}"

    @property
    def api_keys(self) -> str:
        """Hash: API key digest -> tenant id (what authentication reads)."""
        return f"{self.prefix}:apikeys"

    def tenant_api_keys(self, tenant_id: str) -> str:
        """Hash: key id -> API key digest, for each key of the tenant (list and revoke)."""
        return f"{self.prefix}:apikey-ids:{tenant_id}"


def queue_keys(keys: KeySpace, tenant_id: str) -> list[str]:
    """The fair queue's keys as its Lua scripts take them (``fair_queue_scripts``): the
    tenant's tickets and their leases, the active and contending tenants, tenant leases."""
    return [
        keys.queue_tickets(tenant_id),
        keys.queue_leases(tenant_id),
        keys.queue_active,
        keys.queue_contending,
        keys.queue_tenant_leases,
    ]


def reservation_keys(keys: KeySpace, tenant_id: str) -> list[str]:
    """The first KEYS of the admission script (``admission_scripts.ADMIT``) and all of the
    lapse sweep's (``SWEEP_LAPSED``), in their order."""
    return [
        keys.quotas,
        keys.usage,
        keys.reservations(tenant_id),
        keys.reservation_deadlines(tenant_id),
        keys.rate_bucket(tenant_id),
        keys.reservation_starts(tenant_id),
        keys.reservation_total(tenant_id),
        keys.reservation_sequences(tenant_id),
        keys.reservation_lapsed(tenant_id),
        keys.reservation_lapsed_at(tenant_id),
        keys.cluster_reservation_total,
    ]
