"""The replica's engine host: a bad cap refused before the engine, tenant and group salts,
engine arguments; and the real engine (slow): aborts free the KV, n choices with logprobs,
tenants of one prefix group hit each other's cached prompt and no other tenant's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controlplane.clock import SystemClock
from controlplane.openai_models import GenerateChunk, GenerateRequest
from controlplane.prefix import cache_salt
from serving.engine_host import EngineHost
from serving.engine_translators import MIN_LOGPROB, engine_request_ids
from serving.settings import ReplicaSettings


def test_a_bad_cap_becomes_the_requests_error_chunk():
    """The replica half of the 400: ``generate`` answers one chunk with the error (the
    ingress turns ``GenerateChunk.error`` into HTTP 400) before the engine sees anything."""
    host = EngineHost.__new__(EngineHost)  # no engine: refused before it is reached
    host.settings = ReplicaSettings(vtoken={"policy": "h2o", "keep_ratio": 0.5})
    host.replica_id, host.pressure = "r1", {}
    request = GenerateRequest(
        request_id="q1",
        tenant_id="a",
        prompt_token_ids=[1, 2, 3],
        max_tokens=4,
        temperature=0.0,
        top_p=1.0,
        eviction_budget_tokens=0,
    )

    async def answer() -> list[GenerateChunk]:
        return [chunk async for chunk in host.generate(request)]

    (chunk,) = asyncio.run(answer())
    assert "budget_tokens" in chunk.error and chunk.replica_id == "r1"


def test_the_engine_gets_the_tenant_and_its_weight():
    host = EngineHost.__new__(EngineHost)
    host.settings = ReplicaSettings(vtoken={"policy": "h2o", "keep_ratio": 0.5})
    request = GenerateRequest(
        request_id="q1",
        tenant_id="a",
        tenant_weight=3.0,
        prompt_token_ids=[1, 2, 3],
        max_tokens=4,
        temperature=0.0,
        top_p=1.0,
    )
    assert host.extra_args(request) == {"tenant": "a", "tenant_weight": 3.0}
    with pytest.raises(ValueError, match="tenant_weight"):
        GenerateRequest.model_validate(request.model_dump() | {"tenant_weight": 0.0})


def test_cache_salt_separates_tenants_and_is_stable():
    assert cache_salt("a") == cache_salt("a") != cache_salt("b")


def test_a_prefix_group_salts_its_tenants_alike_and_apart_from_every_tenant():
    """Tenants of one group share the group's salt; it is none of theirs, nor the salt of
    a tenant named like the group (separate namespaces); a tenant's own salt is what it was
    before groups existed (cached blocks of an upgraded replica stay the tenant's)."""
    import hashlib

    group = cache_salt("a", "shared")
    assert group == cache_salt("b", "shared") != cache_salt("a", "other")
    assert group not in {cache_salt("a"), cache_salt("b"), cache_salt("shared")}
    assert cache_salt("a", None) == cache_salt("a")
    assert cache_salt("a") == hashlib.sha256(b"vtoken-tenant:a").hexdigest()[:32]
    assert group == hashlib.sha256(b"vtoken-group:shared").hexdigest()[:32]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_replica_builds_its_engine_with_its_prefix_caching_setting(
    tmp_path, monkeypatch, enabled
):
    """``ReplicaSettings.enable_prefix_caching`` (on by default) reaches vLLM's engine
    arguments; no engine is built."""
    from vllm.v1.engine.async_llm import AsyncLLM

    assert ReplicaSettings().enable_prefix_caching is True
    (tmp_path / "config.json").write_text("{}")
    built = []
    monkeypatch.setattr(AsyncLLM, "from_engine_args", lambda args: built.append(args))
    settings = ReplicaSettings(model=str(tmp_path), enable_prefix_caching=enabled)
    EngineHost(settings, "r1", SystemClock())
    (args,) = built
    assert args.enable_prefix_caching is enabled


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_replica_builds_its_engine_with_its_scheduling_policy(tmp_path, monkeypatch, policy):
    """``ReplicaSettings.scheduling_policy`` (``fcfs`` by default) reaches vLLM's engine
    arguments; anything else is refused by the settings; no engine is built."""
    from pydantic import ValidationError
    from vllm.v1.engine.async_llm import AsyncLLM

    assert ReplicaSettings().scheduling_policy == "fcfs"
    with pytest.raises(ValidationError, match="scheduling_policy"):
        ReplicaSettings(scheduling_policy="wfq")
    (tmp_path / "config.json").write_text("{}")
    built = []
    monkeypatch.setattr(AsyncLLM, "from_engine_args", lambda args: built.append(args))
    EngineHost(ReplicaSettings(model=str(tmp_path), scheduling_policy=policy), "r1", SystemClock())
    (args,) = built
    assert args.scheduling_policy == policy


@pytest.mark.slow
def test_a_caller_that_goes_away_aborts_the_engine_request_and_frees_its_kv(tmp_path, smollm2_path):
    """What Serve does when the ingress cancels (the client disconnected): the replica's
    generator is cancelled or closed mid-answer. vLLM must abort the request: it stops
    running and every KV block it held is free again (the engine's counters say so)."""
    import os

    from workers.engine import CPU_ENV
    from workers.models import make_tiny_llama

    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    folder = make_tiny_llama(tmp_path / "tiny", tokenizer_source=smollm2_path)
    settings = ReplicaSettings(
        model=str(folder), block_size=32, max_model_len=1024, max_num_seqs=4, num_blocks=64
    )

    def request(request_id: str) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id,
            tenant_id="leaver",
            prompt_token_ids=list(range(1, 200)),
            max_tokens=800,
            temperature=1.0,
            top_p=1.0,
            seed=7,
        )

    async def scenario() -> list[tuple[int, int]]:
        host = EngineHost(settings, "r1", SystemClock())
        seen: list[tuple[int, int]] = []
        try:
            # (1) The consumer's task is cancelled (Serve cancels the replica call).
            started = asyncio.Event()

            async def consume() -> None:
                async for chunk in host.generate(request("cancelled")):
                    if chunk.completion_tokens >= 3:
                        started.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 120)
            held = await host.refresh_counters()
            assert held.running_requests == 1 and held.used_blocks >= 7  # 199-token prompt
            # The engine has been stepping: its reports carry how long a step takes.
            assert 0 < held.max_step_s < 60
            task.cancel()
            seen.append(await _drained(host))
            # (2) The generator is closed after a few chunks (the stream was abandoned).
            stream = host.generate(request("closed"))
            async for chunk in stream:
                if chunk.completion_tokens >= 3:
                    break
            await stream.aclose()
            seen.append(await _drained(host))
        finally:
            host.shutdown()
        return seen

    for running, used in asyncio.run(scenario()):
        assert (running, used) == (0, 0)


@pytest.mark.slow
def test_n_choices_with_logprobs_run_as_n_sequences_and_free_their_kv(tmp_path, smollm2_path):
    """n=2 with logprobs=2 on the real engine: two choices (indexes 0 and 1), every token
    with its log-probability and the engine's alternatives (the sampled token first, at
    most 3 entries); both sequences run at once, each under its own KV; vToken reports each
    child by the id ``engine_request_ids`` gives; afterwards every block is free."""
    import os

    from workers.api import async_request_counters
    from workers.engine import CPU_ENV
    from workers.models import make_tiny_llama

    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    folder = make_tiny_llama(tmp_path / "tiny", tokenizer_source=smollm2_path)
    settings = ReplicaSettings(
        model=str(folder), block_size=32, max_model_len=1024, max_num_seqs=4, num_blocks=64
    )
    max_tokens = 400  # long enough that the first chunk comes while both still run
    request = GenerateRequest(
        request_id="cmpl-two",
        tenant_id="sampler",
        prompt_token_ids=list(range(1, 100)),
        max_tokens=max_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=7,
        n=2,
        logprobs=2,
    )

    async def scenario() -> tuple[list[GenerateChunk], int, list[bool], tuple[int, int]]:
        host = EngineHost(settings, "r1", SystemClock())
        chunks: list[GenerateChunk] = []
        sequences_held = 0
        try:
            async for chunk in host.generate(request):
                chunks.append(chunk)
                if len(chunks) == 3:  # both sequences are past their prefill by now
                    counters = await host.refresh_counters()
                    sequences_held = counters.tenants["sampler"].requests
            finished = []
            for engine_id in engine_request_ids(request.request_id, request.n):
                report = await async_request_counters(host.llm, engine_id)
                finished.append(report is not None and report.finished)
            drained = await _drained(host)
        finally:
            host.shutdown()
        return chunks, sequences_held, finished, drained

    chunks, sequences_held, finished, drained = asyncio.run(scenario())
    assert all(chunk.error is None for chunk in chunks)
    assert {chunk.index for chunk in chunks} == {0, 1}
    assert sequences_held == 2  # two child requests in the engine, each with its KV
    for index in (0, 1):
        pieces = [chunk for chunk in chunks if chunk.index == index]
        entries = [entry for chunk in pieces for entry in chunk.logprobs or []]
        finish = [chunk.finish_reason for chunk in pieces if chunk.finish_reason]
        assert len(finish) == 1 and pieces[-1].finish_reason == finish[0]
        assert 1 <= len(entries) <= max_tokens
        if finish[0] == "length":
            assert len(entries) == max_tokens
        for entry in entries:
            assert entry.logprob is not None and MIN_LOGPROB <= entry.logprob <= 0
            assert entry.top is not None and 2 <= len(entry.top) <= 3
            assert entry.top[0] == (entry.token, entry.logprob)  # the sampled token first
        assert "".join(entry.token for entry in entries).startswith(pieces[0].text[:1])
    total = sum(len(chunk.logprobs or []) for chunk in chunks)
    assert chunks[-1].completion_tokens == total
    assert finished == [True, True]  # request_report finds each child by its id
    assert drained == (0, 0)


@pytest.mark.slow
def test_tenants_of_one_prefix_group_hit_each_others_cached_prompt(tmp_path, smollm2_path):
    """One engine with prefix caching (the default), the same 100-token prompt from five
    requests in turn: the second tenant of a group reuses the 3 full blocks the first one
    computed; two tenants without a group reuse nothing of each other's, though a tenant's
    own repeat does (the cache is on: the salts keep them apart). vLLM's
    ``RequestOutput.num_cached_tokens`` says how many prompt tokens came from the cache."""
    import os

    from workers.engine import CPU_ENV
    from workers.models import make_tiny_llama

    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    folder = make_tiny_llama(tmp_path / "tiny", tokenizer_source=smollm2_path)
    settings = ReplicaSettings(
        model=str(folder), block_size=32, max_model_len=512, max_num_seqs=2, num_blocks=32
    )
    prompt = list(range(1, 101))  # 3 full blocks of 32, and 4 tokens more

    def request(index: int, tenant_id: str, prefix_group: str | None) -> GenerateRequest:
        return GenerateRequest(
            request_id=f"{tenant_id}-{index}",
            tenant_id=tenant_id,
            prompt_token_ids=prompt,
            max_tokens=2,
            temperature=0.0,
            top_p=1.0,
            prefix_group=prefix_group,
        )

    cached: dict[str, int] = {}  # request id -> its prompt tokens the cache gave

    async def scenario() -> None:
        host = EngineHost(settings, "r1", SystemClock())
        generate = host.llm.generate

        async def observed(prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
            async for output in generate(prompt, params, request_id, **kwargs):
                cached[request_id] = output.num_cached_tokens or 0
                yield output

        host.llm.generate = observed
        try:
            order = [("a", "team"), ("b", "team"), ("c", None), ("d", None), ("c", None)]
            for index, (tenant_id, group) in enumerate(order):
                answer = host.generate(request(index, tenant_id, group))
                chunks = [chunk async for chunk in answer]
                assert chunks and all(chunk.error is None for chunk in chunks)
        finally:
            host.shutdown()

    asyncio.run(scenario())
    assert cached == {"a-0": 0, "b-1": 96, "c-2": 0, "d-3": 0, "c-4": 96}


async def _drained(host: EngineHost, timeout_s: float = 30.0) -> tuple[int, int]:
    """(running requests, used blocks) once both are 0, or when `timeout_s` passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        counters = await host.refresh_counters()
        if (counters.used_blocks == 0 and host.running == 0) or loop.time() > deadline:
            return host.running, counters.used_blocks
        await asyncio.sleep(0.1)
