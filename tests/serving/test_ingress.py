"""The OpenAI API of the ingress in-process (see ``ingress_harness``): answers, admission,
errors, spans; the admin API's tenant quotas; who may read the OpenAPI document."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from typing import Any

import httpx
import pytest

from controlplane import telemetry
from controlplane.models import TenantQuota
from controlplane.prefix import cache_salt, prefix_keys
from serving.ingress import build_api
from tests.serving.ingress_harness import BLOCK_SIZE, MODEL, PROMPT, Ingress, admin, bearer


async def test_a_completion_answers_with_usage_and_gives_its_reservation_back(
    ingress: Ingress, tokenizer: Any
) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8, eviction_budget_tokens=64)
    response = await ingress.complete(api_key)
    assert response.status_code == 200, response.text
    body = response.json()
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["created"] == int(ingress.clock.now())
    assert body["choices"] == [{"index": 0, "text": "Hello there", "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 2,
        "total_tokens": len(prompt_ids) + 2,
        "prompt_tokens_details": {"cached_tokens": len(prompt_ids) // 2},
    }
    (sent,) = ingress.replicas.requests
    assert sent["prompt_token_ids"] == prompt_ids
    assert sent["hold_to_blocks"] is None  # its cap is above its prompt + max_tokens
    assert sent["tenant_id"] == "acme" and sent["request_id"] == body["id"]
    assert sent["eviction_budget_tokens"] == 64
    assert sent["prefix_group"] is None  # no group: the replica salts with the tenant
    assert sent["prefix_keys"] == list(
        prefix_keys(sent["prompt_token_ids"], BLOCK_SIZE, cache_salt(sent["tenant_id"]))
    )
    # Held while the engine answered (worst case: prompt + max_tokens), released after.
    held = math.ceil((len(prompt_ids) + 8) / BLOCK_SIZE)
    assert ingress.replicas.reserved_while_answering == [held]
    assert await ingress.state.admission.reserved_blocks("acme") == 0


async def test_chat_streams_events_and_releases_after_the_stream(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    response = await ingress.client.post("/v1/chat/completions", json=body, headers=bearer(api_key))
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["Hello", " there"]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert all("usage" not in c for c in chunks)  # not asked for
    assert ingress.replicas.reserved_while_answering[0] > 0
    assert await ingress.state.admission.reserved_blocks("acme") == 0


async def test_a_stream_ends_with_its_usage_when_asked(ingress: Ingress, tokenizer: Any) -> None:
    """OpenAI's ``stream_options.include_usage``: a last chunk without choices carries the
    usage, with the prompt tokens the prefix cache served."""
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await ingress.client.post("/v1/completions", json=body, headers=bearer(api_key))
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    *pieces, last = [json.loads(event) for event in events[:-1]]
    assert [p["choices"][0]["text"] for p in pieces] == ["Hello", " there"]
    prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 2,
        "total_tokens": prompt_tokens + 2,
        "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2},
    }
    bad = await ingress.client.post(
        "/v1/completions", json={**body, "stream_options": {"nope": 1}}, headers=bearer(api_key)
    )
    assert bad.status_code == 400


async def test_missing_or_unknown_key_is_401(ingress: Ingress) -> None:
    await ingress.add_tenant("acme", kv_budget_blocks=8)
    body = {"model": MODEL, "prompt": PROMPT}
    missing = await ingress.client.post("/v1/completions", json=body)
    unknown = await ingress.complete("vt-not-a-key-of-anyone")
    for response in (missing, unknown):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "auth"
    assert "unknown API key" in unknown.json()["error"]["message"]
    assert (await ingress.client.get("/v1/models", headers=bearer("nope"))).status_code == 401
    assert ingress.replicas.requests == []


async def test_malformed_or_oversize_requests_are_400(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=100)
    headers = {**bearer(api_key), "Content-Type": "application/json"}
    not_json = await ingress.client.post("/v1/completions", content=b"{oops", headers=headers)
    not_object = await ingress.client.post("/v1/completions", json=[1], headers=headers)
    no_prompt = await ingress.client.post("/v1/completions", json={"model": MODEL}, headers=headers)
    oversize = await ingress.complete(api_key, max_tokens=120)  # prompt + 120 > 128
    for response in (not_json, not_object, no_prompt, oversize):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request"
    assert "not valid JSON" in not_json.json()["error"]["message"]
    assert "prompt" in no_prompt.json()["error"]["message"]
    assert "exceeds the model's context of 128 tokens" in oversize.json()["error"]["message"]
    assert ingress.replicas.requests == []


async def test_a_model_not_served_here_is_404(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    response = await ingress.complete(api_key, model="gpt-4")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"
    models = await ingress.client.get("/v1/models", headers=bearer(api_key))
    assert [m["id"] for m in models.json()["data"]] == [MODEL]


async def test_a_request_that_can_never_fit_is_a_400_naming_the_limit(ingress: Ingress) -> None:
    """Over its tenant's budget, or more choices than it may run at once: a 400 at once,
    though the tenant has a queue to wait in (waiting would not make it fit)."""
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=1, max_concurrent_requests=1)
    too_big = await ingress.complete(api_key, max_tokens=64)
    assert too_big.status_code == 400, too_big.text
    message = too_big.json()["error"]["message"]
    assert "KV blocks at its peak, more than tenant 'acme''s KV budget of 1 blocks" in message
    api_key = await ingress.add_tenant("globex", kv_budget_blocks=100, max_concurrent_requests=1)
    too_many = await ingress.complete(api_key, n=2)
    assert too_many.status_code == 400, too_many.text
    message = too_many.json()["error"]["message"]
    assert "2 choices (n), more than tenant 'globex' may run at once" in message
    assert "(max_concurrent_requests: 1)" in message


async def test_over_the_kv_budget_is_429_until_the_first_request_finishes(
    ingress: Ingress,
) -> None:
    # One request's worst case; no queue: the throttle is today's 429 at once.
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=2, max_queue_depth=0)
    ingress.replicas.gate.clear()
    first = asyncio.create_task(ingress.complete(api_key))
    await ingress.replicas.arrived.wait()
    throttled = await ingress.complete(api_key)
    assert throttled.status_code == 429
    assert throttled.headers["Retry-After"] == "1"
    assert "over its KV budget" in throttled.json()["error"]["message"]
    ingress.replicas.gate.set()
    assert (await first).status_code == 200
    assert (await ingress.complete(api_key)).status_code == 200


async def test_prompt_rate_throttles_with_retry_after_on_redis_time(
    ingress: Ingress, tokenizer: Any
) -> None:
    """Admission times the bucket with Redis's clock: a rate of one prompt per second
    throttles the second prompt for 1 s."""
    prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
    api_key = await ingress.add_tenant(
        "acme", kv_budget_blocks=8, prompt_tokens_per_s=prompt_tokens
    )
    assert (await ingress.complete(api_key)).status_code == 200  # empties the bucket
    throttled = await ingress.complete(api_key)
    assert throttled.status_code == 429
    assert throttled.headers["Retry-After"] == "1"
    await asyncio.sleep(1.05)
    assert (await ingress.complete(api_key)).status_code == 200


async def test_a_failing_replica_is_503_without_its_error_text(
    ingress: Ingress, caplog: pytest.LogCaptureFixture
) -> None:
    """The replica's exception (on a cluster a Ray traceback) is logged under the request
    id the client gets, never answered."""
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.replicas.fail = True
    with caplog.at_level(logging.INFO):
        response = await ingress.complete(api_key)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == 503
    request_id = response.headers["x-request-id"]
    assert "replica died" not in response.text and request_id in error["message"]
    assert any(request_id in record.getMessage() for record in caplog.records)


async def test_spans_carry_the_tenant_and_never_the_prompt_or_key(ingress: Ingress) -> None:
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    answered = (await ingress.complete(api_key)).json()
    (root,) = ingress.finished(telemetry.SPAN_INGRESS)
    (admission,) = ingress.finished(telemetry.SPAN_ADMISSION)
    assert root.attributes is not None and admission.attributes is not None
    assert root.attributes[telemetry.ATTR_TENANT_ID] == "acme"
    assert root.attributes[telemetry.ATTR_REQUEST_ID] == answered["id"]
    assert admission.attributes[telemetry.ATTR_TENANT_ID] == "acme"
    assert admission.parent is not None and admission.parent.span_id == root.context.span_id
    # The replica continues the ingress trace.
    (sent,) = ingress.replicas.requests
    assert f"{root.context.trace_id:032x}" in sent["trace_context"]["traceparent"]
    await ingress.complete("vt-not-a-key-of-anyone")  # a refused request records its error
    for span in ingress.spans.get_finished_spans():
        recorded = [span.attributes or {}] + [event.attributes or {} for event in span.events]
        text = json.dumps([dict(attributes) for attributes in recorded], default=str)
        assert "zebra-42" not in text and api_key not in text, span.name


async def test_admin_api_writes_the_quota_json(ingress: Ingress) -> None:
    limits = {"kv_budget_blocks": 8, "weight": 2.0}
    assert (await ingress.client.put("/admin/tenants/acme", json=limits)).status_code == 403
    api_key = await ingress.add_tenant("acme", **limits)
    updated = await ingress.client.put(
        "/admin/tenants/acme", json={**limits, "max_concurrent_requests": 3}, headers=admin()
    )
    assert updated.status_code == 200 and "api_key" not in updated.json()
    stored = TenantQuota(tenant_id="acme", **limits, max_concurrent_requests=3).model_dump()
    assert updated.json() == stored
    fetched = await ingress.client.get("/admin/tenants/acme", headers=admin())
    assert fetched.json() == stored
    bad = await ingress.client.put(
        "/admin/tenants/acme", json={"kv_budget_blocks": 8, "weight": 0}, headers=admin()
    )
    assert bad.status_code == 400 and "weight" in bad.json()["error"]["message"]
    assert (await ingress.complete(api_key)).status_code == 200


async def test_the_tenants_prefix_group_goes_with_each_of_its_requests(ingress: Ingress) -> None:
    """The quota's ``prefix_group`` reaches the replica with every request of the tenant
    (which salts the prompt with the group); a name that cannot be a group is a 400 naming
    the field, and a quota written without one sends none from the next request on."""
    acme = await ingress.add_tenant("acme", kv_budget_blocks=8, prefix_group="support")
    beta = await ingress.add_tenant("beta", kv_budget_blocks=8, prefix_group="support")
    long_prompt = " ".join([PROMPT] * 6)  # several full blocks
    for api_key in (acme, beta):
        assert (await ingress.complete(api_key, prompt=long_prompt)).status_code == 200
    assert [(r["tenant_id"], r["prefix_group"]) for r in ingress.replicas.requests] == [
        ("acme", "support"),
        ("beta", "support"),
    ]
    # One prompt, one group: the same prefix keys (the router's affinity), one per full block.
    first, second = ingress.replicas.requests
    assert first["prefix_keys"] == second["prefix_keys"]
    assert len(first["prefix_keys"]) == len(first["prompt_token_ids"]) // BLOCK_SIZE > 1
    bad = await ingress.client.put(
        "/admin/tenants/acme",
        json={"kv_budget_blocks": 8, "prefix_group": "no spaces"},
        headers=admin(),
    )
    assert bad.status_code == 400
    assert "prefix_group" in bad.json()["error"]["message"]
    assert "1-64 characters" in bad.json()["error"]["message"]
    fetched = await ingress.client.get("/admin/tenants/acme", headers=admin())
    assert fetched.json()["prefix_group"] == "support"  # the refused update changed nothing
    left = await ingress.client.put(
        "/admin/tenants/acme", json={"kv_budget_blocks": 8}, headers=admin()
    )
    assert left.status_code == 200 and left.json()["prefix_group"] is None
    assert (await ingress.complete(acme)).status_code == 200
    assert ingress.replicas.requests[-1]["prefix_group"] is None


async def test_the_reservation_shrinks_to_the_steady_bound_once_a_token_is_out(
    ingress: Ingress, tokenizer: Any
) -> None:
    """Until prefill ends a request holds its whole prompt; after its first token the policy's
    eviction budget bounds it, and the tenant's reservation says so."""
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=16, eviction_budget_tokens=16)
    prompt = " ".join([PROMPT] * 6)
    prompt_blocks = math.ceil(len(tokenizer(prompt)["input_ids"]) / BLOCK_SIZE)
    steady = math.ceil(16 / BLOCK_SIZE) + 1
    assert prompt_blocks > steady
    ingress.replicas.gate.clear()  # the engine stops after its first chunk
    answer = asyncio.create_task(ingress.complete(api_key, prompt=prompt, max_tokens=8))
    await asyncio.wait_for(ingress.replicas.arrived.wait(), 10)
    assert ingress.replicas.reserved_while_answering == [prompt_blocks]  # the prefill peak
    # Counted at its steady bound once its prefill ends: the engine holds it there.
    assert ingress.replicas.requests[-1]["hold_to_blocks"] == steady
    for _ in range(200):
        if await ingress.state.admission.reserved_blocks("acme") == steady:
            break
        await asyncio.sleep(0.01)
    assert await ingress.state.admission.reserved_blocks("acme") == steady
    ingress.replicas.gate.set()
    assert (await answer).status_code == 200


async def test_kv_budget_retry_after_comes_from_the_measured_token_pace(ingress: Ingress) -> None:
    """The ingress times the decode chunks it streams; a budget 429 then says when the
    tenant's running request is expected to end, not a constant."""
    # One 40-token answer; no queue: the throttle is a 429 at once.
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=4, max_queue_depth=0)
    ingress.replicas.gate.clear()
    warm_up = asyncio.create_task(ingress.complete(api_key))
    await ingress.replicas.arrived.wait()
    ingress.clock.advance(0.5)  # the second token comes 0.5 s after the first
    ingress.replicas.gate.set()
    assert (await warm_up).status_code == 200
    assert ingress.state.pace.seconds_per_token == pytest.approx(0.5)
    ingress.replicas.gate.clear()
    ingress.replicas.arrived.clear()
    running = asyncio.create_task(ingress.complete(api_key, max_tokens=40))
    await asyncio.wait_for(ingress.replicas.arrived.wait(), 10)
    throttled = await ingress.complete(api_key, max_tokens=40)
    assert throttled.status_code == 429
    # Admitted a moment ago (on Redis's clock): 40 tokens at 0.5 s each, about 20 s.
    assert int(throttled.headers["Retry-After"]) in (19, 20)
    ingress.replicas.gate.set()
    assert (await running).status_code == 200


async def test_kv_budget_retry_after_expects_requests_in_prefill_to_settle(
    ingress: Ingress, tokenizer: Any
) -> None:
    """The ingress also times arrival to first token: a budget 429 while
    the tenant's request is still in prefill says when that request is expected to settle
    to its steady bound (its first token), not when it ends."""
    prompt = " ".join([PROMPT] * 6)
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    peak, steady = math.ceil(prompt_tokens / BLOCK_SIZE), math.ceil(16 / BLOCK_SIZE) + 1
    assert steady < peak  # so two peaks exceed the budget, a settled one and a peak fit
    budget = peak + steady
    api_key = await ingress.add_tenant(
        "acme", kv_budget_blocks=budget, eviction_budget_tokens=16, max_queue_depth=0
    )
    replicas = ingress.replicas
    # Warm up: the first token comes 4 s after arrival, the second 0.5 s later.
    replicas.prefill_gate.clear()
    replicas.gate.clear()
    warm_up = asyncio.create_task(ingress.complete(api_key, prompt=prompt, max_tokens=40))
    await asyncio.wait_for(replicas.arrived.wait(), 10)
    ingress.clock.advance(4.0)
    replicas.prefill_gate.set()
    for _ in range(200):
        if ingress.state.first_token.seconds_per_token is not None:
            break
        await asyncio.sleep(0.01)
    ingress.clock.advance(0.5)
    replicas.gate.set()
    assert (await warm_up).status_code == 200
    assert ingress.state.first_token.seconds_per_token == pytest.approx(4.0)
    assert ingress.state.pace.seconds_per_token == pytest.approx(0.5)
    # One request in prefill holds its peak; the next must wait for it to settle (~4 s),
    # not for its 40 tokens (~24 s).
    replicas.prefill_gate.clear()
    replicas.arrived.clear()
    running = asyncio.create_task(ingress.complete(api_key, prompt=prompt, max_tokens=40))
    await asyncio.wait_for(replicas.arrived.wait(), 10)
    throttled = await ingress.complete(api_key, prompt=prompt, max_tokens=40)
    assert throttled.status_code == 429
    assert int(throttled.headers["Retry-After"]) in (3, 4)
    replicas.prefill_gate.set()
    assert (await running).status_code == 200


async def test_opentelemetry_metrics_count_admissions_and_time_answers(ingress: Ingress) -> None:
    """Per tenant: admissions by outcome, time to first token, time per output token
    (measured on the ingress's clock between the chunks it streams)."""
    # One 40-token answer; no queue.
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=4, max_queue_depth=0)
    ingress.replicas.gate.clear()
    running = asyncio.create_task(ingress.complete(api_key, max_tokens=40))
    await ingress.replicas.arrived.wait()
    throttled = await ingress.complete(api_key, max_tokens=40)
    assert throttled.status_code == 429
    ingress.clock.advance(0.5)  # the second token comes 0.5 s after the first
    ingress.replicas.gate.set()
    assert (await running).status_code == 200

    admissions = {
        point.attributes[telemetry.ATTR_ADMISSION_OUTCOME]: point.value
        for point in ingress.metric_points(telemetry.METRIC_ADMISSIONS)
    }
    assert admissions == {"admitted": 1, "throttled": 1}
    (ttft,) = ingress.metric_points(telemetry.METRIC_TIME_TO_FIRST_TOKEN)
    (tpot,) = ingress.metric_points(telemetry.METRIC_TIME_PER_OUTPUT_TOKEN)
    assert ttft.attributes[telemetry.ATTR_TENANT_ID] == "acme" and ttft.count == 1
    assert ttft.sum == pytest.approx(0.0)  # the fake engine's first chunk comes at once
    assert tpot.count == 1 and tpot.sum == pytest.approx(0.5)  # 2 tokens, 0.5 s apart


@pytest.mark.parametrize(
    ("api_docs", "anonymous", "tenant", "operator"),
    [
        ("off", [404, 404, 404], 404, 404),  # the default
        ("admin", [403, 404, 404], 403, 200),
        ("public", [200, 200, 200], 200, 200),
    ],
)
async def test_the_openapi_document_is_served_only_as_configured(
    ingress: Ingress, api_docs: str, anonymous: list[int], tenant: int, operator: int
) -> None:
    """The document names every route and body, the admin API's included: by default
    nobody reads it; with ``api_docs: admin`` only the admin token does."""
    assert dataclasses.replace(ingress.state.settings).api_docs == "off"
    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    ingress.state.settings = dataclasses.replace(ingress.state.settings, api_docs=api_docs)
    transport = httpx.ASGITransport(app=build_api(ingress.state))
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        pages = [
            (await client.get(path)).status_code for path in ("/openapi.json", "/docs", "/redoc")
        ]
        as_tenant = await client.get("/openapi.json", headers=bearer(api_key))
        as_admin = await client.get("/openapi.json", headers=admin())
    assert (pages, as_tenant.status_code, as_admin.status_code) == (anonymous, tenant, operator)
    if operator == 200:
        assert "/admin/tenants/{tenant_id}" in as_admin.json()["paths"]


async def test_priority_reaches_the_engine_under_the_priority_policy_and_is_a_400_otherwise(
    ingress: Ingress, redis_server: Any, tokenizer: Any
) -> None:
    from tests.serving.ingress_harness import running_ingress

    api_key = await ingress.add_tenant("acme", kv_budget_blocks=8)
    refused = await ingress.complete(api_key, priority=-1)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "priority: -1 is not served" in message and "fcfs" in message
    assert ingress.replicas.requests == []  # refused before any engine saw it
    assert (await ingress.complete(api_key, priority=0)).status_code == 200
    assert ingress.replicas.requests[-1]["priority"] == 0
    bad = await ingress.complete(api_key, priority="high")
    assert bad.status_code == 400 and "priority" in bad.json()["error"]["message"]
    async with running_ingress(
        redis_server.url, tokenizer, scheduling_policy="priority"
    ) as by_priority:
        key = await by_priority.add_tenant("acme", kv_budget_blocks=8)
        for value in (-1, 3):
            response = await by_priority.complete(key, priority=value)
            assert response.status_code == 200, response.text
            assert by_priority.replicas.requests[-1]["priority"] == value
