"""`vtoken bench repack`: the repack dispatcher vs a plain copy and torch indexing.

Move patterns come from the real planner (`vtoken.planner.plan_repack`) run on token
tables whose evictions follow the issue:

    compact50 / compact80   one 4096-token request, 50% / 80% of it evicted at random
                            (the last 32 tokens kept, as H2O's recent window)
    trickle                 a decode batch of 8 requests of 1024 compact tokens, each
                            evicting 16 tokens (<= 16 moves per request, as H2O per step)
    scattered               8 requests of 512 tokens on blocks drawn at random from a pool
                            twice their size, 30% evicted at random

Method: timings are the minimum over repetitions after a warm-up (CUDA: events). With
``--cold`` each CPU repetition is preceded by writing a 256 MiB buffer, so no case starts
with its data in the last-level cache; `copy_warm_gbps` always reports the warm copy.
Cold trickle moves are bound by TLB and cache misses (about 1.3 us per token and layer on
the 2-core development machine, for the dispatcher and the baseline alike).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    import numpy as np
    import torch

SHAPES = {"smollm2": (30, 3, 64), "llama8b": (32, 8, 128)}  # layers, kv_heads, head_dim
BLOCK_SIZES = (16, 32, 128)
PATTERNS = ("compact50", "compact80", "trickle", "scattered")


def _request_moves(
    block_ids: list[int], num_tokens: int, block_size: int, evict: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    from vtoken.planner import plan_repack
    from vtoken.token_table import TokenTable

    table = TokenTable(block_size)
    table.append(num_tokens, block_ids)
    table.evict(evict)
    plan = plan_repack(table)
    return plan.src_slots, plan.dst_slots


def make_moves(pattern: str, block_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """``(src_slots, dst_slots, pool_blocks)`` of ``pattern`` from the repack planner."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if pattern.startswith("compact"):
        requests, num_tokens, pool_factor = 1, 4096, 1.25
    elif pattern == "trickle":
        requests, num_tokens, pool_factor = 8, 1024, 1.25
    elif pattern == "scattered":
        requests, num_tokens, pool_factor = 8, 512, 2.0
    else:
        raise ValueError(f"unknown pattern {pattern!r}; expected one of {PATTERNS}")
    blocks_each = -(-num_tokens // block_size)
    pool_blocks = int(requests * blocks_each * pool_factor)
    pool = rng.permutation(pool_blocks)
    sources, destinations = [], []
    for index in range(requests):
        block_ids = pool[index * blocks_each : (index + 1) * blocks_each].tolist()
        older = num_tokens - 32  # the recent window is never evicted
        if pattern.startswith("compact"):
            evict = rng.choice(older, int(num_tokens * int(pattern[-2:]) / 100), replace=False)
        elif pattern == "trickle":
            evict = rng.choice(older, 16, replace=False)
        else:
            evict = rng.choice(older, int(0.3 * num_tokens), replace=False)
        src, dst = _request_moves(block_ids, num_tokens, block_size, np.sort(evict))
        sources.append(src)
        destinations.append(dst)
    return np.concatenate(sources), np.concatenate(destinations), pool_blocks


def torch_indexing_baseline(
    caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, layout: Any
) -> None:
    """Plain advanced indexing on the layout's K and V views, layer by layer."""
    block_size = layout.block_size(caches[0])
    src_blocks, src_offsets = src // block_size, src % block_size
    dst_blocks, dst_offsets = dst // block_size, dst % block_size
    for cache in caches:
        for part in layout.keys_values(cache):
            part[dst_blocks, dst_offsets] = part[src_blocks, src_offsets]


def _timer(device: torch.device, reps: int, cold: bool) -> Callable[[Callable[[], None]], float]:
    """Minimum milliseconds of ``reps`` runs after a warm-up; CPU runs start cache-cold."""
    import torch

    on_cpu = device.type == "cpu" and cold
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.float32) if on_cpu else None

    def measure(function: Callable[[], None]) -> float:
        function()
        times = []
        for _ in range(reps):
            if flush is not None:
                flush.fill_(1.0)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                function()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                function()
                times.append((time.perf_counter() - begin) * 1e3)
        return min(times)

    return measure


def run_case(
    shape: str,
    block_size: int,
    pattern: str,
    device: torch.device,
    reps: int,
    dtype: torch.dtype,
    cold: bool = False,
) -> dict[str, Any]:
    import torch

    from kernels import repack
    from kernels.layout import KVLayout

    layers, kv_heads, head_dim = SHAPES[shape]
    layout = KVLayout.FLASH if device.type == "cuda" else KVLayout.CPU_ATTN
    src_np, dst_np, pool_blocks = make_moves(pattern, block_size)
    src, dst = torch.from_numpy(src_np).to(device), torch.from_numpy(dst_np).to(device)
    caches = [
        layout.new_cache(pool_blocks, block_size, kv_heads, head_dim, dtype, device).fill_(1.0)
        for _ in range(layers)
    ]
    expected = layout.gather(caches[0], src)
    measure = _timer(device, reps, cold)
    repack_ms = measure(lambda: repack(caches, src, dst, layout))
    if not torch.equal(layout.gather(caches[0], dst), expected):
        raise AssertionError(f"repack moved wrong bytes in {shape}/{block_size}/{pattern}")
    baseline_ms = measure(lambda: torch_indexing_baseline(caches, src, dst, layout))
    caches.clear()  # free the pool before the copy buffers
    moved_bytes = src.numel() * layers * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    buffer = torch.ones(moved_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(buffer)
    copy_ms = measure(lambda: target.copy_(buffer))
    copy_warm_ms = _timer(device, reps, False)(lambda: target.copy_(buffer))
    repack_gbps = moved_bytes / repack_ms / 1e6
    copy_gbps = moved_bytes / copy_ms / 1e6
    return {
        "shape": shape,
        "pattern": pattern,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": str(dtype).removeprefix("torch."),
        "moved_tokens": int(src.numel()),
        "moved_bytes": int(moved_bytes),
        "repack_ms": round(repack_ms, 4),
        "repack_gbps": round(repack_gbps, 3),
        "copy_gbps": round(copy_gbps, 3),
        "copy_warm_gbps": round(moved_bytes / copy_warm_ms / 1e6, 3),
        "ratio": round(repack_gbps / copy_gbps, 4),
        "baseline_ms": round(baseline_ms, 4),
        "speedup": round(baseline_ms / repack_ms, 2),
    }


def cli(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    shapes: Annotated[str, typer.Option(help="Comma list of " + ",".join(SHAPES))] = ",".join(
        SHAPES
    ),
    block_sizes: Annotated[str, typer.Option(help="Comma list of block sizes.")] = "16,32,128",
    patterns: Annotated[str, typer.Option(help="Comma list of patterns.")] = ",".join(PATTERNS),
    reps: Annotated[int, typer.Option(help="Timed repetitions per measurement.")] = 5,
    dtype: Annotated[str, typer.Option(help="KV cache dtype.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
    cold: Annotated[bool, typer.Option(help="Flush CPU caches before each repetition.")] = False,
) -> None:
    """Time the repack dispatcher on planner move patterns; JSON as in issue 3."""
    import torch

    chosen = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    )
    cases = []
    for shape in shapes.split(","):
        for block_size in (int(b) for b in block_sizes.split(",")):
            for pattern in patterns.split(","):
                case = run_case(
                    shape, block_size, pattern, chosen, reps, getattr(torch, dtype), cold
                )
                cases.append(case)
                typer.echo(
                    f"{shape:8} bs={block_size:<4} {pattern:10} moves={case['moved_tokens']:<5}"
                    f" repack {case['repack_ms']:8.3f} ms {case['repack_gbps']:6.2f} GB/s"
                    f"  copy {case['copy_gbps']:6.2f} GB/s  ratio {case['ratio']:.3f}"
                    f"  baseline {case['baseline_ms']:8.3f} ms  speedup {case['speedup']:.1f}x"
                )
    name = torch.cuda.get_device_name() if chosen.type == "cuda" else "cpu"
    result = {
        "device": f"{name} ({torch.get_num_threads()} threads)" if chosen.type == "cpu" else name,
        "cold": cold,
        "cases": cases,
    }
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
