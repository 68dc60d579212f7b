"""vToken: token-level virtualization of a block-managed KV cache.

The names below load on first use (PEP 562), so the pure-numpy modules (``token_table``,
``repack_planner``) import without pydantic: the GPU check runs them from a checkout on a
machine where only torch and triton are installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vtoken.block_pool import BlockPool, NoFreeBlocksError, StandaloneBlockPool
    from vtoken.manager import RequestKV, VTokenManager
    from vtoken.policy import EvictionPolicy, PolicyView, ScoreNeeds, StepAttention
    from vtoken.repack_planner import ReclaimMode, RepackPlan, plan_repack
    from vtoken.reports import DEFAULT_TENANT, EngineReport, KVUsage, RequestReport
    from vtoken.token_table import TokenTable

_EXPORTS = {
    "BlockPool": "vtoken.block_pool",
    "NoFreeBlocksError": "vtoken.block_pool",
    "StandaloneBlockPool": "vtoken.block_pool",
    "RequestKV": "vtoken.manager",
    "VTokenManager": "vtoken.manager",
    "EvictionPolicy": "vtoken.policy",
    "PolicyView": "vtoken.policy",
    "ScoreNeeds": "vtoken.policy",
    "StepAttention": "vtoken.policy",
    "ReclaimMode": "vtoken.repack_planner",
    "RepackPlan": "vtoken.repack_planner",
    "plan_repack": "vtoken.repack_planner",
    "DEFAULT_TENANT": "vtoken.reports",
    "EngineReport": "vtoken.reports",
    "KVUsage": "vtoken.reports",
    "RequestReport": "vtoken.reports",
    "TokenTable": "vtoken.token_table",
}

__all__ = [
    "BlockPool",
    "DEFAULT_TENANT",
    "EngineReport",
    "EvictionPolicy",
    "KVUsage",
    "NoFreeBlocksError",
    "PolicyView",
    "ReclaimMode",
    "RepackPlan",
    "RequestKV",
    "RequestReport",
    "ScoreNeeds",
    "StandaloneBlockPool",
    "StepAttention",
    "TokenTable",
    "VTokenManager",
    "plan_repack",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vtoken' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
