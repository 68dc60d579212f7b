"""One engine of `vtoken bench serve` and one trial on it: the open-loop clock, the SLO
bookkeeping and every request's outcome.

**Clock.** One thread adds every request whose arrival time has come, then runs one engine
step; the clock advances by the step's measured wall time. When the engine is idle the
clock jumps to the next arrival instead of sleeping (what a server would see, without the
wait). A request's TTFT runs from its arrival to the end of the step that produced its
first token; its TPOT is the time from the first to the last token over the tokens after
the first.

**Outcomes.** Every finished request of a trial is kept (``Outcome``, in the JSON's
``per_rate[].outcomes``): its lengths, arrival, TTFT, TPOT and end to end, whether it met
the SLO and which bound it missed, how often vLLM preempted it, and the tokens vToken
evicted from it (its ``RequestReport`` when it finished: a preempted request restarts with
a fresh table, so only the evictions of its last run count; ``None`` on vanilla).
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.common import SLO_ATTAINMENT, Quantiles, Slo
from bench.serve_workloads import Workload

BLOCK_SIZE = 32
MAX_NUM_SEQS = 64
# The engine-wide vToken section of each kind (the policy is per request); ``None``: vLLM
# without vToken. The order is the JSON's and the figure's.
ENGINE_CONFIGS: dict[str, dict[str, str] | None] = {
    "vanilla": None,
    "naive": {"policy": "none", "mode": "naive", "eviction": "eager"},
    "block": {"policy": "none", "mode": "block", "eviction": "eager"},
    "eager": {"policy": "none", "eviction": "eager"},
    "on_demand": {"policy": "none", "eviction": "on_demand"},
}
ENGINES = tuple(ENGINE_CONFIGS)


class ServeEngine:
    """One in-process engine of a kind, with vLLM's preemptions counted per request."""

    def __init__(
        self,
        path: str,
        kind: str,
        num_blocks: int,
        max_len: int,
        max_num_batched_tokens: int,
        policy: dict[str, Any] | None = None,
        **args: Any,
    ) -> None:
        from workers.engine import block_pool, engine_scheduler, engine_state, make_llm

        self.kind = kind
        self.num_blocks = num_blocks
        config = ENGINE_CONFIGS[kind]
        # The policy is the engine's own: a request's override would be a tenant's cap
        # to the engine, which it holds at every step whatever the eviction mode.
        self.llm = make_llm(
            path,
            None if config is None else config | (policy or {}),
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            max_model_len=max_len + BLOCK_SIZE,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=max_num_batched_tokens,
            **args,
        )
        self.engine = self.llm.llm_engine
        self.pool = block_pool(self.llm)
        self.state = engine_state(self.llm)
        self.preemptions: Counter[str] = Counter()  # engine-core request id -> count
        self.num_preemptions = 0
        scheduler = engine_scheduler(self.llm)
        original = scheduler._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.num_preemptions += 1
            self.preemptions[request.request_id] += 1
            return original(request, *args, **kwargs)

        scheduler._preempt_request = counting
        self.peak_blocks = 0
        schedule = scheduler.schedule

        def scheduling(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)  # blocks are allocated here, freed on update
            self.peak_blocks = max(self.peak_blocks, self.used_blocks)
            return output

        scheduler.schedule = scheduling

    def warm_up(self, workload: Workload) -> None:
        """Serve the workload's first request once, unmeasured (first-call costs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        turn = workload.sessions[0].turns[0]
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        self.engine.add_request("warm-up", TokensPrompt(prompt_token_ids=list(turn.user)), params)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def evicted_tokens(self, internal_id: str) -> int | None:
        """Tokens vToken evicted from a request that just finished (``None`` on vanilla)."""
        if self.state is None:
            return None
        report = self.state.request_report(internal_id)
        return None if report is None else report.evicted_tokens

    @property
    def used_blocks(self) -> int:
        # vLLM's pool keeps one placeholder block that is never handed out
        return self.num_blocks - 1 - self.pool.get_num_free_blocks()

    def close(self) -> None:
        del self.llm, self.engine, self.pool, self.state
        gc.collect()  # the engine's shutdown must finish before the next one starts


# ---------------------------------------------------------------- one trial


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request of a trial. ``request``: ``s<session>t<turn>`` (the same
    request in every trial of a workload); ``arrival_s`` from the trial's start;
    ``tpot_s`` ``None`` for a single output token; ``met_slo`` ``None`` when the trial had
    no SLO, else whether both bounds held, ``missed`` the bounds that did not
    (``ttft``, ``tpot``); ``preemptions`` by vLLM; ``evicted_tokens`` by vToken (see the
    module's docstring)."""

    request: str
    session: int
    turn: int
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    met_slo: bool | None
    missed: list[str]
    preemptions: int
    evicted_tokens: int | None


def judge(slo: Slo | None, ttft_s: float, tpot_s: float | None, prompt_len: int) -> list[str]:
    """The bounds of ``slo`` a request missed (``ttft``, ``tpot``); none without an SLO."""
    if slo is None:
        return []
    missed = ["ttft"] if ttft_s > slo.ttft_s(prompt_len) else []
    return missed + (["tpot"] if tpot_s is not None and tpot_s > slo.tpot_s else [])


@dataclass(slots=True)
class _InFlight:
    session: int
    turn: int
    arrival: float
    context: list[int]  # the prompt this turn was sent with
    internal_id: str  # the engine core's id of the request
    first: float | None = None


@dataclass(frozen=True, slots=True)
class TrialSummary:
    """One trial's figures in the JSON (``per_rate``). A trial stopped early has no
    attainment or latencies: its attainment is only known to be below ``SLO_ATTAINMENT``
    and its latencies would cover the fast requests only; its ``outcomes`` are the
    requests that finished before it stopped."""

    rate: float
    passed: bool
    slo_attainment: float | None
    requests: int
    finished: int
    stopped_early: bool
    ttft_s: Quantiles
    tpot_s: Quantiles
    e2e_s: Quantiles
    preempted_requests: int
    preemptions: int
    peak_blocks: int
    outcomes: list[Outcome]


@dataclass(slots=True)
class Trial:
    rate: float
    outcomes: list[Outcome] = field(default_factory=list)
    met: int = 0
    missed: int = 0
    total: int = 0
    stopped_early: bool = False
    preemptions: int = 0
    peak_blocks: int = 0

    @property
    def attainment(self) -> float:
        """Share of the trial's requests that met the SLO (an upper bound when stopped)."""
        if self.stopped_early:
            return 1.0 - self.missed / self.total
        return self.met / self.total if self.total else 1.0

    @property
    def passed(self) -> bool:
        return self.attainment >= SLO_ATTAINMENT

    def summary(self) -> TrialSummary:
        """The trial's figures (``None`` where it stopped early)."""

        def quantiles(values: list[float | None]) -> Quantiles:
            known = [v for v in values if v is not None]
            return Quantiles() if self.stopped_early else Quantiles.of(known)

        return TrialSummary(
            rate=round(self.rate, 6),
            passed=self.passed,
            slo_attainment=None if self.stopped_early else round(self.attainment, 4),
            requests=self.total,
            finished=len(self.outcomes),
            stopped_early=self.stopped_early,
            ttft_s=quantiles([o.ttft_s for o in self.outcomes]),
            tpot_s=quantiles([o.tpot_s for o in self.outcomes]),
            e2e_s=quantiles([o.e2e_s for o in self.outcomes]),
            preempted_requests=sum(o.preemptions > 0 for o in self.outcomes),
            preemptions=self.preemptions,
            peak_blocks=self.peak_blocks,
            outcomes=self.outcomes,
        )


def run_trial(
    engine: ServeEngine,
    workload: Workload,
    rate: float,
    slo: Slo | None,
    tag: str,
    stop_early: bool = False,
) -> Trial:
    """Serve ``workload`` at ``rate`` conversations per second on ``engine`` (see the
    module's docstring for the clock). ``stop_early``: abort the trial once more than
    ``1 - SLO_ATTAINMENT`` of its requests have missed the SLO (its pass/fail is then known)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    trial = Trial(rate=rate, total=workload.num_requests)
    allowed = math.floor((1.0 - SLO_ATTAINMENT) * trial.total + 1e-9)
    preemptions_before = engine.num_preemptions
    engine.peak_blocks = 0
    arrivals: list[tuple[float, int, int, list[int]]] = [
        (s.start / rate, i, 0, []) for i, s in enumerate(workload.sessions)
    ]
    heapq.heapify(arrivals)
    in_flight: dict[str, _InFlight] = {}
    waiting_missed: set[str] = set()
    now = 0.0
    while arrivals or in_flight:
        if not in_flight and arrivals[0][0] > now:
            now = arrivals[0][0]  # idle: jump to the next arrival
        while arrivals and arrivals[0][0] <= now:
            arrival, index, turn_index, history = heapq.heappop(arrivals)
            turn = workload.sessions[index].turns[turn_index]
            context = history + list(turn.user)
            params = SamplingParams(max_tokens=turn.max_tokens, temperature=0, ignore_eos=True)
            request_id = f"{tag}s{index}t{turn_index}"
            internal = engine.engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=context), params
            )
            in_flight[request_id] = _InFlight(index, turn_index, arrival, context, internal)
        if not engine.engine.has_unfinished_requests():
            raise RuntimeError(f"the engine lost requests {sorted(in_flight)}")
        started = time.perf_counter()
        outputs = engine.engine.step()
        now += time.perf_counter() - started
        for output in outputs:
            record = in_flight.get(output.request_id)
            if record is None:
                continue
            tokens = output.outputs[0].token_ids
            if record.first is None and tokens:
                record.first = now
            if not output.finished:
                continue
            del in_flight[output.request_id]
            waiting_missed.discard(output.request_id)
            outcome = _outcome(engine, record, len(tokens), now, slo)
            trial.outcomes.append(outcome)
            trial.met += not outcome.missed
            trial.missed += bool(outcome.missed)
            session = workload.sessions[record.session]
            if record.turn + 1 < len(session.turns):
                history = record.context + list(tokens)
                heapq.heappush(
                    arrivals, (now + session.think_s, record.session, record.turn + 1, history)
                )
        if slo is not None and stop_early:  # waiting past the TTFT SLO: already missed
            for request_id, record in in_flight.items():
                if record.first is None and now - record.arrival > slo.ttft_s(len(record.context)):
                    waiting_missed.add(request_id)
            if trial.missed + len(waiting_missed) > allowed:
                trial.missed += len(waiting_missed)
                trial.stopped_early = True
                engine.engine.abort_request(list(in_flight))  # external ids
                break
    trial.preemptions = engine.num_preemptions - preemptions_before
    trial.peak_blocks = engine.peak_blocks
    return trial


def _outcome(
    engine: ServeEngine, record: _InFlight, num_tokens: int, now: float, slo: Slo | None
) -> Outcome:
    """The outcome of ``record``'s request, finished at ``now`` with ``num_tokens``."""
    assert record.first is not None, "a finished request has produced its first token"
    ttft = record.first - record.arrival
    tpot = (now - record.first) / (num_tokens - 1) if num_tokens > 1 else None
    missed = judge(slo, ttft, tpot, len(record.context))
    return Outcome(
        request=f"s{record.session}t{record.turn}",
        session=record.session,
        turn=record.turn,
        prompt_tokens=len(record.context),
        output_tokens=num_tokens,
        arrival_s=round(record.arrival, 4),
        ttft_s=round(ttft, 4),
        tpot_s=None if tpot is None else round(tpot, 5),
        e2e_s=round(now - record.arrival, 4),
        met_slo=None if slo is None else not missed,
        missed=missed,
        preemptions=engine.preemptions[record.internal_id],
        evicted_tokens=engine.evicted_tokens(record.internal_id),
    )
