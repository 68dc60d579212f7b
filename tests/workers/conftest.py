"""Fixtures for the real-engine tests: CPU environment, a tiny random Llama, helpers."""

from __future__ import annotations

import os

import pytest

from workers.engine import CPU_ENV, EngineVariant, device_settings, engine_variants
from workers.models import make_tiny_gemma3, make_tiny_llama
from workers.scheduler_side import VTokenScheduler

for _name, _value in CPU_ENV.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A 2-layer random Llama (4 query / 2 KV heads, vocab 512) on disk; head_dim 32 on
    CPU, 128 on CUDA (``workers.engine.device_settings``)."""
    head_dim = device_settings().head_dim
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), head_dim=head_dim))


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory, smollm2_path) -> str:
    """A 4-layer random hybrid Gemma 3 (sliding-window and full attention alternating,
    window 16 tokens, SmolLM2's tokenizer): two KV cache groups in vLLM."""
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    head_dim = device_settings().head_dim
    return str(make_tiny_gemma3(folder, smollm2_path, head_dim=head_dim))


@pytest.fixture(scope="session", params=engine_variants(), ids=lambda v: v.name)
def engine_variant(request) -> EngineVariant:
    """Each attention backend (and the fp8 KV cache) the engine tests run in: four on
    CUDA, vLLM's CPU attention alone on CPU (``workers.engine.engine_variants``)."""
    return request.param


def token_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts of the given lengths (ids in [1, 500))."""
    return [[(seed + 7 * i + 13 * j) % 499 + 1 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(autouse=True)
def engine_invariants(monkeypatch):
    """Every vToken engine a test builds (in this process) has its token tables and block
    pool checked at teardown: no slot owned twice, tables match vLLM's block lists, and
    held + free == total blocks."""
    states: list[VTokenScheduler] = []
    original = VTokenScheduler.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        states.append(self)

    monkeypatch.setattr(VTokenScheduler, "__init__", recording_init)
    yield states
    for state in states:
        state.check_invariants()
