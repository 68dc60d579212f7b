"""`vtoken bench quotas`: what active-KV admission and on-demand eviction admit, on the
real stack, against worst-case reservations under the same budgets and arrivals.

The command starts everything itself: a ``redis-server``, local Ray, and the Serve app
(``--replicas`` vLLM CPU engines with SmolLM2, vToken with H2O at ``--keep``). It runs the
same open-loop workload twice, one mode after the other, each on a fresh deployment:

- ``worst_case``: every request reserves prompt + max_tokens blocks from admission until
  it finishes (no credit for eviction); engines evict eagerly every step.
- ``active_kv``: a request counts its prefill peak until prefill ends (the whole prompt,
  or with ``--chunk-tokens`` one chunk plus its budget: H2O evicts after each chunk),
  then its policy's bound (keep x its longest length, plus one block); engines evict on
  demand, and the
  controller's pressure squeezes a tenant's running requests when its measured active KV
  passes its budget.

Both modes run the same engines: prompts prefilled in chunks of ``--chunk-tokens``
(vLLM's ``max_num_batched_tokens``; 0 leaves vLLM's default and admission counts whole
prompts).

Workload: per tenant, Poisson arrivals at ``rate_rps`` (times ``--load``) for
``--duration-s`` seconds;
prompts of 256-1,024 tokens cut from CPython's language reference, 64-256 output tokens,
half of them streamed; all drawn from ``--seed`` and identical in both modes. A client
throttled with 429 waits its Retry-After (at most 5 s) and retries until the arrival
window closes; then the request counts as throttled. Admitted requests run to the end.

While the load runs, the replicas' reports in Redis are read every 0.1 s (not through the
ingress, which queues behind the load): per tenant its active KV, the blocks its running
requests hold, summed over every replica's last report (a replica inside a long engine
step publishes nothing until it ends: its KV keeps counting as last reported). From that:
``peak_active_blocks``, ``seconds_over_budget``, ``longest_over_budget_s``, and each
stretch above budget judged against one report period plus the longest engine step that
ran during it on a replica holding the tenant's KV (the reports carry their engines'
recent steps). ``completed_per_min`` is requests_ok over the minutes from the first
arrival to the last completion.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import pyplot, save_figure, write_json
from serving.demo import over_budget, over_budget_stretches

MODES = ("worst_case", "active_kv")
PROMPT_TOKENS = (256, 1024)
OUTPUT_TOKENS = (64, 256)
MAX_RETRY_WAIT_S = 5.0
SAMPLE_PERIOD_S = 0.1


@dataclass(frozen=True, slots=True)
class BenchTenant:
    tenant_id: str
    budget_blocks: int
    rate_rps: float


TENANTS = (
    BenchTenant("small", budget_blocks=42, rate_rps=0.15),
    BenchTenant("medium", budget_blocks=48, rate_rps=0.15),
    BenchTenant("large", budget_blocks=56, rate_rps=0.2),
)
"""Budgets bind as KV does on a GPU: the longest request (1,024 + 256 tokens: 40 blocks of
32) fits each, worst-case reservations (25 blocks on average) let about one request per
tenant run at a time, and the arrivals stay under what two CPU engines decode at once."""


@dataclass(frozen=True, slots=True)
class Arrival:
    tenant_id: str
    at_s: float
    prompt: str
    prompt_tokens: int
    max_tokens: int
    stream: bool


@dataclass(slots=True)
class TenantTally:
    ok: int = 0
    throttled: int = 0  # never admitted before the arrival window closed
    failed: int = 0
    throttle_responses: int = 0
    errors: list[str] = field(default_factory=list)


REPORT_PERIOD_S = 0.1  # the replicas' default report period (serving.replica_reporter)


@dataclass(frozen=True, slots=True)
class Stretch:
    """A stretch of a tenant's active KV above its budget (seconds from the first arrival),
    the replicas holding its KV then, the longest engine step during it, and its bound
    (one report period plus that step)."""

    start_s: float
    length_s: float
    replicas: list[str]
    step_s: float
    bound_s: float
    within_bound: bool


@dataclass(frozen=True, slots=True)
class TenantRow:
    """One tenant's figures in one mode (see the module docstring)."""

    id: str
    budget_blocks: int
    arrivals: int
    peak_active_blocks: int
    seconds_over_budget: float
    longest_over_budget_s: float
    # each stretch against one report period plus the longest engine step the replicas
    # reported during it (the target's bound)
    stretches_over_budget: list[Stretch]
    stretches_over_bound: int
    # what a stretch above budget shorter than this could hide between samples
    max_sample_gap_s: float
    requests_ok: int
    requests_throttled: int
    requests_failed: int
    throttle_responses: int
    completed_per_min: float
    errors: list[str]  # the first five
    active_blocks_series: list[list[float]]  # [seconds, blocks] per sample


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's figures: per tenant, the totals, and the replicas' eviction counters."""

    tenants: list[TenantRow]
    requests_ok: int
    completed_per_min: float
    elapsed_s: float
    stretches_over_bound: int
    max_step_s: float
    preemptions: int
    evictions_under_pressure: int
    evictions_below_budget: int
    evictions_to_bound: int


def judge_stretches(
    stretches: list[tuple[float, float]],
    hosts: list[tuple[float, frozenset[str]]],
    steps: dict[str, list[tuple[float, float]]],
    report_period_s: float,
) -> list[Stretch]:
    """Each stretch above budget with its bound: one report period plus the longest engine
    step that ran during it (overlapping ``[start, end]``) on a replica holding the
    tenant's KV then. ``hosts``: per sample, the replicas holding the tenant's KV;
    ``steps``: per replica, its steps as ``(start, end)`` on the samples' clock. A stretch
    with no step in it is bounded by the report period alone."""
    judged = []
    for start, end in stretches:
        holding: set[str] = set()
        for at_s, replicas in hosts:
            if start <= at_s <= end:
                holding |= replicas
        step_s = max(
            (
                step_end - step_start
                for replica in holding
                for step_start, step_end in steps.get(replica, ())
                if step_start <= end and step_end >= start
            ),
            default=0.0,
        )
        bound_s = report_period_s + step_s
        judged.append(
            Stretch(
                start_s=round(start, 2),
                length_s=round(end - start, 2),
                replicas=sorted(holding),
                step_s=round(step_s, 3),
                bound_s=round(bound_s, 3),
                within_bound=end - start <= bound_s,
            )
        )
    return judged


def make_arrivals(
    tenants: tuple[BenchTenant, ...],
    duration_s: float,
    seed: int,
    passages: list[list[int]],
    decode: Any,
) -> list[Arrival]:
    """Seeded open-loop arrivals of every tenant, in time order. ``passages`` are token id
    lists of at least ``PROMPT_TOKENS[1]`` tokens; ``decode`` turns ids back into text."""
    rng = random.Random(seed)
    arrivals = []
    for tenant in tenants:
        at_s = rng.expovariate(tenant.rate_rps)
        while at_s < duration_s:
            num_tokens = rng.randint(*PROMPT_TOKENS)
            passage = passages[rng.randrange(len(passages))]
            start = rng.randrange(len(passage) - num_tokens + 1)
            arrivals.append(
                Arrival(
                    tenant_id=tenant.tenant_id,
                    at_s=at_s,
                    prompt=decode(passage[start : start + num_tokens]),
                    prompt_tokens=num_tokens,
                    max_tokens=rng.randint(*OUTPUT_TOKENS),
                    stream=rng.random() < 0.5,
                )
            )
            at_s += rng.expovariate(tenant.rate_rps)
    return sorted(arrivals, key=lambda a: a.at_s)


def natural_passages(tokenizer: Any, min_tokens: int, count: int = 12) -> list[list[int]]:
    """Token ids of the first ``count`` language-reference topics with ``min_tokens``+."""
    from pydoc_data.topics import topics

    passages = []
    for name in sorted(topics):
        ids = tokenizer(topics[name])["input_ids"]
        if len(ids) >= min_tokens:
            passages.append(list(ids))
            if len(passages) == count:
                break
    return passages


async def _one(
    client: Any, arrival: Arrival, key: str, deadline_s: float, started: float, tally: TenantTally
) -> float:
    """Send one request (retrying 429s until ``deadline_s``); returns its finish time."""
    await asyncio.sleep(max(0.0, started + arrival.at_s - time.monotonic()))
    body = {
        "model": "smollm2",
        "prompt": arrival.prompt,
        "max_tokens": arrival.max_tokens,
        "temperature": 0.0,
        "stream": arrival.stream,
    }
    headers = {"Authorization": f"Bearer {key}"}
    while True:
        try:
            response = await client.post("/v1/completions", json=body, headers=headers)
        except Exception as error:  # noqa: BLE001 - a transport error is a failed request
            tally.failed += 1
            tally.errors.append(f"{type(error).__name__}: {error}"[:200])
            return time.monotonic()
        if response.status_code != 429:
            break
        tally.throttle_responses += 1
        wait_s = min(float(response.headers.get("Retry-After", "1")), MAX_RETRY_WAIT_S)
        if time.monotonic() + wait_s > started + deadline_s:
            tally.throttled += 1
            return time.monotonic()
        await asyncio.sleep(wait_s)
    text = response.text
    if response.status_code == 200 and (not arrival.stream or "data: [DONE]" in text):
        tally.ok += 1
    else:
        tally.failed += 1
        tally.errors.append(f"{response.status_code}: {text[-200:]}")
    return time.monotonic()


async def drive(
    cluster: Any, tenants: tuple[BenchTenant, ...], arrivals: list[Arrival], duration_s: float
) -> ModeResult:
    """Create the tenants, run ``arrivals`` while sampling active KV from the replicas'
    reports in Redis (not through the loaded ingress); the mode's figures."""
    import httpx

    from controlplane.keys import KeySpace
    from controlplane.models import ReplicaReport
    from controlplane.redis_conn import RedisConfig, connect
    from controlplane.status import REPORT_MAX_AGE_S, cluster_status
    from controlplane.store import RedisStore
    from serving.demo import ADMIN_TOKEN

    store = RedisStore(connect(RedisConfig(url=cluster.redis_url)), KeySpace())

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    tallies = {t.tenant_id: TenantTally() for t in tenants}
    samples: dict[str, list[tuple[float, int]]] = {t.tenant_id: [] for t in tenants}
    hosts: dict[str, list[tuple[float, frozenset[str]]]] = {t.tenant_id: [] for t in tenants}
    # Each replica's last report read: a replica busy in a long step (its event loop runs
    # the engine) publishes nothing until the step ends, and its report expires; its KV
    # still counts, as last reported, rather than dropping out of the tenant's total.
    last_report: dict[str, ReplicaReport] = {}
    steps: dict[str, set[tuple[float, float]]] = {}  # replica -> (start, end), bench clock
    async with httpx.AsyncClient(base_url=cluster.url, timeout=900) as client:
        keys = {}
        for tenant in tenants:
            response = await client.put(
                f"/admin/tenants/{tenant.tenant_id}",
                # No fair queue: a throttle is a 429 at once, as in the runs before it.
                json={"kv_budget_blocks": tenant.budget_blocks, "max_queue_depth": 0},
                headers=admin,
            )
            response.raise_for_status()
            keys[tenant.tenant_id] = response.json()["api_key"]
        started = time.monotonic()
        work = asyncio.gather(
            *(
                _one(client, a, keys[a.tenant_id], duration_s, started, tallies[a.tenant_id])
                for a in arrivals
            )
        )
        status: dict[str, Any] = {}
        while not work.done():
            wall = time.time()
            now_s = time.monotonic() - started
            snapshot = await store.read_reports(wall, REPORT_MAX_AGE_S, forget_after_s=3600.0)
            last_report.update(snapshot.fresh)
            for replica_id, report in snapshot.fresh.items():
                steps.setdefault(replica_id, set()).update(
                    (end - (wall - now_s) - seconds, end - (wall - now_s))
                    for end, seconds in report.recent_steps
                )
            for tenant in tenants:
                held = {
                    replica_id: report.tenants[tenant.tenant_id].blocks
                    for replica_id, report in last_report.items()
                    if tenant.tenant_id in report.tenants
                }
                samples[tenant.tenant_id].append((now_s, sum(held.values())))
                holding = frozenset(r for r, blocks in held.items() if blocks)
                hosts[tenant.tenant_id].append((now_s, holding))
            await asyncio.wait([work], timeout=SAMPLE_PERIOD_S)
        finishes = await work
        await asyncio.sleep(0.5)  # one more report after the last request
        status = await cluster_status(store)
    await store.redis.aclose()
    elapsed_min = (max(finishes, default=started) - started) / 60
    replicas = [r for r in status["replicas"] if r.get("fresh")]
    rows = []
    for tenant in tenants:
        tally, series = tallies[tenant.tenant_id], samples[tenant.tenant_id]
        seconds_over, longest_over = over_budget(series, tenant.budget_blocks)
        stretches = judge_stretches(
            over_budget_stretches(series, tenant.budget_blocks),
            hosts[tenant.tenant_id],
            {replica: sorted(spans) for replica, spans in steps.items()},
            REPORT_PERIOD_S,
        )
        rows.append(
            TenantRow(
                id=tenant.tenant_id,
                budget_blocks=tenant.budget_blocks,
                arrivals=sum(1 for a in arrivals if a.tenant_id == tenant.tenant_id),
                peak_active_blocks=max((blocks for _, blocks in series), default=0),
                seconds_over_budget=round(seconds_over, 2),
                longest_over_budget_s=round(longest_over, 2),
                stretches_over_budget=stretches,
                stretches_over_bound=sum(1 for s in stretches if not s.within_bound),
                max_sample_gap_s=round(
                    max((b[0] - a[0] for a, b in zip(series, series[1:], strict=False)), default=0),
                    2,
                ),
                requests_ok=tally.ok,
                requests_throttled=tally.throttled,
                requests_failed=tally.failed,
                throttle_responses=tally.throttle_responses,
                completed_per_min=round(tally.ok / elapsed_min, 2) if elapsed_min else 0.0,
                errors=tally.errors[:5],
                active_blocks_series=[[round(t, 2), b] for t, b in series],
            )
        )
    return ModeResult(
        tenants=rows,
        requests_ok=sum(t.ok for t in tallies.values()),
        completed_per_min=round(sum(t.ok for t in tallies.values()) / elapsed_min, 2)
        if elapsed_min
        else 0.0,
        elapsed_s=round(elapsed_min * 60, 1),
        stretches_over_bound=sum(row.stretches_over_bound for row in rows),
        max_step_s=round(
            max((end - start for spans in steps.values() for start, end in spans), default=0.0), 3
        ),
        preemptions=sum(r.get("preemptions", 0) for r in replicas),
        evictions_under_pressure=sum(r.get("evictions_under_pressure", 0) for r in replicas),
        evictions_below_budget=sum(r.get("evictions_below_budget", 0) for r in replicas),
        evictions_to_bound=sum(r.get("evictions_to_bound", 0) for r in replicas),
    )


def mode_settings(mode: str, keep: float) -> tuple[str, dict[str, Any]]:
    """(admission mode, vToken config) of a benchmark mode."""
    eviction = "eager" if mode == "worst_case" else "on_demand"
    return mode, {"policy": "h2o", "keep_ratio": keep, "eviction": eviction}


def scaled(tenants: tuple[BenchTenant, ...], load: float) -> tuple[BenchTenant, ...]:
    """``tenants`` with every arrival rate multiplied by ``load`` (budgets unchanged)."""
    return tuple(replace(t, rate_rps=round(t.rate_rps * load, 6)) for t in tenants)


def run(
    duration_s: float,
    seed: int,
    keep: float,
    num_replicas: int,
    modes: tuple[str, ...],
    load: float = 1.0,
    chunk_tokens: int = 0,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from serving.demo import local_cluster
    from workers.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    passages = natural_passages(tokenizer, PROMPT_TOKENS[1])
    tenants = scaled(TENANTS, load)
    arrivals = make_arrivals(tenants, duration_s, seed, passages, tokenizer.decode)
    max_model_len = 2 * (PROMPT_TOKENS[1] + OUTPUT_TOKENS[1])  # text re-tokenizes a bit longer
    results: dict[str, ModeResult] = {}
    for mode in modes:
        admission, vtoken = mode_settings(mode, keep)
        with local_cluster(
            num_replicas,
            vtoken,
            engine={"max_model_len": max_model_len, "max_num_batched_tokens": chunk_tokens or None},
            app_args={"admission": admission},
        ) as cluster:
            results[mode] = asyncio.run(drive(cluster, tenants, arrivals, duration_s))
        typer.echo(f"{mode}: {results[mode].requests_ok} ok in {results[mode].elapsed_s} s")
    summary: dict[str, Any] = {
        "config": {
            "duration_s": duration_s,
            "seed": seed,
            "policy": "h2o",
            "keep": keep,
            "replicas": num_replicas,
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "load": load,
            "chunk_tokens": chunk_tokens or None,
            "tenants": [asdict(t) for t in tenants],
            "arrivals": len(arrivals),
        },
        "modes": {mode: asdict(result) for mode, result in results.items()},
    }
    if "worst_case" in results and "active_kv" in results:
        worst, active = results["worst_case"].requests_ok, results["active_kv"].requests_ok
        summary["completed_ratio_active_kv_over_worst_case"] = (
            round(active / worst, 2) if worst else math.inf
        )
    return summary


def plot(summary: dict[str, Any], path: Path) -> None:
    """Active KV over time per tenant against its budget, one panel per mode."""
    plt = pyplot()
    modes = list(summary["modes"])
    figure, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), sharey=True)
    for axis, mode in zip([axes] if len(modes) == 1 else axes, modes, strict=True):
        for index, tenant in enumerate(summary["modes"][mode]["tenants"]):
            color = f"C{index}"
            series = tenant["active_blocks_series"]
            axis.plot(
                [t for t, _ in series],
                [b for _, b in series],
                color=color,
                lw=1,
                label=f"{tenant['id']} ({tenant['requests_ok']} ok)",
            )
            axis.axhline(tenant["budget_blocks"], color=color, ls="--", lw=1)
        axis.set_title(f"{mode}: {summary['modes'][mode]['requests_ok']} completed")
        axis.set_xlabel("seconds")
        axis.legend(fontsize=8)
    axes_list = [axes] if len(modes) == 1 else list(axes)
    axes_list[0].set_ylabel("active KV blocks (dashed: budget)")
    save_figure(figure, path)


def cli(
    json_path: Annotated[Path, typer.Option("--json", help="write the results here")],
    plot_path: Annotated[Path | None, typer.Option("--plot", help="PNG of active KV")] = None,
    duration_s: Annotated[float, typer.Option(min=10, help="arrival window per mode")] = 120,
    seed: Annotated[int, typer.Option()] = 0,
    keep: Annotated[float, typer.Option(min=0.05, max=1.0)] = 0.2,
    replicas: Annotated[int, typer.Option(min=1)] = 2,
    load: Annotated[
        float, typer.Option(min=0.1, max=10.0, help="multiply every tenant's arrival rate")
    ] = 1.0,
    chunk_tokens: Annotated[
        int,
        typer.Option(min=0, help="prefill chunk (max_num_batched_tokens); 0: vLLM's default"),
    ] = 256,
) -> None:
    """Active-KV admission + on-demand eviction vs worst-case reservations (real stack)."""
    summary = run(duration_s, seed, keep, replicas, MODES, load, chunk_tokens)
    write_json(json_path, summary, indent=1)
    if plot_path is not None:
        plot(summary, plot_path)
    for mode, result in summary["modes"].items():
        line = ", ".join(
            f"{t['id']} {t['requests_ok']} ok/{t['requests_throttled']} thr/"
            f"{t['requests_failed']} fail, peak {t['peak_active_blocks']}/{t['budget_blocks']}"
            for t in result["tenants"]
        )
        typer.echo(f"{mode}: {line}; preemptions {result['preemptions']}")
    if "completed_ratio_active_kv_over_worst_case" in summary:
        typer.echo(
            f"active_kv / worst_case: {summary['completed_ratio_active_kv_over_worst_case']}"
        )
