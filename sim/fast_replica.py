"""A fast replica: vLLM's scheduling rules on block counts, for clusters of 1,000 replicas.

Per request it keeps counts only (prompt, computed, outputs so far, live tokens, held
blocks); per replica a waiting and a running queue with vLLM's essentials:

- ``max_num_seqs`` and ``max_num_batched_tokens`` with chunked prefill: running requests
  first (decodes and unfinished chunks, in order), then the waiting queue, first come
  first served, while the token budget, the sequence cap and the free blocks allow;
- the prefix cache: a per-replica LRU of block hashes (vLLM's chained hash of each full
  block and the tenant's ``cache_salt``), at most ``num_blocks`` of them; a request's
  hit is the leading blocks of its prompt found there, less the prompt's last token;
- preemption (recompute): a step whose allocation finds no free block preempts the
  newest running request (back to the head of the waiting queue, its tokens recomputed).

What a request holds, per engine (``live`` is the tokens its attention reads):

- ``vanilla``: every token, ``ceil((computed + new) / bs)`` blocks;
- ``eager`` (vToken): after every step (and every prefill chunk) it is evicted to its
  budget ``B = ceil(keep_ratio x computed)``, so a step holds
  ``ceil((min(computed, B) + new) / bs)`` blocks: ``ceil((min(live, B) + 1) / bs)`` when
  decoding;
- ``on_demand``: every token until the pool runs short; then running requests are
  evicted to their budgets (most blocks freed first) instead of a preemption, and grow
  again from there; vLLM preempts only when every request is at its budget;
- ``naive`` and ``block``: ``live = min(computed, B)``; held blocks are a fraction of
  vanilla's, ``HELD_FRACTION`` (measured on exact replicas: ``measure_held_fraction``).

A step's counts form the same ``StepRecord`` as an exact replica's, so the cluster loop,
the cost model and the metrics take either. Macro-steps (``plan_macro``): when every
running request is decoding, nothing can be admitted and no request finishes or runs out
of blocks within ``k`` steps, the ``k`` steps are planned at once (numpy over requests and
steps, the cost model applied per step) and committed when they end, or cut at the first
step boundary after an arrival routed to this replica (``truncate``).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sim.replica import ReplicaConfig, StepRecord, check_request

FAST_ENGINES = ("vanilla", "eager", "on_demand", "naive", "block")
# Held blocks over vanilla's (context / block size) in the decode steps of the engines
# that free only whole blocks. Measured by ``sim.fast_gate.measure_held_fraction`` on an
# exact replica (Llama-3.1-8B shape, H2O at keep 0.2 with synthetic statistics, block
# size 16, the first 24 requests of the chat workload at seed 0, served at once); measure
# again for another policy, keep ratio or block size.
HELD_FRACTION = {"naive": 0.207, "block": 0.201}
MEASURED_AT = {"policy": "h2o", "keep_ratio": 0.2, "block_size": 16}  # HELD_FRACTION's run
# Policies whose kept count fast mode follows (a budget every step); SnapKV and PAGE
# compress once, at the end of prefill, which it does not model.
FAST_POLICIES = ("h2o", "tova", "scissorhands", "streaming_llm", "random", "none", None)

if TYPE_CHECKING:
    from sim.fast_plan import MacroPlan


@dataclass(slots=True)
class FastRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    hashes: tuple[int, ...]  # chained hashes of the full blocks of prompt + outputs
    computed: int = 0  # tokens whose KV exists (logical)
    output: int = 0  # output tokens sampled so far
    live: int = 0  # tokens kept (what attention reads before this step's new ones)
    held: int = 0  # blocks held (its shared prefix blocks included)
    shared: int = 0  # leading prompt blocks it shares through the prefix cache
    scheduled: bool = False  # scheduled at least once (its prefix hit is counted)
    cached: int = 0  # prompt tokens served by the prefix cache at first scheduling
    publishes: bool = True  # its full blocks enter the prefix cache (until it evicts)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.output


@dataclass(slots=True)
class FastState:
    """The vToken counters the metrics read from an exact replica's ``state``."""

    num_evictions_under_pressure: int = 0
    num_evictions_below_budget: int = 0


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``tokens`` (salted, as vLLM's)."""
    out, parent = [], hash(salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        out.append(parent)
    return tuple(out)


class FastReplica:
    """One engine on block counts (module docstring); the interface of ``ExactReplica``
    that the cluster loop and the metrics use."""

    def __init__(self, config: ReplicaConfig, engine: str) -> None:
        if engine not in FAST_ENGINES:
            raise ValueError(f"fast mode engines are {FAST_ENGINES}, got {engine!r}")
        vtoken = config.vtoken or {}
        if engine != "vanilla" and vtoken.get("keep_ratio") is None:
            raise ValueError(f"fast mode {engine!r} needs a keep_ratio in its vToken config")
        if vtoken.get("policy") not in FAST_POLICIES:
            raise ValueError(
                f"fast mode does not model policy {vtoken.get('policy')!r} (it follows "
                "policies that hold a budget every step); use --fidelity exact"
            )
        measured = {"policy": vtoken.get("policy"), "keep_ratio": vtoken.get("keep_ratio"),
                    "block_size": config.block_size}  # fmt: skip
        if engine in HELD_FRACTION and measured != MEASURED_AT:
            raise ValueError(
                f"fast mode's {engine!r} holds a share of vanilla's blocks measured at "
                f"{MEASURED_AT}, not {measured}: measure it again "
                "(sim.fast_gate.measure_held_fraction) or use --fidelity exact"
            )
        self.config = config
        self.engine = engine
        self.keep = float(vtoken.get("keep_ratio") or 1.0)
        self.bs = config.block_size
        self.scored = engine != "vanilla" and vtoken.get("policy") not in (None, "none")
        self.fraction = HELD_FRACTION.get(engine, 1.0)
        self.waiting: deque[FastRequest] = deque()
        self.running: list[FastRequest] = []
        self.requests: dict[str, FastRequest] = {}
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.private = 0  # blocks held by one request only
        self.refs: dict[int, int] = {}  # shared prefix blocks: hash -> running holders
        self.sharing = bool(config.enable_prefix_caching) and engine in ("vanilla", "on_demand")
        self.num_steps = 0
        self.num_preemptions = 0
        self.recomputed_tokens = 0
        self.state: FastState | None = None if engine == "vanilla" else FastState()
        self.macro: MacroPlan | None = None
        self.step_new: dict[str, int] = {}  # the step being scheduled: new tokens per request
        # KV slots the repack copies before the next step: vToken mode (eager, on_demand)
        # fills the holes its evictions leave below the live count (at most the kept).
        self.pending_moves = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.free

    @property
    def free(self) -> int:
        return self.config.num_blocks - self.private - len(self.refs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        arrival_time: float = 0.0,
        output_tokens: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request of ``max_tokens`` outputs (``output_tokens``: the tokens it
        emits, whose blocks a later prompt may find in the cache)."""
        del arrival_time  # FCFS is the order of the calls
        check_request(self.config, request_id, prompt, max_tokens)
        if request_id in self.requests:
            raise ValueError(f"request {request_id} is already queued")
        hashes: tuple[int, ...] = ()
        if self.config.enable_prefix_caching:
            hashes = block_hashes((*prompt, *(output_tokens or ())), self.bs, cache_salt)
        request = FastRequest(request_id, len(prompt), max_tokens, hashes)
        # Eager engines evict from the first chunk on (workers/prefix_cache.py: a request
        # publishes nothing past its first eviction): nothing of theirs is cached.
        request.publishes = self.engine in ("vanilla", "on_demand")
        self.requests[request_id] = request
        self.waiting.append(request)

    # -- what a request holds ---------------------------------------------------------

    def budget(self, computed: int) -> int:
        return math.ceil(self.keep * computed)

    def _kept(self, request: FastRequest) -> int:
        """Tokens kept after the step that computed ``request.computed`` tokens."""
        if self.engine in ("vanilla", "on_demand"):
            return request.live
        return min(request.computed, self.budget(request.computed))

    def _need(self, request: FastRequest, new: int) -> int:
        """Blocks ``request`` holds once ``new`` more tokens are allocated."""
        blocks = -(-(request.live + new) // self.bs)
        if self.engine in ("naive", "block"):
            return max(blocks, self._share_of_vanilla(request.computed + new))
        return blocks

    def _share_of_vanilla(self, tokens: int) -> int:
        """Naive and block: ``HELD_FRACTION`` of the blocks vanilla holds for ``tokens``."""
        return math.ceil(self.fraction * -(-tokens // self.bs))

    # -- the step ---------------------------------------------------------------------

    def step(self) -> StepRecord | None:
        """One engine step (``None`` when nothing is left to schedule)."""
        if not self.running and not self.waiting:
            return None
        tokens = self.config.max_num_batched_tokens
        scheduled: list[tuple[FastRequest, int]] = []
        self.step_new = {}  # this step's new tokens per request scheduled so far
        preempted = False
        index = 0
        while index < len(self.running) and tokens > 0:
            request = self.running[index]
            new = min(request.num_tokens - request.computed, tokens)
            if not self._allocate(request, new, index):
                preempted = True
                if request not in self.running:  # it preempted itself
                    break
                continue  # retry after the preemption freed blocks
            scheduled.append((request, new))
            self.step_new[request.request_id] = new
            tokens -= new
            index += 1
        if not preempted:
            while self.waiting and tokens > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                self._prefix_hit(request)  # it holds nothing: what is cached now
                new = min(request.num_tokens - request.computed, tokens)
                need = self._need(request, new) - self._warm_hits(request)
                if need > self.free:
                    if not self._relieve(need, None):
                        break
                    # Relief releases and unpublishes the evicted requests' blocks: the
                    # head's hit and the blocks it shares with them, counted again.
                    self._prefix_hit(request)
                    new = min(request.num_tokens - request.computed, tokens)
                    need = self._need(request, new) - self._warm_hits(request)
                    if need > self.free:
                        break
                self.waiting.popleft()
                request.scheduled = True
                self._share(request, request.computed // self.bs)
                self._take(request, new)
                self.running.append(request)
                scheduled.append((request, new))
                self.step_new[request.request_id] = new
                tokens -= new
        if not scheduled:
            return _empty_record()
        return self._finish_step(scheduled)

    def _allocate(self, request: FastRequest, new: int, index: int) -> bool:
        need = self._need(request, new) - request.held
        while need > self.free:
            if self._relieve(need, request):
                break
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        self._take(request, new)
        return True

    def _take(self, request: FastRequest, new: int) -> None:
        held = self._need(request, new)
        self.private += held - request.held
        request.held = held

    def _warm_hits(self, request: FastRequest) -> int:
        """Prefix-hit blocks a running request holds already (they cost no free block)."""
        if not self.sharing:
            return 0
        hits = request.computed // self.bs
        return sum(1 for key in request.hashes[request.shared : hits] if key in self.refs)

    def _share(self, request: FastRequest, blocks: int) -> None:
        """``request``'s first ``blocks`` prompt blocks become shared (held once)."""
        if not self.sharing or blocks <= request.shared:
            return
        for key in request.hashes[request.shared : blocks]:
            self.refs[key] = self.refs.get(key, 0) + 1
        added = blocks - request.shared
        request.shared = blocks
        if request.held >= blocks:  # they were counted as its own
            self.private -= added
        else:  # a prefix hit at admission: held counts them from now on
            request.held += added

    def _release(self, request: FastRequest) -> None:
        """Return ``request``'s blocks (preempted, finished or evicted below its hits)."""
        for key in request.hashes[: request.shared]:
            count = self.refs[key] - 1
            if count:
                self.refs[key] = count
            else:
                del self.refs[key]
        self.private -= request.held - request.shared
        request.held = request.shared = 0

    def _relieve(self, need: int, asking: FastRequest | None) -> bool:
        """``on_demand``: evict running requests to their budgets (most blocks freed
        first) until ``need`` blocks are free; True if they are."""
        if self.engine != "on_demand":
            return False
        gains = []
        for request in self.running:
            kept = min(request.live, self.budget(request.computed))
            # what it computes this step still needs room: scheduled already, or asking
            new = self.step_new.get(request.request_id, int(request is asking))
            blocks = -(-(kept + new) // self.bs)
            if request.held - blocks > 0:
                gains.append((request.held - blocks, kept, blocks, request))
        gains.sort(key=lambda g: -g[0])
        assert self.state is not None
        for _, kept, blocks, request in gains:
            if need <= self.free:
                break
            self._release(request)  # its shared blocks are repacked: its own from now on
            self._unpublish(request)
            self.pending_moves += min(request.live - kept, kept)
            request.live = kept
            request.held = blocks
            self.private += blocks
            self.state.num_evictions_under_pressure += 1
        return need <= self.free

    def _unpublish(self, request: FastRequest) -> None:
        """An evicting request's blocks leave the cache (those other requests hold stay)
        and it publishes nothing more (``workers/prefix_cache.py``)."""
        request.publishes = False
        for key in request.hashes[: request.computed // self.bs]:
            if key not in self.refs:
                self.cache.pop(key, None)

    def _preempt(self, request: FastRequest) -> None:
        self.running.remove(request)
        self.num_preemptions += 1
        self.recomputed_tokens += request.computed
        self._release(request)
        request.computed = request.live = 0
        self.waiting.appendleft(request)

    def _prefix_hit(self, request: FastRequest) -> None:
        """A waiting request's cached prompt blocks (again after a preemption, as vLLM)."""
        hits = 0
        usable = (request.prompt_len - 1) // self.bs
        for key in request.hashes[:usable]:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            hits += 1
        request.computed = request.live = hits * self.bs
        if not request.scheduled:
            request.cached = request.computed

    def _insert(self, hashes: Sequence[int]) -> None:
        cache = self.cache
        for key in hashes:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > self.config.num_blocks:
            cache.popitem(last=False)

    def _finish_step(self, scheduled: list[tuple[FastRequest, int]]) -> StepRecord:
        prefill = decode = context = live = held = pairs = scored = 0
        first: list[str] = []
        cached: dict[str, int] = {}
        outputs: dict[str, int] = {}
        finished: list[str] = []
        moves, self.pending_moves = self.pending_moves, 0
        for request, new in scheduled:
            in_prompt = request.computed < request.prompt_len
            request.computed += new
            request.live += new
            reads = request.live
            context += request.computed
            prefill += new if in_prompt else 0
            decode += 0 if in_prompt else new
            live += reads
            pairs += new * reads
            held += request.held
            scored += reads if self.scored else 0
            if request.publishes:  # vLLM caches each block as it fills, outputs included
                self._insert(
                    request.hashes[
                        (request.computed - new) // self.bs : request.computed // self.bs
                    ]
                )
                if in_prompt and request.live == request.computed:
                    self._share(request, min(request.computed, request.prompt_len) // self.bs)
            if request.computed >= request.num_tokens:
                if request.output == 0:
                    first.append(request.request_id)
                    cached[request.request_id] = request.cached
                request.output += 1
                outputs[request.request_id] = request.output
                if request.output >= request.max_tokens:
                    finished.append(request.request_id)
                    continue
            self._evict(request)
        for request_id in finished:
            request = self.requests.pop(request_id)
            self.running.remove(request)
            self._release(request)
        self.num_steps += 1
        return StepRecord(
            prefill_tokens=prefill,
            decode_tokens=decode,
            num_requests=len(scheduled),
            context_tokens=context,
            live_tokens=live,
            held_blocks=held,
            attention_pairs=pairs,
            num_moves=moves,
            scored_tokens=scored,
            finished=tuple(finished),
            first_tokens=tuple(first),
            cached_tokens=cached,
            num_output_tokens=outputs,
        )

    def _evict(self, request: FastRequest) -> None:
        """After the step: eager, naive and block keep their budgets."""
        kept = self._kept(request)
        if kept < request.live:
            if self.engine == "eager":
                self.pending_moves += min(request.live - kept, kept)
            request.live = kept
            if self.engine != "on_demand":
                held = -(-kept // self.bs)
                if self.engine != "eager":
                    held = max(held, self._share_of_vanilla(request.computed))
                self.private -= request.held - held
                request.held = held


def _empty_record() -> StepRecord:
    return StepRecord(0, 0, 0, 0, 0, 0, 0, 0, 0, (), ())
