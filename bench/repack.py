"""`vtoken bench repack`: the repack dispatcher vs a plain copy and torch indexing.

Move patterns come from the real planner (`vtoken.repack_planner.plan_repack`) run on token
tables whose evictions follow the issue:

    compact50 / compact80   one 4096-token request, 50% / 80% of it evicted at random
                            (the last 32 tokens kept, as H2O's recent window)
    trickle                 a decode batch of 8 requests of 1024 compact tokens, each
                            evicting 16 tokens (<= 16 moves per request, as H2O per step)
    trickle1                the same step for a batch of one request (16 moves): fixed
                            costs, not memory traffic, decide it
    scattered               8 requests of 512 tokens on blocks drawn at random from a pool
                            twice their size, 30% evicted at random

Method: every timed call of the dispatcher (``repack_ms``), the plain copy of the same
number of bytes (one contiguous uint8 buffer into another, ``copy_gbps``), the baseline
(``kernels.reference_repack``, plain torch indexing on every layer, ``baseline_ms``) and
advanced indexing on the layout's K/V views (``view_index_ms``, informational) and, on the
CPU, the memory floor of the moves (``floor_ms``: only touching the cache lines the repack
must read or write, ``bench/memory_floor.py``; ``floor_ratio = floor_ms / repack_ms``,
``traffic_mb`` the DRAM bytes those lines take) is prepared
the same way: cold by default (a 96 MiB buffer, 3x the last-level cache, is written first, so
nothing starts cached), or with ``--warm`` an untimed call of the same function right before.
Repetitions are interleaved (repack, copy, baseline, view, repack, ...) and each figure is the
median, so all four see the same machine load and ``ratio`` = repack rate / copy rate is
meaningful on a shared machine. The copy, the baseline and the dispatcher run on the same
``--threads`` threads (default: torch's intra-op count, i.e. every core): torch's pool for the
torch ops, and the same pool for the C loop when it is built with OpenMP (see
``kernels/cbuild.py``). Every layer is checked after the runs
(dst == src).

``--granularity request,layer,head`` times instead what a repack costs when a policy keeps
one set per request, per layer or per (layer, KV head) (``bench/repack_groups.py``).

The target on a GPU (``GPU_TARGET``, the run's ``target``): a compaction pattern's repack
at >= 0.8x the device copy rate, judged on the device's time alone (``device_ratio``)
where the launch was hidden, else on ``ratio``. Each such case records ``target_met``;
cases without a target (other patterns, every CPU case) record ``None``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bench.common import csv_items, write_json
from kernels.intmath import cdiv

if TYPE_CHECKING:
    import numpy as np
    import torch

SHAPES = {"smollm2": (30, 3, 64), "llama8b": (32, 8, 128)}  # layers, kv_heads, head_dim
BLOCK_SIZES = (16, 32, 128)
PATTERNS = ("compact50", "compact80", "trickle", "trickle1", "scattered")
GPU_COPY_RATE_TARGET = 0.8
GPU_TARGET = (
    f"compaction (compact50, compact80) on CUDA at >= {GPU_COPY_RATE_TARGET}x the device copy "
    "rate: device_ratio where the launch was hidden, else ratio"
)


def gpu_target_met(pattern: str, ratio: float, device_ratio: float | None) -> bool | None:
    """``GPU_TARGET`` of a case run on CUDA; ``None`` for a pattern without a target."""
    if not pattern.startswith("compact"):
        return None
    return (device_ratio if device_ratio is not None else ratio) >= GPU_COPY_RATE_TARGET


def _request_moves(
    block_ids: list[int], num_tokens: int, block_size: int, evict: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    from vtoken.repack_planner import plan_repack
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
    elif pattern.startswith("trickle"):
        requests, num_tokens, pool_factor = (1 if pattern == "trickle1" else 8), 1024, 1.25
    elif pattern == "scattered":
        requests, num_tokens, pool_factor = 8, 512, 2.0
    else:
        raise ValueError(f"unknown pattern {pattern!r}; expected one of {PATTERNS}")
    blocks_each = cdiv(num_tokens, block_size)
    pool_blocks = int(requests * blocks_each * pool_factor)
    pool = rng.permutation(pool_blocks)
    sources, destinations = [], []
    for index in range(requests):
        block_ids = pool[index * blocks_each : (index + 1) * blocks_each].tolist()
        older = num_tokens - 32  # the recent window is never evicted
        if pattern.startswith("compact"):
            evict = rng.choice(older, int(num_tokens * int(pattern[-2:]) / 100), replace=False)
        elif pattern.startswith("trickle"):
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
    """Plain advanced indexing on the layout's K and V views, layer by layer (informational:
    ``view_index_ms``; the baseline of the targets is ``kernels.reference_repack``)."""
    block_size = layout.block_size(caches[0])
    src_blocks, src_offsets = src // block_size, src % block_size
    dst_blocks, dst_offsets = dst // block_size, dst % block_size
    for cache in caches:
        for part in layout.keys_values(cache):
            part[dst_blocks, dst_offsets] = part[src_blocks, src_offsets]


def _fill_pattern(cache: torch.Tensor) -> None:
    """Distinct, finite values per element of the cache's whole buffer (so the
    correctness check means something), whatever its strides."""
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[cache.element_size()]
    whole = cache.untyped_storage().nbytes() // cache.element_size()
    flat = cache.as_strided((whole,), (1,), 0).view(ints)
    # 16001 < 0x3E81: as bf16/fp16 bit patterns these are small finite numbers.
    flat.copy_(
        torch.arange(flat.numel(), device=cache.device) % (251 if ints is torch.uint8 else 16001)
    )


def _whole_buffers(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The one buffer that per-layer views of vLLM's allocation share, as a 1-D tensor."""
    first = caches[0]
    whole = first.untyped_storage().nbytes() // first.element_size()
    return [first.as_strided((whole,), (1,), 0)]


def run_case(
    shape: str,
    block_size: int,
    pattern: str,
    device: torch.device,
    reps: int,
    dtype: torch.dtype,
    cold: bool = True,
    kv_cache_layout: str = "LBNHC",
) -> dict[str, Any]:
    """One case. On CUDA the caches are vLLM 0.32's GPU views (``bhnc``) of one buffer,
    strided as ``kv_cache_layout``; on the CPU, ``cpu_attn`` layers as vLLM's CPU backend
    allocates them."""
    import torch

    from bench import memory_floor
    from bench.timing import device_only_times, measure_interleaved, rounded_ms
    from kernels import reference_repack, repack
    from kernels.layout import KVLayout, paged_layer_views
    from kernels.repack_cpu import default_threads

    layers, kv_heads, head_dim = SHAPES[shape]
    src_np, dst_np, pool_blocks = make_moves(pattern, block_size)
    src, dst = torch.from_numpy(src_np).to(device), torch.from_numpy(dst_np).to(device)
    if device.type == "cuda":
        layout = KVLayout.BHNC
        caches = paged_layer_views(
            layers, pool_blocks, block_size, kv_heads, head_dim, dtype, device, kv_cache_layout
        )
        _fill_pattern(caches[0])
    else:
        layout, kv_cache_layout = KVLayout.CPU_ATTN, "LBHNC"
        caches = [
            layout.new_cache(pool_blocks, block_size, kv_heads, head_dim, dtype, device)
            for _ in range(layers)
        ]
        for cache in caches:
            _fill_pattern(cache)
    moved_bytes = src.numel() * layers * 2 * kv_heads * head_dim * caches[0].element_size()
    # The plain copy: one contiguous buffer of the moved bytes into another.
    buffer = torch.ones(moved_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(buffer)
    # On CUDA the engine checks the planner's moves on the host, in numpy, before they are
    # uploaded (``kernels.async_repack``), and launches unchecked: time it that way, and the
    # device-side check (several synchronising torch ops) as ``repack_checked_ms``.
    on_gpu = device.type == "cuda"
    functions: dict[str, Callable[[], object]] = {
        "repack": lambda: repack(caches, src, dst, layout, check=not on_gpu),
        "copy": lambda: target.copy_(buffer),
        "baseline": lambda: reference_repack(caches, src, dst, layout),
        "view_index": lambda: torch_indexing_baseline(caches, src, dst, layout),
    }
    if on_gpu:
        from kernels.slot_checks import slot_problem_numpy

        num_slots = layout.num_blocks(caches[0]) * layout.block_size(caches[0])
        if slot_problem_numpy(src_np, dst_np, num_slots) is not None:
            raise AssertionError(f"planner moves of {pattern} are not a valid repack")
        functions["repack_checked"] = lambda: repack(caches, src, dst, layout)
    # CPU: the least memory work of these moves (see bench/memory_floor.py), same threads.
    floor = memory_floor.plan(caches, src, dst, layout) if device.type == "cpu" else None
    touch = floor.runner(caches, default_threads(moved_bytes)) if floor is not None else None
    if touch is not None:
        functions["floor"] = touch
    # Before timing: one dispatcher pass from the filled state must leave every byte of the
    # caches (other layers' and padding bytes included) as the reference's pass does.
    regions = _whole_buffers(caches) if on_gpu else caches
    filled = [region.clone() for region in regions]
    repack(caches, src, dst, layout, check=not on_gpu)
    moved = [region.clone() for region in regions]
    for region, original in zip(regions, filled, strict=True):
        region.copy_(original)
    reference_repack(caches, src, dst, layout)
    for index, (region, got) in enumerate(zip(regions, moved, strict=True)):
        if not torch.equal(region.view(torch.uint8), got.view(torch.uint8)):
            raise AssertionError(
                f"repack moved wrong bytes in {shape}/{block_size}/{pattern} buffer {index}"
            )
    del filled, moved
    prime = tuple(name for name in ("repack", "copy", "floor") if name in functions)
    times = measure_interleaved(
        functions, device, reps, cold, prime=prime, device_only=("repack", "copy")
    )
    repack_ms, copy_ms, baseline_ms = times["repack"], times["copy"], times["baseline"]
    device_ms = device_only_times(times, ("repack", "copy"))
    repack_gbps = moved_bytes / repack_ms / 1e6
    copy_gbps = moved_bytes / copy_ms / 1e6
    device_ratio = (
        round(device_ms["copy"] / device_ms["repack"], 4)
        if device_ms["repack"] and device_ms["copy"]
        else None
    )
    return {
        "shape": shape,
        "pattern": pattern,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_layout": kv_cache_layout,
        "moved_tokens": int(src.numel()),
        "moved_bytes": int(moved_bytes),
        "repack_ms": round(repack_ms, 4),
        "repack_gbps": round(repack_gbps, 3),
        "copy_ms": round(copy_ms, 4),
        "copy_gbps": round(copy_gbps, 3),
        "ratio": round(repack_gbps / copy_gbps, 4),
        # CUDA: the device's time alone (launch queued behind a spin; see measure_interleaved)
        "repack_device_ms": rounded_ms(device_ms["repack"]),
        "copy_device_ms": rounded_ms(device_ms["copy"]),
        "device_ratio": device_ratio,
        "launch_hidden": {name: times.get(f"{name}_launch_hidden") for name in device_ms},
        # CUDA: the host's time to issue one repack (all layers, one launch)
        "repack_launch_ms": rounded_ms(times.get("repack_launch")),
        "baseline_ms": round(baseline_ms, 4),
        "speedup": round(baseline_ms / repack_ms, 2),
        "view_index_ms": round(times["view_index"], 4),
        "repack_checked_ms": (
            round(times["repack_checked"], 4) if "repack_checked" in times else None
        ),
        "view_index_speedup": round(times["view_index"] / repack_ms, 2),
        # Fastest samples: under load a long call is preempted more often than a short one,
        # which biases median ratios against the slower function; minima bound that bias.
        "repack_min_ms": round(times["repack_min"], 4),
        "copy_min_ms": round(times["copy_min"], 4),
        "baseline_min_ms": round(times["baseline_min"], 4),
        "ratio_min": round(times["copy_min"] / times["repack_min"], 4),
        "speedup_min": round(times["baseline_min"] / times["repack_min"], 2),
        # The least memory work of the moves (CPU): floor_ratio near 1 = traffic-bound.
        "floor_ms": round(times["floor"], 4) if "floor" in times else None,
        "floor_ratio": round(times["floor"] / repack_ms, 3) if "floor" in times else None,
        "traffic_mb": round(floor.traffic_bytes(layers) / 1e6, 1) if floor else None,
        "target_met": (
            gpu_target_met(pattern, repack_gbps / copy_gbps, device_ratio) if on_gpu else None
        ),
    }


def cli(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    shapes: Annotated[str, typer.Option(help="Comma list of " + ",".join(SHAPES))] = ",".join(
        SHAPES
    ),
    block_sizes: Annotated[str, typer.Option(help="Comma list of block sizes.")] = "16,32,128",
    patterns: Annotated[str, typer.Option(help="Comma list of patterns.")] = ",".join(PATTERNS),
    reps: Annotated[int, typer.Option(help="Timed repetitions per measurement.")] = 7,
    dtype: Annotated[str, typer.Option(help="KV cache dtype.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto.")] = "auto",
    cold: Annotated[
        bool,
        typer.Option("--cold/--warm", help="Flush caches (default) or warm up before each call."),
    ] = True,
    kv_cache_layout: Annotated[
        str, typer.Option(help="vLLM KVCacheLayout of the CUDA caches (LBNHC, BLHNC, ...).")
    ] = "LBNHC",
    threads: Annotated[
        int | None,
        typer.Option(
            help="CPU threads of the plain copy, the baseline and the dispatcher "
            "(default: torch's intra-op thread count)."
        ),
    ] = None,
    granularity: Annotated[
        str | None,
        typer.Option(help="Time the repack per granularity instead (request,layer,head; CPU)."),
    ] = None,
) -> None:
    """Time the repack dispatcher on planner move patterns; JSON as in issue 3."""
    import torch

    from kernels.layout import resolve_kv_cache_layout

    try:
        resolve_kv_cache_layout(kv_cache_layout)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--kv-cache-layout") from None

    from kernels.repack_cpu import uses_openmp

    # The same thread count for the copy, the baseline (torch) and the dispatcher's C loop.
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    os.environ["VTOKEN_REPACK_THREADS"] = str(threads)
    chosen = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    )
    if granularity is not None:
        from bench.repack_groups import granularity_cases

        result = granularity_cases(
            shapes, block_sizes, granularity, reps, getattr(torch, dtype), SHAPES
        )
        if json_path is not None:
            write_json(json_path, result, indent=1)
        return
    cases = []
    for shape in csv_items(shapes):
        for block_size in (int(b) for b in csv_items(block_sizes)):
            for pattern in csv_items(patterns):
                case = run_case(
                    shape, block_size, pattern, chosen, reps, getattr(torch, dtype), cold,
                    kv_cache_layout,
                )  # fmt: skip
                cases.append(case)
                typer.echo(
                    f"{shape:8} bs={block_size:<4} {pattern:10} moves={case['moved_tokens']:<5}"
                    f" repack {case['repack_ms']:8.3f} ms {case['repack_gbps']:6.2f} GB/s"
                    f"  copy {case['copy_gbps']:6.2f} GB/s  ratio {case['ratio']:.3f}"
                    f"  baseline {case['baseline_ms']:8.3f} ms  speedup {case['speedup']:.1f}x"
                    f"  (view indexing {case['view_index_speedup']:.1f}x)"
                    + (f"  floor {case['floor_ratio']:.2f}" if case["floor_ratio"] else "")
                    + (
                        f"  device ratio {case['device_ratio']}, launch "
                        f"{case['repack_launch_ms']} ms"
                        if case["repack_launch_ms"] is not None
                        else ""
                    )
                )
    name = torch.cuda.get_device_name() if chosen.type == "cuda" else "cpu"
    result = {
        "device": f"{name} ({torch.get_num_threads()} threads)" if chosen.type == "cpu" else name,
        "cold": cold,
        "statistic": "median of interleaved repetitions",
        "reps": reps,
        "threads": threads,
        "cpu_openmp": chosen.type == "cpu" and uses_openmp(),
        "target": GPU_TARGET if chosen.type == "cuda" else None,
        "cases": cases,
    }
    if json_path is not None:
        write_json(json_path, result, indent=1)
