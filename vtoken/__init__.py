"""vToken: token-level virtualization of a block-managed KV cache."""

from vtoken.block_pool import BlockPool, NoFreeBlocksError, StandaloneBlockPool
from vtoken.manager import RequestKV, VTokenManager
from vtoken.policy import EvictionPolicy, PolicyView, ScoreNeeds, StepAttention
from vtoken.repack_planner import ReclaimMode, RepackPlan, plan_repack
from vtoken.reports import DEFAULT_TENANT, EngineReport, KVUsage, RequestReport
from vtoken.token_table import TokenTable

__all__ = [
    "DEFAULT_TENANT",
    "BlockPool",
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
    "StepAttention",
    "StandaloneBlockPool",
    "TokenTable",
    "VTokenManager",
    "plan_repack",
]
