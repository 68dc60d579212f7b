"""The eviction-policy API.

A policy is a small dataclass that scores the live tokens of one request (higher = keep);
the base class owns protection (attention sinks, a recent window), top-k selection and
tie-breaking. A policy instance serves exactly one request, so per-request state (a seeded
generator, a one-shot flag) lives on the instance and per-token state lives in the token
table's stats arrays, which vToken keeps aligned with the tokens through every repack.

Contract of :meth:`EvictionPolicy.select`: given a :class:`PolicyView` and a budget in
tokens, return the logical ids to evict (int64, unique, all live, none protected): ``[k]``,
or ``[num_groups, k]`` (the same count in every group) when the policy selects per layer or
per (layer, KV head) (its ``granularity``, ``vtoken/groups.py``).

Callers outside ``policies/`` never test a policy's name; they read its traits:
``holds_budget_every_step`` (class), ``needs_budget`` and ``evicts_during_prefill``
(instance), below, and what it protects past any budget:
:meth:`EvictionPolicy.protection`, the one source of a request's KV bound for the engine,
the serving layer and admission. A policy that only decides
*whether* another one evicts is a :class:`Gate` overriding ``gate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np

from vtoken.groups import GRANULARITIES, check_granularity


@dataclass(frozen=True, slots=True)
class ScoreNeeds:
    """Which attention statistics a policy asks the engine for, each step.

    - ``step_scores``: ``[n_live]`` attention mass each key received from this step's queries
      (summed over queries; averaged over heads and scored layers, so one query row sums to 1).
    - ``query_window``: ``w > 0`` asks for ``[min(w, q_len), n_live]`` per-query rows of the
      last ``w`` queries of the step (same averaging).
    - ``per_head``: ``[num_layers, num_heads, n_live]`` mass summed over the window rows,
      per scored layer and query head.
    - ``groups``: ``"layer"`` keeps the layer axis of ``step_scores`` and ``window_rows``
      (``[L, n_live]``, ``[w, L, n_live]``: averaged over the layer's heads only),
      ``"head"`` the layer and KV-head axes (``[L, Hkv, n_live]``, ``[w, L, Hkv, n_live]``:
      averaged over the query heads that share the KV head). Every layer is scored then.
    """

    step_scores: bool = False
    query_window: int = 0
    per_head: bool = False
    groups: str = "request"

    def merge(self, other: ScoreNeeds) -> ScoreNeeds:
        return ScoreNeeds(
            step_scores=self.step_scores or other.step_scores,
            query_window=max(self.query_window, other.query_window),
            per_head=self.per_head or other.per_head,
            groups=max(self.groups, other.groups, key=GRANULARITIES.index),
        )

    @property
    def any(self) -> bool:
        return self.step_scores or self.query_window > 0 or self.per_head


@dataclass(frozen=True, slots=True)
class Protection:
    """What a policy never evicts, whatever its budget ``B`` (tokens): its first ``sinks``
    logical ids and its most recent ``max(recent, int(recent_fraction * B))``; a gate adds
    what the policy it wraps protects (``inner``). A request keeps these past its budget.

    One source, read two ways on purpose:

    - the engine, exactly: :meth:`num_protected` (the eviction mask, the floors and the
      room estimates of ``workers/`` and ``vtoken/manager.py``);
    - admission, from above: ``tokens + ceil(fraction * B)`` with :attr:`tokens` and
      :attr:`fraction` (``controlplane.admission.kv_bounds`` takes the two numbers, as
      ``workers.config.VTokenConfig.admission_protection`` computes them for an engine).
      Each level's ``max(recent, int(f * B)) <= recent + ceil(f * B)``, so admission never
      counts fewer tokens than the engine keeps.
    """

    sinks: int = 0
    recent: int = 0
    recent_fraction: float = 0.0
    inner: Protection | None = None

    def num_recent(self, budget: int) -> int:
        """This level's recent window at ``budget`` (``inner``'s not included)."""
        return max(self.recent, int(self.recent_fraction * budget))

    def num_protected(self, budget: int) -> int:
        """The most tokens protected at ``budget``: no eviction brings a request below this
        many (or all it holds, if fewer)."""
        own = self.sinks + self.num_recent(budget)
        return own if self.inner is None else own + self.inner.num_protected(budget)

    @property
    def tokens(self) -> int:
        """What is protected whatever the budget: sinks and fixed recent windows, summed."""
        own = self.sinks + self.recent
        return own if self.inner is None else own + self.inner.tokens

    @property
    def fraction(self) -> float:
        """The share of the budget protected as recent windows, summed over the levels."""
        own = self.recent_fraction
        return own if self.inner is None else own + self.inner.fraction

    def pinned(self, num_tokens: int) -> Protection:
        """This protection with the first ``num_tokens`` tokens protected too: a pinned
        prefix joins the sinks (the larger of the two counts)."""
        return replace(self, sinks=max(self.sinks, num_tokens))


@dataclass(slots=True)
class StepAttention:
    """Attention statistics of one step, aligned with the view's live tokens (see ScoreNeeds)."""

    step_scores: np.ndarray | None = None
    window_rows: np.ndarray | None = None
    head_scores: np.ndarray | None = None


@dataclass(slots=True)
class PolicyView:
    """What a policy sees of one request at one step. Arrays are in slot order.

    ``stats[name]`` are writable copies aligned with ``logical_ids``; vToken stores them
    back into the token table after ``select``.
    """

    logical_ids: np.ndarray  # [n_live] or group_shape + (n_live,) int64; the RoPE positions
    num_logical: int  # tokens in the sequence so far (live or not)
    prompt_len: int
    step: int  # steps that ran ``select`` for this request, this one included (1 at the
    # first; a prefill chunk only observed, see ``evicts_during_prefill``, is not counted)
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    attention: StepAttention = field(default_factory=StepAttention)
    num_pinned: int = 0  # leading logical ids the engine pins: protected like sinks

    @property
    def num_live(self) -> int:
        return int(self.logical_ids.shape[-1])

    @property
    def group_shape(self) -> tuple[int, ...]:
        """``()``, ``(L,)`` or ``(L, Hkv)``: one kept set per entry (``vtoken/groups.py``)."""
        return tuple(self.logical_ids.shape[:-1])

    @property
    def prefill_done_now(self) -> bool:
        """True at the step whose cache first holds the whole prompt and nothing more."""
        return self.num_logical == self.prompt_len

    def require(self, name: str) -> np.ndarray:
        """An attention statistic the policy declared in ``needs``; clear error otherwise."""
        value = getattr(self.attention, name)
        if value is None:
            raise ValueError(f"the engine did not provide '{name}'; declare it in `needs`")
        return value


@dataclass
class EvictionPolicy:
    """Base policy: override ``score`` (and optionally ``observe`` / ``gate`` /
    ``num_to_evict``). Each step ``select`` calls ``observe``, then ``gate``, then evicts
    ``num_to_evict`` tokens when the gate is open.

    Protected tokens (:meth:`protection`): the first ``max(sinks, view.num_pinned)``
    logical ids (an engine may pin a longer prefix at a step: it says so on the view, the
    policy stays as built) and the most recent ``max(recent, recent_fraction * budget)``
    ones. Among the others the lowest scores are evicted; ties go to the older token.

    ``granularity`` (one of the class's ``granularities``): ``"request"`` keeps one set;
    ``"layer"``/``"head"`` one per layer / per (layer, KV head): the view's logical ids
    and stats then have the group axes, ``score`` may return ``[n_live]``, ``[L, n_live]``
    or ``[L, Hkv, n_live]`` (broadcast over the axes it lacks), and every group evicts the
    same count (the fewest any group can: protected tokens are kept in every group).

    Traits (read by the engine and the serving layer instead of names):

    - ``holds_budget_every_step``: the policy evicts down to the budget (or to its floor of
      protected tokens) at every step, so it can enforce a per-request KV cap; ``False`` for
      policies that evict once, only when a gate opens, or never.
    - ``needs_budget``: this instance needs ``budget_tokens`` / ``keep_ratio``; ``False``
      when it never evicts or limits itself.
    - ``evicts``: ``False`` for a policy that never evicts a token (``none``): every full
      block of such a request can be published to a prefix cache.
    - ``observes_every_step``: its ``observe`` accumulates every step's statistics (H2O's
      cumulative mass), so the engine computes them at every step. Otherwise the policy
      reads them only at a step where it evicts, and an engine that evicts on demand
      skips them at the others (:meth:`needs_at_step`): eviction costs nothing while
      memory is free.
    - ``evicts_during_prefill``: this instance may evict after a prefill chunk that does not
      complete its prompt (the engine then runs ``select`` after every chunk, a step each,
      so a long prompt peaks at about one chunk plus its budget); ``False`` for a policy
      that decides at the end of prefill (SnapKV, PAGE) or never evicts: it only
      ``observe``s those chunks. Default: ``holds_budget_every_step``.
    """

    name: ClassVar[str] = "base"
    needs: ClassVar[ScoreNeeds] = ScoreNeeds()
    stat_names: ClassVar[tuple[str, ...]] = ()
    holds_budget_every_step: ClassVar[bool] = True
    evicts: ClassVar[bool] = True
    observes_every_step: ClassVar[bool] = False
    granularities: ClassVar[tuple[str, ...]] = ("request",)

    sinks: int = 0
    recent: int = 0
    recent_fraction: float = 0.0
    granularity: str = "request"

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.recent < 0 or not 0.0 <= self.recent_fraction <= 1.0:
            raise ValueError(
                f"{self.name}: sinks and recent must be >= 0 and recent_fraction in [0, 1]"
            )
        check_granularity(self.granularity)
        if self.granularity not in self.granularities:
            raise ValueError(
                f"{self.name} selects at granularity {', '.join(self.granularities)};"
                f" got {self.granularity!r}"
            )

    @property
    def needs_budget(self) -> bool:
        return True

    @property
    def evicts_during_prefill(self) -> bool:
        return self.holds_budget_every_step

    def score_needs(self) -> ScoreNeeds:
        return replace(self.needs, groups=self.granularity) if self.needs.any else self.needs

    def needs_at_step(self, may_evict: bool) -> ScoreNeeds:
        """The statistics to compute at a step, given whether the policy may evict at its
        end: all it declares when it may or when it observes every step, else none."""
        if may_evict or self.observes_every_step:
            return self.score_needs()
        return ScoreNeeds()

    def observe(self, view: PolicyView) -> None:
        """Update per-token stats from this step's attention (every step, before selection)."""

    def gate(self, view: PolicyView) -> bool:
        """Whether this policy evicts at this step at all (after ``observe``); default: yes."""
        return True

    def score(self, view: PolicyView) -> np.ndarray:
        """``[n_live]`` float (or per group, see the class docstring): higher = keep."""
        raise NotImplementedError

    def num_to_evict(self, view: PolicyView, budget: int) -> int:
        return max(0, view.num_live - budget)

    def protection(self) -> Protection:
        """What this policy keeps past any budget: its sinks and recent window."""
        return Protection(self.sinks, self.recent, self.recent_fraction)

    def num_protected(self, budget: int, num_pinned: int = 0) -> int:
        """The most tokens ``protected`` keeps with ``budget`` and a pinned prefix of
        ``num_pinned`` tokens (sinks + recent window): no eviction brings a request below
        this many (or all it holds, if fewer)."""
        return self.protection().pinned(num_pinned).num_protected(budget)

    def protected(self, view: PolicyView, budget: int) -> np.ndarray:
        """``[n_live]`` bool mask of tokens this policy never evicts at this step."""
        num_recent = self.protection().num_recent(budget)
        ids = view.logical_ids
        return (ids < max(self.sinks, view.num_pinned)) | (ids >= view.num_logical - num_recent)

    def select(self, view: PolicyView, budget: int) -> np.ndarray:
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        self.observe(view)
        num_evict = self.num_to_evict(view, budget) if self.gate(view) else 0
        if num_evict <= 0:
            return np.zeros(0, dtype=np.int64)
        ids = view.logical_ids.reshape(-1, view.num_live)  # [groups, n_live]
        scores = _per_group(np.asarray(self.score(view), dtype=np.float64), view)
        protected = _per_group(self.protected(view, budget), view)
        num_evict = min(num_evict, int((~protected).sum(axis=1).min()))
        if num_evict <= 0:  # every group's candidates are protected: one empty answer
            return np.zeros(0, dtype=np.int64)
        # protected last, then lowest score first, ties to the older token
        order = np.lexsort((ids, scores, protected), axis=-1)[:, :num_evict]
        evicted = np.sort(np.take_along_axis(ids, order, axis=1), axis=1)
        return evicted[0] if not view.group_shape else evicted


def _per_group(values: np.ndarray, view: PolicyView) -> np.ndarray:
    """``values`` (``[n_live]`` or leading group axes of the view, then ``n_live``) as
    ``[num_groups, n_live]``."""
    shape, n = view.group_shape, view.num_live
    if values.ndim - 1 > len(shape) or values.shape[:-1] != shape[: values.ndim - 1]:
        raise ValueError(f"scores of shape {values.shape} for groups {shape} of {n} tokens")
    padded = values.reshape(*values.shape[:-1], *(1,) * (len(shape) + 1 - values.ndim), n)
    return np.broadcast_to(padded, (*shape, n)).reshape(-1, n)


@dataclass
class Gate(EvictionPolicy):
    """A wrapper that decides, through ``gate``, whether the wrapped ``inner`` policy evicts.

    When the gate is open, ``inner`` counts (``num_to_evict``, after its own ``gate``) and
    scores; protected are the gate's own sinks/recent tokens and those ``inner`` protects
    (:meth:`protection` nests ``inner``'s).
    The gate's ``needs`` are merged with the inner policy's. ``inner`` must keep no
    per-token stats (``stat_names`` empty): the token table holds the gate's only.
    """

    holds_budget_every_step = False

    inner: EvictionPolicy = field(kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inner.granularity != "request":
            raise ValueError(f"{self.name} wraps a policy that keeps one set per request")
        if self.inner.stat_names:
            raise ValueError(
                f"{self.name} wraps a policy without per-token stats; "
                f"{self.inner.name} keeps {list(self.inner.stat_names)}"
            )

    @property
    def evicts_during_prefill(self) -> bool:
        return self.inner.evicts_during_prefill  # a gate that decides once overrides this

    def score_needs(self) -> ScoreNeeds:
        return self.inner.score_needs().merge(self.needs)

    def protection(self) -> Protection:
        return replace(super().protection(), inner=self.inner.protection())

    def observe(self, view: PolicyView) -> None:
        self.inner.observe(view)

    def num_to_evict(self, view: PolicyView, budget: int) -> int:
        return self.inner.num_to_evict(view, budget) if self.inner.gate(view) else 0

    def protected(self, view: PolicyView, budget: int) -> np.ndarray:
        return super().protected(view, budget) | self.inner.protected(view, budget)

    def score(self, view: PolicyView) -> np.ndarray:
        return self.inner.score(view)
