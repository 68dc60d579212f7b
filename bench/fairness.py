"""`vtoken bench fairness`: weighted fairness when tenants want more than the cluster has,
on the real stack, against vLLM's first-come-first-served and priority scheduling.

The command starts everything itself, once per deployment (``serving.demo.local_cluster``:
a ``redis-server``, local Ray, the Serve app with ``--replicas`` vLLM CPU engines of
SmolLM2 without eviction). Three tenants whose KV budgets together exceed the pool:

- ``A``, weight 1, floods: ``A_CLIENTS`` clients sending back to back (several times its
  share of the cluster);
- ``C``, weight 2, backlogged: ``C_CLIENTS`` clients sending back to back;
- ``B``, weight 1, light and steady: Poisson arrivals at ``B_RATE_RPS``, shorter requests.

Modes, each on a fresh deployment (``mode_settings``):

- ``fair``: the engines' fair order on (``fair_share``), the ingress fair queue on (the
  tenants' default ``max_queue_depth``, ``max_queue_wait_s`` = ``MAX_QUEUE_WAIT_S``) and a
  cluster bound, ``cluster_kv_blocks`` = ``CLUSTER_KV_BLOCKS``, so the queue decides whose
  request is admitted when the cluster is full;
- ``fcfs``: vLLM's first come, first served with today's admission: ``fair_share`` off,
  no queue (``max_queue_depth`` 0): a throttled client waits its ``Retry-After`` (at most
  ``MAX_RETRY_WAIT_S``) and retries until the arrivals end;
- ``priority``: as ``fcfs`` but the engines run vLLM's ``scheduling_policy: priority``
  and B's requests carry ``priority: -1`` (lower is served first).

``solo``: B alone at the same load, on the ``fair`` deployment after its mix. ``overhead``:
one tenant (``OVERHEAD_CLIENTS`` clients back to back, A's requests), on the ``fair`` and
the ``fcfs`` deployments before their mixes: output tokens/s with fairness on over off.

Every request streams: TTFT from its first attempt, TPOT, its wait to admission, its chunks'
times; statistics and the ``targets`` each mode judges: ``bench/fairness_stats.py``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from bench.common import csv_items, pyplot, save_figure, write_json
from bench.fairness_stats import Costs, Outcome, Record, mode_summary, mode_targets, throughput

MODES = ("fair", "fcfs", "priority")
EXTRA = ("solo", "overhead")
MAX_RETRY_WAIT_S = 5.0
MAX_QUEUE_WAIT_S = 60.0
CLUSTER_KV_BLOCKS = 40  # about four of A's or C's requests at once, cluster-wide
B_PRIORITY = -1  # vLLM's: lower first
B_RATE_RPS = 0.25
A_CLIENTS, C_CLIENTS, OVERHEAD_CLIENTS = 8, 4, 3


@dataclass(frozen=True, slots=True)
class FairTenant:
    tenant_id: str
    weight: float
    budget_blocks: int
    clients: int  # closed loop: clients sending back to back; 0: open loop at rate_rps
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    rate_rps: float = 0.0


BIG = ((64, 160), (64, 128))  # A's and C's requests: at most 9 blocks of 32
TENANTS = (
    FairTenant("A", 1.0, 40, A_CLIENTS, *BIG),
    FairTenant("B", 1.0, 16, 0, (48, 96), (16, 32), rate_rps=B_RATE_RPS),
    FairTenant("C", 2.0, 40, C_CLIENTS, *BIG),
)
"""Budgets 96 blocks together against a cluster bound of 40 in ``fair`` mode."""
OVERHEAD = FairTenant("T", 1.0, 200, OVERHEAD_CLIENTS, *BIG)
BACKLOGGED = ("A", "C")


@dataclass(frozen=True, slots=True)
class Phase:
    """One load against a deployment: its tenants, keys, arrival window and prompts."""

    client: Any  # httpx.AsyncClient
    keys: dict[str, str]
    duration_s: float
    passages: list[list[int]]
    decode: Any
    seed: int
    b_priority: int = 0


def mode_settings(mode: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], bool]:
    """(vToken config, engine settings, app args, fair queue on) of a deployment."""
    vtoken = {"policy": "none", "fair_share": mode == "fair"}
    engine = {"scheduling_policy": "priority"} if mode == "priority" else {}
    app_args = {"cluster_kv_blocks": CLUSTER_KV_BLOCKS} if mode == "fair" else {}
    return vtoken, engine, app_args, mode == "fair"


def body_of(tenant: FairTenant, rng: random.Random, phase: Phase) -> dict[str, Any]:
    """A seeded request of ``tenant``: a prompt cut from the passages, its output length."""
    num_tokens = rng.randint(*tenant.prompt_tokens)
    passage = phase.passages[rng.randrange(len(phase.passages))]
    start = rng.randrange(len(passage) - num_tokens + 1)
    body = {
        "model": "smollm2",
        "prompt": phase.decode(passage[start : start + num_tokens]),
        "max_tokens": rng.randint(*tenant.output_tokens),
        "temperature": 0.0,
        "ignore_eos": True,  # every request decodes its max_tokens: comparable service
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tenant.tenant_id == "B" and phase.b_priority:
        body["priority"] = phase.b_priority
    return body


async def send(phase: Phase, tenant: FairTenant, body: dict[str, Any], t0: float) -> Record:
    """One request until answered, refused for good or past the arrivals (429: wait its
    ``Retry-After``, at most ``MAX_RETRY_WAIT_S``, and retry)."""
    headers = {"Authorization": f"Bearer {phase.keys[tenant.tenant_id]}"}
    sent, throttles = time.monotonic() - t0, 0
    fields: dict[str, Any] = {"tenant": tenant.tenant_id, "sent_s": sent}
    while True:
        try:
            async with phase.client.stream(
                "POST", "/v1/completions", json=body, headers=headers
            ) as response:
                if response.status_code == 429:
                    wait_s = min(float(response.headers.get("Retry-After", "1")), MAX_RETRY_WAIT_S)
                    throttles += 1
                    if time.monotonic() - t0 + wait_s > phase.duration_s:
                        return Record(outcome="throttled", throttle_responses=throttles, **fields)
                    await response.aclose()
                    await asyncio.sleep(wait_s)
                    continue
                if response.status_code != 200:
                    error = f"{response.status_code}: {(await response.aread()).decode()[-200:]}"
                    return Record(
                        outcome="failed", throttle_responses=throttles, error=error, **fields
                    )
                fields["admitted_s"] = time.monotonic() - t0  # admitted: its answer starts
                waited = response.headers.get("x-vtoken-queue-wait")
                fields["queue_wait_s"] = None if waited is None else float(waited)
                return await _read_stream(response, t0, throttles, fields)
        except Exception as error:  # noqa: BLE001 - a transport error is a failed request
            error_text = f"{type(error).__name__}: {error}"[:200]
            return Record(
                outcome="failed", throttle_responses=throttles, error=error_text, **fields
            )


async def _read_stream(response: Any, t0: float, throttles: int, fields: dict[str, Any]) -> Record:
    first: float | None = None
    usage: dict[str, int] = {}
    chunks: list[float] = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = time.monotonic() - t0
            outcome: Outcome = "ok" if usage and first is not None else "failed"
            return Record(
                outcome=outcome,
                prompt_tokens=usage.get("prompt_tokens", 0),
                completion_tokens=usage.get("completion_tokens", 0),
                first_token_s=first,
                done_s=done,
                chunk_times_s=tuple(chunks),
                throttle_responses=throttles,
                error="" if outcome == "ok" else "stream ended without tokens or usage",
                **fields,
            )
        event = json.loads(line[6:])
        if "error" in event:
            error = f"stream error: {event['error'].get('message', '')}"[:200]
            return Record(outcome="failed", throttle_responses=throttles, error=error, **fields)
        if any(c.get("text") for c in event.get("choices", [])):
            chunks.append(time.monotonic() - t0)
            first = chunks[0]
        usage = event.get("usage") or usage
    return Record(outcome="failed", throttle_responses=throttles, error="no [DONE]", **fields)


async def run_load(phase: Phase, tenants: tuple[FairTenant, ...]) -> list[Record]:
    """Every tenant's clients for ``phase.duration_s`` (started requests run to the end)."""
    records: list[Record] = []
    t0 = time.monotonic()

    async def closed_loop(tenant: FairTenant, index: int) -> None:
        rng = random.Random(f"{phase.seed}-{tenant.tenant_id}-{index}")
        while time.monotonic() - t0 < phase.duration_s:
            records.append(await send(phase, tenant, body_of(tenant, rng, phase), t0))

    async def open_loop(tenant: FairTenant) -> None:
        rng, sends = random.Random(f"{phase.seed}-{tenant.tenant_id}"), []
        at_s = rng.expovariate(tenant.rate_rps)
        while at_s < phase.duration_s:
            await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
            sends.append(asyncio.create_task(send(phase, tenant, body_of(tenant, rng, phase), t0)))
            at_s += rng.expovariate(tenant.rate_rps)
        records.extend(await asyncio.gather(*sends))

    await asyncio.gather(
        *(
            closed_loop(t, i) if t.clients else open_loop(t)
            for t in tenants
            for i in range(max(1, t.clients))
        )
    )
    return records


async def add_tenants(
    cluster: Any, client: Any, tenants: tuple[FairTenant, ...], queue: bool
) -> dict[str, str]:
    keys = {}
    for tenant in tenants:
        limits: dict[str, Any] = {"kv_budget_blocks": tenant.budget_blocks, "weight": tenant.weight}
        limits |= {"max_queue_wait_s": MAX_QUEUE_WAIT_S} if queue else {"max_queue_depth": 0}
        response = await client.put(
            f"/admin/tenants/{tenant.tenant_id}", json=limits, headers=cluster.admin
        )
        response.raise_for_status()
        keys[tenant.tenant_id] = response.json()["api_key"]
    return keys


def summarize(
    records: list[Record],
    tenants: tuple[FairTenant, ...],
    queue: bool,
    duration_s: float,
    warmup_s: float,
    costs: Costs,
) -> dict[str, Any]:
    return mode_summary(
        records,
        {t.tenant_id: t.weight for t in tenants},
        [t for t in BACKLOGGED if any(x.tenant_id == t for x in tenants)],
        duration_s,
        warmup_s,
        costs,
        {t.tenant_id: MAX_QUEUE_WAIT_S if queue else None for t in tenants},
    )


@dataclass(frozen=True, slots=True)
class Settings:
    duration_s: float
    warmup_s: float
    overhead_s: float
    seed: int
    replicas: int


async def drive(
    cluster: Any,
    mode: str,
    jobs: set[str],
    settings: Settings,
    prompts: tuple[list[list[int]], Any],
) -> dict[str, Any]:
    """On one deployment: the overhead load (``overhead`` in ``jobs``), the mix (``mix``),
    B alone (``solo``); each job's figures."""
    import httpx

    from workers.config import VTokenConfig

    defaults = VTokenConfig()
    costs = Costs(defaults.fair_prompt_cost, defaults.fair_output_cost)
    queue = mode_settings(mode)[3]
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=900) as client:

        def phase(keys: dict[str, str], duration_s: float) -> Phase:
            return Phase(
                client,
                keys,
                duration_s,
                prompts[0],
                prompts[1],
                settings.seed,
                B_PRIORITY if mode == "priority" else 0,
            )

        if "overhead" in jobs:
            keys = await add_tenants(cluster, client, (OVERHEAD,), queue)
            records = await run_load(phase(keys, settings.overhead_s), (OVERHEAD,))
            out["overhead"] = throughput(records)
        keys = await add_tenants(cluster, client, TENANTS, queue)
        if "mix" in jobs:
            records = await run_load(phase(keys, settings.duration_s), TENANTS)
            out["mix"] = summarize(
                records, TENANTS, queue, settings.duration_s, settings.warmup_s, costs
            )
        if "solo" in jobs:
            solo = (TENANTS[1],)
            records = await run_load(phase(keys, settings.duration_s), solo)
            out["solo"] = summarize(
                records, solo, queue, settings.duration_s, settings.warmup_s, costs
            )
    return out


def plan(modes: list[str]) -> dict[str, set[str]]:
    """Per deployment (a mode's settings), the jobs run on it."""
    deployments: dict[str, set[str]] = {}
    for mode in modes:
        if mode in MODES:
            deployments.setdefault(mode, set()).add("mix")
        elif mode == "solo":
            deployments.setdefault("fair", set()).add("solo")
        elif mode == "overhead":
            deployments.setdefault("fair", set()).add("overhead")
            deployments.setdefault("fcfs", set()).add("overhead")
        else:
            raise typer.BadParameter(f"unknown mode {mode!r}; known: {[*MODES, *EXTRA]}")
    return {mode: deployments[mode] for mode in MODES if mode in deployments}


def run(modes: list[str], settings: Settings) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from bench.quotas import natural_passages
    from serving.demo import local_cluster
    from workers.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    prompts = (natural_passages(tokenizer, 512), tokenizer.decode)
    results: dict[str, dict[str, Any]] = {}
    for mode, jobs in plan(modes).items():
        vtoken, engine, app_args, _ = mode_settings(mode)
        started = time.monotonic()
        with local_cluster(
            settings.replicas,
            vtoken,
            engine=engine,
            app_args=app_args,
            serve_logging={"enable_access_log": False, "log_level": "WARNING"},
        ) as cluster:
            results[mode] = asyncio.run(drive(cluster, mode, jobs, settings, prompts))
        typer.echo(f"{mode}: {sorted(jobs)} in {time.monotonic() - started:.0f} s")
    summary: dict[str, Any] = {
        "config": {
            "duration_s": settings.duration_s,
            "warmup_s": settings.warmup_s,
            "overhead_s": settings.overhead_s,
            "seed": settings.seed,
            "replicas": settings.replicas,
            "cluster_kv_blocks_fair": CLUSTER_KV_BLOCKS,
            "max_queue_wait_s_fair": MAX_QUEUE_WAIT_S,
            "b_priority": B_PRIORITY,
            "tenants": [_fields(t) for t in TENANTS],
        },
        "modes": {mode: result["mix"] for mode, result in results.items() if "mix" in result},
    }
    if "solo" in results.get("fair", {}):
        summary["solo"] = results["fair"]["solo"]["tenants"][0]
    for result in summary["modes"].values():  # judged against B alone
        result["targets"] = mode_targets(result, summary.get("solo"))
    if all("overhead" in results.get(m, {}) for m in ("fair", "fcfs")):
        on, off = results["fair"]["overhead"], results["fcfs"]["overhead"]
        both = on["tokens_per_s"] and off["tokens_per_s"]
        ratio = on["tokens_per_s"] / off["tokens_per_s"] if both else None
        summary["overhead"] = {
            "fair": on,
            "fcfs": off,
            "ratio": None if ratio is None else round(ratio, 3),
        }
    return summary


def _fields(tenant: FairTenant) -> dict[str, Any]:
    return {name: getattr(tenant, name) for name in tenant.__slots__}


def plot(summary: dict[str, Any], path: Path) -> None:
    """Weighted service per window per tenant, one panel per mode."""
    plt = pyplot()
    modes = list(summary["modes"])
    figure, axes = plt.subplots(
        1, max(1, len(modes)), figsize=(6 * max(1, len(modes)), 4), sharey=True
    )
    axes_list = [axes] if len(modes) <= 1 else list(axes)
    for axis, mode in zip(axes_list, modes, strict=False):
        result = summary["modes"][mode]
        for index, tenant in enumerate(result["tenants"]):
            series = tenant["service_per_window"]
            starts = [result["window_s"] * i for i in range(len(series))]
            axis.step(
                starts,
                series,
                where="post",
                color=f"C{index}",
                label=f"{tenant['id']} (weight {tenant['weight']:g})",
            )
        axis.axvline(result["warmup_s"], color="grey", ls=":", lw=1)
        axis.set_title(f"{mode}: Jain min {result['jain_index']}")
        axis.set_xlabel("seconds (window start)")
        axis.legend(fontsize=8)
    axes_list[0].set_ylabel("weighted service per window (tokens / weight)")
    save_figure(figure, path)


SMOKE = Settings(duration_s=20.0, warmup_s=0.0, overhead_s=8.0, seed=0, replicas=1)


def cli(
    json_path: Annotated[Path, typer.Option("--json", help="write the results here")],
    plot_path: Annotated[
        Path | None, typer.Option("--plot", help="PNG of weighted service")
    ] = None,
    duration_s: Annotated[float, typer.Option(min=10, help="arrival window of each load")] = 120,
    warmup_s: Annotated[float, typer.Option(min=0, help="windows before this are not judged")] = 30,
    overhead_s: Annotated[float, typer.Option(min=5, help="one tenant's load per side")] = 45,
    modes: Annotated[
        str, typer.Option(help="of fair,fcfs,priority,solo,overhead")
    ] = "fair,fcfs,priority,solo,overhead",
    seed: Annotated[int, typer.Option()] = 0,
    replicas: Annotated[int, typer.Option(min=1)] = 2,
    smoke: Annotated[
        bool,
        typer.Option(help="a tiny run (one replica, 20 s loads, no warm-up): checks the wiring"),
    ] = False,
) -> None:
    """Weighted fairness under overcommit: fair scheduling vs vLLM's FCFS and priority."""
    settings = SMOKE if smoke else Settings(duration_s, warmup_s, overhead_s, seed, replicas)
    if settings.warmup_s >= settings.duration_s:
        raise typer.BadParameter("--warmup-s must be below --duration-s")
    summary = run(csv_items(modes), settings)
    write_json(json_path, summary, indent=1)
    if plot_path is not None:
        plot(summary, plot_path)
    for mode, result in summary["modes"].items():
        rows = ", ".join(
            f"{t['id']} {t['requests_ok']} ok/{t['requests_throttled']} thr/"
            f"{t['requests_failed']} fail, ttft p99 {t['ttft_p99_s']}"
            for t in result["tenants"]
        )
        typer.echo(f"{mode}: Jain min {result['jain_index']} mean {result['jain_mean']}; {rows}")
    if "solo" in summary:
        typer.echo(f"solo B: ttft p99 {summary['solo']['ttft_p99_s']}")
    if "overhead" in summary:
        typer.echo(f"overhead: fair/fcfs tokens/s {summary['overhead']['ratio']}")
