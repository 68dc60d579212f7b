"""Request validation: a request's ``extra_args["vtoken_policy"]`` and
``extra_args["tenant_weight"]`` are checked where vLLM
checks its parameters (the front end) and again as the engine core takes it in, so the
scheduler never sees a bad one. An override that keeps a set per layer or per (layer, KV
head) is refused on an engine that cannot (``support.grouping_problems``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers.config import CONFIG_KEY, parse_config, request_policy_spec
from workers.fair_share import tenant_weight
from workers.vllm_patches.scheduler_hooks import scheduler_state
from workers.vllm_patches.support import (
    grouping_problems,
    model_is_hybrid,
    refuse_grouped_request,
)


def validate_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """Front end, where vLLM validates a request's parameters: ``LLM.generate`` raises,
    ``AsyncLLM.generate`` re-raises it as a client error, before the request exists."""

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        if CONFIG_KEY in (self.vllm_config.additional_config or {}):
            from vllm.exceptions import VLLMValidationError

            try:
                spec = request_policy_spec(getattr(params, "extra_args", None))
                tenant_weight(getattr(params, "extra_args", None))
                if spec is not None:
                    refuse_grouped_request(spec, _front_end_problems(self.vllm_config))
            except ValueError as error:
                raise VLLMValidationError(str(error), parameter="extra_args") from None
        return result

    return _validate_params


def preprocess_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """Engine core, every request's first step in it: a bad override that skipped the front
    end (a pre-built ``EngineCoreRequest``) raises here, so the scheduler never sees one. In
    an engine-core process vLLM answers that request alone with ``FinishReason.ERROR``."""

    def preprocess_add_request(self: Any, request: Any) -> Any:
        state = scheduler_state(self.scheduler)
        if state is not None and request.sampling_params is not None:
            spec = request_policy_spec(request.sampling_params.extra_args)
            tenant_weight(request.sampling_params.extra_args)
            if spec is not None:
                refuse_grouped_request(spec, state.grouping_problems)
        return original(self, request)

    return preprocess_add_request


def _front_end_problems(vllm_config: Any) -> list[str]:
    """``grouping_problems`` as the front end sees the engine (hybrid from the model's
    layer types: its KV cache groups exist in the engine core only)."""
    config = parse_config(vllm_config.additional_config)
    assert config is not None
    return grouping_problems(vllm_config, config, model_is_hybrid(vllm_config.model_config))
