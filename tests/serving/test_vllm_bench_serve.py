"""vLLM's own load generator, ``vllm bench serve``, against the ingress over HTTP: a real
redis-server, the ingress app on a real port, and a real vLLM engine (SmolLM2, vToken on)
behind it. Every request of both its OpenAI backends succeeds: they send vLLM's sampling
extensions (``repetition_penalty``, ``ignore_eos``) and chat's ``max_completion_tokens``.
A token-id prompt is served by the same engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from controlplane.admission import AdmissionConfig
from controlplane.clock import SystemClock
from controlplane.openai_models import GenerateRequest
from controlplane.redis_conn import RedisConfig, connect
from controlplane.telemetry import NOOP_TRACER
from serving.engine_host import EngineHost
from serving.ingress import build_api
from serving.openai_http import IngressState
from serving.settings import IngressSettings, ReplicaSettings
from tests.redis_server import RedisServer, free_port, unique_keys
from tests.serving.ingress_harness import ADMIN, admin, bearer

pytestmark = pytest.mark.slow
MODEL = "smollm2"
BLOCK_SIZE = 32
NUM_PROMPTS = 12


class LocalReplicas:
    """A Serve handle's shape (``options(stream=True).generate.remote(dict)``) around one
    in-process :class:`EngineHost`."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, stream: bool) -> LocalReplicas:
        assert stream
        return self

    async def _remote(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.host.generate(GenerateRequest.model_validate(request)):
            yield chunk.model_dump()


@contextlib.asynccontextmanager
async def serving_stack(redis_url: str, model: Path) -> AsyncIterator[str]:
    """The ingress app on ``http://127.0.0.1:<port>`` in front of one real engine."""
    import uvicorn
    from transformers import AutoTokenizer

    from workers.engine import CPU_ENV

    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    engine = ReplicaSettings(
        model=str(model),
        served_name=MODEL,
        block_size=BLOCK_SIZE,
        max_model_len=512,
        max_num_seqs=4,
        num_blocks=64,
    )
    host = EngineHost(engine, "r1", SystemClock())
    settings = IngressSettings(
        model_name=MODEL,
        tokenizer_path=str(model),
        max_model_len=engine.max_model_len,
        admin_token=ADMIN,
        redis_url=redis_url,
        admission=AdmissionConfig(block_size=BLOCK_SIZE),
        key_prefix=unique_keys().prefix,
    )
    redis = connect(RedisConfig(url=redis_url))
    tokenizer = AutoTokenizer.from_pretrained(model)
    state = IngressState(
        settings, LocalReplicas(host), redis, SystemClock(), tokenizer, NOOP_TRACER
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_api(state), host="127.0.0.1", port=port, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), "the ingress did not start"
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving
        host.shutdown()
        await redis.aclose()


async def bench_serve(url: str, backend: str, endpoint: str, tokenizer: Path) -> dict[str, Any]:
    """``vllm bench serve`` in-process (its Python entry point), on vLLM's random dataset."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            *("--backend", backend, "--base-url", url, "--endpoint", endpoint),
            *("--model", MODEL, "--tokenizer", str(tokenizer)),
            *("--dataset-name", "random", "--random-input-len", "32"),
            *("--random-output-len", "8", "--num-prompts", str(NUM_PROMPTS)),
            *("--max-concurrency", "4", "--seed", "0", "--disable-tqdm"),
            *("--ready-check-timeout-sec", "0", "--save-detailed"),
        ]
    )
    return await main_async(args)


async def test_vllm_bench_serve_gets_every_answer(
    redis_server: RedisServer, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        serving_stack(redis_server.url, smollm2_path) as url,
        httpx.AsyncClient(base_url=url, timeout=120) as client,
    ):
        created = await client.put(
            "/admin/tenants/bench", json={"kv_budget_blocks": 64}, headers=admin()
        )
        assert created.status_code == 201, created.text
        api_key = created.json()["api_key"]
        monkeypatch.setenv("OPENAI_API_KEY", api_key)  # what vllm bench sends as Bearer
        for backend, endpoint in (
            ("openai", "/v1/completions"),
            ("openai-chat", "/v1/chat/completions"),
        ):
            result = await bench_serve(url, backend, endpoint, smollm2_path)
            errors = [error for error in result["errors"] if error]
            assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), errors
            assert result["total_output_tokens"] == NUM_PROMPTS * 8  # ignore_eos honoured
        body = {"model": MODEL, "prompt": [[1, 2, 3, 4, 5]], "max_tokens": 3, "ignore_eos": True}
        answer = await client.post("/v1/completions", json=body, headers=bearer(api_key))
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (5, 3)
