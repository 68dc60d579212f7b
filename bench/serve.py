"""`vtoken bench serve`: SLA goodput of vanilla vLLM, Naive-Evict and vToken on one KV pool.

An open-loop serving benchmark on in-process vLLM engines (the CPU build here; nothing in
it is CPU-specific). Requests arrive by a Poisson process; each engine serves the same
arrivals on the same pool of KV blocks, one engine at a time:

- ``vanilla``: vLLM without a vToken config (it preempts and recomputes under pressure);
- ``naive``: Naive-Evict, the policy's decisions every step, every block that still holds
  a live token kept (what a block-granular manager can free);
- ``eager``: vToken, the same decisions every step, live tokens repacked, emptied blocks
  freed;
- ``on_demand``: vToken, tokens kept until memory is needed, then running requests
  evicted to their budget instead of preempted (the serving default).

The policy rides on each request (``extra_args["vtoken_policy"]``), so one engine per kind
serves every policy.

**Workloads** (seeded; the seed and every parameter go into the JSON):

- ``single``: prompts cut from CPython's own documentation (``pydoc_data.topics``), lengths
  from a Pareto distribution (shape ``PARETO_SHAPE``) truncated to [min, max] prompt tokens,
  outputs uniform in [min, max] new tokens (``ignore_eos``: every engine generates the same
  count);
- ``chat``: multi-turn conversations; each turn's prompt is the whole conversation so far
  (earlier prompts and the engine's own answers) plus a new user message; the next turn
  arrives a think time after the previous answer ends. Rates are conversations per second.

**Clock.** One thread adds every request whose arrival time has come, then runs one engine
step; the clock advances by the step's measured wall time. When the engine is idle the
clock jumps to the next arrival instead of sleeping (what a server would see, without the
wait). A request's TTFT runs from its arrival to the end of the step that produced its
first token; its TPOT is the time from the first to the last token over the tokens after
the first.

**SLOs and goodput.** At the start of a run the vanilla engine serves
``UNLOADED_REQUESTS`` prompts of the workload one at a time; the SLOs are
``TTFT_SLO_FACTOR`` x its TTFT at the request's prompt length (a line fitted through the
measurements, see ``unloaded_slo``) and ``TPOT_SLO_FACTOR`` x its p50 TPOT
(``bench.common``). A request meets
the SLO when both hold. Goodput (DistServe's definition) is the highest rate at which at least
``SLO_ATTAINMENT`` of the requests meet it: every rate of the sweep is run (the attainment
curve), then the rate is bisected (geometrically) between the highest passing rate and the
first failing one. A trial stops as soon as more than ``1 - SLO_ATTAINMENT`` of its requests
have missed (its attainment is then the upper bound ``1 - missed / requests``), which keeps
overloaded trials short.
"""

from __future__ import annotations

import gc
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import (
    SLO_ATTAINMENT,
    TPOT_SLO_FACTOR,
    TTFT_SLO_FACTOR,
    Quantiles,
    Slo,
    csv_floats,
    csv_items,
    doc_tokens,
    pyplot,
    ratio,
    save_figure,
    write_json,
)

ENGINES = ("vanilla", "naive", "eager", "on_demand")
VTOKEN_ENGINES = {  # the engine-wide vToken section of each kind (the policy is per request)
    "naive": {"policy": "none", "mode": "naive", "eviction": "eager"},
    "eager": {"policy": "none", "eviction": "eager"},
    "on_demand": {"policy": "none", "eviction": "on_demand"},
}
POLICIES = ("h2o:0.2", "h2o:0.5", "snapkv:0.2")
WORKLOADS = ("single", "chat")
BLOCK_SIZE = 32
UNLOADED_REQUESTS = 8
PARETO_SHAPE = 1.2
MAX_NUM_SEQS = 64


@dataclass(frozen=True, slots=True)
class WorkloadPreset:
    """Token ranges (inclusive) of the workloads: single-turn prompts, outputs, chat user
    messages, turns per conversation, and the longest conversation."""

    prompt_tokens: tuple[int, int]
    new_tokens: tuple[int, int]
    user_tokens: tuple[int, int]
    turns: tuple[int, int]
    max_context: int


FULL = WorkloadPreset((128, 2048), (32, 256), (32, 256), (2, 6), 2048 + 256)
QUICK = WorkloadPreset((64, 256), (8, 16), (32, 96), (2, 3), 512)


# ---------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class Turn:
    user: tuple[int, ...]  # the new prompt tokens of this turn
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation (a single request when it has one turn). ``start`` is its first
    arrival at one conversation per second; a trial at rate ``r`` scales it by ``1 / r``."""

    start: float
    turns: tuple[Turn, ...]
    think_s: float = 0.0

    def context_len(self, turns: int) -> int:
        """Tokens the prompt of turn ``turns`` (0-based) carries."""
        done = self.turns[:turns]
        return sum(len(t.user) + t.max_tokens for t in done) + len(self.turns[turns].user)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any]

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt and output) of any request."""
        return max(s.context_len(len(s.turns) - 1) + s.turns[-1].max_tokens for s in self.sessions)


def truncated_pareto(rng: random.Random, low: int, high: int, shape: float) -> int:
    """A Pareto(``shape``) length conditioned on ``[low, high]`` (inverse CDF)."""
    tail = (low / high) ** shape
    return min(high, int(low / (1.0 - rng.random() * (1.0 - tail)) ** (1.0 / shape)))


def single_workload(
    corpus: Sequence[int],
    count: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    sessions, clock = [], 0.0
    for _ in range(count):
        clock += rng.expovariate(1.0)
        length = truncated_pareto(rng, *prompt_range, PARETO_SHAPE)
        start = rng.randrange(len(corpus) - length)
        turn = Turn(tuple(corpus[start : start + length]), rng.randint(*output_range))
        sessions.append(Session(clock, (turn,)))
    params = {
        "requests": count,
        "prompt_tokens": list(prompt_range),
        "new_tokens": list(output_range),
        "prompt_distribution": f"pareto(shape={PARETO_SHAPE}) truncated to prompt_tokens",
        "seed": seed,
    }
    return Workload("single", tuple(sessions), params)


def chat_workload(
    corpus: Sequence[int],
    count: int,
    turns: tuple[int, int],
    user_range: tuple[int, int],
    output_range: tuple[int, int],
    max_context: int,
    think_s: float,
    seed: int,
) -> Workload:
    """``count`` conversations of ``turns`` turns (fewer when the context would pass
    ``max_context``), user messages and answers of uniform lengths."""
    rng = random.Random(seed)
    sessions, clock = [], 0.0
    for _ in range(count):
        clock += rng.expovariate(1.0)
        chosen: list[Turn] = []
        context = 0
        for _ in range(rng.randint(*turns)):
            length = rng.randint(*user_range)
            answer = rng.randint(*output_range)
            if context + length + answer > max_context:
                break
            start = rng.randrange(len(corpus) - length)
            chosen.append(Turn(tuple(corpus[start : start + length]), answer))
            context += length + answer
        if chosen:  # a conversation whose first turn would not fit is left out
            sessions.append(Session(clock, tuple(chosen), think_s))
    params = {
        "conversations": count,
        "turns": list(turns),
        "user_tokens": list(user_range),
        "new_tokens": list(output_range),
        "max_context": max_context,
        "think_s": think_s,
        "seed": seed,
    }
    return Workload("chat", tuple(sessions), params)


# ---------------------------------------------------------------- one engine


class ServeEngine:
    """One in-process engine of a kind, with vLLM's preemptions counted per request."""

    def __init__(self, path: str, kind: str, num_blocks: int, max_len: int, **args: Any) -> None:
        from workers.engine import block_pool, engine_scheduler, make_llm

        self.kind = kind
        self.num_blocks = num_blocks
        self.llm = make_llm(
            path,
            VTOKEN_ENGINES.get(kind),
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            max_model_len=max_len + BLOCK_SIZE,
            max_num_seqs=MAX_NUM_SEQS,
            **args,
        )
        self.engine = self.llm.llm_engine
        self.pool = block_pool(self.llm)
        self.preempted: set[str] = set()
        self.num_preemptions = 0
        scheduler = engine_scheduler(self.llm)
        original = scheduler._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.num_preemptions += 1
            self.preempted.add(request.request_id)
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

    @property
    def used_blocks(self) -> int:
        # vLLM's pool keeps one placeholder block that is never handed out
        return self.num_blocks - 1 - self.pool.get_num_free_blocks()

    def close(self) -> None:
        del self.llm, self.engine, self.pool
        gc.collect()  # the engine's shutdown must finish before the next one starts


# ---------------------------------------------------------------- one trial


@dataclass(frozen=True, slots=True)
class Outcome:
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prompt_len: int
    preempted: bool

    def meets(self, slo: Slo) -> bool:
        return slo.meets(self.ttft_s, self.tpot_s, self.prompt_len)


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
    and its latencies would cover the fast requests only."""

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

        def quantiles(values: list[float]) -> Quantiles:
            return Quantiles() if self.stopped_early else Quantiles.of(values)

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
            preempted_requests=sum(o.preempted for o in self.outcomes),
            preemptions=self.preemptions,
            peak_blocks=self.peak_blocks,
        )


def run_trial(
    engine: ServeEngine,
    workload: Workload,
    rate: float,
    slo: Slo | None,
    policy: dict[str, Any] | None,
    tag: str,
    stop_early: bool = False,
) -> Trial:
    """Serve ``workload`` at ``rate`` conversations per second on ``engine`` (see the
    module's docstring for the clock). ``stop_early``: abort the trial once more than
    ``1 - SLO_ATTAINMENT`` of its requests have missed the SLO (its pass/fail is then known)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"vtoken_policy": policy} if policy is not None and engine.kind != "vanilla" else None
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
            params = SamplingParams(
                max_tokens=turn.max_tokens, temperature=0, ignore_eos=True, extra_args=extra
            )
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
            assert record.first is not None
            outcome = Outcome(
                ttft_s=record.first - record.arrival,
                tpot_s=(now - record.first) / max(1, len(tokens) - 1),
                e2e_s=now - record.arrival,
                prompt_len=len(record.context),
                preempted=record.internal_id in engine.preempted,
            )
            trial.outcomes.append(outcome)
            met = slo is None or outcome.meets(slo)
            trial.met += met
            trial.missed += not met
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


# ---------------------------------------------------------------- SLOs and goodput


@dataclass(frozen=True, slots=True)
class TtftFit:
    """The unloaded TTFT line: ``base_s + per_token_s * prompt tokens``."""

    base_s: float
    per_token_s: float


@dataclass(frozen=True, slots=True)
class UnloadedSlo:
    """How the SLOs were set (the JSON's ``slo``): the unloaded measurements, the factors,
    the bounds (rounded) and the attainment goodput asks for."""

    unloaded_requests: int
    unloaded_prompt_tokens: list[int]
    unloaded_ttft_s: list[float]
    unloaded_ttft_p50_s: float
    unloaded_ttft_fit: TtftFit
    unloaded_tpot_p50_s: float
    ttft_factor: float
    tpot_factor: float
    ttft_slo_base_s: float
    ttft_slo_per_token_s: float
    tpot_slo_s: float
    attainment: float


def unloaded_slo(engine: ServeEngine, workload: Workload, count: int) -> tuple[UnloadedSlo, Slo]:
    """SLOs from the vanilla engine serving ``count`` requests one at a time, their prompt
    lengths spread over the workload's (evenly spaced in its sorted lengths).

    TPOT: ``TPOT_SLO_FACTOR`` x the p50. TTFT: ``TTFT_SLO_FACTOR`` x the unloaded TTFT *of
    the request's prompt length*, from a least-squares line through the measurements:
    prefill time grows with the prompt, and an absolute bound of ``TTFT_SLO_FACTOR`` x the
    p50 would be missed by every long prompt of a long-tailed workload on an idle engine.
    """
    import numpy as np

    by_length = sorted(workload.sessions, key=lambda s: len(s.turns[0].user))
    picks = [by_length[round(i * (len(by_length) - 1) / (count - 1))] for i in range(count)]
    probe = Workload(
        workload.name,
        tuple(Session(float(i), (s.turns[0],)) for i, s in enumerate(picks)),
        workload.params,
    )
    engine.warm_up(workload)
    trial = run_trial(engine, probe, 1e-6, None, None, "unloaded")
    lengths = np.array([o.prompt_len for o in trial.outcomes], dtype=np.float64)
    ttfts = np.array([o.ttft_s for o in trial.outcomes])
    per_token, base = np.polyfit(lengths, ttfts, 1)
    per_token = max(0.0, float(per_token))
    base = max(float(base), float(ttfts.min()) - per_token * float(lengths.min()), 1e-3)
    tpot = float(np.median([o.tpot_s for o in trial.outcomes]))
    slo = Slo.from_unloaded(base, per_token, tpot)
    report = UnloadedSlo(
        unloaded_requests=count,
        unloaded_prompt_tokens=[int(n) for n in lengths],
        unloaded_ttft_s=[round(float(t), 4) for t in ttfts],
        unloaded_ttft_p50_s=round(float(np.median(ttfts)), 4),
        unloaded_ttft_fit=TtftFit(round(base, 5), round(per_token, 7)),
        unloaded_tpot_p50_s=round(tpot, 4),
        ttft_factor=TTFT_SLO_FACTOR,
        tpot_factor=TPOT_SLO_FACTOR,
        ttft_slo_base_s=round(slo.ttft_base_s, 5),
        ttft_slo_per_token_s=round(slo.ttft_per_token_s, 7),
        tpot_slo_s=round(slo.tpot_s, 4),
        attainment=SLO_ATTAINMENT,
    )
    return report, slo


def search_goodput(
    trial_at: Callable[[float, bool], Trial], rates: Sequence[float], bisect_steps: int
) -> tuple[float, str, list[Trial]]:
    """Goodput from the sweep ``rates`` (run to the end: the attainment curve) and
    ``bisect_steps`` geometric bisections (stopped as soon as they fail):
    ``(rate, bound, trials)``. ``bound``: ``bisected`` (between a passing rate and a failing
    one), ``bracketed`` (the same without bisection steps), ``at_least`` (every rate
    passed) or ``below_lowest`` (the lowest failed: goodput 0). The curve is taken as
    monotone: the search starts below the first failing rate of the sweep."""
    trials = [trial_at(rate, False) for rate in sorted(rates)]
    first_fail = next((t.rate for t in trials if not t.passed), None)
    passing = [t.rate for t in trials if t.passed and (first_fail is None or t.rate < first_fail)]
    if not passing:
        return 0.0, "below_lowest", trials
    low = max(passing)
    if first_fail is None:
        return low, "at_least", trials
    high = first_fail
    for _ in range(bisect_steps):
        middle = math.sqrt(low * high)
        trial = trial_at(middle, True)
        trials.append(trial)
        low, high = (middle, high) if trial.passed else (low, middle)
    return low, "bisected" if bisect_steps else "bracketed", trials


# ---------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class Case:
    engine: str
    policy: str
    keep: float | None


def cases(engines: Sequence[str], policies: Sequence[tuple[str, float]]) -> Iterator[Case]:
    if "vanilla" in engines:
        yield Case("vanilla", "none", None)
    for engine in engines:
        if engine != "vanilla":
            for name, keep in policies:
                yield Case(engine, name, keep)


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One row of the results: a case on one workload, its goodput (``goodput_bound``: see
    ``search_goodput``), its attainment curve over the sweep (keyed by rate) and every
    trial's figures, by rate."""

    engine: str
    policy: str
    keep: float | None
    workload: str
    goodput_rps: float
    goodput_bound: str
    slo_attainment: dict[str, float]
    preemptions: int
    preempted_requests: int
    peak_blocks: int
    per_rate: list[TrialSummary]


@dataclass(frozen=True, slots=True)
class GoodputRatio:
    """A vToken engine's goodput over Naive-Evict's (same policy) and vanilla's; ``exact``:
    both goodputs were bisected (otherwise the ratio is only a bound)."""

    engine: str
    policy: str
    keep: float | None
    workload: str
    vtoken_over_naive: float | None
    vtoken_over_naive_exact: bool
    vtoken_over_vanilla: float | None
    vtoken_over_vanilla_exact: bool


def serve_case(
    engine: ServeEngine,
    case: Case,
    workload: Workload,
    slo: Slo,
    rates: Sequence[float],
    bisect_steps: int,
    bar: Any,
) -> CaseResult:
    """One row of the results: ``case`` on ``engine``, its goodput and attainment curve."""
    policy = None if case.keep is None else {"policy": case.policy, "keep_ratio": case.keep}

    def trial_at(rate: float, stop_early: bool) -> Trial:
        tag = f"{case.policy}{case.keep}{workload.name}{rate:.6f}-"
        trial = run_trial(engine, workload, rate, slo, policy, tag, stop_early)
        bar.set_postfix_str(
            f"{case.engine} {case.policy} {workload.name} {rate:.3g}/s: "
            f"{'pass' if trial.passed else 'fail'}"
        )
        bar.update()
        return trial

    goodput, bound, trials = search_goodput(trial_at, rates, bisect_steps)
    sweep = trials[: len(rates)]  # the same rates for every engine, each run to the end
    return CaseResult(
        engine=case.engine,
        policy=case.policy,
        keep=case.keep,
        workload=workload.name,
        goodput_rps=round(goodput, 4),
        goodput_bound=bound,
        slo_attainment={f"{t.rate:g}": round(t.attainment, 4) for t in sweep},
        preemptions=sum(t.preemptions for t in sweep),
        preempted_requests=sum(o.preempted for t in sweep for o in t.outcomes),
        peak_blocks=max(t.peak_blocks for t in sweep),
        per_rate=[t.summary() for t in sorted(trials, key=lambda t: t.rate)],
    )


def run(
    path: str,
    probe: Workload,
    workloads: Sequence[Workload],
    engines: Sequence[str],
    policies: Sequence[tuple[str, float]],
    num_blocks: int,
    rates: Sequence[float],
    bisect_steps: int,
    progress: bool = True,
    **engine_args: Any,
) -> dict[str, Any]:
    from tqdm import tqdm

    max_len = max(w.max_len for w in (probe, *workloads))
    todo = list(cases(engines, policies))
    bar = tqdm(
        total=len(todo) * len(workloads) * (len(rates) + bisect_steps),
        desc="serve",
        unit="trial",
        disable=not progress,
    )
    vanilla = ServeEngine(path, "vanilla", num_blocks, max_len, **engine_args)
    slo_report, slo = unloaded_slo(vanilla, probe, UNLOADED_REQUESTS)
    if "vanilla" not in engines:
        vanilla.close()
    results = []
    for kind in sorted(engines, key=ENGINES.index):  # vanilla first: its engine is built
        engine = (
            vanilla
            if kind == "vanilla"
            else ServeEngine(path, kind, num_blocks, max_len, **engine_args)
        )
        engine.warm_up(probe)
        for case in (c for c in todo if c.engine == kind):
            for workload in workloads:
                results.append(serve_case(engine, case, workload, slo, rates, bisect_steps, bar))
        engine.close()
    bar.close()
    return {
        "python": sys.version.split()[0],  # pydoc_data.topics changes between versions
        "block_size": BLOCK_SIZE,
        "num_blocks": num_blocks,
        "max_num_seqs": MAX_NUM_SEQS,
        "rates": list(rates),
        "bisect_steps": bisect_steps,
        "slo": asdict(slo_report),
        "workloads": {w.name: w.params for w in workloads},
        "results": [asdict(r) for r in results],
        "ratios": [asdict(r) for r in ratios(results)],
    }


def _ratio(row: CaseResult, other: CaseResult | None) -> tuple[float | None, bool]:
    """``row``'s goodput over ``other``'s, and whether both were bisected (otherwise the
    ratio is only a bound)."""
    if other is None or other.goodput_rps == 0:
        return None, False
    exact = row.goodput_bound == other.goodput_bound == "bisected"
    return ratio(row.goodput_rps, other.goodput_rps, 3), exact


def ratios(results: Sequence[CaseResult]) -> list[GoodputRatio]:
    """Goodput of each vToken engine over Naive-Evict (same policy) and over vanilla."""
    by_key = {(r.engine, r.policy, r.keep, r.workload): r for r in results}
    rows = []
    for r in results:
        if r.engine not in ("eager", "on_demand"):
            continue
        over_naive, naive_exact = _ratio(r, by_key.get(("naive", r.policy, r.keep, r.workload)))
        over_vanilla, vanilla_exact = _ratio(r, by_key.get(("vanilla", "none", None, r.workload)))
        rows.append(
            GoodputRatio(
                r.engine,
                r.policy,
                r.keep,
                r.workload,
                over_naive,
                naive_exact,
                over_vanilla,
                vanilla_exact,
            )
        )
    return rows


def plot(document: dict[str, Any], path: Path) -> None:
    """SLO attainment against rate, one panel per policy and workload, a line per engine."""
    plt = pyplot()
    results = document["results"]
    panels = sorted({(r["policy"], r["keep"], r["workload"]) for r in results if r["keep"]})
    figure, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 4), sharey=True, squeeze=False
    )
    for axis, (policy, keep, workload) in zip(axes[0], panels, strict=True):
        for r in results:
            if r["workload"] == workload and (
                r["keep"] is None or (r["policy"], r["keep"]) == (policy, keep)
            ):
                points = [
                    (p["rate"], p["slo_attainment"])
                    for p in r["per_rate"]
                    if p["slo_attainment"] is not None  # a stopped trial: only "below"
                ]
                axis.plot(*zip(*points, strict=True), marker="o", label=r["engine"])
        axis.axhline(SLO_ATTAINMENT, color="grey", linestyle=":", linewidth=1)
        axis.set_xscale("log")
        axis.set_title(f"{policy} keep {keep}, {workload}")
        axis.set_xlabel("arrival rate (per s)")
    axes[0][0].set_ylabel("SLO attainment")
    axes[0][0].legend()
    save_figure(figure, path)


def parse_policies(value: str) -> list[tuple[str, float]]:
    """``"h2o:0.2,snapkv:0.2"`` -> ``[("h2o", 0.2), ("snapkv", 0.2)]``."""
    from policies import REGISTRY

    chosen = []
    for part in csv_items(value):
        name, _, keep = part.partition(":")
        try:
            ratio = float(keep)
        except ValueError:
            raise typer.BadParameter(f"{part!r}: write policy:keep, e.g. h2o:0.2") from None
        if name not in REGISTRY or name == "none" or not 0.0 < ratio <= 1.0:
            raise typer.BadParameter(
                f"{part!r}: policy among {sorted(set(REGISTRY) - {'none'})}, keep in (0, 1]"
            )
        chosen.append((name, ratio))
    if not chosen:
        raise typer.BadParameter("no policy given")
    return chosen


def cli(
    model: Annotated[str, typer.Option(help="Shipped model name or model folder.")] = "smollm2",
    engines: Annotated[str, typer.Option(help="Subset of " + ",".join(ENGINES))] = ",".join(
        ENGINES
    ),
    policies: Annotated[str, typer.Option(help="policy:keep, comma-separated.")] = ",".join(
        POLICIES
    ),
    workloads: Annotated[str, typer.Option(help="Subset of single,chat.")] = ",".join(WORKLOADS),
    rates: Annotated[str, typer.Option(help="Sweep of arrival rates, per second.")] = (
        "0.25,0.5,1,2"
    ),
    bisect_steps: Annotated[int, typer.Option(min=0)] = 2,
    requests: Annotated[int, typer.Option(min=4, help="Requests (conversations) per trial.")] = 40,
    num_blocks: Annotated[
        int | None,
        typer.Option(help="KV pool, 32-token blocks (default: twice the longest request)."),
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    quick: Annotated[bool, typer.Option(help="A small run for tests.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Write a PNG here.")] = None,
) -> None:
    """Goodput under TTFT/TPOT SLOs of vanilla vLLM, Naive-Evict and vToken on one pool."""
    from transformers import AutoTokenizer

    from workers.models import resolve_model

    chosen_engines = list(dict.fromkeys(csv_items(engines)))
    if not chosen_engines or set(chosen_engines) - set(ENGINES):
        raise typer.BadParameter(f"engines must be among {ENGINES}, got {engines!r}")
    chosen_workloads = list(dict.fromkeys(csv_items(workloads)))
    if not chosen_workloads or set(chosen_workloads) - set(WORKLOADS):
        raise typer.BadParameter(f"workloads must be among {WORKLOADS}, got {workloads!r}")
    sweep = csv_floats(rates, "rates")
    if not sweep or not all(math.isfinite(r) and r > 0 for r in sweep):
        raise typer.BadParameter(f"rates must be positive finite numbers, got {rates!r}")
    chosen_policies = list(dict.fromkeys(parse_policies(policies)))
    path = str(resolve_model(model))
    corpus = doc_tokens(AutoTokenizer.from_pretrained(path))
    preset = QUICK if quick else FULL
    # the SLO probe always comes from the single-turn prompts: they span the whole range
    single = single_workload(corpus, requests, preset.prompt_tokens, preset.new_tokens, seed)
    built = []
    for name in chosen_workloads:
        if name == "single":
            built.append(single)
        else:
            built.append(
                chat_workload(
                    corpus,
                    max(2, requests // 4),
                    preset.turns,
                    preset.user_tokens,
                    preset.new_tokens,
                    preset.max_context,
                    think_s=1.0,
                    seed=seed + 1,
                )
            )
    from kernels.intmath import cdiv

    longest = cdiv(max(w.max_len for w in (single, *built)) + BLOCK_SIZE, BLOCK_SIZE)
    blocks = num_blocks if num_blocks is not None else 2 * longest
    if blocks <= longest:
        raise typer.BadParameter(f"num_blocks must exceed the longest request's {longest}")
    document = run(
        path, single, built, chosen_engines, chosen_policies, blocks, sweep, bisect_steps
    )
    document = {"model": model, "quick": quick, **document}
    for row in document["results"]:
        typer.echo(
            f"{row['engine']:>9} {row['policy']:>7} keep={row['keep']} {row['workload']}: "
            f"goodput {row['goodput_rps']} req/s ({row['goodput_bound']})"
        )
    for row in document["ratios"]:
        typer.echo(json.dumps(row))
    if json_path is not None:
        write_json(json_path, document)
    if plot_path is not None:
        plot(document, plot_path)
