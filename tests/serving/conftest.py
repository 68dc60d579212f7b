"""Fixtures of the ingress tests: one redis-server per test file, SmolLM2's tokenizer, and
an in-process ingress on a fresh key space per test (see ``ingress_harness``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.redis_server import RedisServer
from tests.serving.ingress_harness import Ingress, running_ingress


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
async def ingress(redis_server: RedisServer, tokenizer: Any) -> AsyncIterator[Ingress]:
    async with running_ingress(redis_server.url, tokenizer) as under_test:
        yield under_test
