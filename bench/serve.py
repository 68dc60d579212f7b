"""`vtoken bench serve`: SLA goodput of vanilla vLLM, Naive-Evict and vToken on one KV pool.

An open-loop serving benchmark on in-process vLLM engines (the CPU build here; nothing in
it is CPU-specific). Requests arrive by a Poisson process; each engine serves the same
arrivals on the same pool of KV blocks, one engine at a time (``ENGINE_CONFIGS`` in
``bench.serve_trial``; ``--engines`` picks among them):

- ``vanilla``: vLLM without a vToken config (it preempts and recomputes under pressure);
- ``naive``: Naive-Evict, the policy's decisions every step, every block that still holds
  a live token kept (what a block-granular manager can free);
- ``eager``: vToken, the same decisions every step, live tokens repacked, emptied blocks
  freed;
- ``on_demand``: vToken, tokens kept until memory is needed, then running requests
  evicted to their budget instead of preempted (the serving default).

The policy is each engine's own (one engine per kind and policy): a request's own policy
(``extra_args["vtoken_policy"]``) is a tenant's cap to the engine, held at every step
whatever the eviction mode, so on_demand would evict like eager. The workloads
(``single``, ``chat``, ``reasoning``) and their presets are in ``bench.serve_workloads``;
the clock and the per-request outcomes of a trial in ``bench.serve_trial``; the rows,
ratios, summary and figure in ``bench.serve_results``.

**The reasoning preset** (``--workloads reasoning``, which runs alone: its pool and
batched-token limit are its own): prompts of 48-80 tokens, outputs of 128-256, a pool of
32 blocks, ``max_num_batched_tokens`` 64, 24 requests per trial, rates 0.5, 1 and 2 per
second and one bisection step, TPOT factor 3, policies ``random:0.2`` (no score pass:
reclamation alone) and ``h2o:0.2``. It is the issue's example (prompts 192-320, outputs
512-1,024, 128 blocks, 256 batched tokens, 64 requests) at a quarter of every length and
of the pool, with 24 requests. An unloaded SmolLM2-135M decode step on a 2-core CPU is
16-25 ms (``bench/RESULTS.md``), about 40 ms at the batch of 8 where memory binds, so one
trial of the example (about 49,000 output tokens) takes about 4 minutes and a run of the
four engines and two policies (28 trials) about 2 hours; scaled, a trial is about 4,600
output tokens (25-40 s) and the run about 20 minutes on an otherwise idle machine (an
estimate from those step times). Memory binds as in the example: a request ends at 6-11
blocks (the example's 22-42 of 128), so the pool holds 3-5 requests at their end, while at
1 request per second and 6-10 s end to end 6-10 are in flight (about twice the pool); at
keep 0.2 a request needs 1-3 blocks.

**SLOs and goodput.** At the start of a run the vanilla engine serves
``UNLOADED_REQUESTS`` prompts of the workload one at a time (the single-turn workload for
``single`` and ``chat``); the SLOs are ``TTFT_SLO_FACTOR`` x its TTFT at the request's
prompt length (a line fitted through the measurements, see ``unloaded_slo``) and the TPOT
factor (``--tpot-factor``, default ``TPOT_SLO_FACTOR``) x its p50 TPOT. A request meets
the SLO when both hold. Goodput (DistServe's definition) is the highest rate at which at
least ``SLO_ATTAINMENT`` of the requests meet it: every rate of the sweep is run (the
attainment curve), then the rate is bisected (geometrically) between the highest passing
rate and the first failing one. A trial stops as soon as more than ``1 - SLO_ATTAINMENT``
of its requests have missed (its attainment is then the upper bound
``1 - missed / requests``), which keeps overloaded trials short.

**Summary.** Per workload and policy, on_demand's goodput over every other engine's
(``summary`` in the JSON, printed at the end).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import (
    SLO_ATTAINMENT,
    TPOT_SLO_FACTOR,
    TTFT_SLO_FACTOR,
    Slo,
    csv_floats,
    csv_items,
    doc_tokens,
    write_json,
)
from bench.serve_results import CaseResult, plot, ratios, summary, summary_lines
from bench.serve_trial import BLOCK_SIZE, ENGINES, MAX_NUM_SEQS, ServeEngine, Trial, run_trial
from bench.serve_workloads import (
    WORKLOADS,
    Preset,
    Session,
    Workload,
    chat_workload,
    preset,
    reasoning_workload,
    single_workload,
)

UNLOADED_REQUESTS = 8


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


def unloaded_slo(
    engine: ServeEngine, workload: Workload, count: int, tpot_factor: float = TPOT_SLO_FACTOR
) -> tuple[UnloadedSlo, Slo]:
    """SLOs from the vanilla engine serving ``count`` requests one at a time, their prompt
    lengths spread over the workload's (evenly spaced in its sorted lengths).

    TPOT: ``tpot_factor`` x the p50. TTFT: ``TTFT_SLO_FACTOR`` x the unloaded TTFT *of
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
    trial = run_trial(engine, probe, 1e-6, None, "unloaded")
    lengths = np.array([o.prompt_tokens for o in trial.outcomes], dtype=np.float64)
    ttfts = np.array([o.ttft_s for o in trial.outcomes])
    per_token, base = np.polyfit(lengths, ttfts, 1)
    per_token = max(0.0, float(per_token))
    base = max(float(base), float(ttfts.min()) - per_token * float(lengths.min()), 1e-3)
    tpot = float(np.median([o.tpot_s or 0.0 for o in trial.outcomes]))
    slo = Slo(TTFT_SLO_FACTOR * base, TTFT_SLO_FACTOR * per_token, tpot_factor * tpot)
    report = UnloadedSlo(
        unloaded_requests=count,
        unloaded_prompt_tokens=[int(n) for n in lengths],
        unloaded_ttft_s=[round(float(t), 4) for t in ttfts],
        unloaded_ttft_p50_s=round(float(np.median(ttfts)), 4),
        unloaded_ttft_fit=TtftFit(round(base, 5), round(per_token, 7)),
        unloaded_tpot_p50_s=round(tpot, 4),
        ttft_factor=TTFT_SLO_FACTOR,
        tpot_factor=tpot_factor,
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

    def trial_at(rate: float, stop_early: bool) -> Trial:
        tag = f"{case.policy}{case.keep}{workload.name}{rate:.6f}-"
        trial = run_trial(engine, workload, rate, slo, tag, stop_early)
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
        preempted_requests=sum(o.preemptions > 0 for t in sweep for o in t.outcomes),
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
    max_num_batched_tokens: int = 2048,
    tpot_factor: float = TPOT_SLO_FACTOR,
    **engine_args: Any,
) -> dict[str, Any]:
    """Every case on every workload; the SLOs from ``probe`` on vanilla (the document the
    CLI writes, less the options it adds)."""
    from tqdm import tqdm

    max_len = max(w.max_len for w in (probe, *workloads))
    todo = list(cases(engines, policies))
    bar = tqdm(
        total=len(todo) * len(workloads) * (len(rates) + bisect_steps),
        desc="serve",
        unit="trial",
        disable=not progress,
    )

    def build(kind: str, policy: dict[str, Any] | None = None) -> ServeEngine:
        return ServeEngine(
            path, kind, num_blocks, max_len, max_num_batched_tokens, policy, **engine_args
        )

    vanilla = build("vanilla")
    slo_report, slo = unloaded_slo(vanilla, probe, UNLOADED_REQUESTS, tpot_factor)
    if "vanilla" not in engines:
        vanilla.close()
    results = []
    # Vanilla first (its engine is built); then one engine per kind and policy.
    for case in sorted(todo, key=lambda c: ENGINES.index(c.engine)):
        if case.keep is None:
            engine = vanilla
        else:
            engine = build(case.engine, {"policy": case.policy, "keep_ratio": case.keep})
        engine.warm_up(probe)
        for workload in workloads:
            row = serve_case(engine, case, workload, slo, rates, bisect_steps, bar)
            bar.write(
                f"{row.engine} {row.policy}:{row.keep} {row.workload}: goodput "
                f"{row.goodput_rps} req/s ({row.goodput_bound}) {row.slo_attainment}"
            )
            results.append(row)
        engine.close()
    bar.close()
    return {
        "python": sys.version.split()[0],  # pydoc_data.topics changes between versions
        "block_size": BLOCK_SIZE,
        "num_blocks": num_blocks,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": max_num_batched_tokens,
        "rates": list(rates),
        "bisect_steps": bisect_steps,
        "slo": asdict(slo_report),
        "workloads": {w.name: w.params for w in workloads},
        "results": [asdict(r) for r in results],
        "ratios": [asdict(r) for r in ratios(results)],
        "summary": [asdict(s) for s in summary(results)],
    }


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


def token_range(value: str, option: str) -> tuple[int, int]:
    """``"192,320"`` -> ``(192, 320)``: an inclusive range of token counts; anything but
    two integers ``1 <= MIN <= MAX`` raises ``typer.BadParameter`` naming ``option``."""
    parts = csv_items(value)
    try:
        low, high = (int(part) for part in parts)
    except ValueError:
        raise typer.BadParameter(
            f"{option} must be MIN,MAX (two integers), got {value!r}"
        ) from None
    if not 1 <= low <= high:
        raise typer.BadParameter(f"{option} must have 1 <= MIN <= MAX, got {value!r}")
    return low, high


def build_workloads(
    corpus: Sequence[int], names: Sequence[str], chosen: Preset, seed: int
) -> tuple[Workload, list[Workload]]:
    """The SLO probe's workload and the workloads ``names`` (``chosen``'s lengths and
    counts). The probe is ``reasoning`` itself, else the single-turn prompts: they span the
    whole range of prompt lengths."""
    count, prompts, outputs = chosen.requests, chosen.prompt_tokens, chosen.new_tokens
    if "reasoning" in names:
        reasoning = reasoning_workload(corpus, count, prompts, outputs, seed)
        return reasoning, [reasoning]
    single = single_workload(corpus, count, prompts, outputs, seed)
    built = []
    for name in names:
        if name == "single":
            built.append(single)
        else:
            built.append(
                chat_workload(
                    corpus,
                    max(2, count // 4),
                    chosen.turns,
                    chosen.user_tokens,
                    outputs,
                    chosen.max_context,
                    think_s=1.0,
                    seed=seed + 1,
                )
            )
    return single, built


def cli(
    model: Annotated[str, typer.Option(help="Shipped model name or model folder.")] = "smollm2",
    engines: Annotated[str, typer.Option(help="Subset of " + ",".join(ENGINES))] = ",".join(
        ENGINES
    ),
    policies: Annotated[
        str | None, typer.Option(help="policy:keep, comma-separated (default: the preset's).")
    ] = None,
    workloads: Annotated[
        str, typer.Option(help="Subset of single,chat; or reasoning (which runs alone).")
    ] = "single,chat",
    rates: Annotated[
        str | None, typer.Option(help="Sweep of arrival rates, per second (default: preset).")
    ] = None,
    bisect_steps: Annotated[
        int | None, typer.Option(min=0, help="Bisections after the sweep (default: preset).")
    ] = None,
    requests: Annotated[
        int | None, typer.Option(min=4, help="Requests (conversations) per trial.")
    ] = None,
    prompt_tokens: Annotated[
        str | None, typer.Option(help="MIN,MAX prompt tokens (single, reasoning, the SLO probe).")
    ] = None,
    output_tokens: Annotated[str | None, typer.Option(help="MIN,MAX output tokens.")] = None,
    tpot_factor: Annotated[
        float | None, typer.Option(min=1.0, help="TPOT SLO: this times the unloaded p50.")
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(min=MAX_NUM_SEQS, help="vLLM's token budget of a step (chunked prefill)."),
    ] = None,
    num_blocks: Annotated[
        int | None,
        typer.Option(help="KV pool, 32-token blocks (default: preset, or twice the longest)."),
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    quick: Annotated[bool, typer.Option(help="A small run for tests.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Write a PNG here.")] = None,
) -> None:
    """Goodput under TTFT/TPOT SLOs of vanilla vLLM, Naive-Evict and vToken on one pool."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from kernels.intmath import cdiv
    from workers.models import resolve_model

    chosen_engines = list(dict.fromkeys(csv_items(engines)))
    if not chosen_engines or set(chosen_engines) - set(ENGINES):
        raise typer.BadParameter(f"engines must be among {ENGINES}, got {engines!r}")
    chosen_workloads = list(dict.fromkeys(csv_items(workloads)))
    if not chosen_workloads or set(chosen_workloads) - set(WORKLOADS):
        raise typer.BadParameter(f"workloads must be among {WORKLOADS}, got {workloads!r}")
    if "reasoning" in chosen_workloads and len(chosen_workloads) > 1:
        raise typer.BadParameter("workloads: reasoning runs alone (its own pool and batch)")
    chosen = preset(chosen_workloads, quick)
    chosen = replace(
        chosen,
        prompt_tokens=chosen.prompt_tokens
        if prompt_tokens is None
        else token_range(prompt_tokens, "--prompt-tokens"),
        new_tokens=chosen.new_tokens
        if output_tokens is None
        else token_range(output_tokens, "--output-tokens"),
        requests=chosen.requests if requests is None else requests,
        bisect_steps=chosen.bisect_steps if bisect_steps is None else bisect_steps,
        tpot_factor=chosen.tpot_factor if tpot_factor is None else tpot_factor,
        max_num_batched_tokens=chosen.max_num_batched_tokens
        if max_num_batched_tokens is None
        else max_num_batched_tokens,
    )
    sweep = csv_floats(chosen.rates if rates is None else rates, "rates")
    if not sweep or not all(math.isfinite(r) and r > 0 for r in sweep):
        raise typer.BadParameter(f"rates must be positive finite numbers, got {rates!r}")
    chosen_policies = list(
        dict.fromkeys(parse_policies(chosen.policies if policies is None else policies))
    )
    path = str(resolve_model(model))
    corpus = doc_tokens(AutoTokenizer.from_pretrained(path))
    if chosen.prompt_tokens[1] >= len(corpus):
        raise typer.BadParameter(f"--prompt-tokens: at most {len(corpus) - 1} (the corpus)")
    probe, built = build_workloads(corpus, chosen_workloads, chosen, seed)
    longest = cdiv(max(w.max_len for w in (probe, *built)) + BLOCK_SIZE, BLOCK_SIZE)
    blocks = num_blocks if num_blocks is not None else chosen.num_blocks or 2 * longest
    if blocks <= longest:
        raise typer.BadParameter(f"num_blocks must exceed the longest request's {longest}")
    document = run(
        path,
        probe,
        built,
        chosen_engines,
        chosen_policies,
        blocks,
        sweep,
        chosen.bisect_steps,
        max_num_batched_tokens=chosen.max_num_batched_tokens,
        tpot_factor=chosen.tpot_factor,
    )
    document = {"model": model, "quick": quick, **document}
    for row in document["results"]:
        typer.echo(
            f"{row['engine']:>9} {row['policy']:>7} keep={row['keep']} {row['workload']}: "
            f"goodput {row['goodput_rps']} req/s ({row['goodput_bound']})"
        )
    for row in document["ratios"]:
        typer.echo(json.dumps(row))
    for line in summary_lines(document):
        typer.echo(line)
    if json_path is not None:
        write_json(json_path, document)
    if plot_path is not None:
        plot(document, plot_path)
