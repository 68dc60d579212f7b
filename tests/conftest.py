"""Shared fixtures: the prepared SmolLM2 and Gemma 3 270M folders (converted once, cached
across runs)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    # ``triton.jit`` reads this when a kernel is decorated: set before any test folder can
    # import a kernel module (an engine's score path, a benchmark), so the kernel tests
    # always find interpreted kernels on CPU whatever ran before them.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_path():
    from workers.models import prepare_model

    return prepare_model("smollm2")


@pytest.fixture(scope="session")
def gemma3_path():
    from workers.models import prepare_model

    return prepare_model("gemma3-270m")
