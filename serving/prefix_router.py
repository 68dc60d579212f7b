"""Ray Serve's ``PrefixCacheAffinityRouter`` fitted to this app's replicas: a baseline
of ``vtoken bench prefix`` (``AppArgs.router = "serve_prefix_cache_affinity"``).

Serve's router matches the prompt *text* of an OpenAI request object in a prefix tree of
what it routed where; this app's replicas take a dict of token ids, so the adapter hands
it the token ids written out (``"12 345 "``: a shared token prefix is a shared text
prefix). Nothing else changes: its tree, match threshold and power-of-two fallback are
Serve's. A module of its own, imported only when chosen: Serve re-imports a router class
by its path, and the class comes from ``ray.llm`` (the public ``ray.serve.llm`` path needs
``ray[llm]``'s extras; the class is the same).
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest

from serving.router import request_fields


class ServePrefixCacheAffinityRouter(PrefixCacheAffinityRouter):  # type: ignore[misc]
    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        ids = request_fields(pending_request).get("prompt_token_ids")
        if ids is None:
            return str(super()._extract_text_from_request(pending_request))
        return "".join(f"{token} " for token in ids)
