"""`vtoken bench prefix`: settings, workload, the ideal hit count and the figures (pure
logic; the stack run itself is the benchmark)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import typer

from bench.common import Slo
from bench.prefix import (
    Outcome,
    Setting,
    Trial,
    ideal_cached_tokens,
    ratios,
    setting_row,
    trial_row,
    turn_prompt,
)


class WordTokenizer:
    """One token per space-separated word (ids: the words' hashes)."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [hash(word) for word in text.split(" ")]}


def outcome(tenant: str, prompt: str, at: float, cached: int = 0, ttft: float = 0.1) -> Outcome:
    return Outcome(tenant, prompt, ttft, 0.01, len(prompt.split(" ")), cached, 4, at)


def test_settings_parse_and_refuse():
    assert Setting.parse("vtoken:on") == Setting("vtoken", True)
    assert Setting.parse("serve_default:off").name == "serve_default:off"
    assert Setting.parse("vtoken:on:pinhits") == Setting("vtoken", True, pin_cache_hits=True)
    assert Setting.parse("vtoken:on:pinhits").name == "vtoken:on:pinhits"
    for bad in ("random:on", "vtoken:maybe", "vtoken:on:what"):
        with pytest.raises(typer.BadParameter):
            Setting.parse(bad)


def test_a_turn_carries_the_system_prompt_and_the_whole_history():
    first = turn_prompt("SYS", [], "hi")
    second = turn_prompt("SYS", [("hi", " hello")], "more")
    assert second.startswith(first) and first.startswith("SYS")


def test_the_ideal_is_the_longest_prefix_shared_with_the_tenants_earlier_prompts():
    words = " ".join(f"w{i}" for i in range(10))
    outcomes = [
        outcome("a", words, 1.0),
        outcome("b", words, 2.0),  # another tenant: nothing of a's counts
        outcome("a", words + " x y", 3.0),
        outcome("a", " ".join(f"w{i}" for i in range(5)) + " z", 4.0),
    ]
    seen: dict[str, list[list[int]]] = {}
    # block size 4: a's second prompt shares 10 tokens -> 8; the third shares 5 -> 4
    assert ideal_cached_tokens(WordTokenizer(), outcomes, 4, seen) == [0, 0, 8, 4]
    # A later trial on the same engines: the earlier prompts still count.
    again = [outcome("a", words, 5.0)]
    assert ideal_cached_tokens(WordTokenizer(), again, 4, seen) == [8]  # at most 9 of 10


def test_rows_and_ratios():
    slo = Slo(0.5, 0.0, 0.05)
    fast = Trial("vtoken:on", 0.25, [outcome("a", "p q", float(i), cached=1) for i in range(9)])
    fast.outcomes.append(outcome("a", "p q", 9.0, ttft=2.0))  # misses the TTFT SLO
    row = trial_row(fast, [2] * 10, slo, turns=4)
    assert row.slo_attainment == 0.9 and row.passed and row.request_rate == 1.0
    assert row.hit_rate == 0.45 and row.hit_rate_of_ideal == 0.45  # 9 of 20 tokens
    slow = Trial("vtoken:on", 0.5, [outcome("a", "p q", 0.0, ttft=2.0)], errors=["boom"])
    failed = trial_row(slow, [0], slo, turns=4)
    assert not failed.passed and failed.requests == 2 and failed.hit_rate_of_ideal is None
    on = setting_row(Setting("vtoken", True), [row, failed])
    assert on.goodput_rps == 1.0 and on.goodput_bound == "sweep"
    # A pass above a failed rate does not count (attainment is noisy).
    later = replace(row, request_rate=4.0)
    assert setting_row(Setting("vtoken", True), [row, failed, later]).goodput_rps == 1.0
    assert setting_row(Setting("vtoken", True), [row, later]).goodput_bound == "at_least"
    off = setting_row(Setting("vtoken", False), [failed])
    assert off.goodput_rps == 0.0 and off.goodput_bound == "below_lowest"
    default = setting_row(Setting("serve_default", True), [replace(row, ttft_p50_s=0.2)])
    result = ratios([on, off, default])
    assert result.ttft_p50_vtoken_over_serve_default == 0.5
    assert result.goodput_prefix_caching_on_over_off is None  # off served nothing
