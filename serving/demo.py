"""``vtoken demo``: the whole system on one machine, end to end, with a readable report.

Starts its own ``redis-server`` (own folder, free port), local Ray, and the Serve app with
CPU replicas of SmolLM2 running vToken + H2O; creates three tenants with different KV
quotas; drives a mixed workload in which one tenant asks for more KV than its quota
allows; shows a live status table; prints (and optionally writes) the final report; shuts
everything down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import httpx

ADMIN_TOKEN = secrets.token_urlsafe(32)  # this run only: the demo binds to loopback
GIVE_UP_AFTER_S = 600.0  # per request; each 429 waits its Retry-After (at most 5 s here)


@dataclass(frozen=True, slots=True)
class DemoTenant:
    tenant_id: str
    kv_budget_blocks: int
    concurrency: int  # requests in flight at once
    num_requests: int


DEMO_TENANTS = (
    DemoTenant("alpha", kv_budget_blocks=96, concurrency=3, num_requests=6),
    DemoTenant("beta", kv_budget_blocks=48, concurrency=2, num_requests=4),
    DemoTenant("gamma", kv_budget_blocks=16, concurrency=6, num_requests=12),  # over quota
)


@dataclass
class Tally:
    ok: int = 0
    throttled: int = 0
    failed: int = 0
    peak_kv_blocks: int = 0


def over_budget_stretches(
    samples: list[tuple[float, int]], budget: int
) -> list[tuple[float, float]]:
    """The ``(start, end)`` stretches that ``samples`` ((time, blocks), in time order) spend
    above ``budget``; a sample above budget lasts until the next one."""
    stretches: list[tuple[float, float]] = []
    start: float | None = None
    for (at_s, blocks), (next_s, _) in zip(samples, samples[1:], strict=False):
        if blocks > budget:
            start = at_s if start is None else start
            end = next_s
        elif start is not None:
            stretches.append((start, end))
            start = None
    if start is not None:
        stretches.append((start, end))
    return stretches


def over_budget(samples: list[tuple[float, int]], budget: int) -> tuple[float, float]:
    """(total seconds, longest stretch in seconds) that ``samples`` spend above ``budget``."""
    lengths = [end - start for start, end in over_budget_stretches(samples, budget)]
    return sum(lengths), max(lengths, default=0.0)


@dataclass
class DemoState:
    tallies: dict[str, Tally] = field(default_factory=dict)
    peak_used: dict[str, int] = field(default_factory=dict)
    peak_naive: dict[str, int] = field(default_factory=dict)
    last_status: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def observe(self, status: dict[str, Any]) -> None:
        self.last_status = status
        now_s = time.monotonic() - self.started
        for tenant in status["tenants"]:
            self.samples.setdefault(tenant["id"], []).append((now_s, tenant["kv_blocks"]))
        for replica in status["replicas"]:
            if replica.get("fresh"):
                rid = replica["id"]
                self.peak_used[rid] = max(self.peak_used.get(rid, 0), replica["blocks_used"])
                naive = replica["naive_equivalent_blocks"]
                self.peak_naive[rid] = max(self.peak_naive.get(rid, 0), naive)
        for tenant in status["tenants"]:
            tally = self.tallies.setdefault(tenant["id"], Tally())
            tally.peak_kv_blocks = max(tally.peak_kv_blocks, tenant["kv_blocks"])


def prompts() -> list[str]:
    from pydoc_data.topics import topics

    texts = [topics[name] for name in ("for", "while", "if", "try", "with", "class")]
    return [f"Summarize this passage.\n\n{text[:1400]}" for text in texts]


async def drive_tenant(
    client: httpx.AsyncClient, tenant: DemoTenant, api_key: str, model: str, state: DemoState
) -> None:
    tally = state.tallies.setdefault(tenant.tenant_id, Tally())
    texts = prompts()
    semaphore = asyncio.Semaphore(tenant.concurrency)

    async def one(index: int) -> None:
        async with semaphore:
            body = {
                "model": model,
                "prompt": texts[index % len(texts)],
                "max_tokens": 96,
                "temperature": 0.0,
                "stream": index % 2 == 1,
            }
            headers = {"Authorization": f"Bearer {api_key}"}
            # A well-behaved client: retry after each Retry-After until its own deadline (a
            # count of attempts would make the outcome depend on the machine's speed).
            give_up = time.monotonic() + GIVE_UP_AFTER_S
            while True:
                response = await client.post("/v1/completions", json=body, headers=headers)
                if response.status_code != 429 or time.monotonic() >= give_up:
                    break
                tally.throttled += 1
                await asyncio.sleep(min(float(response.headers.get("Retry-After", "1")), 5.0))
            if response.status_code == 200:
                tally.ok += 1
            else:
                tally.failed += 1

    await asyncio.gather(*(one(i) for i in range(tenant.num_requests)))


def status_table(state: DemoState):  # type: ignore[no-untyped-def]
    from rich.table import Table

    table = Table(title="vtoken demo: live status")
    for column in ("tenant / replica", "quota / total", "KV blocks now", "peak", "ok", "429"):
        table.add_column(column, justify="right")
    for tenant in state.last_status.get("tenants", []):
        tally = state.tallies.get(tenant["id"], Tally())
        table.add_row(
            tenant["id"],
            str(tenant["quota_blocks"]),
            str(tenant["kv_blocks"]),
            str(tally.peak_kv_blocks),
            str(tally.ok),
            str(tally.throttled),
        )
    for replica in state.last_status.get("replicas", []):
        if replica.get("fresh"):
            rid = replica["id"]
            table.add_row(
                f"replica {rid[:8]}",
                str(replica["blocks_total"]),
                str(replica["blocks_used"]),
                f"{state.peak_used.get(rid, 0)} (naive {state.peak_naive.get(rid, 0)})",
                f"reclaimed {replica['blocks_reclaimed']}",
                "",
            )
    return table


async def run_workload(base_url: str, model: str, state: DemoState) -> None:
    from rich.live import Live

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        keys = {}
        for tenant in DEMO_TENANTS:
            body = {"kv_budget_blocks": tenant.kv_budget_blocks}
            response = await client.put(
                f"/admin/tenants/{tenant.tenant_id}", json=body, headers=admin
            )
            response.raise_for_status()
            keys[tenant.tenant_id] = response.json()["api_key"]
        work = asyncio.gather(
            *(drive_tenant(client, t, keys[t.tenant_id], model, state) for t in DEMO_TENANTS)
        )
        with Live(status_table(state), refresh_per_second=2) as live:
            while not work.done():
                status = (await client.get("/admin/status", headers=admin)).json()
                state.observe(status)
                live.update(status_table(state))
                await asyncio.wait([work], timeout=0.2)
            await work
            await asyncio.sleep(0.5)  # one more report after the last request
            state.observe((await client.get("/admin/status", headers=admin)).json())
            live.update(status_table(state))


def final_report(state: DemoState) -> dict[str, Any]:
    """Per tenant: budget, peak measured active KV, time above budget, requests ok /
    throttled (429 answers, each retried) / failed; per replica: peak blocks vs what
    Naive-Evict would hold, blocks reclaimed, preemptions and evictions forced by memory
    or pressure (each one a preemption avoided), and what the repacks cost (bytes copied,
    seconds spent copying)."""
    tenants = []
    for tenant in DEMO_TENANTS:
        tally = state.tallies[tenant.tenant_id]
        seconds_over, longest_over = over_budget(
            state.samples.get(tenant.tenant_id, []), tenant.kv_budget_blocks
        )
        tenants.append(
            {
                "id": tenant.tenant_id,
                "quota_blocks": tenant.kv_budget_blocks,
                "peak_kv_blocks": tally.peak_kv_blocks,
                "seconds_over_budget": round(seconds_over, 2),
                "longest_over_budget_s": round(longest_over, 2),
                "requests_ok": tally.ok,
                "throttled_429s": tally.throttled,
                "requests_failed": tally.failed,
            }
        )
    replicas = [
        {
            "id": r["id"],
            "blocks_total": r["blocks_total"],
            "peak_blocks_used": state.peak_used.get(r["id"], 0),
            "blocks_reclaimed": r["blocks_reclaimed"],
            "naive_equivalent_blocks": state.peak_naive.get(r["id"], 0),
            "preemptions": r.get("preemptions", 0),
            "evictions_under_pressure": r.get("evictions_under_pressure", 0),
            "evictions_below_budget": r.get("evictions_below_budget", 0),
            "repack_bytes": r.get("repack_bytes", 0),
            "repack_seconds": r.get("repack_seconds", 0.0),
        }
        for r in state.last_status.get("replicas", [])
        if r.get("fresh")
    ]
    return {"tenants": tenants, "replicas": replicas}


@dataclass(frozen=True, slots=True)
class LocalCluster:
    url: str  # the HTTP API
    redis: Any  # controlplane.local_redis.LocalRedis (append-only; benchmarks stop it)
    admin_token: str
    model_path: str  # the engines' model folder (its tokenizer too)

    @property
    def redis_url(self) -> str:
        return str(self.redis.url)

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}


@contextlib.contextmanager
def local_cluster(
    num_replicas: int,
    vtoken: dict[str, Any],
    *,
    engine: dict[str, Any] | None = None,
    app_args: dict[str, Any] | None = None,
    ray_init: dict[str, Any] | None = None,
    serve_logging: dict[str, Any] | None = None,
    folder: Path | None = None,
    redis_password: str | None = None,
) -> Iterator[LocalCluster]:
    """Redis + Ray + the Serve app on this machine; yields its URLs. The engines run
    SmolLM2 unless ``engine`` (fields of ``ReplicaSettings``) says otherwise; ``app_args``
    (fields of ``AppArgs``), ``ray_init`` (``ray.init`` arguments) and ``serve_logging``
    (Serve's ``logging_config``) add to the defaults.
    Redis lives in ``folder`` (a temporary one by default), with ``redis_password`` if
    given: the URL then travels as a Serve config must carry it, in ``$VTOKEN_REDIS_URL``,
    not in the config. ``ray_init`` may name an ``address`` to deploy onto a running
    cluster. The admin token is ``ADMIN_TOKEN``."""
    import ray
    from ray import serve

    from controlplane.local_redis import LocalRedis
    from workers.models import resolve_model

    engine = {"model": "smollm2", "max_model_len": 1024, "dtype": "float32", **(engine or {})}
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vtoken-")))
        redis = stack.enter_context(LocalRedis(folder / "redis", password=redis_password))
        if redis_password:  # in the driver (build_app) and, below, in every actor
            stack.enter_context(mock.patch.dict(os.environ, {"VTOKEN_REDIS_URL": redis.url}))
            ray_init = _with_redis_url(ray_init, redis.url)
        ray.init(
            **{
                "include_dashboard": False,
                "logging_level": logging.ERROR,
                "log_to_driver": False,
                **(ray_init or {}),
            }
        )
        try:
            redis_url = None if redis_password else redis.url  # else in the environment
            args = _app_args(num_replicas, {**engine, "vtoken": vtoken}, app_args, redis_url)
            port = _serve_app(args, serve_logging)
            model_path = str(resolve_model(engine["model"]))
            yield LocalCluster(f"http://127.0.0.1:{port}", redis, ADMIN_TOKEN, model_path)
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            if not redis.running:
                redis.start()  # a benchmark stopped it: its context manager stops it again


def _with_redis_url(ray_init: dict[str, Any] | None, redis_url: str) -> dict[str, Any]:
    """``ray_init`` whose runtime environment gives every actor ``$VTOKEN_REDIS_URL``."""
    runtime_env = dict((ray_init or {}).get("runtime_env", {}))
    env_vars = {**runtime_env.get("env_vars", {}), "VTOKEN_REDIS_URL": redis_url}
    return {**(ray_init or {}), "runtime_env": {**runtime_env, "env_vars": env_vars}}


def _app_args(
    num_replicas: int,
    engine: dict[str, Any],
    app_args: dict[str, Any] | None,
    redis_url: str | None,
) -> dict[str, Any]:
    """The ``AppArgs`` fields of a local cluster: ``num_replicas`` small replicas running
    ``engine``, a fast controller, ``app_args`` over those, and ``redis_url`` unless it is
    ``None`` (then the app reads ``$VTOKEN_REDIS_URL``)."""
    return {
        **({} if redis_url is None else {"redis_url": redis_url}),
        "num_replicas": num_replicas,
        "replica_num_cpus": 0.5,
        "controller_period_s": 0.2,
        **(app_args or {}),
        "engine": engine,
    }


def _serve_app(args: dict[str, Any], serve_logging: dict[str, Any] | None) -> int:
    """Serve (on a free port of this machine) running the app ``args`` (fields of
    ``AppArgs``) describe, behind ``ADMIN_TOKEN``; returns the port."""
    from ray import serve

    from controlplane.local_redis import free_port
    from serving.app import build_app

    port = free_port()
    # One proxy, on the head: nodes sharing this machine cannot all bind the port.
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(
        build_app(args, admin_token=ADMIN_TOKEN),
        name="vtoken",
        route_prefix="/",
        logging_config=serve_logging,
    )
    return port


def run_demo(report_path: Path | None, num_replicas: int = 2) -> dict[str, Any]:
    from rich.console import Console

    console = Console()
    started = time.monotonic()
    vtoken = {"policy": "h2o", "keep_ratio": 0.5, "eviction": "on_demand"}
    console.print(f"Starting Redis, Ray and {num_replicas} SmolLM2 replicas (vToken + h2o)...")
    state = DemoState()
    with local_cluster(num_replicas, vtoken) as cluster:
        console.print(f"Serving at {cluster.url}; driving the workload")
        asyncio.run(run_workload(cluster.url, "smollm2", state))
    report = final_report(state)
    console.print_json(json.dumps(report))
    console.print(f"Done in {time.monotonic() - started:.0f} s.")
    if report_path is not None:
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
