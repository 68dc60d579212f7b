"""The counters API: per-request and per-tenant KV counters of a vToken engine.

Counters (``workers/scheduler_side.py: RequestCounters``): live tokens, allocated blocks
(ballast included in naive mode), ideal blocks ``ceil(live / block_size)``, reclaimable
blocks (allocated - ideal), evicted tokens and repack moves; a request's tenant is
``SamplingParams.extra_args["tenant"]`` (``"default"`` when absent).

The engine core answers the utility call ``vtoken_counters`` (installed by the plugin),
so this works whether the engine core runs in this process or in its own:
``LLM``/``LLMEngine`` clients through ``call_utility``, ``AsyncLLM`` through
``call_utility_async``. The result is plain data (``VTokenScheduler.snapshot``).
"""

from __future__ import annotations

from typing import Any


def engine_counters(llm: Any) -> dict[str, Any] | None:
    """Counters of a ``vllm.LLM`` (or ``LLMEngine``); ``None`` when vToken is off."""
    client = getattr(llm, "llm_engine", llm).engine_core
    in_process = getattr(client, "engine_core", None)  # InprocClient holds the EngineCore
    if in_process is not None:
        return in_process.vtoken_counters()
    return client.call_utility("vtoken_counters")


async def async_engine_counters(engine: Any) -> dict[str, Any] | None:
    """Counters of a ``vllm.v1.engine.async_llm.AsyncLLM``."""
    return await engine.engine_core.call_utility_async("vtoken_counters")


async def async_request_counters(engine: Any, request_id: str) -> dict[str, Any] | None:
    """One request's counters (running or recently finished) of an ``AsyncLLM``."""
    return await engine.engine_core.call_utility_async("vtoken_request_counters", request_id)
