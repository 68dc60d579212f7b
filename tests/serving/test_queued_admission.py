"""The fair queue through the ingress's HTTP path (in-process ingress, real redis-server,
fake engine handle; see ``ingress_harness``): a request waits instead of a 429, within its
tenant's bounds; a client that leaves takes its ticket; a flooding tenant delays another
tenant's request by at most one release."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from controlplane import telemetry
from controlplane.admission import AdmissionConfig
from controlplane.fair_queue import Enqueued
from controlplane.kv_bounds import kv_bounds
from serving.queued_admission import AdmitAsk
from tests.redis_server import RedisServer
from tests.serving.ingress_harness import BLOCK_SIZE, PROMPT, Ingress, admin, running_ingress

MAX_TOKENS = 8


class Permits:
    """An engine gate that lets one answer finish per :meth:`release`."""

    def __init__(self) -> None:
        self._permits = asyncio.Semaphore(0)

    async def wait(self) -> None:
        await self._permits.acquire()

    def release(self) -> None:
        self._permits.release()


@pytest.fixture
async def queued(redis_server: RedisServer, tokenizer: Any) -> AsyncIterator[Ingress]:
    """An ingress whose cluster holds one request at a time (``cluster_kv_blocks``)."""
    prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
    one_request = kv_bounds(prompt_tokens, MAX_TOKENS, BLOCK_SIZE, None, None).peak
    config = AdmissionConfig(
        block_size=BLOCK_SIZE,
        cluster_kv_blocks=one_request,
        queue_poll_s=0.02,
        queue_ticket_ttl_s=1.0,
    )
    async with running_ingress(redis_server.url, tokenizer, admission=config) as under_test:
        yield under_test


async def until(condition: Callable[[], Any], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def depth(ingress: Ingress, tenant_id: str) -> int:
    queues = await ingress.state.queue.queues()
    return queues[tenant_id].depth if tenant_id in queues else 0


def queue_spans(ingress: Ingress) -> list[dict[str, Any]]:
    return [
        dict(span.attributes or {})
        for span in ingress.finished(telemetry.SPAN_INGRESS)
        if telemetry.ATTR_QUEUE_OUTCOME in (span.attributes or {})
    ]


async def test_over_budget_waits_in_the_queue_and_is_served_when_room_frees(
    queued: Ingress,
) -> None:
    api_key = await queued.add_tenant("acme", kv_budget_blocks=2)  # one request at a time
    queued.replicas.gate.clear()
    first = asyncio.create_task(queued.complete(api_key))
    await queued.replicas.arrived.wait()
    second = asyncio.create_task(queued.complete(api_key))
    await until(lambda: _is(depth(queued, "acme"), 1))
    status = (await queued.client.get("/admin/status", headers=admin())).json()
    [acme] = [t for t in status["tenants"] if t["id"] == "acme"]
    assert acme["queue_depth"] == 1 and acme["queue_oldest_wait_s"] >= 0
    metrics = (await queued.client.get("/metrics", headers=admin())).text
    assert 'vtoken_ingress_queue_depth{tenant="acme"} 1.0' in metrics
    queued.replicas.gate.set()
    unqueued, waited = await first, await second
    assert unqueued.status_code == 200 and waited.status_code == 200
    [span] = queue_spans(queued)
    assert span[telemetry.ATTR_QUEUE_OUTCOME] == "admitted"
    assert span[telemetry.ATTR_QUEUE_DEPTH] == 1 and span[telemetry.ATTR_QUEUE_WAIT_S] > 0
    # The answer says how long it waited; one that never queued says nothing.
    assert "x-vtoken-queue-wait" not in unqueued.headers
    wait_s = float(waited.headers["x-vtoken-queue-wait"])
    assert wait_s == pytest.approx(span[telemetry.ATTR_QUEUE_WAIT_S], abs=1e-3)
    assert (
        'vtoken_ingress_queue_wait_seconds_count{tenant="acme"} 1.0'
        in (await queued.client.get("/metrics", headers=admin())).text
    )


async def test_past_the_longest_wait_it_is_todays_429_with_retry_after(queued: Ingress) -> None:
    api_key = await queued.add_tenant("acme", kv_budget_blocks=2, max_queue_wait_s=0.3)
    queued.replicas.gate.clear()
    first = asyncio.create_task(queued.complete(api_key))
    await queued.replicas.arrived.wait()
    started = time.monotonic()
    throttled = await queued.complete(api_key)
    assert time.monotonic() - started >= 0.3
    assert throttled.status_code == 429
    assert int(throttled.headers["Retry-After"]) >= 1
    assert "over its KV budget" in throttled.json()["error"]["message"]
    assert await depth(queued, "acme") == 0  # its ticket left with it
    [span] = queue_spans(queued)
    assert span[telemetry.ATTR_QUEUE_OUTCOME] == "timeout"
    queued.replicas.gate.set()
    assert (await first).status_code == 200


async def test_past_the_queue_depth_it_is_a_429_at_once(queued: Ingress) -> None:
    api_key = await queued.add_tenant("acme", kv_budget_blocks=2, max_queue_depth=1)
    queued.replicas.gate.clear()
    first = asyncio.create_task(queued.complete(api_key))
    await queued.replicas.arrived.wait()
    second = asyncio.create_task(queued.complete(api_key))
    await until(lambda: _is(depth(queued, "acme"), 1))
    started = time.monotonic()
    refused = await queued.complete(api_key)
    assert time.monotonic() - started < queued.state.queue.config.queue_ticket_ttl_s
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    queued.replicas.gate.set()
    assert [(await first).status_code, (await second).status_code] == [200, 200]


async def test_at_its_concurrency_limit_a_tenant_with_a_queue_waits_for_its_turn(
    queued: Ingress,
) -> None:
    """The pre-check lets a tenant at its concurrency limit through when it may queue; the
    request then waits for the running one to end instead of a 429."""
    api_key = await queued.add_tenant("acme", kv_budget_blocks=100, max_concurrent_requests=1)
    queued.replicas.gate.clear()
    first = asyncio.create_task(queued.complete(api_key))
    await queued.replicas.arrived.wait()
    second = asyncio.create_task(queued.complete(api_key))
    await until(lambda: _is(depth(queued, "acme"), 1))
    queued.replicas.gate.set()
    assert [(await first).status_code, (await second).status_code] == [200, 200]


async def test_a_client_that_leaves_while_queued_takes_its_ticket(queued: Ingress) -> None:
    api_key = await queued.add_tenant("acme", kv_budget_blocks=2)
    queued.replicas.gate.clear()
    first = asyncio.create_task(queued.complete(api_key))
    await queued.replicas.arrived.wait()
    leaving = asyncio.create_task(queued.complete(api_key))
    await until(lambda: _is(depth(queued, "acme"), 1))
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await until(lambda: _is(depth(queued, "acme"), 0), timeout_s=0.5)  # not its lease: left
    assert queued.state.admitter.waiting == {}
    queued.replicas.gate.set()
    assert (await first).status_code == 200
    assert await queued.state.admission.reserved_blocks("acme") == 0


async def test_a_client_that_leaves_while_its_ticket_is_being_taken_takes_it(
    queued: Ingress,
) -> None:
    """The client leaves after Redis queued its ticket but before the reply arrived: the
    ticket is taken away once the reply is in, not held until its lease lapses."""
    await queued.add_tenant("acme", kv_budget_blocks=1)
    quota = await queued.state.store.get_quota("acme")
    assert quota is not None
    running = await queued.state.admission.admit(quota, "running", 8, MAX_TOKENS)
    assert running.reservation is not None  # the tenant's budget is full
    admitter, replied, reply_late = queued.state.admitter, asyncio.Event(), asyncio.Event()
    enqueue = admitter.queue.enqueue

    async def slow_reply(*args: Any) -> Enqueued:
        joined = await enqueue(*args)  # in Redis now
        replied.set()
        await reply_late.wait()
        return joined

    admitter.queue.enqueue = slow_reply  # type: ignore[method-assign]
    ask = AdmitAsk(quota, "leaving", 8, MAX_TOKENS)
    leaving = asyncio.create_task(admitter.admit(ask, trace.INVALID_SPAN))
    await replied.wait()
    assert await depth(queued, "acme") == 1
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    reply_late.set()
    await until(lambda: _is(depth(queued, "acme"), 0), timeout_s=0.5)  # not its lease: left
    await queued.state.admission.release(running.reservation)


async def test_a_request_larger_than_the_cluster_is_a_400_naming_its_capacity(
    queued: Ingress,
) -> None:
    api_key = await queued.add_tenant("acme", kv_budget_blocks=1000)
    capacity = queued.state.admission.config.cluster_kv_blocks
    started = time.monotonic()
    refused = await queued.complete(api_key, max_tokens=64)
    assert time.monotonic() - started < queued.state.queue.config.queue_ticket_ttl_s
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert f"more than the cluster's capacity of {capacity} blocks" in message
    assert await depth(queued, "acme") == 0


async def test_a_flooding_tenant_delays_another_by_at_most_one_release(queued: Ingress) -> None:
    """The cluster holds one request. ``a-flood`` has one running and five queued when
    ``b-calm`` sends one: it is admitted at the second release at the latest (a tie of
    counters goes to ``a-flood`` by name, the worst case), not after the flood's five."""
    permits = Permits()
    queued.replicas.gate = permits  # type: ignore[assignment]
    flood = await queued.add_tenant("a-flood", kv_budget_blocks=1000, max_queue_depth=8)
    calm = await queued.add_tenant("b-calm", kv_budget_blocks=1000)
    tasks = [asyncio.create_task(queued.complete(flood))]
    await queued.replicas.arrived.wait()
    for num_queued in range(1, 6):  # one at a time: a tenant tokenizes at most 4 at once
        tasks.append(asyncio.create_task(queued.complete(flood)))
        await until(lambda n=num_queued: _is(depth(queued, "a-flood"), n))
    tasks.append(asyncio.create_task(queued.complete(calm)))
    await until(lambda: _is(depth(queued, "b-calm"), 1))
    status = (await queued.client.get("/admin/status", headers=admin())).json()
    depths = {t["id"]: t["queue_depth"] for t in status["tenants"]}
    assert depths == {"a-flood": 5, "b-calm": 1}
    requests = queued.replicas.requests
    for released in range(1, 7):  # each release admits the next request
        permits.release()
        await until(lambda n=released: _true(len(requests) > n))
    permits.release()
    results: list[httpx.Response] = await asyncio.gather(*tasks)
    assert [r.status_code for r in results] == [200] * 7
    order = [request["tenant_id"] for request in requests]
    assert order[0] == "a-flood"
    assert order.index("b-calm") <= 2, order  # after at most one more of the flood's
    assert order.count("a-flood") == 6


async def _is(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def _true(value: bool) -> bool:
    return value


async def test_a_ticket_whose_lease_lapsed_while_its_ingress_waits_joins_again(
    queued: Ingress,
) -> None:
    """A poll a whole lease late (a starved event loop) finds its ticket gone: the request
    takes a new one at the back of its queue and is served, not answered 429."""
    api_key = await queued.add_tenant("acme", kv_budget_blocks=2)  # one request at a time
    queued.replicas.gate.clear()
    first = asyncio.create_task(queued.complete(api_key))
    await queued.replicas.arrived.wait()
    second = asyncio.create_task(queued.complete(api_key))
    await until(lambda: _is(depth(queued, "acme"), 1))
    keys = queued.keys
    [ticket] = await queued.state.store.redis.zrange(keys.queue_tickets("acme"), 0, -1)
    # What a lapsed lease leaves once the next script purges it: the ticket is gone.
    await queued.state.store.redis.zrem(keys.queue_tickets("acme"), ticket)
    await queued.state.store.redis.zrem(keys.queue_leases("acme"), ticket)
    await until(lambda: _is(depth(queued, "acme"), 1))  # it took a new ticket
    queued.replicas.gate.set()
    assert (await first).status_code == 200
    answer = await second
    assert answer.status_code == 200, answer.text
    assert float(answer.headers["x-vtoken-queue-wait"]) > 0
