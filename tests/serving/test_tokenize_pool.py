"""The tokenizer pool: its bounds, its fair order between tenants, cancellation - and, at
the ingress, a tenant flooding long prompts does not hold up another tenant's request
(issue 34: on the shared default pool a trivial request went from 4 ms to 6.1 s)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from serving.errors import HTTPError
from serving.input_limits import InputLimits
from serving.tokenize_pool import TokenizerPool
from tests.redis_server import RedisServer
from tests.serving.ingress_harness import running_ingress

WAIT_S = 10.0  # far above any step here; reached only when the pool is wrong


class Calls:
    """Blocking calls for the pool: each records its name when it starts, then waits for
    its own gate (a ``threading.Event``)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}

    def call(self, name: str) -> Callable[[], str]:
        self.gates[name] = threading.Event()

        def run() -> str:
            self.started.append(name)
            if not self.gates[name].wait(WAIT_S):
                raise TimeoutError(name)
            return name

        return run

    async def until_started(self, count: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while len(self.started) < count:
                await asyncio.sleep(0.005)

    def open(self, *names: str) -> None:
        for name in names or tuple(self.gates):
            self.gates[name].set()


@pytest.fixture
async def pool() -> AsyncIterator[TokenizerPool]:
    pool = TokenizerPool(threads=2, max_per_tenant=3, max_waiting=4)
    yield pool
    pool.check_invariants()
    pool.shutdown()


async def test_a_tenant_runs_on_at_most_half_the_threads(pool: TokenizerPool) -> None:
    calls = Calls()
    run = pool.run
    flood = [asyncio.create_task(run("a", calls.call(f"a{i}"))) for i in range(3)]
    await calls.until_started(1)
    other = asyncio.create_task(run("b", calls.call("b0")))
    await calls.until_started(2)
    assert calls.started == ["a0", "b0"]  # b did not wait behind a1 and a2
    calls.open("b0")
    assert await other == "b0"
    pool.check_invariants()
    calls.open()
    assert await asyncio.gather(*flood) == ["a0", "a1", "a2"]


async def test_a_free_thread_goes_to_the_tenant_served_longest_ago(pool: TokenizerPool) -> None:
    calls = Calls()
    tasks = [asyncio.create_task(pool.run("a", calls.call("a0")))]
    tasks.append(asyncio.create_task(pool.run("b", calls.call("b0"))))
    await calls.until_started(2)
    for name in ("a1", "a2", "b1", "c0"):  # all wait: each tenant runs one at a time
        tasks.append(asyncio.create_task(pool.run(name[0], calls.call(name))))
    await asyncio.sleep(0.05)
    pool.check_invariants()
    assert pool.num_waiting == 4
    calls.open("a0")  # c was never served: c0 goes before a1
    await calls.until_started(3)
    calls.open("b0")  # a was served before b: a1 goes before b1
    await calls.until_started(4)
    calls.open()  # then b1 (a runs a1), then a2
    await asyncio.gather(*tasks)
    assert calls.started == ["a0", "b0", "c0", "a1", "b1", "a2"]


async def test_a_tenant_over_its_share_is_429_and_a_full_queue_503(pool: TokenizerPool) -> None:
    calls = Calls()
    tasks = [asyncio.create_task(pool.run("a", calls.call(f"a{i}"))) for i in range(3)]
    await calls.until_started(1)
    with pytest.raises(HTTPError) as busy:
        await pool.run("a", calls.call("a3"))
    assert busy.value.status == 429 and busy.value.headers == {"Retry-After": "1"}
    with pytest.raises(HTTPError) as limited:  # a caller's own, lower limit
        await pool.run("b", calls.call("b0"), limit=0)
    assert limited.value.status == 429
    tasks += [asyncio.create_task(pool.run("b", calls.call(f"b{i}"))) for i in (1, 2)]
    tasks += [asyncio.create_task(pool.run("c", calls.call(f"c{i}"))) for i in (0, 1)]
    await asyncio.sleep(0.05)
    assert pool.num_running == 2 and pool.num_waiting == 4  # a1 a2 b2 c0 wait, c1 refused
    calls.open()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    full = [r for r in results if isinstance(r, HTTPError)]
    assert [error.status for error in full] == [503]  # c1: the fifth to wait


async def test_a_cancelled_caller_gives_its_place_up(pool: TokenizerPool) -> None:
    calls = Calls()
    first = asyncio.create_task(pool.run("a", calls.call("a0")))
    await calls.until_started(1)
    waiting = asyncio.create_task(pool.run("a", calls.call("a1")))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    pool.check_invariants()
    assert pool.num_waiting == 0
    first.cancel()  # running: its thread stays counted until the call returns
    with pytest.raises(asyncio.CancelledError):
        await first
    assert pool.num_running == 1
    calls.open()
    async with asyncio.timeout(WAIT_S):
        while pool.num_running:
            await asyncio.sleep(0.005)
    assert calls.started == ["a0"]
    assert await pool.run("a", lambda: "after") == "after"


class GatedTokenizer:
    """The real tokenizer; a prompt that starts with ``FLOOD`` waits for ``gate`` first.
    ``tokenized`` names each prompt's first word as its call starts."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.gate = threading.Event()
        self.tokenized: list[str] = []

    def __call__(self, text: str) -> Any:
        self.tokenized.append(text.split()[0])
        if text.startswith("FLOOD"):
            self.gate.wait(WAIT_S)
        return self.tokenizer(text)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(conversation, **kwargs)


async def test_a_tenant_flooding_long_prompts_does_not_hold_up_another(
    redis_server: RedisServer, tokenizer: Any
) -> None:
    """40 long prompts of one tenant (more than the default thread pool has threads, on
    any machine) are stuck in the tokenizer; another tenant's request is still answered,
    and the flooder's requests beyond its share are refused at once."""
    gated = GatedTokenizer(tokenizer)
    limits = InputLimits(tokenizer_threads=2, max_tokenizing_per_tenant=4)
    async with running_ingress(redis_server.url, gated, limits) as ingress:
        flooder = await ingress.add_tenant("flooder", kv_budget_blocks=10_000)
        other = await ingress.add_tenant("other", kv_budget_blocks=100)
        prompt = "FLOOD " + "漢字" * 10
        floods = [asyncio.create_task(ingress.complete(flooder, prompt=prompt)) for _ in range(40)]
        try:
            async with asyncio.timeout(WAIT_S):
                while not gated.tokenized:
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.5)  # the other floods reach the tokenizer or a refusal
            answer = await asyncio.wait_for(ingress.complete(other), WAIT_S)
            assert answer.status_code == 200, answer.text
            assert gated.tokenized.count("FLOOD") == 1  # the flooder holds one thread
        finally:
            gated.gate.set()
        statuses = [response.status_code for response in await asyncio.gather(*floods)]
        assert sorted(statuses) == [200] * 4 + [429] * 36, statuses
        assert ingress.state.tokenize_pool.num_running == 0
        ingress.state.tokenize_pool.check_invariants()
