"""Each policy's published rule on small hand-made attention, and protection guarantees."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from policies import CAP_POLICY, REGISTRY, make_policy
from policies.page import head_agreement
from vtoken.policy import EvictionPolicy, Gate, PolicyView, ScoreNeeds, StepAttention
from workers.statistics import reduce_attention


def view(n, attention=None, prompt_len=None, num_logical=None, ids=None, stats=None):
    ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    num_logical = int(ids.max()) + 1 if num_logical is None else num_logical
    return PolicyView(
        logical_ids=ids,
        num_logical=num_logical,
        prompt_len=num_logical if prompt_len is None else prompt_len,
        step=1,
        stats=stats or {},
        attention=attention or StepAttention(),
    )


def kept(n, evicted):
    return sorted(set(range(n)) - set(evicted.tolist()))


def test_none_never_evicts():
    assert make_policy("none").select(view(10), budget=0).size == 0


def test_streaming_llm_keeps_sinks_and_recent_window():
    evicted = make_policy("streaming_llm", sinks=4, recent=6).select(view(20), budget=100)
    assert kept(20, evicted) == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19]
    evicted = make_policy("streaming_llm", sinks=2).select(view(12), budget=5)
    assert kept(12, evicted) == [0, 1, 9, 10, 11]


def test_h2o_keeps_heavy_hitters_plus_recent_and_accumulates():
    policy = make_policy("h2o", recent=2)
    stats = {"h2o_score": np.zeros(8, dtype=np.float32)}
    scores = np.array([0.9, 0.1, 0.5, 0.05, 0.3, 0.2, 0.0, 0.0], dtype=np.float32)
    evicted = policy.select(view(8, StepAttention(step_scores=scores), stats=stats), budget=4)
    assert kept(8, evicted) == [0, 2, 6, 7]  # top-2 heavy {0, 2} + recent {6, 7}
    assert np.allclose(stats["h2o_score"], scores)  # accumulated in place


def test_h2o_default_splits_budget_between_heavy_and_recent():
    scores = np.array([5, 0, 4, 0, 0, 0, 0, 0, 1, 1], dtype=np.float32)
    stats = {"h2o_score": np.zeros(10, dtype=np.float32)}
    evicted = make_policy("h2o").select(view(10, StepAttention(step_scores=scores), stats=stats), 4)
    assert kept(10, evicted) == [0, 2, 8, 9]


def test_tova_drops_lowest_attention_of_the_last_query():
    rows = np.array([[0.0, 0.9, 0.1, 0.0, 0.0], [0.3, 0.05, 0.4, 0.2, 0.05]])
    evicted = make_policy("tova").select(view(5, StepAttention(window_rows=rows)), budget=3)
    assert kept(5, evicted) == [0, 2, 3]


def test_scissorhands_counts_hits_above_uniform_and_drops_least_important():
    policy = make_policy("scissorhands", recent=2, drop_fraction=0.25)
    # 3 queries over 8 keys; uniform threshold per row is 1 / visible keys
    rows = np.array(
        [
            [0.5, 0.0, 0.3, 0.0, 0.2, 0.0, 0.0, 0.0],  # 3 visible -> threshold 1/3
            [0.1, 0.1, 0.2, 0.1, 0.2, 0.1, 0.2, 0.0],  # 7 visible -> 1/7
            [0.2, 0.0, 0.1, 0.1, 0.1, 0.1, 0.2, 0.2],  # 7 visible -> 1/7
        ]
    )
    stats = {"hits": np.zeros(8, np.float32), "seen": np.zeros(8, np.float32)}
    evicted = policy.select(view(8, StepAttention(window_rows=rows), stats=stats), budget=6)
    assert stats["hits"].tolist() == [2, 0, 1, 0, 1, 0, 2, 1]
    assert stats["seen"].tolist() == [3, 1, 3, 2, 3, 2, 2, 1]
    # overflow 2 + drop 0.25 * 6 = 1 -> 3 evicted among ids 0..5 (6, 7 are recent)
    assert evicted.tolist() == [1, 3, 5]


def test_snapkv_pools_window_votes_and_protects_the_window():
    policy = make_policy("snapkv", window=2, kernel_size=3, pooling="max")
    rows = np.zeros((2, 10))
    rows[:, 3] = 1.0  # a spike at 3 also protects 2 and 4 through max pooling
    rows[:, 7] = 0.5
    evicted = policy.select(view(10, StepAttention(window_rows=rows)), budget=7)
    assert kept(10, evicted) == [2, 3, 4, 6, 7, 8, 9]
    decode = view(11, StepAttention(window_rows=np.ones((1, 11))), prompt_len=10)
    assert policy.select(decode, budget=3).size == 0  # compresses once, at the end of prefill


def test_snapkv_pools_only_the_tokens_before_the_window():
    """The window's own votes take no part in pooling: the token just before the window
    does not inherit a window token's votes (as the official SnapKV)."""
    rows = np.zeros((2, 10))
    rows[:, 8] = 5.0  # a window token, heavily attended
    rows[:, 2] = 1.0
    rows[:, 5] = 0.5
    for pooling in ("max", "avg"):
        policy = make_policy("snapkv", window=2, kernel_size=3, pooling=pooling)
        evicted = policy.select(view(10, StepAttention(window_rows=rows)), budget=5)
        assert kept(10, evicted) == [1, 2, 3, 8, 9], pooling  # not 7, beside the window
    assert make_policy("snapkv").pooling == "avg"  # the official default


def _snapkv_published(layers, window, kernel_size, pooling, budget):
    """SnapKV as the paper and its official code state it, in plain torch: the window's
    attention (mean over layers and heads) summed over the window queries, for the tokens
    before the window only; 1-D pooled with ``kernel_size`` (zero padding counted for avg,
    as ``avg_pool1d``); top ``budget - window`` of them plus the window. Ties keep the newer
    token (the policy's stated tie rule; the paper leaves it open)."""
    probabilities = torch.stack(list(layers)).float()  # [layers, heads, window, n]
    n = probabilities.shape[-1]
    votes = probabilities.mean(dim=(0, 1)).sum(0)[: n - window]
    pool = torch.nn.functional.avg_pool1d if pooling == "avg" else torch.nn.functional.max_pool1d
    pooled = pool(votes[None, None], kernel_size, stride=1, padding=kernel_size // 2)[0, 0]
    newest_first = torch.argsort(pooled.flip(0), descending=True, stable=True)
    top = (n - window - 1 - newest_first[: budget - window]).tolist()
    return sorted(top) + list(range(n - window, n))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(12, 80),
    window=st.integers(1, 10),
    kernel_size=st.sampled_from([1, 3, 5, 7]),
    pooling=st.sampled_from(["avg", "max"]),
    keep=st.floats(0.2, 0.9),
    seed=st.integers(0, 2**16),
)
def test_snapkv_keeps_what_the_published_rule_keeps(n, window, kernel_size, pooling, keep, seed):
    """Kept sets equal the published rule computed independently, on the same attention
    statistics (softmax rows of the last ``window`` queries, several layers and heads)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, window, n, generator=generator) * 3
    causal = torch.arange(n)[None, :] > torch.arange(n - window, n)[:, None]
    layers = list(logits.masked_fill(causal, float("-inf")).softmax(-1))
    budget = max(window, int(keep * n))
    attention = reduce_attention(layers, ScoreNeeds(query_window=window))
    policy = make_policy("snapkv", window=window, kernel_size=kernel_size, pooling=pooling)
    evicted = policy.select(view(n, attention), budget=budget)
    assert kept(n, evicted) == _snapkv_published(layers, window, kernel_size, pooling, budget)


def test_random_is_seeded_order_independent_and_respects_protection():
    first = make_policy("random", seed=7, sinks=2, recent=3).select(view(30), budget=10)
    again = make_policy("random", seed=7, sinks=2, recent=3).select(view(30), budget=10)
    other = make_policy("random", seed=8, sinks=2, recent=3).select(view(30), budget=10)
    shuffled = make_policy("random", seed=7, sinks=2, recent=3).select(
        view(30, ids=np.random.default_rng(0).permutation(30)), budget=10
    )
    assert first.tolist() == again.tolist() == shuffled.tolist()
    assert first.tolist() != other.tolist()
    assert not set(first.tolist()) & {0, 1, 27, 28, 29}


def test_page_gates_on_the_drop_in_head_agreement():
    agree = np.tile(np.arange(20.0), (6, 4, 1))  # every head of every layer agrees
    diverge = agree.copy()
    rng = np.random.default_rng(0)
    for layer in range(3, 6):  # late layers: each head reads different tokens
        for head in range(4):
            diverge[layer, head] = rng.permutation(20)
    assert head_agreement(agree, 5).tolist() == [1.0] * 6
    assert head_agreement(agree[:, :1], 5).tolist() == [1.0] * 6  # one head: no pairs
    rows = np.zeros((1, 20))
    kept_all = make_policy("page", top_fraction=0.25, inner=make_policy("snapkv", window=2)).select(
        view(20, StepAttention(window_rows=rows, head_scores=agree)), budget=8
    )
    assert kept_all.size == 0
    gated = make_policy("page", top_fraction=0.25, inner=make_policy("snapkv", window=2)).select(
        view(20, StepAttention(window_rows=rows, head_scores=diverge)), budget=8
    )
    assert gated.size == 12


def test_page_is_a_gate_around_snapkv_that_opens_once_at_the_end_of_prefill():
    """Open: exactly what the wrapped SnapKV evicts; closed: nothing, at every later step."""
    agree = np.tile(np.arange(20.0), (6, 4, 1))
    diverge = agree.copy()
    for layer in range(3, 6):
        diverge[layer] = np.random.default_rng(layer).permuted(agree[layer], axis=-1)
    rows = np.random.default_rng(1).random((2, 20))
    snapkv = make_policy("snapkv", window=2)
    for head_scores, opens in ((diverge, True), (agree, False)):
        page = make_policy("page", top_fraction=0.25, inner=make_policy("snapkv", window=2))
        prefill = view(20, StepAttention(window_rows=rows, head_scores=head_scores))
        expected = snapkv.select(prefill, budget=8) if opens else np.zeros(0)
        assert page.select(prefill, budget=8).tolist() == expected.tolist()
        assert page.enabled is opens
        decode = view(21, StepAttention(window_rows=np.ones((2, 21))), prompt_len=20)
        assert page.select(decode, budget=8).size == 0  # SnapKV compresses once
        assert not page.score_needs().any  # decided: nothing more to compute


class _Lowest(EvictionPolicy):
    """Test policy: evicts the lowest logical ids, and only at even steps (its own gate)."""

    def gate(self, current: PolicyView) -> bool:
        return current.step % 2 == 0

    def score(self, current: PolicyView) -> np.ndarray:
        return current.logical_ids.astype(np.float64)


@dataclass
class _Open(Gate):
    """Test gate: open while ``is_open``."""

    is_open: bool = True

    def gate(self, current: PolicyView) -> bool:
        return self.is_open


def test_a_gate_runs_the_wrapped_policy_only_when_both_gates_open():
    def at_step(step):
        return PolicyView(logical_ids=np.arange(10), num_logical=10, prompt_len=10, step=step)

    gate = _Open(inner=_Lowest(), sinks=2)
    assert gate.select(at_step(2), budget=6).tolist() == [2, 3, 4, 5]  # its sinks protected
    assert gate.select(at_step(1), budget=6).size == 0  # the inner policy's gate is shut
    gate.is_open = False
    assert gate.select(at_step(2), budget=6).size == 0
    assert not gate.holds_budget_every_step
    with pytest.raises(ValueError, match="without per-token stats"):
        _Open(inner=make_policy("h2o"))


def test_a_pinned_prefix_on_the_view_is_protected_like_sinks_and_leaves_the_policy_alone():
    pinned = view(20)
    pinned.num_pinned = 8
    policy = make_policy("random", sinks=2, recent=2)
    evicted = policy.select(pinned, budget=10)
    assert kept(20, evicted)[:8] == list(range(8)) and policy.sinks == 2
    assert policy.num_protected(10, num_pinned=8) == 8 + 2
    assert policy.num_protected(10) == 2 + 2
    window = make_policy("streaming_llm", sinks=1, recent=3)
    assert kept(20, window.select(pinned, budget=100)) == [*range(8), 17, 18, 19]
    gate = _Open(inner=make_policy("streaming_llm", sinks=1), sinks=2)
    assert gate.num_protected(10, num_pinned=8) == 8 + 1  # the gate's sinks, not its inner's


def test_traits_say_which_policies_hold_a_budget_every_step_and_which_need_one():
    every_step = {name for name, cls in REGISTRY.items() if cls.holds_budget_every_step}
    assert every_step == {"h2o", "random", "scissorhands", "tova", "streaming_llm"}
    unbudgeted = {name for name in REGISTRY if not make_policy(name).needs_budget}
    assert unbudgeted == {"none"}
    assert not make_policy("streaming_llm", recent=60).needs_budget  # its window is its limit
    assert CAP_POLICY.holds_budget_every_step


def test_traits_say_which_policies_evict_during_prefill():
    """Those that hold a budget every step; SnapKV and PAGE decide when the prompt is
    complete, ``none`` never evicts; a gate as the policy it wraps (PAGE excepted)."""
    during = {name for name in REGISTRY if make_policy(name).evicts_during_prefill}
    assert during == {"h2o", "random", "scissorhands", "tova", "streaming_llm"}
    assert CAP_POLICY().evicts_during_prefill  # a tenant's cap holds from the first chunk
    assert _Open(inner=_Lowest()).evicts_during_prefill
    assert not _Open(inner=make_policy("snapkv")).evicts_during_prefill
    assert not make_policy("page", inner="tova").evicts_during_prefill


def test_registry_rejects_unknown_names_and_arguments():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lru")
    with pytest.raises(ValueError, match="no argument"):
        make_policy("h2o", heavy_ratio=0.1)
    with pytest.raises(ValueError):
        make_policy("snapkv", pooling="median")
    with pytest.raises(ValueError, match="odd"):
        make_policy("snapkv", kernel_size=4)
    with pytest.raises(ValueError):
        make_policy("h2o", recent_fraction=2.0)
    assert type(make_policy("page", inner="tova").inner).__name__ == "TOVA"  # by name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("page", inner="lru")


def full_attention(n, rng):
    rows = rng.random((4, n))
    return StepAttention(
        step_scores=rows.sum(0),
        window_rows=rows / rows.sum(1, keepdims=True),
        head_scores=rng.random((3, 2, n)),
    )


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(REGISTRY)),
    n=st.integers(1, 60),
    budget=st.integers(0, 60),
    sinks=st.integers(0, 5),
    recent=st.integers(0, 10),
    seed=st.integers(0, 1000),
)
def test_no_policy_evicts_a_protected_token_or_evicts_twice(name, n, budget, sinks, recent, seed):
    rng = np.random.default_rng(seed)
    policy = make_policy(name, sinks=sinks, recent=recent)
    stats = {key: np.zeros(n, np.float32) for key in policy.stat_names}
    current = view(n, full_attention(n, rng), stats=stats)
    evicted = policy.select(current, budget)
    assert np.unique(evicted).size == evicted.size
    assert set(evicted.tolist()) <= set(range(n))
    protected = {i for i in range(n) if i < sinks or i >= n - recent}
    assert not protected & set(evicted.tolist())
    if name not in ("none", "page", "snapkv", "scissorhands", "streaming_llm"):
        num_protected = int(policy.protected(current, budget).sum())
        assert n - evicted.size == (n if n <= budget else max(budget, num_protected))


def code_lines(path: Path) -> int:
    """Lines of code: no blank lines, comments or docstrings."""
    import ast

    source = path.read_text()
    tree = ast.parse(source)
    doc_lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            doc_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), start=1)
        if line.strip() and not line.strip().startswith("#") and number not in doc_lines
    )


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_file_is_small(name):
    module = REGISTRY[name].__module__.split(".")[-1]
    path = Path(policies.__file__).parent / f"{module}.py"
    assert code_lines(path) <= 50


def test_one_shot_policies_ask_for_no_statistics_once_they_decided():
    """SnapKV and PAGE decide at the end of prefill; the engine computes no attention
    statistics for them after that (the window's are the costliest it computes)."""
    view = PolicyView(
        logical_ids=np.arange(8),
        num_logical=8,
        prompt_len=8,
        step=1,
        attention=StepAttention(window_rows=np.ones((2, 8)), head_scores=np.ones((1, 2, 8))),
    )
    snapkv = make_policy("snapkv", window=2)
    assert snapkv.score_needs().query_window == 2
    snapkv.select(view, budget=4)
    assert not snapkv.score_needs().any
    page = make_policy("page", inner=make_policy("snapkv", window=2))
    assert page.score_needs().per_head
    page.select(view, budget=4)
    assert not page.score_needs().any


@pytest.mark.parametrize("n", [3, 4])
def test_snapkv_on_a_prompt_no_longer_than_its_window_keeps_it_whole(n):
    """No token lies before the window: nothing to pool or evict, and no error (an engine
    would otherwise fail at the end of a short prompt's prefill)."""
    rows = np.ones((4, n))
    for pooling in ("max", "avg"):
        policy = make_policy("snapkv", window=4, kernel_size=3, pooling=pooling)
        assert policy.select(view(n, StepAttention(window_rows=rows)), budget=1).size == 0


@pytest.mark.parametrize("kernel_size", [-1, -3, 0, 2])
def test_snapkv_refuses_a_kernel_that_is_not_a_positive_odd_number(kernel_size):
    with pytest.raises(ValueError):
        make_policy("snapkv", kernel_size=kernel_size)
