"""`vtoken bench quality`: what eviction costs in answers, and the PAGE gate calibrated.

On SmolLM2 through real vLLM engines (the CPU build here):

- **Passkey retrieval** (the task of the Landmark Attention and LongLoRA papers): a 5-digit
  key stated once at a depth of 10%-90% of a prompt of CPython documentation filler, then
  asked for; ``multi``: ``MULTI_KEYS`` named keys, one asked for (the others are
  distractors; copying a random one of them scores ``1 / MULTI_KEYS``). The answer is the
  first 5-digit number the engine generates (greedy, at most ``ANSWER_TOKENS`` tokens,
  stopping at EOS). Every cell runs the same seeded cases.
- **Cells**: the full cache (vanilla vLLM), then each policy x keep ratio on a vToken
  engine evicting ``eager``ly (decisions and attention equal Naive-Evict's, so answers
  are the same), and ``on_demand`` cells on a pool too small for the batch (the serving
  pool: eviction happens only under pressure, so only some requests are squeezed).
- **Token vs block selection at equal held blocks** ("why not just drop whole blocks?"):
  per policy and keep, a ``token`` cell (vToken, eager) and a ``block`` cell (block-granular
  eviction: the policy's scores summed per block, whole lowest-scored blocks dropped, no
  repack) give every request the same budget in whole blocks, ``bs * ceil(ceil(keep *
  prompt) / bs)`` tokens: token-level eviction then holds exactly that many blocks, and
  block-level eviction (it stops at or under the budget with every kept block full but its
  last) holds as many, unless what its policy protects pins more (each cell reports its
  mean held blocks).
- **Granularity** (``--granularity``): eager cells of policies that can select per layer
  or per (layer, KV head) (TOVA, H2O, SnapKV) run once per granularity asked for.
- **Output length**: mean generated tokens per cell against the full cache on the same
  prompts (greedy, EOS on).
- **Perplexity**: held-out documentation text continued under each policy, teacher-forced
  through the reference engine (``workers/hf_sim.py``: the same vToken manager and policy,
  the evicted tokens really removed), relative to the full cache; and, at budgets rounded up
  to whole blocks, token-level against block-level selection (``selection``), with the
  blocks each held.
- **PAGE**: its gate decides at the end of prefill from the drop in head agreement between
  early and late layers. Every PAGE request records its drop. Harm (the PAGE paper's
  definition): eviction turns a correct full-cache answer into a wrong one; harm rate =
  harmed / correct with the full cache. The threshold is chosen on a calibration half of
  the cases: the lowest threshold (the most requests gated open) whose harm rate there,
  predicted from plain SnapKV's answers on the requests it would open, is at most
  ``HARM_TARGET``. PAGE then runs at that threshold and is judged on the other half.
"""

from __future__ import annotations

import gc
import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bench.common import (
    csv_floats,
    doc_tokens,
    percentile,
    policy_names,
    pyplot,
    save_figure,
    score_layer_ids,
    write_json,
)
from policies import REGISTRY
from vtoken.groups import GRANULARITIES

if TYPE_CHECKING:
    from workers.config import ScoreLayers

BLOCK_SIZE = 32
POLICIES = ("h2o", "snapkv", "page", "streaming_llm", "tova")
KEEPS = (0.2, 0.5)
ON_DEMAND_POLICIES = ("h2o", "snapkv")
MULTI_KEYS = 4
NAMES = ("Alice", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana")
ANSWER_TOKENS = 16
HARM_TARGET = 0.05
DEFAULT_THRESHOLD = 0.1  # PAGE's default (policies/page.py); a test keeps them equal
INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key.\n\n"
)
KEY = re.compile(r"(?<!\d)\d{5}(?!\d)")  # a 5-digit number, not part of a longer one


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big a run is: passkey cases per task and cell, prompt lengths (inclusive),
    perplexity documents (0: none) and their context and target tokens."""

    cases: int
    min_tokens: int
    max_tokens: int
    ppl_docs: int
    ppl_context: int
    ppl_target: int


QUICK = Sizes(cases=8, min_tokens=256, max_tokens=512, ppl_docs=1, ppl_context=128, ppl_target=8)


@dataclass(frozen=True, slots=True)
class Case:
    task: str  # "single" or "multi"
    prompt: tuple[int, ...]
    key: str
    depth: float  # where the asked key sits, as a fraction of the filler


def passkey_cases(
    tokenizer: Any,
    corpus: Sequence[int],
    count: int,
    lengths: tuple[int, int],
    task: str,
    seed: int,
) -> list[Case]:
    """``count`` seeded prompts of ``lengths`` tokens (uniform) with the key(s) inside."""

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(f"{task}-{seed}")
    intro = ids(INTRO)
    cases = []
    for _ in range(count):
        length = rng.randint(*lengths)
        if task == "single":
            keys = {"": str(rng.randint(10000, 99999))}
            asked = ""
            question = ids("\n\nWhat is the pass key? The pass key is")
        else:
            names = rng.sample(NAMES, MULTI_KEYS)
            keys = {name: str(rng.randint(10000, 99999)) for name in names}
            asked = rng.choice(names)
            question = ids(f"\n\nWhat is the pass key of {asked}? The pass key of {asked} is")
        needles = {
            name: ids(
                f"\nThe pass key{f' of {name}' if name else ''} is {key}. Remember it. "
                f"{key} is the pass key{f' of {name}' if name else ''}.\n"
            )
            for name, key in keys.items()
        }
        filler_len = length - len(intro) - len(question) - sum(map(len, needles.values()))
        start = rng.randrange(len(corpus) - filler_len)
        filler = list(corpus[start : start + filler_len])
        depths = {name: rng.uniform(0.1, 0.9) for name in keys}
        prompt, cut = list(intro), 0
        for name in sorted(keys, key=depths.__getitem__):
            at = int(depths[name] * filler_len)
            prompt += filler[cut:at] + needles[name]
            cut = at
        prompt += filler[cut:] + question
        cases.append(Case(task, tuple(prompt), keys[asked], round(depths[asked], 3)))
    return cases


@dataclass(frozen=True, slots=True)
class Answer:
    correct: bool
    generated_tokens: int
    held_blocks: int  # at the end (vanilla: what a full cache holds)
    page_drop: float | None = None
    gate_open: bool | None = None


def is_correct(text: str, key: str) -> bool:
    found = KEY.search(text)
    return found is not None and found.group() == key


ENGINE_OF_CELL = {"token": "eager"}  # a cell's engine kind, where it differs from its name
SELECTION_CELLS = ("token", "block")  # token vs block selection at equal held blocks


def whole_blocks_budget(keep: float, num_tokens: int) -> int:
    """``ceil(keep * num_tokens)`` rounded up to whole blocks, in tokens: token-level and
    block-level eviction both hold ``budget / BLOCK_SIZE`` blocks at it."""
    return BLOCK_SIZE * math.ceil(math.ceil(keep * num_tokens) / BLOCK_SIZE)


class QualityEngine:
    """One in-process engine; records each finished request's held blocks and PAGE gate.
    ``kind``: ``vanilla`` (no vToken), ``eager`` or ``on_demand`` (vToken), ``block``
    (block-granular eviction, eager)."""

    def __init__(
        self,
        path: str,
        kind: str,
        num_blocks: int | None,
        max_len: int,
        score_layers: ScoreLayers = "all",
    ) -> None:
        from workers.engine import engine_state, make_llm

        self.kind = kind
        vtoken: dict[str, Any] | None = {"policy": "none", "eviction": kind}
        if kind == "vanilla":
            vtoken = None
        elif kind == "block":
            vtoken = {"policy": "none", "eviction": "eager", "mode": "block"}
        if vtoken is not None:
            vtoken["score_layers"] = score_layers
        self.llm = make_llm(
            path,
            vtoken,
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            max_model_len=max_len + BLOCK_SIZE,
            max_num_seqs=32,
        )
        self.finished: dict[str, tuple[int, float | None, bool | None]] = {}
        state = engine_state(self.llm)
        if state is not None:
            original = state.free

            def free(request_id: str, preempted: bool = False) -> None:
                if not preempted:
                    record = state.requests[request_id].kv
                    policy = record.policy
                    self.finished[request_id] = (
                        record.num_held_blocks,
                        getattr(policy, "drop", None),
                        getattr(policy, "enabled", None),
                    )
                original(request_id, preempted)

            state.free = free  # type: ignore[method-assign]

    def answer(self, cases: Sequence[Case], spec: dict[str, Any] | None) -> list[Answer]:
        """Every case under one policy spec (``None``: the engine's)."""
        return self.answer_each(cases, [spec] * len(cases))

    def answer_each(
        self, cases: Sequence[Case], specs: Sequence[dict[str, Any] | None]
    ) -> list[Answer]:
        """Each case under its own policy spec."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from kernels.intmath import cdiv

        params = [
            SamplingParams(
                max_tokens=ANSWER_TOKENS,
                temperature=0,
                extra_args={"vtoken_policy": spec} if spec is not None else None,
            )
            for spec in specs
        ]
        self.finished.clear()
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(c.prompt)) for c in cases], params, use_tqdm=False
        )
        # the engine core's ids are the LLM's with "-<random>" appended
        by_id = {internal.rsplit("-", 1)[0]: v for internal, v in self.finished.items()}
        answers = []
        for case, output in zip(cases, outputs, strict=True):
            generated = output.outputs[0]
            if self.kind == "vanilla":  # the full cache: every token but the last sampled
                held = cdiv(len(case.prompt) + len(generated.token_ids) - 1, BLOCK_SIZE)
                drop, gate = None, None
            elif output.request_id in by_id:
                held, drop, gate = by_id[output.request_id]
            else:
                raise RuntimeError(f"request {output.request_id}: no vToken record at its end")
            answers.append(
                Answer(
                    is_correct(generated.text, case.key),
                    len(generated.token_ids),
                    held,
                    drop,
                    gate,
                )
            )
        return answers

    def close(self) -> None:
        del self.llm
        gc.collect()  # the engine's shutdown must finish before the next one starts


@dataclass(frozen=True, slots=True)
class Cell:
    task: str
    engine: str  # vanilla (the full cache), eager, on_demand; token, block (SELECTION_CELLS)
    policy: str
    keep: float | None
    threshold: float | None = None  # PAGE's
    granularity: str = "request"  # one kept set, per layer, or per (layer, KV head)

    @property
    def spec(self) -> dict[str, Any] | None:
        if self.keep is None:
            return None
        args: dict[str, Any] = {} if self.threshold is None else {"threshold": self.threshold}
        if self.granularity != "request":
            args["granularity"] = self.granularity
        return {"policy": self.policy, "keep_ratio": self.keep, "policy_args": args}

    def spec_for(self, case: Case) -> dict[str, Any] | None:
        """The case's spec: a ``token`` or ``block`` cell's budget is whole blocks
        (:func:`whole_blocks_budget` of its prompt), fixed for the request's life."""
        spec = self.spec
        if spec is None or self.keep is None or self.engine not in SELECTION_CELLS:
            return spec
        budget = whole_blocks_budget(self.keep, len(case.prompt))
        return {"policy": self.policy, "budget_tokens": budget, "policy_args": spec["policy_args"]}


@dataclass(frozen=True, slots=True)
class PasskeyRow:
    """One cell's passkey figures (its ``Cell`` fields first). ``cases_from``: ``all`` or
    ``evaluation_half`` (a calibrated PAGE cell); ``random_guess``: the accuracy of
    guessing."""

    task: str
    engine: str
    policy: str
    keep: float | None
    threshold: float | None
    granularity: str
    cases: int
    cases_from: str
    accuracy: float
    harm_rate: float
    mean_generated_tokens: float
    output_length_change: float
    mean_held_blocks: float
    random_guess: float


def summarize(
    cell: Cell, answers: Sequence[Answer], full: Sequence[Answer], cases_from: str = "all"
) -> PasskeyRow:
    """One cell's passkey figures against the full cache's answers to the same cases."""
    correct_full = [f.correct for f in full]
    harmed = sum(f and not a.correct for f, a in zip(correct_full, answers, strict=True))
    return PasskeyRow(
        **asdict(cell),
        cases=len(answers),
        cases_from=cases_from,
        accuracy=round(sum(a.correct for a in answers) / len(answers), 4),
        harm_rate=round(harmed / max(1, sum(correct_full)), 4),
        mean_generated_tokens=round(sum(a.generated_tokens for a in answers) / len(answers), 2),
        output_length_change=round(
            sum(a.generated_tokens for a in answers) / max(1, sum(f.generated_tokens for f in full))
            - 1.0,
            4,
        ),
        mean_held_blocks=round(sum(a.held_blocks for a in answers) / len(answers), 2),
        random_guess=1 / MULTI_KEYS if cell.task == "multi" else 1 / 90000,
    )


# ---------------------------------------------------------------- PAGE


def page_harm(
    drops: Sequence[float], full: Sequence[bool], evicted: Sequence[bool], threshold: float
) -> tuple[float, float]:
    """``(harm_rate, open_rate)`` of a gate opening when ``drop > threshold``, the gated
    answers being ``evicted``'s and the closed ones ``full``'s."""
    opened = [d > threshold for d in drops]
    harmed = sum(o and f and not e for o, f, e in zip(opened, full, evicted, strict=True))
    return harmed / max(1, sum(full)), sum(opened) / max(1, len(opened))


def calibrate(drops: Sequence[float], full: Sequence[bool], evicted: Sequence[bool]) -> float:
    """The lowest threshold whose predicted harm rate is at most ``HARM_TARGET`` (the gate
    open as often as that allows): candidates are just below the smallest drop (always
    open) and each observed drop (the highest opens nothing, so one always qualifies)."""
    observed = sorted(d for d in drops if math.isfinite(d))
    if not observed:
        return math.inf
    return next(
        t
        for t in [observed[0] - 1e-6, *observed]
        if page_harm(drops, full, evicted, t)[0] <= HARM_TARGET
    )


# ---------------------------------------------------------------- perplexity


@dataclass(frozen=True, slots=True)
class PerplexityRow:
    """A policy's perplexity at a keep ratio (``none``: the full cache, keep ``None``) and
    relative to the full cache's. ``whole_blocks``: the budget rounded up to whole blocks
    (:func:`whole_blocks_budget`), for token-level against block-level ``selection`` at
    equal held blocks; ``mean_held_blocks``: what each held at the end."""

    policy: str
    keep: float | None
    perplexity: float
    relative: float
    selection: str = "token"
    whole_blocks: bool = False
    mean_held_blocks: float | None = None


def perplexities(
    path: str,
    corpus: Sequence[int],
    policies: Sequence[str],
    keeps: Sequence[float],
    docs: int,
    context: int,
    target: int,
    seed: int,
    score_layers: ScoreLayers = "all",
    selection: bool = True,
) -> list[PerplexityRow]:
    """Teacher-forced perplexity of ``target`` tokens after ``context`` tokens of held-out
    documentation, per policy and keep, relative to the full cache (reference engine);
    with ``selection``, also token- and block-level selection at equal held blocks."""
    from policies import make_policy
    from vtoken import ReclaimMode, StandaloneBlockPool, VTokenManager
    from workers.hf_sim import HFSimEngine

    engine = HFSimEngine(path, score_layers)
    rng = random.Random(f"ppl-{seed}")
    starts = [rng.randrange(len(corpus) - context - target) for _ in range(docs)]

    def nll(policy: str, keep: float, selection: str, whole_blocks: bool) -> tuple[float, float]:
        """Mean NLL over the documents and mean blocks held at the end."""
        total, held = 0.0, 0.0
        mode = ReclaimMode.BLOCK if selection == "block" else ReclaimMode.VTOKEN
        budget = whole_blocks_budget if whole_blocks else lambda k, n: math.ceil(k * n)
        for start in starts:
            window = corpus[start : start + context + target]
            pool = StandaloneBlockPool(math.ceil((context + target) / BLOCK_SIZE) + 2)
            manager = VTokenManager(pool, BLOCK_SIZE, mode)
            total += engine.teacher_forced_nll(
                window[:context],
                window[context:],
                make_policy(policy),
                partial(budget, keep),
                manager,
            )
            held += manager.requests["nll"].num_held_blocks
        return total / len(starts), held / len(starts)

    full = math.exp(nll("none", 1.0, "token", False)[0])
    rows = [PerplexityRow("none", None, round(full, 3), 1.0)]
    # PAGE here runs at its default threshold (the calibrated one is chosen on passkey)
    for policy in policies:
        for keep in keeps:
            value = math.exp(nll(policy, keep, "token", False)[0])
            rows.append(PerplexityRow(policy, keep, round(value, 3), round(value / full, 4)))
            for kind in SELECTION_CELLS if selection else ():
                loss, held = nll(policy, keep, kind, True)
                value = math.exp(loss)
                rows.append(
                    PerplexityRow(
                        policy, keep, round(value, 3), round(value / full, 4), kind, True, held
                    )
                )
    return rows


# ---------------------------------------------------------------- the run


def run(
    path: str,
    tokenizer: Any,
    cases_per_task: int,
    lengths: tuple[int, int],
    policies: Sequence[str],
    keeps: Sequence[float],
    on_demand_blocks: int,
    seed: int,
    progress: bool = True,
    score_layers: ScoreLayers = "all",
    selection: bool = True,
    granularities: Sequence[str] = ("request",),
) -> dict[str, Any]:
    from tqdm import tqdm

    corpus = doc_tokens(tokenizer)
    tasks = {
        task: passkey_cases(tokenizer, corpus, cases_per_task, lengths, task, seed)
        for task in ("single", "multi")
    }
    max_len = lengths[1] + ANSWER_TOKENS
    grid: list[Cell] = []
    for task in tasks:
        grid.append(Cell(task, "vanilla", "none", None))
        grid += [
            Cell(task, "eager", p, k, granularity=g)
            for p in policies
            for k in keeps
            for g in granularities
            if g in REGISTRY[p].granularities
        ]
        grid += [
            Cell(task, "on_demand", p, min(keeps)) for p in ON_DEMAND_POLICIES if p in policies
        ]
        grid += [
            Cell(task, kind, p, k)
            for kind in (SELECTION_CELLS if selection else ())
            for p in policies
            for k in keeps
        ]
    with_page = "page" in policies and "snapkv" in policies and "request" in granularities
    bar = tqdm(
        total=len(grid) + with_page * len(tasks), desc="quality", unit="cell", disable=not progress
    )
    answers: dict[Cell, list[Answer]] = {}
    page = None
    for kind in ("vanilla", "eager", "block", "on_demand"):
        if kind == "block" and not selection:
            continue
        blocks = on_demand_blocks if kind == "on_demand" else None
        engine = QualityEngine(path, kind, blocks, max_len, score_layers)
        for cell in (c for c in grid if ENGINE_OF_CELL.get(c.engine, c.engine) == kind):
            cases = tasks[cell.task]
            answers[cell] = engine.answer_each(cases, [cell.spec_for(c) for c in cases])
            bar.set_postfix_str(f"{cell.task} {cell.engine} {cell.policy} {cell.keep}")
            bar.update()
        if kind == "eager" and with_page:
            page = page_section(engine, tasks, answers, min(keeps))
            bar.update(len(tasks))
        engine.close()
    bar.close()
    rows = []
    for cell, result in answers.items():
        full = answers[Cell(cell.task, "vanilla", "none", None)]
        if cell.threshold is None:
            rows.append(summarize(cell, result, full))
        else:  # calibrated on the first half: judged on the second only
            half = len(result) // 2
            rows.append(summarize(cell, result[half:], full[half:], "evaluation_half"))
    return {
        "cases_per_task": cases_per_task,
        "prompt_tokens": list(lengths),
        "multi_keys": MULTI_KEYS,
        "on_demand_blocks": on_demand_blocks,
        "seed": seed,
        "score_layers": score_layers,
        "passkey": [asdict(row) for row in rows],
        "page": None if page is None else asdict(page),
    }


@dataclass(frozen=True, slots=True)
class DropQuantiles:
    """How many PAGE requests recorded their agreement drop, and its p10, p50 and p90."""

    recorded: int
    p10: float | None
    p50: float | None
    p90: float | None


@dataclass(frozen=True, slots=True)
class PageReport:
    """PAGE at its calibrated threshold on the evaluation half, against SnapKV alone."""

    keep: float
    threshold: float
    calibration_cases: int
    evaluation_cases: int
    harm_rate: float
    snapkv_harm_rate: float
    gate_open_rate: float
    blocks_saved: float
    drops: DropQuantiles
    default_threshold: float
    default_threshold_open_rate: float


def page_section(
    engine: QualityEngine,
    tasks: dict[str, list[Case]],
    answers: dict[Cell, list[Answer]],
    keep: float,
) -> PageReport:
    """Calibrate PAGE's threshold on the first half of every task's cases (from the drops
    the default-threshold cell recorded and plain SnapKV's answers), run PAGE at it, and
    judge it on the second half against SnapKV alone at the same budget."""
    drops, full, snap, halves = [], [], [], []
    for task in tasks:
        recorded = answers[Cell(task, "eager", "page", keep)]
        drops += [a.page_drop if a.page_drop is not None else -math.inf for a in recorded]
        full += [a.correct for a in answers[Cell(task, "vanilla", "none", None)]]
        snap += [a.correct for a in answers[Cell(task, "eager", "snapkv", keep)]]
        halves += [i < len(recorded) // 2 for i in range(len(recorded))]

    def part(values: list[Any], calibration: bool) -> list[Any]:
        return [v for v, h in zip(values, halves, strict=True) if h == calibration]

    recorded_drops = sorted(d for d in drops if d > -math.inf)
    threshold = calibrate(part(drops, True), part(full, True), part(snap, True))
    if not math.isfinite(threshold):
        raise RuntimeError("no PAGE request of the calibration half recorded its agreement drop")
    gated: list[Answer] = []
    for task in tasks:
        cell = Cell(task, "eager", "page", keep, threshold=threshold)
        answers[cell] = engine.answer(tasks[task], cell.spec)
        gated += answers[cell]
    held_out_full, held_out_gated = part(full, False), part(gated, False)
    harmed = sum(f and not g.correct for f, g in zip(held_out_full, held_out_gated, strict=True))
    snap_harmed = sum(f and not s for f, s in zip(held_out_full, part(snap, False), strict=True))
    full_blocks = [a.held_blocks for t in tasks for a in answers[Cell(t, "vanilla", "none", None)]]
    blocks_full = part(full_blocks, False)
    correct_full = max(1, sum(held_out_full))
    return PageReport(
        keep=keep,
        threshold=threshold,
        calibration_cases=halves.count(True),
        evaluation_cases=halves.count(False),
        harm_rate=round(harmed / correct_full, 4),
        snapkv_harm_rate=round(snap_harmed / correct_full, 4),
        gate_open_rate=round(
            sum(bool(g.gate_open) for g in held_out_gated) / len(held_out_gated), 4
        ),
        blocks_saved=round(
            sum(f - g.held_blocks for f, g in zip(blocks_full, held_out_gated, strict=True))
            / len(held_out_gated),
            2,
        ),
        drops=DropQuantiles(
            len(recorded_drops),
            percentile(recorded_drops, 0.1),
            percentile(recorded_drops, 0.5),
            percentile(recorded_drops, 0.9),
        ),
        default_threshold=DEFAULT_THRESHOLD,
        default_threshold_open_rate=round(
            sum(d > DEFAULT_THRESHOLD for d in recorded_drops) / max(1, len(recorded_drops)), 4
        ),
    )


def plot(document: dict[str, Any], path: Path) -> None:
    """Passkey accuracy per policy and keep (eager), one panel per task; the full cache as
    a line."""
    plt = pyplot()
    rows = document["passkey"]
    tasks = sorted({r["task"] for r in rows})
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks, strict=True):
        cells = [r for r in rows if r["task"] == task and r["engine"] == "eager"]
        cells = [r for r in cells if r["threshold"] is None]
        labels = [f"{r['policy']}\n{r['keep']}" for r in cells]
        axis.bar(labels, [r["accuracy"] for r in cells], color="tab:blue")
        (full,) = [r for r in rows if r["task"] == task and r["engine"] == "vanilla"]
        axis.axhline(full["accuracy"], color="black", linestyle="--", label="full cache")
        axis.set_ylim(0, 1)
        axis.set_title(f"passkey ({task})")
        axis.set_ylabel("accuracy")
        axis.tick_params(axis="x", labelsize=7)
        axis.legend()
    save_figure(figure, path)


def cli(
    model: Annotated[str, typer.Option(help="Shipped model name or model folder.")] = "smollm2",
    cases: Annotated[int, typer.Option(min=2, help="Passkey cases per task and cell.")] = 100,
    min_tokens: Annotated[int, typer.Option(min=256)] = 512,
    max_tokens: Annotated[int, typer.Option(min=256, max=8192)] = 2048,
    policies: Annotated[str, typer.Option(help="Comma-separated.")] = ",".join(POLICIES),
    keeps: Annotated[str, typer.Option(help="Keep ratios, comma-separated.")] = "0.2,0.5",
    on_demand_blocks: Annotated[
        int | None,
        typer.Option(
            help="Pool of the on_demand engine (default: twice the longest request, every"
            " KV cache group counted)."
        ),
    ] = None,
    ppl_docs: Annotated[int, typer.Option(min=0, help="Documents for perplexity (0: skip).")] = 8,
    ppl_context: Annotated[int, typer.Option(min=32)] = 512,
    ppl_target: Annotated[int, typer.Option(min=2)] = 64,
    seed: Annotated[int, typer.Option()] = 0,
    score_layers: Annotated[
        str,
        typer.Option(
            help="Layers that feed the scores: all, spread:N, or ids and ranges (0-29/3)."
        ),
    ] = "all",
    selection: Annotated[
        bool, typer.Option(help="Also token- vs block-level selection at equal held blocks.")
    ] = True,
    granularity: Annotated[
        str, typer.Option(help="Eager cells per granularity, comma-separated: request,layer,head.")
    ] = "request",
    quick: Annotated[bool, typer.Option(help="A small run for tests.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Write a PNG here.")] = None,
) -> None:
    """Passkey accuracy, output length and perplexity under eviction; PAGE calibrated."""
    from transformers import AutoTokenizer

    from controlplane.kv_bounds import SlidingWindows
    from kernels.intmath import cdiv
    from workers.model_windows import sliding_windows
    from workers.models import resolve_model

    names = policy_names(policies, allow_none=False)
    ratios = csv_floats(keeps, "keeps")
    if not ratios or not all(0.0 < k <= 1.0 for k in ratios):
        raise typer.BadParameter("keeps must lie in (0, 1]")
    if min_tokens > max_tokens:
        raise typer.BadParameter("min-tokens must not exceed max-tokens")
    sizes = (
        QUICK if quick else Sizes(cases, min_tokens, max_tokens, ppl_docs, ppl_context, ppl_target)
    )
    path = str(resolve_model(model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Every KV cache group draws from the one pool: a hybrid model's sliding-window groups
    # hold up to the whole request too (no window cap counted: a bound from above).
    request_tokens = sizes.max_tokens + ANSWER_TOKENS
    windows = SlidingWindows(sliding_windows(path))
    longest = cdiv(request_tokens, BLOCK_SIZE) + 1 + windows.blocks(request_tokens, BLOCK_SIZE)
    blocks = on_demand_blocks if on_demand_blocks is not None else 2 * longest
    if blocks <= longest:
        raise typer.BadParameter(f"on-demand-blocks must exceed the longest request's {longest}")
    lengths = (sizes.min_tokens, sizes.max_tokens)
    layers = score_layer_ids(score_layers)
    granularities = [g.strip() for g in granularity.split(",") if g.strip()]
    if not granularities or not set(granularities) <= set(GRANULARITIES):
        raise typer.BadParameter(f"granularity: comma-separated of {', '.join(GRANULARITIES)}")
    document = run(
        path,
        tokenizer,
        sizes.cases,
        lengths,
        names,
        ratios,
        blocks,
        seed,
        score_layers=layers,
        selection=selection,
        granularities=granularities,
    )
    if sizes.ppl_docs:
        # held out: the documentation topics after the ones the passkey filler comes from
        held_out = doc_tokens(tokenizer, held_out=True)
        rows = perplexities(
            path,
            held_out,
            names,
            ratios,
            sizes.ppl_docs,
            sizes.ppl_context,
            sizes.ppl_target,
            seed,
            layers,
            selection,
        )
        document["perplexity"] = [asdict(row) for row in rows]
    document = {"model": model, "quick": quick, **document}
    for row in document["passkey"]:
        gate = "" if row["threshold"] is None else f" threshold={row['threshold']:.3f}"
        gate += "" if row["granularity"] == "request" else f" per {row['granularity']}"
        typer.echo(
            f"{row['task']:>6} {row['engine']:>9} {row['policy']:>13} keep={row['keep']}{gate}: "
            f"accuracy {row['accuracy']}, harm {row['harm_rate']}, "
            f"length {row['output_length_change']:+.1%}"
        )
    for row in document.get("perplexity", []):
        budget = " whole blocks" if row["whole_blocks"] else ""
        held = "" if row["mean_held_blocks"] is None else f", {row['mean_held_blocks']} blocks"
        typer.echo(
            f"perplexity {row['policy']:>13} keep={row['keep']} {row['selection']}{budget}: "
            f"{row['perplexity']} ({row['relative']}x){held}"
        )
    if document["page"] is not None:
        typer.echo("page: " + json.dumps(document["page"]))
    if json_path is not None:
        write_json(json_path, document)
    if plot_path is not None:
        plot(document, plot_path)
