"""What a client of the ingress sees under faults, and what happens to reservations:
Redis away or refusing -> 503 with an OpenAI error body and Retry-After (never a plain-text
500, never Redis's address); a release Redis cannot take never spoils a finished answer
and lands later; long requests renew their reservation; admission ignores ingress clocks;
a replica failing mid-answer ends it with an error (JSON 503 or an SSE error event)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from controlplane.clock import SystemClock
from controlplane.redis_conn import RedisConfig, connect
from tests.controlplane.fakes import FakeClock
from tests.faults.ingress import (
    Ingress,
    client_of,
    leaks_internals,
    make_ingress,
    sse_events,
    wait_released,
)
from tests.faults.redis_faults import FAULTS, read_only
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test alone (it may be stopped)."""
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture
async def ingress(redis: aioredis.Redis, tokenizer: Any) -> AsyncIterator[Ingress]:
    state, replicas = make_ingress(redis, SystemClock(), tokenizer)
    async with client_of(state) as client:
        yield Ingress(client, state, replicas)
    await state.releaser.close()


def assert_openai_503(response: Any, redis_port: int) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == 503
    assert int(response.headers["Retry-After"]) >= 1
    assert not leaks_internals(response.text, redis_port), response.text


async def test_redis_down_at_the_ingress_is_an_openai_503(
    own_server: RedisServer, tokenizer: Any
) -> None:
    redis = connect(RedisConfig(url=own_server.url, command_retries=0))
    state, _ = make_ingress(redis, SystemClock(), tokenizer)
    async with client_of(state) as client:
        under_test = Ingress(client, state, _)
        await under_test.add_tenant("acme", kv_budget_blocks=8)
        assert (await under_test.complete("acme")).status_code == 200
        own_server.stop()
        for stream in (False, True):
            assert_openai_503(await under_test.complete("acme", stream=stream), own_server.port)
        models = await client.get(
            "/v1/models", headers={"Authorization": f"Bearer {Ingress.api_key('acme')}"}
        )
        assert_openai_503(models, own_server.port)
        admin = {"Authorization": "Bearer admin-token-of-the-fault-suite"}
        for method, path in (("GET", "/admin/status"), ("GET", "/admin/tenants")):
            response = await client.request(method, path, headers=admin)
            assert_openai_503(response, own_server.port)
    await redis.aclose()


@pytest.mark.parametrize("fault", ["read_only", "out_of_memory"])
async def test_redis_refusing_admission_is_an_openai_503(
    fault: str, ingress: Ingress, admin: aioredis.Redis, redis_server: RedisServer
) -> None:
    await ingress.add_tenant("acme", kv_budget_blocks=8)
    async with FAULTS[fault](admin):
        assert_openai_503(await ingress.complete("acme"), redis_server.port)
    assert (await ingress.complete("acme")).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_release_never_spoils_a_finished_answer(
    stream: bool, ingress: Ingress, admin: aioredis.Redis
) -> None:
    """Redis turns read-only while the answer runs: the client still gets the whole answer
    (not a 500, not an error event), and the reservation is released once Redis is back."""
    await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.gate.clear()
    answer = asyncio.create_task(ingress.complete("acme", stream=stream))
    await asyncio.wait_for(ingress.replicas.arrived.wait(), 10)
    async with read_only(admin):
        ingress.replicas.gate.set()
        response = await asyncio.wait_for(answer, 30)
        assert response.status_code == 200, response.text
        if stream:
            events = sse_events(response.text)
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello there"
        else:
            assert response.json()["choices"][0]["text"] == "Hello there"
        assert ingress.state.releaser.pending == 1
        assert await ingress.state.admission.reserved_blocks("acme") > 0
    assert await wait_released(ingress.state.admission, "acme", timeout_s=20) == 0
    assert ingress.state.releaser.pending == 0
    await ingress.state.admission.check_invariants("acme")


async def test_a_release_stuck_on_paused_writes_does_not_hold_the_answer(
    ingress: Ingress, admin: aioredis.Redis
) -> None:
    await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.gate.clear()
    answer = asyncio.create_task(ingress.complete("acme"))
    await asyncio.wait_for(ingress.replicas.arrived.wait(), 10)
    await admin.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
    try:
        started = time.monotonic()
        ingress.replicas.gate.set()
        response = await asyncio.wait_for(answer, 30)
        elapsed = time.monotonic() - started
        assert response.status_code == 200 and elapsed < 2.5, elapsed  # writes paused 3 s
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
    assert await wait_released(ingress.state.admission, "acme", timeout_s=20) == 0


async def test_a_long_request_renews_its_reservation(redis: aioredis.Redis, tokenizer: Any) -> None:
    """TTL 0.3 s, a request running 1 s: without renewals it would lapse at 0.3 s and a
    second request would slip past the concurrency limit of 1."""
    state, replicas = make_ingress(redis, SystemClock(), tokenizer, reservation_ttl_s=0.3)
    async with client_of(state) as client:
        ingress = Ingress(client, state, replicas)
        quota = await ingress.add_tenant("acme", kv_budget_blocks=8, max_concurrent_requests=1)
        replicas.gate.clear()
        running = asyncio.create_task(ingress.complete("acme"))
        await asyncio.wait_for(replicas.arrived.wait(), 10)
        for _ in range(4):
            await asyncio.sleep(0.25)
            probe = await state.admission.admit(quota, f"probe-{time.monotonic()}", 4, 4)
            assert probe.reason == "max_concurrent_requests"
        replicas.gate.set()
        assert (await running).status_code == 200
    assert await state.admission.reserved_blocks("acme") == 0
    await state.releaser.close()


async def test_an_ingress_whose_clock_is_ten_minutes_ahead_changes_nothing(
    redis: aioredis.Redis, tokenizer: Any
) -> None:
    """Ingress B's clock is 601 s ahead of A's (TTL 600 s): B must neither lapse A's live
    reservations nor admit past the tenant's concurrency limit."""
    now = time.time()
    a, a_replicas = make_ingress(redis, FakeClock(now), tokenizer)
    b, _ = make_ingress(redis, FakeClock(now + 601), tokenizer, keys=a.admission.keys)
    async with client_of(a) as a_client, client_of(b) as b_client:
        ingress_a, ingress_b = Ingress(a_client, a, a_replicas), Ingress(b_client, b, _)
        await ingress_a.add_tenant("acme", kv_budget_blocks=100, max_concurrent_requests=2)
        a_replicas.gate.clear()
        held = [asyncio.create_task(ingress_a.complete("acme")) for _ in range(2)]
        while len(a_replicas.streams) < 2:
            await asyncio.sleep(0.01)
        skewed = await ingress_b.complete("acme")
        assert skewed.status_code == 429, skewed.text
        assert (
            await b.admission.reserved_blocks("acme")
            == await a.admission.reserved_blocks("acme")
            > 0
        )
        a_replicas.gate.set()
        assert [(await task).status_code for task in held] == [200, 200]
    await a.releaser.close()
    await b.releaser.close()


@pytest.mark.parametrize(
    ("stream", "how"), [(s, h) for s in (False, True) for h in ("fail", "cut")]
)
async def test_a_replica_dying_mid_answer_ends_it_with_an_error(
    stream: bool, how: str, ingress: Ingress, redis_server: RedisServer
) -> None:
    """The replica raises (Ray's ActorDiedError) or its stream just stops: either way the
    client gets an error, never an answer silently cut short."""
    await ingress.add_tenant("acme", kv_budget_blocks=8)
    setattr(ingress.replicas, how, True)
    response = await ingress.complete("acme", stream=stream)
    assert not leaks_internals(response.text, redis_server.port), response.text
    if stream:
        assert response.status_code == 200
        *chunks, error, done = sse_events(response.text)
        assert done == "[DONE]" and [c["choices"][0]["text"] for c in chunks] == ["Hello"]
        assert error["error"]["type"] == "server_error" and error["error"]["code"] == 503
        assert set(error["error"]) == {"message", "type", "code"}
    else:
        assert_openai_503(response, redis_server.port)
    assert await ingress.state.admission.reserved_blocks("acme") == 0


async def test_a_client_that_leaves_cancels_the_engine_request_and_releases(
    ingress: Ingress,
) -> None:
    """The handler is cancelled mid-answer (the client hung up): the replica stream is
    cancelled (Serve then aborts the vLLM request, freeing its KV: see
    tests/serving/test_engine_host.py) and the reservation is given back."""
    await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.gate.clear()
    answer = asyncio.create_task(ingress.complete("acme"))
    await asyncio.wait_for(ingress.replicas.arrived.wait(), 10)
    answer.cancel()
    await asyncio.gather(answer, return_exceptions=True)
    (stream,) = ingress.replicas.streams
    assert stream.cancelled
    assert await wait_released(ingress.state.admission, "acme", timeout_s=20) == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_cancelled_at_any_moment_leaks_nothing_and_runs_on_nowhere(
    ingress: Ingress, stream: bool
) -> None:
    """Clients that leave at any moment of admission and answering (cancelled after 0 to
    ~20 ms, through the admission script's commit): once committed, a reservation is
    released however the handler was cancelled, and no replica stream runs on after its
    client left. (Before: 96 of 200 such cancels leaked a reservation until its TTL.)"""
    await ingress.add_tenant("acme", kv_budget_blocks=10_000)
    ingress.replicas.gate.clear()  # answers wait after their first chunk
    delays = [i * 0.0005 for i in range(40)]
    for delay in delays:
        answer = asyncio.create_task(ingress.complete("acme", stream=stream))
        await asyncio.sleep(delay)
        answer.cancel()
        done, _ = await asyncio.wait([answer], timeout=5)
        assert done, f"cancelled after {delay} s, the request ran on"
    assert await wait_released(ingress.state.admission, "acme", timeout_s=20) == 0
    await asyncio.sleep(0.1)
    for replica_stream in ingress.replicas.streams:  # every answer started was aborted
        assert replica_stream.cancelled
    ingress.replicas.gate.set()
