"""Request validation: a request's ``extra_args["vtoken_policy"]`` and
``extra_args["tenant_weight"]`` are checked where vLLM
checks its parameters (the front end) and again as the engine core takes it in, so the
scheduler never sees a bad one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers.config import CONFIG_KEY, request_policy_spec
from workers.fair_share import tenant_weight
from workers.vllm_patches.scheduler_hooks import scheduler_state


def validate_params(original: Callable[..., Any]) -> Callable[..., Any]:
    """Front end, where vLLM validates a request's parameters: ``LLM.generate`` raises,
    ``AsyncLLM.generate`` re-raises it as a client error, before the request exists."""

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        if CONFIG_KEY in (self.vllm_config.additional_config or {}):
            from vllm.exceptions import VLLMValidationError

            try:
                request_policy_spec(getattr(params, "extra_args", None))
                tenant_weight(getattr(params, "extra_args", None))
            except ValueError as error:
                raise VLLMValidationError(str(error), parameter="extra_args") from None
        return result

    return _validate_params


def preprocess_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """Engine core, every request's first step in it: a bad override that skipped the front
    end (a pre-built ``EngineCoreRequest``) raises here, so the scheduler never sees one. In
    an engine-core process vLLM answers that request alone with ``FinishReason.ERROR``."""

    def preprocess_add_request(self: Any, request: Any) -> Any:
        if scheduler_state(self.scheduler) is not None and request.sampling_params is not None:
            request_policy_spec(request.sampling_params.extra_args)
            tenant_weight(request.sampling_params.extra_args)
        return original(self, request)

    return preprocess_add_request
