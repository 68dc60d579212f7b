"""Utilities added to vLLM's ``EngineCore``, each as a method of its own name: a client
reads the engine's counters and sets tenant pressure through ``call_utility``
(``workers/api.py``), in whichever process the engine core runs.
"""

from __future__ import annotations

from typing import Any

from workers.vllm_patches.scheduler_hooks import scheduler_state


def vtoken_counters(self: Any) -> dict[str, Any] | None:
    """``EngineCore`` utility: the ``EngineReport`` dumped to plain data (``None`` when
    off); vLLM sends utility results as msgpack, which takes no pydantic model.

    From a client: ``workers/api.py`` (``call_utility("vtoken_counters")`` or ``_async``).
    """
    state = scheduler_state(self.scheduler)
    return None if state is None else state.snapshot().model_dump(mode="json")


def vtoken_request_counters(self: Any, request_id: str) -> dict[str, Any] | None:
    """``EngineCore`` utility: one request's ``RequestReport`` (running or recently
    finished) dumped to plain data."""
    state = scheduler_state(self.scheduler)
    report = None if state is None else state.request_report(request_id)
    return None if report is None else report.model_dump(mode="json")


def vtoken_set_pressure(
    self: Any, pressure: dict[str, float], allowance: dict[str, int] | None = None
) -> bool:
    """``EngineCore`` utility: the controller's per-tenant keep fractions for running
    requests and KV allowances here (``VTokenScheduler.set_pressure``); ``False`` when
    vToken is off."""
    state = scheduler_state(self.scheduler)
    if state is None:
        return False
    state.set_pressure(pressure, allowance)
    return True
