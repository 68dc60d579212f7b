"""Tokenization on the ingress's own threads, shared fairly between tenants.

Tokenizing is CPU work (a long CJK prompt: tens of ms), so it runs off the event loop; on
the default thread pool every tenant shared one queue, and a tenant sending many long
prompts delayed every other tenant's requests behind its own (a trivial request went from
4 ms to 6.1 s). :class:`TokenizerPool` bounds each tenant instead:

- ``threads`` calls run at once; one tenant runs at most half of them (at least one), so
  with two or more threads another tenant finds one free while a single tenant floods;
- a tenant has at most ``max_per_tenant`` calls running or waiting (a caller may lower
  that, e.g. to the tenant's concurrent-request limit): more is a 429 at once;
- at most ``max_waiting`` calls wait in all: more is a 503 at once;
- a free thread goes to the waiting tenant served longest ago (one never served first),
  each tenant's calls in their order: a tenant's call waits behind at most one call of
  each other waiting tenant, never behind another tenant's whole queue.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from serving.errors import HTTPError

T = TypeVar("T")
BUSY_RETRY_AFTER_S = 1


class TokenizerPool:
    """Runs ``fn(*args)`` on its threads for a tenant (:meth:`run`).

    Invariants (:meth:`check_invariants`): the running calls are at most ``threads``, and a
    tenant's at most ``max_running_per_tenant``; each tenant's running and waiting calls are
    counted in ``in_flight``; a call waits only while no thread is free for its tenant."""

    def __init__(self, threads: int, max_per_tenant: int, max_waiting: int) -> None:
        self.threads = threads
        self.max_per_tenant = max_per_tenant
        self.max_waiting = max_waiting
        self.max_running_per_tenant = max(1, threads // 2)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="vtoken-tokenize")
        self._running: dict[str, int] = {}  # tenant -> calls on a thread
        self._in_flight: dict[str, int] = {}  # tenant -> calls running or waiting
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}  # tenant -> turns, FIFO
        self._served_at: dict[str, int] = {}  # tenant -> sequence number of its last start
        self._sequence = itertools.count()

    @property
    def num_running(self) -> int:
        return sum(self._running.values())

    @property
    def num_waiting(self) -> int:
        return sum(len(turns) for turns in self._waiting.values())

    async def run(
        self, tenant_id: str, fn: Callable[..., T], *args: object, limit: int | None = None
    ) -> T:
        """``fn(*args)`` on a thread once one is free for ``tenant_id``; 429 when the tenant
        has ``min(max_per_tenant, limit)`` calls in flight, 503 when the pool's queue is
        full. A caller cancelled while waiting gives its place up; one cancelled while its
        call runs keeps the thread counted until the call returns."""
        cap = self.max_per_tenant if limit is None else min(limit, self.max_per_tenant)
        in_flight = self._in_flight.get(tenant_id, 0)
        if in_flight >= cap:
            raise HTTPError(
                429,
                f"tenant {tenant_id!r} has {in_flight} prompts being tokenized; retry after "
                f"{BUSY_RETRY_AFTER_S} s",
                "rate_limit",
                headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
            )
        # Calls wait only while no thread is free for their tenant (every finish grants).
        must_wait = not self._free_for(tenant_id)
        if must_wait and self.num_waiting >= self.max_waiting:
            raise HTTPError(
                503,
                "the ingress is busy tokenizing; retry the request",
                "server_error",
                headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
            )
        self._in_flight[tenant_id] = in_flight + 1
        try:
            if must_wait:
                await self._turn(tenant_id)
            else:
                self._start(tenant_id)
        except BaseException:
            self._forget(tenant_id)
            raise
        call = self._executor.submit(fn, *args)
        loop = asyncio.get_running_loop()
        call.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, tenant_id))
        return await asyncio.wrap_future(call)

    def _free_for(self, tenant_id: str) -> bool:
        return (
            self.num_running < self.threads
            and self._running.get(tenant_id, 0) < self.max_running_per_tenant
        )

    async def _turn(self, tenant_id: str) -> None:
        """Wait until :meth:`_grant` starts this call (or give the place up, cancelled)."""
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant_id, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # started, then cancelled: hand it on
                self._running[tenant_id] -= 1
                self._grant()
            else:
                self._waiting[tenant_id].remove(turn)
                if not self._waiting[tenant_id]:
                    del self._waiting[tenant_id]
            raise

    def _start(self, tenant_id: str) -> None:
        self._running[tenant_id] = self._running.get(tenant_id, 0) + 1
        self._served_at[tenant_id] = next(self._sequence)

    def _finished(self, tenant_id: str) -> None:
        """A call's thread is free again (on the event loop)."""
        self._running[tenant_id] -= 1
        self._forget(tenant_id)
        self._grant()

    def _forget(self, tenant_id: str) -> None:
        self._in_flight[tenant_id] -= 1
        if not self._in_flight[tenant_id]:
            del self._in_flight[tenant_id]
            self._running.pop(tenant_id, None)
            self._served_at.pop(tenant_id, None)

    def _grant(self) -> None:
        """Start waiting calls while a thread is free for their tenants: the tenant served
        longest ago first."""
        while True:
            ready = [tenant for tenant in self._waiting if self._free_for(tenant)]
            if not ready:
                return
            tenant_id = min(ready, key=lambda tenant: self._served_at.get(tenant, -1))
            turns = self._waiting[tenant_id]
            turn = turns.popleft()
            if not turns:
                del self._waiting[tenant_id]
            self._start(tenant_id)
            turn.set_result(None)

    def shutdown(self) -> None:
        """Stop the threads once their calls are done (no call may start after)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_invariants(self) -> None:
        assert self.num_running <= self.threads, self._running
        assert all(0 <= n <= self.max_running_per_tenant for n in self._running.values())
        for tenant_id, in_flight in self._in_flight.items():
            waiting = len(self._waiting.get(tenant_id, ()))
            assert in_flight >= self._running.get(tenant_id, 0) + waiting, tenant_id
        assert set(self._waiting) <= set(self._in_flight), self._waiting
