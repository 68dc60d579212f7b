"""`vtoken bench router`: the latency the project's router adds over Ray Serve's default.

The command starts the whole stack itself (a ``redis-server``, local Ray, the Serve app:
ingress with admission, ``--replicas`` vLLM CPU engines with SmolLM2 and vToken H2O at
keep 0.5 on demand, the controller) once per router, one after the other:

- ``serve_default``: Ray Serve's default request router (power of two choices on queue
  length);
- ``vtoken``: ``VTokenRequestRouter``, which asks the control plane's routing plan.

Same replicas, same requests: ``--clients`` closed-loop clients send ``--requests``
completions in all (prompts of ``PROMPT_TOKENS`` tokens of CPython's documentation,
``--max-tokens`` tokens out, not streamed) after ``WARM_UP`` unmeasured ones. Per router:
client-side end-to-end latency p50 / p90 / p99; the ratios vtoken / serve_default. The
engines' own time is in both; what differs is the router (and noise, so ``--rounds``
repeats the pair).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer

from bench.common import Quantiles, doc_tokens, write_json

ROUTERS = ("serve_default", "vtoken")
PROMPT_TOKENS = 64
WARM_UP = 4
VTOKEN = {"policy": "h2o", "keep_ratio": 0.5, "eviction": "on_demand"}


@dataclass(frozen=True, slots=True)
class Latencies:
    """One router's measured requests and their end-to-end latency quantiles."""

    requests: int
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Latencies:
        quantiles = Quantiles.of(values)
        return cls(len(values), quantiles.p50, quantiles.p90, quantiles.p99)


def _over(value: float | None, other: float | None) -> float:
    assert value is not None and other is not None  # every router measured >= 2 requests
    return round(value / other, 3)


async def _tenant_key(base_url: str) -> str:
    """Create the benchmark's tenant (a budget that never binds); its API key."""
    import httpx

    from serving.demo import ADMIN_TOKEN

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        response = await client.put(
            "/admin/tenants/bench", json={"kv_budget_blocks": 10_000}, headers=admin
        )
        response.raise_for_status()
        return str(response.json()["api_key"])


async def _drive(
    base_url: str, key: str, prompts: list[str], clients: int, max_tokens: int
) -> list[float]:
    """Latencies (s) of ``prompts`` sent by ``clients`` closed-loop clients."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        headers = {"Authorization": f"Bearer {key}"}
        queue: asyncio.Queue[str] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        latencies: list[float] = []

        async def one_client() -> None:
            while not queue.empty():
                body = {
                    "model": "smollm2",
                    "prompt": queue.get_nowait(),
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                }
                started = time.perf_counter()
                response = await client.post("/v1/completions", json=body, headers=headers)
                response.raise_for_status()
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(one_client() for _ in range(clients)))
        return latencies


def measure(
    router: str, prompts: list[str], replicas: int, clients: int, max_tokens: int
) -> list[float]:
    from serving.demo import local_cluster

    with local_cluster(replicas, VTOKEN, app_args={"router": router}) as cluster:
        key = asyncio.run(_tenant_key(cluster.url))
        asyncio.run(_drive(cluster.url, key, prompts[:WARM_UP], clients, max_tokens))
        return asyncio.run(_drive(cluster.url, key, prompts[WARM_UP:], clients, max_tokens))


def cli(
    replicas: Annotated[int, typer.Option(min=1)] = 2,
    requests: Annotated[int, typer.Option(min=2, help="Measured requests per router.")] = 60,
    clients: Annotated[int, typer.Option(min=1)] = 4,
    max_tokens: Annotated[int, typer.Option(min=1)] = 8,
    rounds: Annotated[int, typer.Option(min=1, help="Times the pair of routers is run.")] = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """End-to-end latency through the Serve stack: the project's router vs Serve's default."""
    from transformers import AutoTokenizer

    from workers.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    corpus = doc_tokens(tokenizer)
    stride = len(corpus) // (requests + WARM_UP)
    prompts = [
        str(tokenizer.decode(corpus[i * stride : i * stride + PROMPT_TOKENS]))
        for i in range(requests + WARM_UP)
    ]
    latencies: dict[str, list[float]] = {router: [] for router in ROUTERS}
    for round_index in range(rounds):
        for router in ROUTERS:
            latencies[router] += measure(router, prompts, replicas, clients, max_tokens)
            typer.echo(f"round {round_index}: {router} done")
    rows = {router: Latencies.of(values) for router, values in latencies.items()}
    vtoken, default = rows["vtoken"], rows["serve_default"]
    ratios = {
        "p50": _over(vtoken.p50_s, default.p50_s),
        "p90": _over(vtoken.p90_s, default.p90_s),
        "p99": _over(vtoken.p99_s, default.p99_s),
    }
    document = {
        "replicas": replicas,
        "clients": clients,
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "vtoken": VTOKEN,
        "routers": {router: asdict(row) for router, row in rows.items()},
        "vtoken_over_serve_default": ratios,
    }
    typer.echo(json.dumps(document, indent=2))
    if json_path is not None:
        write_json(json_path, document)
