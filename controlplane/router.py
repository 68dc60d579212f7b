"""The router core: rank replicas for a tenant from the current plan and latest reports.

`rank` is synchronous and allocation-light (it runs once per request, target p99 <= 50
us at 1000 replicas): the plan is turned into per-tenant tuples once per plan version,
and the candidates' load order once per (candidate set, reports) pair. `refresh` (async)
polls Redis; the Ray Serve `RequestRouter` wrapper calls `rank` from `choose_replicas`.

Fallback to least-loaded routing happens when there is no plan, when neither the plan
version nor its leader's heartbeat has moved for `max_plan_age_s` (measured on this
process's clock, so clock skew between hosts does not matter), when the last refresh
could not reach Redis, or when none of the tenant's warm replicas is among the candidates.

Prefix affinity (`controlplane/prefix.py`): a request that carries its prompt's prefix
keys goes first to the replica whose reports hold the longest run of them (ties: the
less loaded), unless that replica is over the bounded-load cap (consistent hashing with
bounded loads, `prefix_load_factor` times the mean); the plan's ranking follows. Prefix
caching pays only on the replica that holds the prefix, so this comes before the tenant's
warm set; the load bound keeps one popular prefix from piling its tenants on one replica.
Reports reach the router a period late, so it also remembers, for `routed_memory_s`, the
keys of the requests it sent itself (`note_routed`, from Serve's `on_request_routed`, as
Serve's `PrefixCacheAffinityRouter` inserts what it routed into its tree): a
conversation's next turn, or a tenant's second request with the same system prompt,
follows the first even before the replica's report lists its keys.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import logging
import zlib
from collections import deque
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from controlplane.clock import Clock
from controlplane.models import ReplicaReport, RoutingPlan
from controlplane.prefix import PrefixIndex, within_load_bound
from controlplane.redis_conn import REDIS_ERRORS, Backoff
from controlplane.store import RedisStore

logger = logging.getLogger(__name__)

# The most routed requests whose prefix keys a router remembers (at 1,000 requests/s,
# the last 10 s; 64 keys each at most).
MAX_ROUTED_REMEMBERED = 10_000


class RouteSource(enum.Enum):
    PLAN = "plan"  # first rank is the tenant's warm set
    NO_PLAN = "no_plan"  # no plan yet, or the plan went stale
    REDIS_UNREACHABLE = "redis_unreachable"
    NOT_IN_PLAN = "not_in_plan"  # tenant unknown, or none of its replicas is a candidate
    PREFIX = "prefix"  # first rank is the replica holding the longest prefix


@dataclass(frozen=True, slots=True)
class RouteRanking:
    """Candidate replica ids in ranks, most preferred first (Ray Serve's shape). Every
    rank is non-empty; the ranks are empty only when there were no candidates."""

    ranks: tuple[tuple[str, ...], ...]
    source: RouteSource
    plan_version: int | None


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """`fallback_width`: how many least-loaded replicas the fallback rank holds.
    `prefix_load_factor`, `prefix_load_slack`: the bounded-load cap of prefix affinity
    (a factor >= 1 of the mean load, 1.25 as in the bounded-load paper's experiments, plus
    an absolute allowance in requests). `routed_memory_s`: how long the keys of a request
    this router sent stay matched without a report listing them (a few report periods)."""

    max_plan_age_s: float = 5.0
    refresh_period_s: float = 0.1
    report_refresh_s: float = 1.0
    report_max_age_s: float = 1.0
    fallback_width: int = 4
    prefix_load_factor: float = 1.25
    prefix_load_slack: int = 2
    routed_memory_s: float = 10.0

    def __post_init__(self) -> None:
        periods = (self.max_plan_age_s, self.refresh_period_s, self.report_refresh_s)
        if min(*periods, self.routed_memory_s) <= 0:
            raise ValueError("router periods and ages must be positive")
        if self.fallback_width < 1:
            raise ValueError("fallback_width must be >= 1")
        if self.prefix_load_factor < 1 or self.prefix_load_slack < 0:
            raise ValueError("prefix_load_factor must be >= 1 and prefix_load_slack >= 0")


class RouterCore:
    def __init__(self, store: RedisStore, clock: Clock, config: RouterConfig | None = None):
        self.config = config if config is not None else RouterConfig()
        self._store = store
        self._clock = clock
        self._plan: RoutingPlan | None = None
        self._plan_seen_s = 0.0
        self._heartbeat_s: float | None = None
        self._warm: dict[str, tuple[str, ...]] = {}
        self._drained: frozenset[str] = frozenset()
        self._load: dict[str, float] = {}
        self._requests: dict[str, int] = {}  # queued + running, per replica (reports)
        self._routed: dict[str, int] = {}  # sent by prefix affinity since the last reports
        self._prefix = PrefixIndex()  # of the fresh reports' keys
        self._held_keys: dict[str, frozenset[str]] = {}  # what `_prefix` holds per replica
        self._prefix_tags: dict[str, str] = {}  # the stored tag of each one's keys
        # (when, replica, keys) of the requests this router sent, oldest first, and the
        # index of those still within `routed_memory_s`
        self._sent: deque[tuple[float, str, tuple[str, ...]]] = deque()
        self._sent_index = PrefixIndex()
        self._order_cache: tuple[Set[str], tuple[str, ...]] | None = None
        self._reports_read_s: float | None = None
        self._redis_ok = True
        self._rejected_version: int | None = None

    @property
    def plan(self) -> RoutingPlan | None:
        return self._plan

    @property
    def redis_ok(self) -> bool:
        """False after a refresh failed to reach Redis, until one succeeds."""
        return self._redis_ok

    def apply_plan(self, plan: RoutingPlan) -> None:
        """Adopt `plan` (from Redis or in-process) and precompute its rankings."""
        self._plan = plan
        self._plan_seen_s = self._clock.now()
        self._warm = {
            tenant_id: tuple(w.replica_id for w in route.replicas)
            for tenant_id, route in plan.tenants.items()
        }
        self._drained = frozenset(plan.drained_replica_ids)
        self._order_cache = None

    def apply_reports(
        self,
        reports: Mapping[str, ReplicaReport],
        prefix_keys: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Adopt fresh reports: load = queued + running requests + KV use (0-1). The
        prefix keys each replica holds: `prefix_keys` for those whose keys changed (by
        default each report's own), the keys held before for the others; replicas not
        among `reports` hold none. The index is updated by difference (a replica's keys
        mostly stay from one report to the next)."""
        self._load = {
            r: rep.queue_depth
            + rep.running_requests
            + 1.0
            - rep.available_blocks / rep.total_blocks
            for r, rep in reports.items()
        }
        self._requests = {r: rep.queue_depth + rep.running_requests for r, rep in reports.items()}
        self._routed = {}  # the reports count what was routed before them
        if prefix_keys is None:
            prefix_keys = {r: rep.prefix_keys for r, rep in reports.items()}
        held, index = self._held_keys, self._prefix
        for replica_id in [r for r in held if r not in reports]:
            index.remove(replica_id, held.pop(replica_id))
            self._prefix_tags.pop(replica_id, None)
        for replica_id, keys in prefix_keys.items():
            if replica_id not in reports:
                continue
            old, new = held.get(replica_id, frozenset()), frozenset(keys)
            index.remove(replica_id, old - new)
            index.add(replica_id, new - old)
            held[replica_id] = new
        self._order_cache = None

    def note_routed(self, replica_id: str, prefix_keys: Sequence[str]) -> None:
        """`replica_id` accepted a request with `prefix_keys`: match them there from now
        on, for `routed_memory_s`, whatever the reports say meanwhile. At most
        `MAX_ROUTED_REMEMBERED` requests are remembered (the oldest go first), reports or
        not."""
        if not prefix_keys:
            return
        keys = tuple(prefix_keys)
        self._sent.append((self._clock.now(), replica_id, keys))
        self._sent_index.add(replica_id, keys)
        self._forget_sent()

    def _forget_sent(self) -> None:
        """Drop what was sent more than `routed_memory_s` ago, and the oldest beyond
        `MAX_ROUTED_REMEMBERED`."""
        sent, index = self._sent, self._sent_index
        horizon = self._clock.now() - self.config.routed_memory_s
        while sent and (sent[0][0] < horizon or len(sent) > MAX_ROUTED_REMEMBERED):
            _, replica_id, keys = sent.popleft()
            index.remove(replica_id, keys)

    async def refresh(self) -> bool:
        """Poll Redis: new plan version -> read the plan; reports every
        `report_refresh_s`. Returns False (and keeps everything) when Redis is away."""
        try:
            head = await self._store.read_plan_head()
            version = head.version
            if (
                version is not None
                and version != self._rejected_version
                and (self._plan is None or version != self._plan.version)
            ):
                await self._read_plan(version)
            elif (
                self._plan is not None
                and version == self._plan.version
                and head.heartbeat_s is not None
                and head.heartbeat_s != self._heartbeat_s
            ):
                self._plan_seen_s = self._clock.now()  # the plan held is still the leader's
            self._heartbeat_s = head.heartbeat_s
            now_s = self._clock.now()
            if (
                self._reports_read_s is None
                or now_s - self._reports_read_s >= self.config.report_refresh_s
            ):
                await self._refresh_reports(now_s)
        except REDIS_ERRORS as error:
            if self._redis_ok:
                logger.warning("router: Redis unreachable (%s); routing by load", error)
            self._redis_ok = False
            return False
        self._redis_ok = True
        return True

    async def _refresh_reports(self, now_s: float) -> None:
        """The reports (without prefix keys), then the keys of the fresh replicas whose
        keys changed since this router read them: two script calls; 1,024 keys per
        replica cross the network only when that replica's keys moved."""
        snapshot = await self._store.read_reports(
            now_s, self.config.report_max_age_s, forget_after_s=float("inf")
        )
        tags = self._prefix_tags
        changed = await self._store.read_prefix_keys({r: tags.get(r, "") for r in snapshot.fresh})
        self.apply_reports(snapshot.fresh, {r: held.keys for r, held in changed.items()})
        tags.update((r, held.tag) for r, held in changed.items())
        self._reports_read_s = now_s

    async def _read_plan(self, version: int) -> None:
        try:
            plan = await self._store.read_plan()
        except ValueError as error:  # e.g. written by an incompatible controller
            logger.error("router: plan version %d is invalid, keeping mine: %s", version, error)
            self._rejected_version = version
            return
        if plan is not None:
            self.apply_plan(plan)

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh every `refresh_period_s` until `stop` is set, backing off on errors;
        any error is logged and retried, never the end of the loop."""
        backoff = Backoff(self.config.refresh_period_s, max(2.0, self.config.refresh_period_s))
        while not stop.is_set():
            try:
                ok = await self.refresh()
            except Exception:  # noqa: BLE001 - a bad value must not end the loop
                logger.exception("router: refresh failed; keeping what was known")
                ok = False
            if ok:
                backoff.reset()
            delay = self.config.refresh_period_s if ok else backoff.next_delay_s()
            await self._clock.sleep(delay)

    def rank(
        self,
        tenant_id: str,
        candidate_ids: Set[str],
        queue_lengths: Mapping[str, int] | None = None,
        prefix_keys: Sequence[str] = (),
    ) -> RouteRanking:
        """Rank `candidate_ids` (the replicas the caller can reach now) for `tenant_id`.

        With `prefix_keys` (the prompt's, `controlplane/prefix.py`) held by a candidate
        within the load bound, the first rank is that replica alone (source `PREFIX`) and
        the ranking below follows without it. With a usable plan the first rank is the
        tenant's warm set among the candidates,
        least queued first (`queue_lengths` from the caller, else the latest reports),
        and the second rank the `fallback_width` least-loaded others by the latest
        reports. Otherwise one least-loaded rank (by `queue_lengths` when given).
        Pass the same `candidate_ids` object while the replica set is unchanged: its
        load order is cached by identity (sorting 1000 ids costs ~300 us, a lookup ~1).
        """
        ranking = self._rank(tenant_id, candidate_ids, queue_lengths)
        holder = self._prefix_holder(prefix_keys, candidate_ids, queue_lengths)
        if holder is None:
            return ranking
        rest = tuple(
            kept
            for kept in (tuple(r for r in rank if r != holder) for rank in ranking.ranks)
            if kept
        )
        return RouteRanking(((holder,), *rest), RouteSource.PREFIX, self._plan_version)

    def _prefix_holder(
        self,
        prefix_keys: Sequence[str],
        candidate_ids: Set[str],
        queue_lengths: Mapping[str, int] | None,
    ) -> str | None:
        """The candidate holding the longest run of `prefix_keys` (the less loaded on a
        tie) if it is within the load bound; `None` otherwise."""
        if not prefix_keys:
            return None
        self._forget_sent()  # also while no reports come (Redis away)
        if not (self._prefix or self._sent_index):
            return None
        usable = [r for r in candidate_ids if r not in self._drained]
        matched = self._prefix.longest_match(prefix_keys, usable)
        for replica_id, depth in self._sent_index.longest_match(prefix_keys, usable).items():
            matched[replica_id] = max(depth, matched.get(replica_id, 0))
        if not matched:
            return None
        if queue_lengths is not None:  # the caller's live counts
            loads: Mapping[str, int] = queue_lengths
        else:  # the reports', plus what this router sent since (reports lag a period)
            routed = self._routed
            loads = {r: self._requests.get(r, 0) + routed.get(r, 0) for r in usable}
        deepest = prefix_keys[max(matched.values()) - 1]
        # Longest match, then least loaded; equal ones spread by the prefix (a fixed order
        # would pile every tie on one replica).
        holder = max(
            matched,
            key=lambda r: (matched[r], -loads.get(r, 0), zlib.crc32(f"{deepest}/{r}".encode())),
        )
        all_loads = [loads.get(r, 0) for r in usable]
        config = self.config
        bound = (config.prefix_load_factor, config.prefix_load_slack)
        if not within_load_bound(loads.get(holder, 0), all_loads, *bound):
            return None
        self._routed[holder] = self._routed.get(holder, 0) + 1
        return holder

    def _rank(
        self,
        tenant_id: str,
        candidate_ids: Set[str],
        queue_lengths: Mapping[str, int] | None,
    ) -> RouteRanking:
        source = self._fallback_source()
        warm: tuple[str, ...] = ()
        if source is RouteSource.PLAN:
            warm = tuple(r for r in self._warm.get(tenant_id, ()) if r in candidate_ids)
            if not warm:
                source = RouteSource.NOT_IN_PLAN
        width = self.config.fallback_width
        if warm:
            if len(warm) > 1:
                loads = queue_lengths if queue_lengths is not None else self._load
                warm = tuple(sorted(warm, key=lambda r: loads.get(r, 0)))
            others = self._least_loaded(candidate_ids, warm, width)
            return RouteRanking((warm, others) if others else (warm,), source, self._plan_version)
        if queue_lengths is not None:
            drained = self._drained
            key = lambda r: (r in drained, queue_lengths.get(r, 0), r)  # noqa: E731
            ranked = tuple(heapq.nsmallest(width, candidate_ids, key=key))
        else:
            ranked = self._least_loaded(candidate_ids, (), width)
        return RouteRanking((ranked,) if ranked else (), source, self._plan_version)

    @property
    def _plan_version(self) -> int | None:
        return self._plan.version if self._plan is not None else None

    def _fallback_source(self) -> RouteSource:
        if not self._redis_ok:
            return RouteSource.REDIS_UNREACHABLE
        if self._plan is None or self._clock.now() - self._plan_seen_s > self.config.max_plan_age_s:
            return RouteSource.NO_PLAN
        return RouteSource.PLAN

    def _least_loaded(
        self, candidate_ids: Set[str], exclude: tuple[str, ...], width: int
    ) -> tuple[str, ...]:
        """The `width` least-loaded candidates not in `exclude`; drained ones last."""
        cached = self._order_cache
        if cached is not None and cached[0] is candidate_ids:
            order = cached[1]
        else:
            drained, load = self._drained, self._load
            order = tuple(sorted(candidate_ids, key=lambda r: (r in drained, load.get(r, 0.0), r)))
            self._order_cache = (candidate_ids, order)
        if not exclude:
            return order[:width]
        chosen: list[str] = []
        for replica_id in order:
            if replica_id not in exclude:
                chosen.append(replica_id)
                if len(chosen) == width:
                    break
        return tuple(chosen)
