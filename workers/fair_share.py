"""Weighted fairness between tenants in one engine: virtual token counters (VTC).

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): each tenant
has a counter of the service it received, ``prompt_cost x prompt tokens + output_cost x
output tokens``, divided by its weight. The waiting queue serves the tenant with the
smallest counter first (``workers/fair_queue.py``); a tenant that becomes active (a new
request while none of its requests waits) starts at the smallest counter among the
tenants with waiting requests (or, when none waits, at the counter of the last tenant
whose queue emptied), so neither idling nor arriving late buys credit. Between tenants
that stay backlogged the service difference is then bounded by a small constant.

Under memory pressure the same weights decide who gives memory back first: a tenant holds
*above its share* when its blocks exceed ``pool x weight / sum of the present tenants'
weights`` (present: a request running or waiting here). The squeeze below budget
(``workers/squeeze.py``) and vLLM's preemption take from such tenants first
(:func:`victim_order`).

Pure bookkeeping on injected values: no vLLM, no clock. A request's tenant and weight
travel in ``SamplingParams.extra_args`` (:data:`TENANT_KEY`, :data:`WEIGHT_KEY`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from vtoken.reports import DEFAULT_TENANT

if TYPE_CHECKING:
    from workers.config import VTokenConfig
    from workers.scheduled_request import ScheduledRequest

TENANT_KEY = "tenant"
WEIGHT_KEY = "tenant_weight"
# A tenant's weight, as the control plane bounds it: a weight near 0 would turn counters
# into inf and nan (one token over 1e-308), which no order or report survives.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1000.0
"""``extra_args``: the request's tenant weight, a finite number > 0 (default 1)."""
MAX_TENANTS = 1024
"""Tenants whose counters an engine keeps before it drops those a new request would lift
anyway."""


def tenant_weight(extra: Mapping[str, Any] | None) -> tuple[str, float]:
    """The request's tenant and weight from its ``extra_args``; a bad weight raises
    ``ValueError`` (the request is refused, ``workers/vllm_patches/request_checks.py``)."""
    extra = extra or {}
    tenant = str(extra.get(TENANT_KEY, DEFAULT_TENANT))
    weight = extra.get(WEIGHT_KEY, 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValueError(f"extra_args[{WEIGHT_KEY!r}] must be a number, got {weight!r}")
    if not math.isfinite(weight) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ValueError(
            f"extra_args[{WEIGHT_KEY!r}] must be in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {weight!r}"
        )
    return tenant, float(weight)


def served(num_computed: int, num_prompt: int, prompt_cost: float, output_cost: float) -> float:
    """Service of a request with ``num_computed`` positions computed: its prompt tokens
    at ``prompt_cost`` (prefix-cache hits included), and one output token per position
    computed from the prompt's last one on (the last prefill position samples the first
    output token) at ``output_cost``."""
    prompt = min(num_computed, num_prompt)
    output = max(0, num_computed - num_prompt + 1) if num_computed >= num_prompt else 0
    return prompt_cost * prompt + output_cost * output


class Scheduled(NamedTuple):
    """What the counters read of one request scheduled in a step, after vLLM scheduled it
    (``num_computed``: its positions once the step ran). A tuple: one per running request
    and step."""

    request_id: str
    tenant: str
    num_prompt: int
    num_computed: int


@dataclass(slots=True)
class FairShare:
    """The tenants' virtual counters of one engine and who is waiting.

    Charging: :meth:`admit` when a request leaves the waiting queue (a provisional charge
    of its uncomputed tokens, so a step admitting several requests alternates tenants),
    :meth:`refund` when it goes back unscheduled, :meth:`settle` after the step was
    scheduled (provisional charges replaced by what each scheduled request computes; a
    position is charged once per request, so a preempted request recomputed is not
    charged twice), :meth:`forget` when the request ends."""

    prompt_cost: float = 1.0
    output_cost: float = 2.0
    counters: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)  # tenant -> requests waiting
    last_left: str | None = None  # the last tenant whose waiting queue emptied
    charged: dict[str, int] = field(default_factory=dict)  # request -> positions charged
    provisional: dict[str, tuple[str, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, config: VTokenConfig) -> FairShare | None:
        """An engine's counters (``None`` when its ``fair_share`` is off)."""
        if not config.fair_share:
            return None
        return cls(config.fair_prompt_cost, config.fair_output_cost)

    def __post_init__(self) -> None:
        for name in ("prompt_cost", "output_cost"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")

    # ------------------------------------------------------------------ tenants
    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def set_weight(self, tenant: str, weight: float) -> None:
        """The tenant's weight (the latest request's: a quota change applies from it)."""
        self.weights[tenant] = weight

    def enqueue(self, tenant: str, arrival: bool = True) -> None:
        """One of the tenant's requests enters the waiting queue. A new ``arrival`` while
        none of its requests waits lifts its counter to the smallest among the waiting
        tenants (``last_left`` when none waits); a request put back (preempted, skipped)
        does not."""
        if arrival and not self.waiting.get(tenant):
            active = [self.counter(t) for t, n in self.waiting.items() if n > 0]
            floor = min(active) if active else self.last_left_counter
            self.counters[tenant] = max(self.counter(tenant), floor)
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1

    def dequeue(self, tenant: str) -> None:
        """One of the tenant's requests leaves the waiting queue (scheduled or removed)."""
        left = self.waiting.get(tenant, 0) - 1
        if left > 0:
            self.waiting[tenant] = left
            return
        self.waiting.pop(tenant, None)
        self.last_left = tenant

    @property
    def last_left_counter(self) -> float:
        """The current counter of the last tenant whose waiting queue emptied (VTC lifts a
        newcomer to it: the service that tenant received since still counts)."""
        return 0.0 if self.last_left is None else self.counter(self.last_left)

    # ------------------------------------------------------------------ charges
    def _charge(self, tenant: str, amount: float) -> None:
        self.counters[tenant] = self.counter(tenant) + amount / self.weight(tenant)

    def admit(self, request_id: str, tenant: str, num_uncomputed: int) -> None:
        """The request leaves the waiting queue to be scheduled: charged provisionally for
        its ``num_uncomputed`` tokens at the prompt cost until :meth:`settle`. What was
        added to the counter is kept, so a refund undoes exactly that whatever the
        tenant's weight has become since."""
        self.refund(request_id)
        added = self.prompt_cost * max(0, num_uncomputed) / self.weight(tenant)
        self.provisional[request_id] = (tenant, added)
        self.counters[tenant] = self.counter(tenant) + added

    def refund(self, request_id: str) -> None:
        """Undo the request's provisional charge (it went back to the waiting queue)."""
        entry = self.provisional.pop(request_id, None)
        if entry is not None:
            tenant, added = entry
            self.counters[tenant] = max(0.0, self.counter(tenant) - added)

    def settle(self, scheduled: Iterable[Scheduled]) -> None:
        """After a step was scheduled: every provisional charge is undone and each
        scheduled request is charged for the positions it computes that were never
        charged (:func:`served`). O(scheduled requests)."""
        for request_id in list(self.provisional):
            self.refund(request_id)
        charged, output_cost = self.charged, self.output_cost
        totals: dict[str, float] = {}
        for request_id, tenant, num_prompt, num_computed in scheduled:
            before = charged.get(request_id, 0)
            if num_computed <= before:
                continue
            charged[request_id] = num_computed
            if before >= num_prompt:  # decoding: output tokens only
                amount = output_cost * (num_computed - before)
            else:
                costs = (num_prompt, self.prompt_cost, output_cost)
                amount = served(num_computed, *costs) - served(before, *costs)
            totals[tenant] = totals.get(tenant, 0.0) + amount
        for tenant, amount in totals.items():
            self._charge(tenant, amount)

    def forget(self, request_id: str) -> None:
        """The request ended (finished or aborted)."""
        self.charged.pop(request_id, None)
        self.refund(request_id)

    def prune(self, present: Collection[str]) -> None:
        """Drop idle tenants whose counter a new request would lift anyway (at or below
        the floor of :meth:`enqueue`): memory stays bounded by the tenants that matter."""
        active = [self.counter(t) for t, n in self.waiting.items() if n > 0]
        floor = min(active) if active else self.last_left_counter
        keep = set(present) | self.waiting.keys() | {t for t, _ in self.provisional.values()}
        for tenant in [t for t, c in self.counters.items() if c <= floor and t not in keep]:
            del self.counters[tenant]
            self.weights.pop(tenant, None)

    def report(self, running: Iterable[ScheduledRequest]) -> dict[str, float]:
        """Every tenant's counter, rounded to a thousandth of a token; past
        :data:`MAX_TENANTS` tenants, those not worth keeping are dropped first
        (:meth:`prune`; ``running``: the engine's running requests)."""
        if len(self.counters) > MAX_TENANTS:
            self.prune({record.kv.tenant for record in running})
        return {tenant: round(max(0.0, counter), 3) for tenant, counter in self.counters.items()}

    # ------------------------------------------------------------------ shares
    def present_weights(self, running_tenants: Iterable[str]) -> dict[str, float]:
        """Weights of the tenants present here: with a request running or waiting."""
        present = set(running_tenants) | {t for t, n in self.waiting.items() if n > 0}
        return {tenant: self.weight(tenant) for tenant in present}


def excess_over_share(
    held: Mapping[str, int], weights: Mapping[str, float], pool_blocks: int
) -> dict[str, float]:
    """Blocks each tenant holds above its weighted share of the pool (``pool_blocks x
    weight / sum of weights`` over ``weights``, the present tenants), for the tenants
    above it only. Empty with fewer than two present tenants: one tenant's share is the
    whole pool."""
    if len(weights) < 2:
        return {}
    total = sum(weights.values())
    excess = {}
    for tenant, blocks in held.items():
        share = pool_blocks * weights.get(tenant, 0.0) / total
        if blocks > share:
            excess[tenant] = blocks - share
    return excess


@dataclass(frozen=True, slots=True)
class Running:
    """One running request as the preemption order reads it."""

    request_id: str
    tenant: str
    priority: int = 0
    arrival_time: float = 0.0


def victim_order(
    running: Sequence[Running], above: Collection[str], by_priority: bool
) -> list[str]:
    """The running requests in the order the scheduler keeps them; vLLM preempts from the
    end. First come, first served (``running`` in vLLM's order): the requests of tenants
    above their share (``above``) move behind the others, each group in its order.
    ``by_priority`` (vLLM's ``priority`` policy, which preempts the largest ``(priority,
    arrival_time)``): above share first (whatever their priority: a tenant cannot shield
    itself with a low priority value), then by priority, then arrival. With no tenant
    above its share this is the victim vLLM itself would take."""
    if not by_priority:  # a stable partition, O(running)
        within = [entry.request_id for entry in running if entry.tenant not in above]
        return within + [entry.request_id for entry in running if entry.tenant in above]
    indexed = list(enumerate(running))
    indexed.sort(key=lambda e: (e[1].tenant in above, e[1].priority, e[1].arrival_time, e[0]))
    return [entry.request_id for _, entry in indexed]
