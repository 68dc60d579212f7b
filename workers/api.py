"""The counters API: what a vToken engine holds, per request, per tenant and in total.

Reports (``vtoken/reports.py``): live tokens, allocated blocks (ballast included in naive
mode), ideal blocks ``ceil(live / block_size)``, floor blocks (at the request's budget),
reclaimable blocks (allocated - floor),
evicted tokens and repack moves; a request's tenant is ``SamplingParams.extra_args
["tenant"]`` (``vtoken.reports.DEFAULT_TENANT`` when absent).

The engine core answers the utility calls ``vtoken_counters``,
``vtoken_request_counters`` and ``vtoken_set_pressure`` (installed by the plugin), so this
works whether the engine core runs in this process or in its own: ``LLM``/``LLMEngine``
clients through ``call_utility``, ``AsyncLLM`` through ``call_utility_async``. The engine
core dumps the report to plain data (vLLM's utility results are msgpack, which knows no
pydantic models); these functions validate it back.
"""

from __future__ import annotations

from typing import Any

from vtoken.reports import EngineReport, RequestReport


def engine_counters(llm: Any) -> EngineReport | None:
    """What a ``vllm.LLM`` (or ``LLMEngine``) holds; ``None`` when vToken is off."""
    client = getattr(llm, "llm_engine", llm).engine_core
    in_process = getattr(client, "engine_core", None)  # InprocClient holds the EngineCore
    if in_process is not None:
        data = in_process.vtoken_counters()
    else:
        data = client.call_utility("vtoken_counters")
    return None if data is None else EngineReport.model_validate(data)


async def async_engine_counters(engine: Any) -> EngineReport | None:
    """What a ``vllm.v1.engine.async_llm.AsyncLLM`` holds; ``None`` when vToken is off."""
    data = await engine.engine_core.call_utility_async("vtoken_counters")
    return None if data is None else EngineReport.model_validate(data)


async def async_request_counters(engine: Any, request_id: str) -> RequestReport | None:
    """One request's report (running or recently finished) of an ``AsyncLLM``."""
    data = await engine.engine_core.call_utility_async("vtoken_request_counters", request_id)
    return None if data is None else RequestReport.model_validate(data)


async def async_set_pressure(
    engine: Any, pressure: dict[str, float], allowance: dict[str, int] | None = None
) -> bool:
    """Hand an ``AsyncLLM``'s engine core the controller's pressure (tenant -> keep
    fraction in (0, 1]) for its running requests and the tenants' KV allowances here
    (tenant -> blocks); ``False`` when vToken is off."""
    return bool(
        await engine.engine_core.call_utility_async("vtoken_set_pressure", pressure, allowance)
    )
