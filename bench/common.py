"""What every benchmark shares: prompts, option parsing, percentiles, SLOs, JSON, figures.

Result rows are frozen dataclasses in the module of the benchmark that makes them; their
field order is the key order of the JSON the benchmark writes (``dataclasses.asdict``), so
a row's fields must not be reordered without changing the published files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from workers.config import ScoreLayers

SLO_ATTAINMENT = 0.9  # the share of requests that must meet the SLO (DistServe's goodput)
TTFT_SLO_FACTOR = 5.0  # the TTFT SLO: this many times the unloaded TTFT
TPOT_SLO_FACTOR = 3.0  # the TPOT SLO: this many times the unloaded p50 TPOT
FIGURE_DPI = 120
DOC_TOPICS = 60  # the documentation topics ``doc_tokens`` cuts prompts from
PROMPT_TOPICS = ("compound", "specialnames", "types", "typesseq", "execmodel", "import")


# ---------------------------------------------------------------- prompts


def doc_tokens(tokenizer: Any, held_out: bool = False) -> list[int]:
    """CPython's documentation topics (sorted, the first ``DOC_TOPICS``; ``held_out``: the
    ones after them, 19 in CPython 3.11), tokenized."""
    from pydoc_data.topics import topics

    names = sorted(topics)[DOC_TOPICS : 2 * DOC_TOPICS] if held_out else sorted(topics)[:DOC_TOPICS]
    text = "\n\n".join(topics[name] for name in names)
    return list(tokenizer(text)["input_ids"])


def natural_prompts(tokenizer: Any, count: int, num_tokens: int) -> list[list[int]]:
    """``count`` prompts of exactly ``num_tokens`` tokens from the Python language reference
    (the topics ``PROMPT_TOPICS``, in order); a topic too short raises ``ValueError``."""
    from pydoc_data.topics import topics

    prompts = []
    for topic in PROMPT_TOPICS[:count]:
        ids = tokenizer(topics[topic])["input_ids"]
        if len(ids) < num_tokens:
            raise ValueError(f"topic {topic!r} has only {len(ids)} tokens")
        prompts.append(list(ids[:num_tokens]))
    return prompts


def model_prompts(model: str, count: int, num_tokens: int) -> tuple[str, list[list[int]]]:
    """The model's folder and ``natural_prompts`` tokenized by its own tokenizer."""
    from transformers import AutoTokenizer

    from workers.models import resolve_model

    path = str(resolve_model(model))
    return path, natural_prompts(AutoTokenizer.from_pretrained(path), count, num_tokens)


# ---------------------------------------------------------------- options


def csv_items(value: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: a comma-separated option, blanks dropped."""
    return [part.strip() for part in value.split(",") if part.strip()]


def csv_floats(value: str, option: str) -> list[float]:
    """The distinct numbers of a comma-separated option, ascending; a value that is not a
    number raises ``typer.BadParameter`` naming ``option``."""
    try:
        return sorted({float(part) for part in csv_items(value)})
    except ValueError:
        raise typer.BadParameter(f"{option} must be numbers, got {value!r}") from None


def policy_names(value: str, allow_none: bool = True) -> list[str]:
    """The registered policy names of a comma-separated option (``none``, no eviction, only
    with ``allow_none``); an unknown name or an empty list raises ``typer.BadParameter``."""
    from policies import REGISTRY

    names = csv_items(value)
    unknown = [n for n in names if n not in REGISTRY or (n == "none" and not allow_none)]
    if unknown or not names:
        raise typer.BadParameter(f"unknown policies {unknown}; known: {sorted(REGISTRY)}")
    return names


MAX_LAYER_ID = 10_000  # a range past any model's depth is a typo, not a layer list


def score_layer_ids(value: str) -> ScoreLayers:
    """The ``--score-layers`` option as ``VTokenConfig.score_layers``: ``all``;
    ``spread:N`` (N layers evenly spaced, the last included); or comma-separated layer ids
    and inclusive ranges with an optional step (``"0-29/3,29"``: every third layer and the
    last). A malformed item raises ``typer.BadParameter``; ids past the model's layers are
    refused when the engine starts."""
    if value.strip() == "all":
        return "all"
    if value.strip().startswith("spread:"):
        count = value.strip().removeprefix("spread:")
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise typer.BadParameter(f"score-layers: {value!r} is not spread:N with N >= 1")
        return int(count)
    ids: set[int] = set()
    for item in csv_items(value):
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?:/(\d+))?)?", item)
        if match is None:
            raise typer.BadParameter(f"score-layers: {item!r} is not N, A-B or A-B/S")
        first, last, step = match.groups()
        start, stop, stride = int(first), int(last or first), int(step or 1)
        if stop < start or stride < 1 or stop >= MAX_LAYER_ID:
            raise typer.BadParameter(f"score-layers: {item!r} is not an ascending range of ids")
        ids.update(range(start, stop + 1, stride))
    if not ids:
        raise typer.BadParameter("score-layers: give 'all' or at least one layer id")
    return sorted(ids)


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank ``q``-quantile (``0 < q <= 1``) of ``values``, rounded to 4 digits;
    ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return round(float(ordered[max(0, math.ceil(q * len(ordered)) - 1)]), 4)


@dataclass(frozen=True, slots=True)
class Quantiles:
    """The p50, p90 and p99 of a set of values (``percentile``); ``None`` where unknown."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Quantiles:
        return cls(percentile(values, 0.5), percentile(values, 0.9), percentile(values, 0.99))


def ratio(numerator: float, denominator: float | None, digits: int) -> float | None:
    """``numerator / denominator`` rounded to ``digits``; ``None`` when the denominator is
    ``None`` or zero (nothing to compare against)."""
    if not denominator:
        return None
    return round(numerator / denominator, digits)


# ---------------------------------------------------------------- SLOs


@dataclass(frozen=True, slots=True)
class Slo:
    """TTFT allowed a prompt of ``n`` tokens: ``ttft_base_s + ttft_per_token_s * n``;
    TPOT allowed every request: ``tpot_s``."""

    ttft_base_s: float
    ttft_per_token_s: float
    tpot_s: float

    @classmethod
    def from_unloaded(cls, ttft_base_s: float, ttft_per_token_s: float, tpot_s: float) -> Slo:
        """The SLO of an engine whose unloaded TTFT is ``ttft_base_s + ttft_per_token_s *
        n`` and unloaded TPOT ``tpot_s``: ``TTFT_SLO_FACTOR`` and ``TPOT_SLO_FACTOR`` times
        those."""
        return cls(
            TTFT_SLO_FACTOR * ttft_base_s,
            TTFT_SLO_FACTOR * ttft_per_token_s,
            TPOT_SLO_FACTOR * tpot_s,
        )

    def ttft_s(self, prompt_len: int) -> float:
        return self.ttft_base_s + self.ttft_per_token_s * prompt_len

    def meets(self, ttft_s: float, tpot_s: float | None, prompt_len: int) -> bool:
        """Both bounds hold (a request of one output token has no TPOT: only its TTFT)."""
        return ttft_s <= self.ttft_s(prompt_len) and (tpot_s is None or tpot_s <= self.tpot_s)


# ---------------------------------------------------------------- output


def write_json(path: Path, document: Any, indent: int = 2) -> None:
    """``document`` as indented JSON and a final newline (every benchmark's file format)."""
    path.write_text(json.dumps(document, indent=indent) + "\n")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Figure, path: Path) -> None:
    """Lay out ``figure``, write it to ``path`` as a PNG and release it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=FIGURE_DPI)
    plt.close(figure)
