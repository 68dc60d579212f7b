"""Kernel tests run the Triton kernels on CPU through the interpreter when there is no GPU.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated; the kernel modules
are imported lazily (by the dispatchers or the tests), so setting it here, before any test
of this folder runs, is early enough even if triton itself was imported before.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Per-dtype tolerances for float32 scores computed from keys of this dtype.
SCORE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def triton_usable() -> bool:
    if torch.cuda.is_available():
        return True
    from kernels import _repack_triton

    # Decorated before TRITON_INTERPRET was set (triton kernels imported by an earlier
    # test folder): running would try to compile for a GPU.
    return type(_repack_triton._repack_kernel).__name__ == "InterpretedFunction"
