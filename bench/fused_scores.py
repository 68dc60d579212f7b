"""The fused score pass of one decode step (every scored layer in one launch) against the
decode attention of the same step.

For a shape, batch size and seq_len, ``layers`` scored layers of decode rows (q_len 1):

- ``fused``: ``kernels.fused_scores.fused_decode_mass``, the step's request table built
  and uploaded once, one launch for every layer (what ``summed_attention_mass`` runs on
  CUDA for decode rows);
- ``per_layer``: the batched kernels one layer at a time (three launches and one request
  table per layer: the path before the fused kernel), summed;
- ``attention``: SDPA decode over each layer's K and V already contiguous (not timed), one
  call per layer: the attention kernels alone, a lower bound of a paged decode kernel.

``ratio = fused_ms / attention_ms`` (the target: <= 1.0 at batch >= 32 on a GPU; none on
the CPU, ``target_met`` null);
``device_ratio`` the same from the device's time alone and ``fused_launch_ms`` the host's
time to issue the step's pass (``bench.timing.measure_interleaved``). Before timing, the
fused mass is compared with the per-layer kernels' (``max_abs_diff``; the GPU check
fails a case above ``MASS_TOLERANCE``, the run's ``max_abs_diff_tolerance``). The layers
are views of one buffer like vLLM's; where ``layers`` distinct caches would pass
``MAX_CACHE_BYTES`` they alias one cache (``aliased_layers``), each layer still reading
all its keys (far more than the last-level cache). Under ``TRITON_INTERPRET=1`` it runs on
CPU (tiny shapes: a smoke test of this module).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bench.common import csv_items, write_json
from bench.scores import GPU_TARGET_MIN_BATCH, SHAPES, gather_pages, gpu_target_met, sdpa_attention
from kernels.intmath import cdiv

if TYPE_CHECKING:
    import torch

MAX_CACHE_BYTES = 16 * 1024**3
# The fused mass against the per-layer kernels': both add float32 softmax terms of the same
# logits (each request's mass sums to layers * q_heads, 1024 for llama8b), in different
# orders; a token read from the wrong slot moves its mass by about 1024 / seq_len.
MASS_TOLERANCE = 1e-3
BLOCK_SIZE = 16
GPU_TARGET = f"device_ratio (else ratio) <= 1.0 at batch >= {GPU_TARGET_MIN_BATCH} on CUDA"


def fused_target_met(
    device_type: str, batch: int, ratio: float, device_ratio: float | None
) -> bool | None:
    """``GPU_TARGET`` of a case; ``None`` (no target) below batch ``GPU_TARGET_MIN_BATCH``
    and on the CPU (the interpreter's times say nothing of a GPU)."""
    if device_type != "cuda" or batch < GPU_TARGET_MIN_BATCH:
        return None
    return gpu_target_met(ratio, device_ratio)


def run_case(
    shape: str,
    batch: int,
    seq_len: int,
    layers: int,
    device: torch.device,
    reps: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    import torch

    from bench.timing import device_only_times, measure_interleaved, rounded_ms
    from kernels.attention_scores import batch_attention_scores
    from kernels.fused_scores import DecodeRequests, fused_decode_mass
    from kernels.layout import KVLayout, paged_layer_views

    layout = KVLayout.BHNC
    q_heads, kv_heads, head_dim = SHAPES[shape]
    blocks_each = cdiv(seq_len, BLOCK_SIZE)
    num_blocks = 2 * batch * blocks_each
    layer_bytes = num_blocks * BLOCK_SIZE * kv_heads * 2 * head_dim * dtype.itemsize
    aliased = layers * layer_bytes > MAX_CACHE_BYTES
    views = paged_layer_views(
        1 if aliased else layers, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype, device
    )
    caches = [views[0]] * layers if aliased else views
    storage = views[0].untyped_storage()
    torch.empty(0, dtype=dtype, device=device).set_(storage).normal_()
    block_tables = (
        torch.randperm(num_blocks, device=device)[: batch * blocks_each]
        .view(batch, blocks_each)
        .int()
    )
    # The capture buffer: every layer's decode rows, one view per layer.
    captured = torch.randn(layers, batch, q_heads, head_dim, device=device, dtype=dtype)
    queries = list(captured)
    scales = [head_dim**-0.5] * layers
    rows, seq_lens = list(range(batch)), [seq_len] * batch

    def fused() -> torch.Tensor:
        requests = DecodeRequests.build(block_tables, rows, seq_lens)
        return fused_decode_mass(queries, caches, scales, requests, layout)

    def per_layer() -> torch.Tensor:
        total = torch.zeros(batch * seq_len, dtype=torch.float32, device=device)
        for query, cache in zip(queries, caches, strict=True):
            total += batch_attention_scores(
                query, cache, block_tables, rows, [1] * batch, seq_lens, layout, check=False
            ).sum(0)
        return total

    kv = [gather_pages(cache, block_tables, seq_len, layout) for cache in views]
    batched = [query.view(batch, 1, q_heads, head_dim).transpose(1, 2) for query in queries]

    def attention() -> None:
        for layer, query in enumerate(batched):
            sdpa_attention(query, *kv[0 if aliased else layer], None)

    max_abs_diff = (fused() - per_layer()).abs().max().item()
    times = measure_interleaved(
        {"fused": fused, "per_layer": per_layer, "attention": attention},
        device,
        reps,
        cold=False,
        device_only=("fused", "attention", "per_layer"),
    )
    device_ms = device_only_times(times, ("fused", "attention", "per_layer"))
    fused_ms, attention_ms = times["fused"], times["attention"]
    fused_device, attention_device = device_ms["fused"], device_ms["attention"]
    device_ratio = (
        round(fused_device / attention_device, 3) if fused_device and attention_device else None
    )
    return {
        "shape": shape,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": BLOCK_SIZE,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "seq_len": seq_len,
        "layers": layers,
        "aliased_layers": aliased,
        "key_mb_per_layer": round(batch * seq_len * kv_heads * head_dim * dtype.itemsize / 1e6, 1),
        "max_abs_diff": max_abs_diff,
        "fused_ms": round(fused_ms, 4),
        "per_layer_ms": round(times["per_layer"], 4),
        "attention_ms": round(attention_ms, 4),
        "ratio": round(fused_ms / attention_ms, 3),
        "per_layer_ratio": round(times["per_layer"] / attention_ms, 3),
        "fused_device_ms": rounded_ms(fused_device),
        "attention_device_ms": rounded_ms(attention_device),
        "per_layer_device_ms": rounded_ms(device_ms["per_layer"]),
        "device_ratio": device_ratio,
        "fused_launch_ms": rounded_ms(times.get("fused_launch")),
        "launch_hidden": {name: times.get(f"{name}_launch_hidden") for name in device_ms},
        "target_met": fused_target_met(device.type, batch, fused_ms / attention_ms, device_ratio),
    }


def cli(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    shapes: Annotated[str, typer.Option(help="Comma list of " + ",".join(SHAPES))] = "llama8b",
    batches: Annotated[str, typer.Option(help="Comma list of batch sizes.")] = "1,32,128",
    seq_lens: Annotated[str, typer.Option(help="Comma list of sequence lengths.")] = "4096,16384",
    layers: Annotated[int, typer.Option(help="Scored layers in the step.")] = 32,
    reps: Annotated[int, typer.Option(help="Timed repetitions per measurement.")] = 10,
    dtype: Annotated[str, typer.Option(help="Query and KV cache dtype.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cuda, or cpu under TRITON_INTERPRET=1.")] = "cuda",
) -> None:
    """Time the fused score pass of a decode step against its attention; JSON output."""
    import torch

    chosen = torch.device(device)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("no CUDA device here", param_hint="--device")
    cases = []
    for shape in csv_items(shapes):
        for batch in (int(b) for b in csv_items(batches)):
            for seq_len in (int(s) for s in csv_items(seq_lens)):
                case = run_case(shape, batch, seq_len, layers, chosen, reps, getattr(torch, dtype))
                cases.append(case)
                typer.echo(
                    f"{shape:8} batch={batch:<3} seq={seq_len:<5} layers={layers} fused "
                    f"{case['fused_ms']:8.3f} ms (device {case['fused_device_ms']}, launch "
                    f"{case['fused_launch_ms']})  attention {case['attention_ms']:8.3f} ms  "
                    f"ratio {case['ratio']:.2f} (device {case['device_ratio']})  per-layer "
                    f"{case['per_layer_ratio']:.2f}  max diff {case['max_abs_diff']:.1e}"
                )
    result = {
        "device": torch.cuda.get_device_name() if chosen.type == "cuda" else "cpu",
        "attention": "sdpa decode over contiguous K/V, one call per layer",
        "statistic": "median of interleaved warm repetitions",
        "target": GPU_TARGET if chosen.type == "cuda" else None,
        "max_abs_diff_tolerance": MASS_TOLERANCE,
        "reps": reps,
        "cases": cases,
    }
    if json_path is not None:
        write_json(json_path, result, indent=1)
