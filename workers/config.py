"""The plugin's configuration: ``additional_config={"vtoken": {...}}``, validated by pydantic.

It crosses process boundaries (front end -> engine core -> workers) inside vLLM's config,
so it is a pydantic model; a bad value raises ``ValueError`` naming the field, which
fails engine start. Without a ``"vtoken"`` key the plugin stays inert.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from vtoken.block_eviction import admission_protected_tokens
from vtoken.policy import EvictionPolicy
from vtoken.repack_planner import ReclaimMode

CONFIG_KEY = "vtoken"
REQUEST_KEY = "vtoken_policy"
HOLD_TO_BLOCKS_KEY = "vtoken_hold_to_blocks"
"""``extra_args``: the most blocks the request may hold once its prefill ended (what
admission counts it at); above it, it evicts at that step whatever the eviction mode. A
policy that evicts during prefill is held to it after every prefill chunk too (with the
next chunk's blocks: admission's prefill peak counts one chunk above its budget)."""


@dataclass(frozen=True, slots=True)
class ProtectionBound:
    """What admission counts an engine's requests as keeping past any budget ``B``: at most
    ``tokens + ceil(fraction * B)`` tokens (``controlplane.admission.kv_bounds`` takes the
    two numbers; ``vtoken.policy.Protection`` explains the rounding)."""

    tokens: int
    fraction: float


NOTHING_FREED = ProtectionBound(tokens=2**31 - 1, fraction=0.0)
"""The protection in naive mode: eviction frees no block, so a request counts its length."""


class PolicySpec(BaseModel):
    """Which policy a request runs and its budget.

    - ``policy``/``policy_args``: a name of ``policies.REGISTRY`` and its dataclass fields
      (one policy instance per request).
    - ``budget_tokens`` or ``keep_ratio`` (at most one; required unless the policy's
      ``needs_budget`` is false): the live-token budget after each step, absolute or
      ``ceil(keep_ratio * sequence length)``.

    A request may override the engine's spec with ``SamplingParams.extra_args
    ["vtoken_policy"] = {...}`` (same fields), read by :func:`request_policy_spec`; an
    invalid override refuses the request, it never runs under another spec.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = "none"
    policy_args: dict[str, Any] = Field(default_factory=dict)
    budget_tokens: int | None = Field(default=None, ge=1)
    keep_ratio: float | None = Field(default=None, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _policy_and_budget(self) -> PolicySpec:
        from policies import make_policy

        policy = make_policy(self.policy, **self.policy_args)  # bad names/arguments raise
        if self.budget_tokens is not None and self.keep_ratio is not None:
            raise ValueError("give budget_tokens or keep_ratio, not both")
        unbudgeted = self.budget_tokens is None and self.keep_ratio is None
        if policy.needs_budget and unbudgeted:
            raise ValueError(f"policy {self.policy!r} needs budget_tokens or keep_ratio")
        return self

    def make_policy(self) -> EvictionPolicy:
        from policies import make_policy

        return make_policy(self.policy, **self.policy_args)

    def budget(self, num_logical: int) -> int:
        """Live tokens a request may keep once ``num_logical`` tokens have been computed."""
        if self.budget_tokens is not None:
            return self.budget_tokens
        if self.keep_ratio is not None:
            return math.ceil(self.keep_ratio * num_logical)
        return num_logical


class VTokenConfig(PolicySpec):
    """One engine's vToken settings: the default ``PolicySpec`` plus

    - ``mode``: ``vtoken`` repacks and frees every emptied block; ``naive`` keeps every block
      a block-granular manager would still hold (Naive-Evict, ``vtoken/manager.py``);
      ``block`` evicts whole blocks (the policy's scores summed per block, protected
      blocks kept) and frees them without copies (``vtoken/block_eviction.py``);
    - ``eviction``: ``eager`` evicts every request to its budget after every step (the
      paper's benchmarks); ``on_demand`` keeps tokens until memory is needed, then evicts
      running requests to their budgets (those whose eviction gives the next step the most
      blocks first) so that the next
      step and the head of the waiting queue fit, instead of vLLM preempting one. Policies
      that decide at one step only (``holds_budget_every_step`` false) keep their timing.
      Chunked prefill (``max_num_batched_tokens`` below the prompt): after each chunk that
      does not complete its prompt, a request whose policy evicts during prefill
      (``evicts_during_prefill``: H2O, StreamingLLM, TOVA, Random, Scissorhands; not
      SnapKV or PAGE, which decide when the prompt is complete) is treated as a decoding
      request, its budget the one at the tokens computed so far (``keep_ratio x
      computed`` or ``budget_tokens``, never above ``hold_to_blocks``): ``eager`` evicts it
      to that budget after every chunk; ``on_demand`` when a hard bound applies
      (``hold_to_blocks`` it would outgrow with its next chunk, a tenant's cap, pressure)
      or memory is needed, never below that budget. So a long prompt peaks at about one
      chunk plus its budget instead of the whole prompt;
    - ``squeeze_below_budget`` (``on_demand`` only): when the running requests' next step
      still does not fit with every decoding request at its budget, squeeze them further,
      a block at a time from the one keeping the largest share of its budget (tenants
      above their allowance first), only as many blocks as the step needs, never under its
      floor, instead of vLLM preempting one: a request keeps less context instead of being
      recomputed from scratch. When the floors cannot free enough, vLLM preempts its
      newest request and the others give only what that leaves short. Off, vLLM preempts
      as soon as every request is at its budget;
    - ``squeeze_floor``: a request's floor for that squeeze, as a fraction of its policy's
      budget (its policy still keeps its sinks and pinned prefix; the policy chooses which
      tokens stay, among them a recent window sized on the smaller budget);
    - ``score_layers``: which layers feed the attention statistics of scored policies:
      ``all``, a list of layer ids, or a count N (N layers evenly spaced, the first and
      last included: :func:`spread_layers`);
    - ``prefix_pin_tokens``: the leading tokens of every request that eviction never takes
      (added to its policy's sinks); with vLLM's prefix caching on, their full blocks stay
      in the cache however hard the request is squeezed (a tenant's system prompt,
      few-shot examples), see ``workers/prefix_cache.py``;
    - ``pin_cache_hits``: a request also keeps, for its whole life and on top of its
      policy's budget, the tokens it took from a prefix-cache hit, so they stay cached for
      the next request (a conversation's next turn) at the cost of the memory they hold;
      not under a hard bound (``hold_to_blocks``, a tenant's cap, pressure) nor for a
      resumed request. Off, a hit whose first holder finished is evicted like the
      request's own tokens;
    - ``fair_share`` (default on): weighted fairness between tenants
      (``workers/fair_share.py``): the waiting queue serves the tenant with the smallest
      virtual counter first (tokens served, ``fair_prompt_cost`` per prompt token and
      ``fair_output_cost`` per output token, divided by the tenant's weight,
      ``extra_args["tenant_weight"]``), and under memory pressure the squeeze below
      budget and vLLM's preemption take from tenants above their weighted share of the
      pool first. With one tenant (or none named) scheduling is vLLM's own;
    - ``record_evictions``: keep every step's evicted logical ids per request (tests);
    - ``check_invariants``: run ``check_invariants()`` after every scheduler step (tests).
    """

    mode: ReclaimMode = ReclaimMode.VTOKEN
    eviction: Literal["eager", "on_demand"] = "eager"
    squeeze_below_budget: bool = True
    squeeze_floor: float = Field(default=0.5, ge=0.0, le=1.0)
    score_layers: Literal["all"] | StrictInt | list[StrictInt] = "all"
    prefix_pin_tokens: int = Field(default=0, ge=0)
    pin_cache_hits: bool = False
    fair_share: bool = True
    fair_prompt_cost: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    fair_output_cost: float = Field(default=2.0, ge=0.0, allow_inf_nan=False)
    record_evictions: bool = False
    check_invariants: bool = False

    @field_validator("score_layers", mode="before")
    @classmethod
    def _score_layers(cls, value: Any) -> Any:
        if not (
            (isinstance(value, str) and value == "all")
            or (type(value) is int and value >= 1)
            or (
                isinstance(value, list)
                and value
                and all(type(i) is int and i >= 0 for i in value)
                and len(set(value)) == len(value)
            )
        ):
            raise ValueError(
                "score_layers must be 'all', a count >= 1 or a non-empty list of distinct "
                f"layer ids >= 0, got {value!r}"
            )
        return value

    def layer_ids(self, num_layers: int) -> list[int]:
        return score_layer_ids(self.score_layers, num_layers)

    def admission_keep_ratio(self) -> float | None:
        """The keep ratio when the policy evicts to it whenever asked (admission bounds a
        request without a tenant cap by it after prefill, counting what the policy protects
        past it: :meth:`admission_protection`); ``None`` otherwise (policy ``none``, an
        absolute budget, a policy that compresses once, or naive mode). Block mode frees
        whole blocks: a budget ``B`` holds at most ``ceil(B / bs)`` blocks past what its
        policy protects, so the ratio bounds it too.

        In ``on_demand`` mode a request keeps more than its ratio while memory is free; that
        excess is reclaimable, and the controller's pressure takes it back as soon as the
        tenant's measured active KV passes its budget, so the ratio still bounds what the
        tenant's requests count against it."""
        policy = self.make_policy()
        if not (policy.holds_budget_every_step and policy.needs_budget):
            return None
        if self.mode is ReclaimMode.NAIVE:  # Naive-Evict frees no block by evicting
            return None
        return self.keep_ratio

    def admission_protection(self, block_size: int | None = None) -> ProtectionBound:
        """What the engine keeps of a request whatever its budget ``B``, at most ``tokens +
        ceil(fraction * B)``: its policy's :meth:`~vtoken.policy.EvictionPolicy.protection`
        (sinks, or the pinned prefix ``prefix_pin_tokens`` where it is longer, fixed recent
        windows, recent windows sized on the budget; a gate's and the policy it wraps,
        added). A request under a tenant's cap may run under ``policies.CAP_POLICY``
        instead (``serving.engine_translators.request_spec``): its recent share counts too.
        Admission counts a request at no less (``kv_bounds``); forgetting it let a pinned
        system prompt hold twice what admission counted. In naive mode eviction frees no
        block, so everything counts (:data:`NOTHING_FREED`). In block mode each protected
        token pins its whole block: the sinks or pinned prefix count ``ceil(S / bs)``
        blocks, each recent window ``ceil(r / bs) + 1`` (the last, partial block among
        them), one more when a window grows with the budget
        (:func:`~vtoken.block_eviction.admission_protected_tokens`); ``block_size`` (the
        engine's) is required then, ``ValueError`` without it."""
        from policies import CAP_POLICY

        if self.mode is ReclaimMode.NAIVE:  # Naive-Evict frees no block: not even a cap's
            return NOTHING_FREED
        protection = self.make_policy().protection().pinned(self.prefix_pin_tokens)
        # The cap policy keeps the pinned prefix (<= tokens) and its own recent share.
        fraction = min(1.0, max(protection.fraction, CAP_POLICY().protection().fraction))
        if self.mode is ReclaimMode.BLOCK:
            if block_size is None or block_size <= 0:
                raise ValueError(
                    f"mode 'block': admission needs the engine's block_size > 0, got {block_size}"
                )
            tokens = admission_protected_tokens(protection, block_size, fraction)
            return ProtectionBound(tokens=tokens, fraction=fraction)
        return ProtectionBound(tokens=protection.tokens, fraction=fraction)

    def admission_prefill_chunk_tokens(self, max_num_batched_tokens: int | None) -> int | None:
        """The prefill chunk admission counts a request's prefill peak with (``kv_bounds``:
        one chunk plus its budget, if below its prompt): the engine's
        ``max_num_batched_tokens`` when every request admission counts with a budget
        evicts during prefill: under the engine's policy where it holds a keep ratio, and
        under whichever policy a tenant's cap runs (this one, or ``policies.CAP_POLICY``:
        ``serving.engine_translators.request_spec``). ``None`` (a prompt counts whole)
        when the chunk is unknown, in naive mode, or when one of them does not."""
        from policies import CAP_POLICY

        if max_num_batched_tokens is None or self.mode != "vtoken":
            return None
        policy = self.make_policy()
        holds_budget = policy.holds_budget_every_step and policy.needs_budget
        if holds_budget and not policy.evicts_during_prefill:
            return None  # its keep ratio and caps run under it, only once prefill ended
        return max_num_batched_tokens if CAP_POLICY().evicts_during_prefill else None

    def admission_floor_tokens(self, block_size: int | None = None) -> int | None:
        """The fewest tokens the policy can be squeezed to, when it evicts to any budget
        whenever asked; ``None`` otherwise (nothing to squeeze a request toward:
        ``squeeze_to_floor`` tenants are counted at their budgets then).

        What the policy protects grows with the budget (:meth:`admission_protection`:
        ``P + f x B``), so the floor is the budget that covers its own protection:
        ``ceil(P / (1 - f))`` (``block_size``: the engine's, required in block mode)."""
        policy = self.make_policy()
        if self.mode is ReclaimMode.NAIVE:
            return None
        if not (policy.holds_budget_every_step and policy.needs_budget):
            return None
        bound = self.admission_protection(block_size)
        if bound.fraction >= 1:
            return None
        return math.ceil(bound.tokens / (1 - bound.fraction))


def request_policy_spec(extra_args: Mapping[str, Any] | None) -> PolicySpec | None:
    """A request's own ``PolicySpec`` from ``SamplingParams.extra_args["vtoken_policy"]``, or
    ``None`` when it brings none (the engine's spec applies).

    Raises ``ValueError`` naming the key and each problem when the override is not a valid
    spec: the request must be refused, never run under a spec it did not ask for (a tenant's
    cap that admission counted on would silently go unenforced).
    """
    override = (extra_args or {}).get(REQUEST_KEY)
    if override is None or isinstance(override, PolicySpec):
        return override
    where = f"extra_args[{REQUEST_KEY!r}]"
    if not isinstance(override, dict):
        raise ValueError(f"{where} must be a dict, got {type(override).__name__}")
    try:
        return PolicySpec.model_validate(override)
    except ValidationError as error:
        raise ValueError(f"invalid {where}: {_problems(error)}") from None
    except (ValueError, TypeError) as error:  # raised by a policy's own constructor
        raise ValueError(f"invalid {where}: {error}") from None


def _problems(error: ValidationError) -> str:
    """Pydantic's errors on one line: ``field: message; ...`` (a 400 body, not a report)."""
    parts = []
    for e in error.errors():
        message = str(e["msg"]).removeprefix("Value error, ")
        location = ".".join(str(part) for part in e["loc"])
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts)


def parse_config(additional_config: dict[str, Any] | None) -> VTokenConfig | None:
    """The vToken config inside vLLM's ``additional_config``, or ``None`` (plugin inert).

    Raises ``ValueError`` with every pydantic error spelled out when the section is bad.
    """
    if not additional_config or CONFIG_KEY not in additional_config:
        return None
    section = additional_config[CONFIG_KEY]
    if isinstance(section, VTokenConfig):
        return section
    if not isinstance(section, dict):
        kind = type(section).__name__
        raise ValueError(f"additional_config['vtoken'] must be a dict, got {kind}")
    try:
        return VTokenConfig.model_validate(section)
    except ValidationError as error:
        raise ValueError(f"invalid additional_config['vtoken']: {error}") from None


def spread_layers(count: int, num_layers: int) -> list[int]:
    """``count`` layer ids evenly spaced over ``num_layers``, the first and last included
    (4 of 30: 0, 10, 19, 29); every layer where ``count >= num_layers``."""
    if count >= num_layers:
        return list(range(num_layers))
    if count == 1:
        return [num_layers - 1]
    stride = (num_layers - 1) / (count - 1)  # >= 1: the rounded ids are distinct
    return sorted(num_layers - 1 - round(k * stride) for k in range(count))


ScoreLayers = Literal["all"] | int | list[int]


def score_layer_ids(score_layers: ScoreLayers, num_layers: int) -> list[int]:
    """The layer ids a ``score_layers`` value names on a model of ``num_layers`` layers;
    ids past the model raise ``ValueError``."""
    if score_layers == "all":
        return list(range(num_layers))
    if isinstance(score_layers, int):
        return spread_layers(score_layers, num_layers)
    bad = [i for i in score_layers if i >= num_layers]
    if bad:
        raise ValueError(f"score_layers {bad} out of range: the model has {num_layers}")
    return list(score_layers)
