#!/usr/bin/env bash
# GPU check for a bare GPU machine: NVIDIA GPU, PyTorch >= 2.11 and Triton >= 3.6, no vLLM,
# no network, no install (the checkout is put on PYTHONPATH). Usage: bench/gpu_check.sh OUTDIR
# One command, under 8 minutes: every stage runs under the lesser of its limit and what is
# left of the check's deadline (DEADLINE_S, 450 s from the start, probes included; a stage
# cut short by it says so, one with no time left is NOT RUN). Limits (expected time on one
# H100/H200 when everything passes: estimates, not yet timed with these case lists):
# env 20 s (5 s), probe 60 s (15 s: Triton builds its launcher once),
# kernel-tests 150 s (90 s), repack 40 s (15 s), repack-variants 30 s (10 s), scores 45 s
# (20 s), fused-scores 35 s (15 s), cuda-graph 30 s (10 s), runner-harness 40 s (15 s).
# The probe (bench/gpu_probe.py) first checks what every stage needs and is not the
# product: Python >= 3.11, numpy, torch, Triton, a CUDA device, and one trivial Triton
# kernel built (a C compiler, Python's headers) and run; without it every stage is NOT RUN
# with the reason. Every stage prints "PASS", "FAIL" or "NOT RUN" with its reason; the
# summary is in OUTDIR/summary.txt and the exit status is 0 only when every stage passed (a
# stage that could not run, e.g. no CUDA or no pytest, is a failure). A stage passes when
# its command exits 0 and bench/gpu_verdict.py passes what it wrote: the kernel tests with
# at least one test passed and every skip for a reason expected on a CUDA machine (every
# test skipped or none collected: NOT RUN); each benchmark with every target it records
# met (target_met) and, where it records one, its error within the tolerance it records
# (fused-scores, cuda-graph); the runner harness with its negative control failing. The
# benchmarks run only the cases their targets judge (scores: decode at batch 32 and 128;
# repack: the compaction patterns; fused-scores: batch 32 and 128). Stage helpers:
# bench/gpu_stages.sh.
# Writes OUTDIR/{env.json, tests.txt, tests.xml, repack-gpu.json, repack-gpu-variants.json,
# scores-gpu.json, fused-scores-gpu.json, cuda-graph.json, runner-harness.json, summary.txt}
# (those left from an earlier run are removed first).
# vLLM's engine tests need vLLM 0.32's CUDA build: bench/gpu_engine_check.sh, elsewhere.
set -uo pipefail
# shellcheck source=bench/gpu_stages.sh
source "$(dirname "$0")/gpu_stages.sh"
DEADLINE_S="${DEADLINE_S:-450}"
begin "${1:?usage: bench/gpu_check.sh OUTDIR}" env.json tests.txt tests.xml repack-gpu.json \
  repack-variant.json repack-gpu-variants.json scores-gpu.json fused-scores-gpu.json \
  cuda-graph.json runner-harness.json

stage env 20 - - "$PY" - "$OUT/env.json" <<'PY'
import importlib.metadata, json, subprocess, sys

def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None

try:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
except Exception:  # the probe says why
    device = None
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    smi = None
json.dump({"python": sys.version.split()[0], "torch": version("torch"), "triton": version("triton"),
           "numpy": version("numpy"), "pytest": version("pytest"), "vllm": version("vllm"),
           "device": device, "nvidia_smi": smi}, open(sys.argv[1], "w"), indent=1)
print(open(sys.argv[1]).read())
PY
STAGES="kernel-tests repack repack-variants scores fused-scores cuda-graph runner-harness"
echo "== probe (limit 60s)"
probe="$(timeout --kill-after=5 60 "$PY" -m bench.gpu_probe 2>&1)"
rc=$?
printf '%s\n' "$probe"
if [ $rc -ne 0 ]; then
  reason="$(printf '%s\n' "$probe" | tail -1)"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    reason="the probe (python -m bench.gpu_probe) timed out or was killed (exit $rc)"
  fi
  for name in $STAGES; do not_run "$name" "${reason:-the probe exited $rc}"; done
  finish
fi
# typer only decorates the benchmark CLIs; a stub keeps them importable where it is missing.
if ! timeout 60 "$PY" -c "import typer" 2>/dev/null; then
  STUB="$(mktemp -d)"
  printf 'def Option(*a, **k):\n    return None\ndef echo(m, err=False):\n    print(m, flush=True)\n' > "$STUB/typer.py"
  export PYTHONPATH="$PYTHONPATH:$STUB"
fi

if timeout 60 "$PY" -c "import pytest" 2>/dev/null; then
  # every vLLM KVCacheLayout; bf16, fp16, fp8; side-stream repack
  # passes with at least one test passed, none failed, every skip expected on CUDA
  pytest_stage kernel-tests 150 kernel-tests "$OUT/tests" tests/kernels
else
  echo "pytest missing" > "$OUT/tests.txt"
  not_run kernel-tests "pytest is not installed (carry its wheel)"
fi

# the compaction patterns (the target's cases), both shapes, three block sizes
stage repack 40 repack "$OUT/repack-gpu.json" "$PY" -c "
import sys; from pathlib import Path; from bench.repack import cli
cli(json_path=Path(sys.argv[1]), shapes='smollm2,llama8b', block_sizes='16,32,128',
    patterns='compact50,compact80', reps=10, dtype='bfloat16',
    device='cuda', cold=True, kv_cache_layout='LBNHC', threads=None)" "$OUT/repack-gpu.json"

# llama8b: BLHNC bf16, LBNHC fp8 stored as uint8
stage repack-variants 30 repack-variants "$OUT/repack-gpu-variants.json" "$PY" -c "
import json, sys; from pathlib import Path; from bench.repack import cli
runs = []
for layout, dtype in (('BLHNC', 'bfloat16'), ('LBNHC', 'uint8')):  # fp8 KV is stored as uint8
    path = Path(sys.argv[1])
    cli(json_path=path, shapes='llama8b', block_sizes='16', patterns='compact50,compact80',
        reps=10, dtype=dtype, device='cuda', cold=True, kv_cache_layout=layout, threads=None)
    runs.append(json.loads(path.read_text()))
path.unlink()
Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))" "$OUT/repack-variant.json" "$OUT/repack-gpu-variants.json"

# batched decode at batch 32 and 128 (the target's cases), vs SDPA of the same batch
stage scores 45 scores "$OUT/scores-gpu.json" "$PY" -c "
import sys; from pathlib import Path; from bench.scores import cli
cli(json_path=Path(sys.argv[1]), shapes='smollm2,llama8b', batches='32,128',
    seq_lens='4096,16384', q_lens='1', reps=15, dtype='bfloat16', device='cuda')" "$OUT/scores-gpu.json"

# every scored layer's decode rows in one launch, vs the per-layer kernels and SDPA decode
stage fused-scores 35 fused-scores "$OUT/fused-scores-gpu.json" "$PY" -c "
import sys; from pathlib import Path; from bench.fused_scores import cli
cli(json_path=Path(sys.argv[1]), shapes='llama8b', batches='32,128',
    seq_lens='4096,16384', layers=32, reps=10, dtype='bfloat16', device='cuda')" "$OUT/fused-scores-gpu.json"

# a decode step captured in a CUDA graph; repack between replays; replay equals eager
stage cuda-graph 30 cuda-graph "$OUT/cuda-graph.json" "$PY" - "$OUT/cuda-graph.json" <<'PY'
"""Capture a decode attention step that reads block_table and seq_lens from static buffers;
repack (and shrink seq_lens) between replays; replay must equal eager on the new state."""
import json, sys
import torch
from kernels import KVLayout, repack
from kernels.layout import paged_layer_views

torch.manual_seed(0)
dev, layout, bs, kvh, qh, hd = "cuda", KVLayout.BHNC, 16, 8, 32, 128
num_reqs, max_blocks, pool = 4, 64, 512
cache = paged_layer_views(1, pool, bs, kvh, hd, torch.bfloat16, dev, "LBNHC")[0].normal_()
block_table = torch.randperm(pool, device=dev)[: num_reqs * max_blocks].view(num_reqs, max_blocks).int()
seq_lens = torch.tensor([1000, 700, 1023, 64], device=dev, dtype=torch.int32)
query = torch.randn(num_reqs, qh, hd, device=dev, dtype=torch.bfloat16)
out = torch.empty_like(query)

def step():
    keys, values = layout.keys_values(cache)
    k = keys[block_table.long()].flatten(1, 2)  # [reqs, max_blocks*bs, kvh, hd]
    v = values[block_table.long()].flatten(1, 2)
    mask = torch.arange(k.shape[1], device=dev)[None, :] < seq_lens[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], enable_gqa=True)
    out.copy_(o[:, :, 0])

stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    step()
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    step()
def live_attention(keys_live, values_live):
    """Attention of each request's query over its live tokens, in logical order."""
    outs = []
    for r in range(num_reqs):
        o = torch.nn.functional.scaled_dot_product_attention(
            query[r][None, :, None], keys_live[r].transpose(0, 1)[None], values_live[r].transpose(0, 1)[None],
            enable_gqa=True)
        outs.append(o[0, :, 0])
    return torch.stack(outs)

results = []
for round_ in range(3):
    # evict 30% of each request's older tokens, move tail tokens into the holes
    src, dst, keys_live, values_live = [], [], [], []
    keys_all, values_all = layout.keys_values(cache)
    for r in range(num_reqs):
        n = int(seq_lens[r]); gen = torch.Generator().manual_seed(round_ * 10 + r)
        live = torch.ones(n, dtype=torch.bool); live[torch.randperm(n - 8, generator=gen)[: int(0.3 * n)]] = False
        n_live = int(live.sum())
        holes = (~live[:n_live]).nonzero().flatten(); tail = live[n_live:].nonzero().flatten() + n_live
        row = block_table[r].long().cpu()
        slot = lambda p: row[p // bs] * bs + p % bs
        live_slots = slot(live.nonzero().flatten()).to(dev)
        keys_live.append(keys_all[live_slots // bs, live_slots % bs].clone())
        values_live.append(values_all[live_slots // bs, live_slots % bs].clone())
        src.append(slot(tail)); dst.append(slot(holes))
        seq_lens[r] = n_live
    src_t, dst_t = torch.cat(src).to(dev), torch.cat(dst).to(dev)
    repack([cache], src_t, dst_t, layout)
    graph.replay()
    replayed = out.clone()
    step()
    diff = (replayed.float() - out.float()).abs().max().item()
    # The same attention as over the live tokens before the repack (keys in another order:
    # equal up to bf16 summation order).
    expected = live_attention(keys_live, values_live)
    live_diff = (replayed.float() - expected.float()).abs().max().item()
    results.append({"round": round_, "moves": int(src_t.numel()), "max_abs_diff": diff,
                    "max_abs_diff_vs_live_attention": live_diff})
tolerance = 2e-2  # replay equals eager exactly; live attention within bf16 summation order
ok = all(r["max_abs_diff"] == 0.0 and r["max_abs_diff_vs_live_attention"] < tolerance for r in results)
report = {"ok": ok, "live_attention_tolerance": tolerance, "rounds": results}
json.dump(report, open(sys.argv[1], "w"), indent=1)
print(json.dumps(report))
sys.exit(0 if ok else 1)
PY

# vLLM's step on a dedicated stream with the repack on the side stream, checked against a
# host reference every step; the negative control (fence disabled) must fail
stage runner-harness 40 runner-harness "$OUT/runner-harness.json" "$PY" -m bench.runner_harness "$OUT/runner-harness.json"

finish
