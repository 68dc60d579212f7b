"""Fixtures for the simulator's tests: CPU environment and the tiny random Llama."""

from __future__ import annotations

import os

import pytest

from workers.engine import CPU_ENV, device_settings
from workers.models import make_tiny_llama

for _name, _value in CPU_ENV.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A 2-layer random Llama (4 query / 2 KV heads, vocab 512) on disk."""
    head_dim = device_settings().head_dim
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), head_dim=head_dim))


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tmp_path_factory, smollm2_path) -> str:
    """The tiny Llama with SmolLM2's tokenizer (an ``LLMEngine`` detokenizes)."""
    folder = tmp_path_factory.mktemp("tiny-llama-text") / "tiny"
    head_dim = device_settings().head_dim
    return str(make_tiny_llama(folder, tokenizer_source=smollm2_path, head_dim=head_dim))


def token_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts (ids in [1, 500))."""
    return [[(seed + 7 * i + 13 * j) % 499 + 1 for j in range(length)] for i in range(count)]
