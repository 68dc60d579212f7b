"""Shared fixtures: the prepared SmolLM2 folder (converted once, cached across runs)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_path():
    from workers.models import prepare_model

    return prepare_model("smollm2")
