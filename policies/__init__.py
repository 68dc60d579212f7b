"""Eviction policies, one per file, and the registry that names them."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from policies.h2o import H2O
from policies.none import NoEviction
from policies.page import PAGE
from policies.random import RandomEviction
from policies.scissorhands import Scissorhands
from policies.snapkv import SnapKV
from policies.streaming_llm import StreamingLLM
from policies.tova import TOVA
from vtoken.policy import EvictionPolicy, Gate

REGISTRY: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (NoEviction, RandomEviction, StreamingLLM, H2O, Scissorhands, TOVA, SnapKV, PAGE)
}

# A per-request KV cap runs under the engine's policy when that policy holds its budget
# every step, else under this one (a tenant's cap must hold at every step).
CAP_POLICY: type[EvictionPolicy] = H2O


def make_policy(name: str, **policy_args: Any) -> EvictionPolicy:
    """A fresh policy instance (one per request); unknown names or arguments raise ValueError."""
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    known = {f.name for f in fields(cls) if f.init}
    unknown = set(policy_args) - known
    if unknown:
        raise ValueError(
            f"policy {name!r} has no argument(s) {sorted(unknown)}; known: {sorted(known)}"
        )
    if issubclass(cls, Gate) and isinstance(policy_args.get("inner"), str):
        policy_args["inner"] = make_policy(policy_args["inner"])  # a gate's policy, by name
    return cls(**policy_args)


__all__ = ["CAP_POLICY", "REGISTRY", "EvictionPolicy", "make_policy"]
