"""A replica that dies under a request: before the request's first chunk another replica
serves it (the client never sees the death), after it the client gets the documented 503
(a retry would repeat what it was sent)."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from serving import answer_stream
from serving.answer_stream import REPLICA_ATTEMPTS
from tests.serving.ingress_harness import Ingress


@pytest.mark.parametrize("stream", [False, True])
async def test_a_replica_dead_before_its_first_chunk_is_replaced(
    ingress: Ingress, stream: bool
) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.dead = REPLICA_ATTEMPTS - 1
    response = await ingress.complete(api_key, stream=stream)
    assert response.status_code == 200, response.text
    assert "there" in response.text  # the answer's second chunk
    assert len(ingress.replicas.requests) == REPLICA_ATTEMPTS  # the same request each time
    assert len({r["request_id"] for r in ingress.replicas.requests}) == 1


async def test_a_request_whose_every_replica_dies_is_503(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.dead = REPLICA_ATTEMPTS + 1
    response = await ingress.complete(api_key)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert len(ingress.replicas.requests) == REPLICA_ATTEMPTS
    assert (await ingress.complete(api_key)).status_code == 200  # the last dead one


async def test_a_replica_dead_after_its_first_chunk_is_not_retried(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.fail, ingress.replicas.fail_with = True, ActorDiedError
    response = await ingress.complete(api_key)
    assert response.status_code == 503
    assert len(ingress.replicas.requests) == 1


async def test_a_replica_unavailable_before_its_first_chunk_is_not_retried(
    ingress: Ingress,
) -> None:
    """Ray's ``ActorUnavailableError`` says the task "may or may not have been executed":
    the replica may be alive and still running the request (Serve keeps it routable, and
    the tenant's warm set ranks it first again), so a retry could run it twice."""
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.dead = 1
    ingress.replicas.dead_with = lambda: ActorUnavailableError("Actor is unavailable.", None)
    response = await ingress.complete(api_key)
    assert response.status_code == 503, response.text
    assert len(ingress.replicas.requests) == 1


async def test_a_client_gone_during_the_backoff_sends_no_other_attempt(
    ingress: Ingress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while waiting to retry: no further attempt, the reservation released."""
    monkeypatch.setattr(answer_stream, "REPLICA_RETRY_BACKOFF_S", 30.0)
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.dead = 1
    for stream in (False, True):
        ingress.replicas.requests.clear()
        ingress.replicas.dead = 1
        sent = asyncio.create_task(ingress.complete(api_key, stream=stream))
        for _ in range(500):
            if ingress.replicas.requests:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # inside the backoff
        assert not sent.done()
        sent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sent
        await asyncio.sleep(0.2)
        assert len(ingress.replicas.requests) == 1
        assert await ingress.state.admission.reserved_blocks("acme") == 0
