"""The squeeze planner: which decoding requests evict this step, and to how many tokens.

Pure arithmetic over one :class:`RequestView` per running request (taken before any
eviction of the step, in the order vLLM added them) and the pool's free blocks; it
changes nothing. ``workers/scheduler_side.py`` builds the views, asks for a
:class:`SqueezePlan` and applies it.

Room is counted for the *next* step: a decoding request that evicts to ``B`` live tokens
and repacks holds them with its next token in ``ceil((B + 1) / block_size)`` blocks; one
squeezed onto a block boundary opens a block again with its next token, so evicting it
there gives nothing back. In naive mode (Naive-Evict) eviction frees no block: no request
gives room. A prompt in prefill whose policy evicts during prefill is planned like a
decoding request after each chunk (its next step opens its next chunk's blocks), but never
squeezed below its budget.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kernels.intmath import cdiv
from workers.fair_share import excess_over_share


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the squeeze arithmetic reads of one running request, taken before any eviction
    of the step. Token counts are live tokens, block counts blocks of ``block_size``.

    Two fields are functions: what its policy protects depends on the budget asked about,
    and counting the blocks only it holds reads every block's reference count, which is
    needed only for the requests that end with this step and for vLLM's likely victim."""

    tenant: str
    num_blocks: int  # blocks of its token table (ballast not included)
    num_paid_blocks: int  # blocks it holds (ballast included) less those others pay for
    num_live: int
    num_next_token_blocks: int  # blocks its next token opens (0 or 1)
    num_next_step_blocks: int  # blocks its next step may open (0 if it ends with this one)
    budget: int  # live tokens it may keep after this step (its bounds applied)
    num_unbudgeted: int  # leading tokens kept outside its policy's budget (shared, pinned hit)
    protected_at: Callable[[int], int]  # tokens its policy protects at a budget of that many
    sole_blocks: Callable[[], int]  # blocks only it holds (back in the pool when it ends)
    evicts_to_budget: bool = True  # its policy brings it to its budget whenever asked
    own_timing: bool = False  # its policy decides at one step only (SnapKV, PAGE)
    capped: bool = False  # its spec is a tenant's per-request cap
    under_pressure: bool = False  # its tenant is under the controller's pressure
    hold_blocks: int | None = None  # what admission counts it at (``hold_blocks``)
    running: bool = True  # vLLM runs it (it is in vLLM's requests)
    ending: bool = False  # it reaches its ``max_tokens`` with this step
    # blocks another request also holds that its eviction copies (copy on evict): an
    # eviction never gives them back to the pool
    num_shared_blocks: int = 0

    @property
    def outgrows_hold(self) -> bool:
        """It would hold more than ``hold_blocks`` of the blocks it pays for with the blocks
        its next step opens (admission's bound counts that step)."""
        held = self.num_paid_blocks + self.num_next_step_blocks
        return self.hold_blocks is not None and held > self.hold_blocks

    @property
    def evicts_every_step(self) -> bool:
        """It evicts to its budget this step whatever memory holds: its policy keeps its own
        timing, or a cap, ``hold_blocks`` or its tenant's pressure bounds it."""
        return self.own_timing or self.capped or self.outgrows_hold or self.under_pressure


class SqueezeCause(Enum):
    """Why a request evicted (which engine counter it adds to)."""

    BELOW_BUDGET = "below_budget"  # squeezed under its budget: counted under pressure too
    UNDER_PRESSURE = "under_pressure"  # for room, its tenant's allowance or pressure
    TO_BOUND = "to_bound"  # to stay within what admission counts (``hold_blocks``)
    OWN = "own"  # its policy's own timing or a tenant's cap: counted nowhere


@dataclass(frozen=True, slots=True)
class SqueezePlan:
    """This step's decoding requests that evict now.

    ``always``: evict to budget whatever memory holds (:attr:`RequestView.evicts_every_step`;
    every decoding request in ``eager`` mode). ``for_room``: evict to budget to give the next
    step room or bring a tenant within its allowance. ``below``: squeezed under their budgets,
    request id -> live tokens it keeps. ``budgets``: every squeezed request -> live tokens it
    may keep this step (the others keep all they hold); ``causes``: why each evicts.
    """

    always: frozenset[str]
    for_room: frozenset[str]
    below: Mapping[str, int]
    budgets: Mapping[str, int]
    causes: Mapping[str, SqueezeCause]

    @classmethod
    def of(
        cls,
        views: Mapping[str, RequestView],
        always: Iterable[str],
        for_room: Iterable[str] = (),
        below: Mapping[str, int] | None = None,
    ) -> SqueezePlan:
        always, for_room, below = frozenset(always), frozenset(for_room), dict(below or {})
        budgets, causes = {}, {}
        for request_id in always | for_room | below.keys():
            view = views[request_id]
            budgets[request_id] = min(view.budget, below.get(request_id, view.budget))
            if request_id in below:
                causes[request_id] = SqueezeCause.BELOW_BUDGET
            elif request_id in for_room or view.under_pressure:
                causes[request_id] = SqueezeCause.UNDER_PRESSURE
            elif request_id in always and view.outgrows_hold:
                causes[request_id] = SqueezeCause.TO_BOUND
            else:
                causes[request_id] = SqueezeCause.OWN
        return cls(always, for_room, below, budgets, causes)


@dataclass(frozen=True, slots=True)
class SqueezePlanner:
    """The room and squeeze arithmetic of one engine step (see the module docstring).

    ``requests``: every running request's view, in the order vLLM added them.
    ``victim_order``: the running requests in the order the scheduler keeps them, the
    first it would preempt last (``workers.fair_share.victim_order``; empty: the order of
    ``requests``). ``allowance``: tenant -> most blocks it may hold here (a tenant left out
    has no limit). ``squeeze_floor``: the share of its own budget no squeeze below budget
    takes from a request. ``tenant_weights``: the weights of the tenants present here
    (running or waiting) when fairness is on; a tenant holding more than its weighted
    share of ``pool_blocks`` gives room, and is squeezed below budget, before the others
    (after tenants above their allowance).
    """

    requests: Mapping[str, RequestView]
    num_free_blocks: int
    block_size: int
    allowance: Mapping[str, int]
    eager: bool = False
    frees_blocks: bool = True  # False in naive mode
    squeeze_below_budget: bool = True
    squeeze_floor: float = 0.5
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    pool_blocks: int = 0
    victim_order: Sequence[str] = ()

    # ------------------------------------------------------------------ one request
    def tokens_at(self, request_id: str, budget: int) -> int:
        """Live tokens the request keeps after eviction to ``budget`` (what its policy
        protects at that budget, if more)."""
        view = self.requests[request_id]
        return min(view.num_live, max(budget, view.protected_at(budget)))

    def blocks_at(self, request_id: str, budget: int) -> int:
        """Blocks the request keeps after eviction to ``budget`` live tokens and a repack."""
        held = self.requests[request_id].num_blocks
        return min(held, cdiv(self.tokens_at(request_id, budget), self.block_size))

    def room(self, request_id: str, budget: int | None = None) -> int:
        """Blocks the next step needs fewer of if the decoding request evicts to ``budget``
        live tokens (default: its budget) now and repacks. 0 for a policy that would not
        evict if asked now, and in naive mode."""
        view = self.requests[request_id]
        if not view.evicts_to_budget or not self.frees_blocks:
            return 0
        budget = view.budget if budget is None else budget
        now = view.num_blocks - view.num_shared_blocks + view.num_next_token_blocks
        after = cdiv(self.tokens_at(request_id, budget) + 1, self.block_size)
        return max(0, now - after)

    def blocks_above_budget(self, request_id: str) -> int:
        """Blocks eviction to its budget (then a repack) would give back now: it keeps its
        budget or what its policy protects at that budget, if more. 0 for a policy that
        would not evict if asked now, and in naive mode."""
        view = self.requests[request_id]
        if not view.evicts_to_budget or not self.frees_blocks:
            return 0
        own = view.num_blocks - view.num_shared_blocks
        return max(0, own - self.blocks_at(request_id, view.budget))

    def squeeze_order(self, request_ids: list[str]) -> list[str]:
        """Requests with blocks above their budget, most first (ties keep the given order)."""
        above = {request_id: self.blocks_above_budget(request_id) for request_id in request_ids}
        return sorted((r for r in request_ids if above[r] > 0), key=lambda r: -above[r])

    # ------------------------------------------------------------------ the engine
    def blocks_needed_next_step(self) -> int:
        """Blocks the running requests may open next step."""
        return sum(view.num_next_step_blocks for view in self.requests.values())

    def held_per_tenant(self) -> dict[str, int]:
        """Blocks each tenant's requests hold here, shared blocks counted once."""
        held: dict[str, int] = {}
        for view in self.requests.values():
            held[view.tenant] = held.get(view.tenant, 0) + view.num_paid_blocks
        return held

    def excess_over_share(self) -> dict[str, float]:
        """Blocks each tenant holds here above its weighted share of the pool (tenants
        above it only; none without ``tenant_weights``)."""
        if not self.tenant_weights:
            return {}
        return excess_over_share(self.held_per_tenant(), self.tenant_weights, self.pool_blocks)

    def excess_over_allowance(self, always: set[str], ending: set[str]) -> dict[str, int]:
        """Blocks each tenant with an allowance here holds above it once this step's
        requests that always evict (to budget) and those ending with it gave theirs back."""
        if not self.allowance:
            return {}
        held = self.held_per_tenant()
        for request_id in always | ending:
            tenant = self.requests[request_id].tenant
            if request_id in ending:
                held[tenant] = held.get(tenant, 0) - self.requests[request_id].sole_blocks()
            else:
                held[tenant] = held.get(tenant, 0) - self.blocks_above_budget(request_id)
        return {t: held.get(t, 0) - limit for t, limit in self.allowance.items()}

    def over_allowance(self, decoding: list[str], excess: Mapping[str, int]) -> set[str]:
        """Decoding requests to evict to budget so that each tenant fits its allowance
        (``excess``: :meth:`excess_over_allowance`)."""
        chosen: set[str] = set()
        for tenant, over in excess.items():
            excess_left = over
            if excess_left <= 0:
                continue
            mine = [r for r in decoding if self.requests[r].tenant == tenant]
            for request_id in self.squeeze_order(mine):
                if excess_left <= 0:
                    break
                chosen.add(request_id)
                excess_left -= self.blocks_above_budget(request_id)
        return chosen

    def likely_victim(
        self, ending: set[str], evicting: set[str] | None = None
    ) -> tuple[str, int] | None:
        """The request the scheduler would preempt if the next step does not fit (the last
        of ``victim_order``) and the blocks that gives the step: what only it holds and
        what its own next step would have opened, less what its eviction this step
        (``evicting``) already gives."""
        for request_id in reversed(list(self.victim_order or self.requests)):
            view = self.requests.get(request_id)
            if view is None:
                continue
            if request_id in ending or not view.running:
                continue
            if not view.num_blocks:
                continue  # an allocation that failed: still waiting, not running
            blocks = view.sole_blocks() + view.num_next_step_blocks
            evicts = evicting is not None and request_id in evicting
            return request_id, blocks - (self.room(request_id) if evicts else 0)
        return None

    # ------------------------------------------------------------------ the plan
    def plan(
        self, decoding: list[str], num_waiting_blocks: int, prefilling: Sequence[str] = ()
    ) -> SqueezePlan:
        """Who of this step's ``decoding`` requests, and of its ``prefilling`` ones (a chunk
        that did not complete the prompt, under a policy that evicts during prefill),
        evicts now. ``eager``: all of them. ``on_demand``: those that always do, then
        (beyond the free blocks, for what the head of vLLM's waiting queue needs,
        ``num_waiting_blocks``, and the running requests' next step) those whose eviction
        to budget gives the most room, tenants over their allowance first, then those above
        their weighted share of the pool (``tenant_weights``), then, if the
        running requests' own next step still does not fit, :meth:`below_budget` (decoding
        requests only: a prompt in prefill is never squeezed under its budget)."""
        if self.eager:
            return SqueezePlan.of(self.requests, [*decoding, *prefilling])
        candidates = [*decoding, *prefilling]
        always = {r for r in candidates if self.requests[r].evicts_every_step}
        ending = {r for r in decoding if self.requests[r].ending}
        need = (
            num_waiting_blocks
            + self.blocks_needed_next_step()
            - self.num_free_blocks
            - sum(self.requests[r].sole_blocks() for r in ending)
            - sum(self.room(r) for r in always - ending)
        )
        decoding = [r for r in decoding if r not in ending]  # nothing to gain from them
        candidates = [r for r in candidates if r not in ending]
        excess = self.excess_over_allowance(always, ending)
        for_room = self.over_allowance([r for r in candidates if r not in always], excess)
        need -= sum(self.room(r) for r in for_room)
        rest = [r for r in candidates if r not in always | for_room]
        room = {request_id: self.room(request_id) for request_id in rest}
        above = self.excess_over_share()
        for request_id in ending if above else ():
            tenant = self.requests[request_id].tenant
            if tenant in above:
                above[tenant] -= self.requests[request_id].sole_blocks()
        order = sorted(
            (r for r in rest if room[r] > 0),
            key=lambda r: (above.get(self.requests[r].tenant, 0) <= 0, -room[r]),
        )
        for request_id in order:
            if need <= 0:
                break
            for_room.add(request_id)
            need -= room[request_id]
        # Only the running requests' own next step, not the waiting queue, squeezes anyone
        # below budget: that is where vLLM would preempt one.
        for request_id in for_room | always:
            tenant = self.requests[request_id].tenant
            if tenant in excess and request_id in for_room:
                excess[tenant] -= self.blocks_above_budget(request_id)
            if tenant in above:
                above[tenant] -= self.blocks_above_budget(request_id)
        victim = self.likely_victim(ending, always | for_room)
        below = self.below_budget(decoding, need - num_waiting_blocks, excess, victim, above)
        return SqueezePlan.of(self.requests, always, for_room, below)

    def below_budget(
        self,
        decoding: list[str],
        need: int,
        excess: Mapping[str, int] | None = None,
        victim: tuple[str, int] | None = None,
        above: Mapping[str, float] | None = None,
    ) -> dict[str, int]:
        """Decoding requests squeezed under their budgets so that the next step needs
        ``need`` blocks fewer (``on_demand`` with ``squeeze_below_budget``, once every request
        that could give room at its budget does). Block by block, the request that would
        keep the largest share of its own budget gives one up (requests of tenants still
        above their allowance here, ``excess`` in blocks, first, then those of tenants
        still above their weighted share of the pool, ``above``), so shares stay level and
        no more is taken than ``need``; a request keeps whatever its remaining blocks hold
        with its next token. None goes under its *floor*: ``squeeze_floor`` of its own
        budget plus the prefix it does not pay for or pinned (and never under what its
        policy protects). Request id -> live tokens it keeps.

        When the floors cannot free ``need`` blocks, vLLM preempts ``victim`` (its id and
        the blocks its preemption gives the step): the others then give only what that
        leaves short, if they can, and nothing if it covers the step (squeezing them as
        well would only cost them context)."""
        if need <= 0 or not self.squeeze_below_budget or not self.frees_blocks:
            return {}
        order, start = self._give_order(decoding, need, dict(excess or {}), dict(above or {}))
        if len(order) < need:
            if victim is None:
                return {}
            victim_id, victim_blocks = victim
            others = [r for r in decoding if r != victim_id]
            order, start = self._give_order(others, need, dict(excess or {}), dict(above or {}))
            if len(order) + victim_blocks >= need:
                order = order[: max(0, need - victim_blocks)]
            # else vLLM preempts more than the victim: each block given spares some of that
        taken: dict[str, int] = {}
        for request_id in order:
            taken[request_id] = taken.get(request_id, 0) + 1
        return {r: start[r] - count * self.block_size for r, count in taken.items()}

    def _floor(self, request_id: str) -> int:
        """The fewest live tokens a squeeze below budget leaves the request."""
        view = self.requests[request_id]
        own = max(1, view.budget - view.num_unbudgeted)
        floor = view.num_unbudgeted + math.ceil(self.squeeze_floor * own)
        return max(floor, view.protected_at(own), 1)

    def _give_order(
        self,
        decoding: list[str],
        need: int,
        excess: dict[str, int],
        above: dict[str, float] | None = None,
    ) -> tuple[list[str], dict[str, int]]:
        """Who gives each block, in order, up to ``need`` blocks (see :meth:`below_budget`),
        and each candidate's live tokens before giving (what its next step's blocks at
        budget hold with its next token)."""
        size = self.block_size
        above = {} if above is None else above
        # (tenant within its allowance, tenant within its weighted share, -share, id)
        heap: list[tuple[bool, bool, float, str]] = []

        def within(tenant: str) -> tuple[bool, bool]:
            return excess.get(tenant, 0) <= 0, above.get(tenant, 0) <= 0

        candidates = [r for r in decoding if self.requests[r].evicts_to_budget]
        # next step's blocks at budget, then after each block given
        blocks = {r: cdiv(self.tokens_at(r, self.requests[r].budget) + 1, size) for r in candidates}
        floors = {r: self._floor(r) for r in candidates}
        start = {r: b * size - 1 for r, b in blocks.items()}
        held = {r: cdiv(self.tokens_at(r, self.requests[r].budget), size) for r in blocks}

        def push(request_id: str) -> None:
            view = self.requests[request_id]
            goal = (blocks[request_id] - 1) * size - 1  # live tokens after one more block
            if goal < floors[request_id] or self.tokens_at(request_id, goal) > goal:
                return  # at its floor, or its policy would keep more than the block holds
            own = max(1, view.budget - view.num_unbudgeted)
            share = (goal - view.num_unbudgeted) / own
            heapq.heappush(heap, (*within(view.tenant), -share, request_id))

        for request_id in blocks:
            push(request_id)
        order: list[str] = []
        while heap and len(order) < need:
            in_allowance, in_share, share, request_id = heapq.heappop(heap)
            tenant = self.requests[request_id].tenant
            if (in_allowance, in_share) != within(tenant):  # its tenant came within since
                heapq.heappush(heap, (*within(tenant), share, request_id))
                continue
            order.append(request_id)
            blocks[request_id] -= 1
            # in blocks held: the first one given may be a next step's
            now = cdiv(blocks[request_id] * size - 1, size)
            if tenant in excess:
                excess[tenant] -= held[request_id] - now
            if tenant in above:
                above[tenant] -= held[request_id] - now
            held[request_id] = now
            push(request_id)
        return order, start
