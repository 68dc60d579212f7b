"""`vtoken bench repack --granularity`: what a repack costs per selection granularity.

A policy that keeps a set per layer or per (layer, KV head) evicts different tokens in
each group, so each group compacts on its own map: the planner emits a move per group
(``vtoken.repack_planner``) and the repack copies one head of one layer per move
(``kernels.grouped_repack``) instead of a whole slot over every layer and head
(``kernels.repack``: the C loop on CPU). This times both on the same request:

    compact50   one 4096-token request, half of its older tokens evicted at random (each
                group its own draw, the same count), the last 32 kept
    trickle1    one 1024-token request evicting 16 tokens per group (a decode step)

Per case: the planned moves (group moves; a whole slot counts once), the bytes they copy,
and the median of ``reps`` warm calls on the vLLM CPU layout (``cpu_attn``) of what the
worker runs (``repack_ms``: a grouped repack checks its moves first), and for grouped
repacks also without the check (``unchecked_ms``). After the timed calls every
destination holds its source's values (each move's head of its layer; a whole slot
without groups), or the case raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import kernels
from kernels import KVLayout
from kernels.grouped_repack import grouped_repack
from vtoken.groups import GroupedMoves, ModelGeometry
from vtoken.repack_planner import plan_repack
from vtoken.token_table import TokenTable

GROUP_PATTERNS = {"compact50": (4096, 0.5), "trickle1": (1024, 16)}


def _planned(
    geometry: ModelGeometry, granularity: str, block_size: int, pattern: str, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[int, ...], int]:
    """``(src, dst, group_ids, group_shape, pool_blocks)`` of one planned repack."""
    num_tokens, amount = GROUP_PATTERNS[pattern]
    count = int(amount * num_tokens) if isinstance(amount, float) else amount
    rng = np.random.default_rng(seed)
    shape = geometry.group_shape(granularity)
    table = TokenTable(block_size, group_shape=shape)
    pool_blocks = -(-num_tokens // block_size)
    table.append(num_tokens, rng.permutation(pool_blocks).tolist())
    older = num_tokens - 32
    table.evict(
        np.array([rng.choice(older, count, replace=False) for _ in range(table.num_groups)])
    )
    plan = plan_repack(table)
    return plan.src_slots, plan.dst_slots, plan.group_ids, shape, pool_blocks


def granularity_case(
    shape_name: str,
    dims: tuple[int, int, int],
    block_size: int,
    pattern: str,
    granularity: str,
    reps: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """One timed case (module docstring)."""
    num_layers, kv_heads, head_dim = dims
    geometry = ModelGeometry(num_layers, kv_heads)
    src, dst, groups, shape, pool_blocks = _planned(geometry, granularity, block_size, pattern, 0)
    layout = KVLayout.CPU_ATTN
    caches = [
        layout.new_cache(pool_blocks, block_size, kv_heads, head_dim, dtype).normal_()
        for _ in range(num_layers)
    ]
    slot_bytes = num_layers * kv_heads * 2 * head_dim * caches[0].element_size()
    calls: dict[str, Callable[[], None]] = {}
    if groups is None:
        args = (torch.from_numpy(src), torch.from_numpy(dst))
        moved_bytes = src.size * slot_bytes
        sources = [layout.gather(cache, args[0]).clone() for cache in caches]
        calls["repack"] = lambda: kernels.repack(caches, *args, layout)

        def copied() -> bool:
            return all(
                torch.equal(layout.gather(cache, args[1]), before)
                for cache, before in zip(caches, sources, strict=True)
            )
    else:
        moves = GroupedMoves.of_groups(groups, src, dst, shape, kv_heads)
        arrays = (moves.layers, moves.heads, moves.src_slots, moves.dst_slots)
        layers, heads, src_t, dst_t = (torch.from_numpy(a) for a in arrays)
        moved_bytes = moves.num_moves * slot_bytes // (num_layers * kv_heads)
        heads_at = _heads_at(caches, layers, heads, layout)
        head_sources = heads_at(src_t)
        calls["repack"] = lambda: grouped_repack(caches, layers, heads, src_t, dst_t, layout)
        calls["unchecked"] = lambda: grouped_repack(
            caches, layers, heads, src_t, dst_t, layout, check=False
        )

        def copied() -> bool:
            return torch.equal(heads_at(dst_t), head_sources)

    times = {name: _median_ms(call, reps) for name, call in calls.items()}
    if not copied():
        raise RuntimeError(f"repack {granularity} {pattern}: a destination lost its source")
    repack_ms = times["repack"]
    return {
        "shape": shape_name,
        "block_size": block_size,
        "pattern": pattern,
        "granularity": granularity,
        "moves": int(src.size),
        "moved_mb": round(moved_bytes / 1e6, 3),
        "repack_ms": round(repack_ms, 3),
        "unchecked_ms": round(times["unchecked"], 3) if "unchecked" in times else None,
        "gbps": round(moved_bytes / repack_ms / 1e6, 3),
    }


def _median_ms(call: Callable[[], None], reps: int) -> float:
    """Median of ``reps`` timed calls after one warm call (the library built, the lines
    touched), in milliseconds."""
    call()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def _heads_at(
    caches: list[torch.Tensor], layers: torch.Tensor, heads: torch.Tensor, layout: KVLayout
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``slots -> [moves, 2, head_dim]``: K and V of each move's head of its layer there."""

    def at(slots: torch.Tensor) -> torch.Tensor:
        parts = []
        for layer, cache in enumerate(caches):
            pick = layers == layer
            stored = layout.gather(cache, slots[pick])  # [moves, 2, heads, head_dim]
            parts.append(stored[torch.arange(stored.shape[0]), :, heads[pick]])
        return torch.cat(parts)

    return at


def granularity_cases(
    shapes: str,
    block_sizes: str,
    granularities: str,
    reps: int,
    dtype: torch.dtype,
    known_shapes: dict[str, tuple[int, int, int]],
) -> dict[str, Any]:
    """Every shape (named in ``known_shapes``: layers, KV heads, head size) x block size x
    pattern x granularity, printed as it runs."""
    import typer

    from bench.common import csv_items
    from vtoken.groups import check_granularity

    names = csv_items(granularities)
    try:
        for name in names:
            check_granularity(name)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--granularity") from None
    cases = []
    for shape in csv_items(shapes):
        for block_size in (int(b) for b in csv_items(block_sizes)):
            for pattern in GROUP_PATTERNS:
                for name in names:
                    case = granularity_case(
                        shape, known_shapes[shape], block_size, pattern, name, reps, dtype
                    )
                    cases.append(case)
                    typer.echo(
                        f"{shape:8} bs={block_size:<4} {pattern:10} {name:8}"
                        f" moves={case['moves']:<7} {case['moved_mb']:8.3f} MB"
                        f" repack {case['repack_ms']:9.3f} ms {case['gbps']:6.2f} GB/s"
                        f" (unchecked {case['unchecked_ms']} ms)"
                    )
    return {
        "device": f"cpu ({torch.get_num_threads()} threads)",
        "statistic": "median of warm repetitions",
        "reps": reps,
        "granularity_cases": cases,
    }
