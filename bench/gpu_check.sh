#!/usr/bin/env bash
# GPU check for a bare GPU machine: NVIDIA GPU, PyTorch >= 2.11 and Triton >= 3.6, no vLLM,
# no network, no install (the checkout is put on PYTHONPATH). Usage: bench/gpu_check.sh OUTDIR
# One command, under 8 minutes: the stage limits add up to 475 s (about 3 minutes on one
# H200 when every stage passes); each stage's check of its output runs within its limit.
# Every stage prints "PASS", "FAIL" or "NOT RUN" with its reason; the summary is in
# OUTDIR/summary.txt and the exit status is 0 only when every stage passed (a stage that
# could not run, e.g. no CUDA or no pytest, is a failure). A stage passes when its command
# exits 0 and bench/gpu_verdict.py passes what it wrote: the kernel tests with at least one
# test passed (every test skipped or none collected: NOT RUN); each benchmark with every
# target it records met (target_met) and, where it records one, its error within the
# tolerance it records (fused-scores, cuda-graph); the runner harness with its negative
# control failing. Stage helpers: bench/gpu_stages.sh.
# Writes OUTDIR/{env.json, tests.txt, tests.xml, repack-gpu.json, repack-gpu-variants.json,
# scores-gpu.json, fused-scores-gpu.json, cuda-graph.json, runner-harness.json, summary.txt}.
# vLLM's engine tests need vLLM 0.32's CUDA build: bench/gpu_engine_check.sh, elsewhere.
set -uo pipefail
# shellcheck source=bench/gpu_stages.sh
source "$(dirname "$0")/gpu_stages.sh"
begin "${1:?usage: bench/gpu_check.sh OUTDIR}"
# typer only decorates the benchmark CLIs; a stub keeps them importable where it is missing.
if ! "$PY" -c "import typer" 2>/dev/null; then
  STUB="$(mktemp -d)"
  printf 'def Option(*a, **k):\n    return None\ndef echo(m, err=False):\n    print(m, flush=True)\n' > "$STUB/typer.py"
  export PYTHONPATH="$PYTHONPATH:$STUB"
fi

stage env 30 - - "$PY" - "$OUT/env.json" <<'PY'
import importlib.metadata, json, subprocess, sys, torch, triton
try:
    vllm_version = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    vllm_version = None
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except OSError:
    smi = None
json.dump({"torch": torch.__version__, "triton": triton.__version__, "vllm": vllm_version,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "nvidia_smi": smi}, open(sys.argv[1], "w"), indent=1)
print(open(sys.argv[1]).read())
PY
STAGES="kernel-tests repack repack-variants scores fused-scores cuda-graph runner-harness"
if ! "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  for name in $STAGES; do not_run "$name" "no CUDA device visible to PyTorch (or torch/triton missing)"; done
  finish
fi

if "$PY" -c "import pytest" 2>/dev/null; then
  # every vLLM KVCacheLayout; bf16, fp16, fp8; side-stream repack
  # passes with at least one test passed and none failed (skips: the CPU-only tests)
  pytest_stage kernel-tests 125 kernel-tests "$OUT/tests" tests/kernels
else
  echo "pytest missing" > "$OUT/tests.txt"
  not_run kernel-tests "pytest is not installed (carry its wheel)"
fi

stage repack 70 repack "$OUT/repack-gpu.json" "$PY" -c "
from pathlib import Path; from bench.repack import cli
cli(json_path=Path('$OUT/repack-gpu.json'), shapes='smollm2,llama8b', block_sizes='16,32,128',
    patterns='compact50,compact80,trickle,trickle1,scattered', reps=10, dtype='bfloat16',
    device='cuda', cold=True, kv_cache_layout='LBNHC', threads=None)"

# llama8b: BLHNC bf16, LBNHC fp8 stored as uint8
stage repack-variants 45 repack-variants "$OUT/repack-gpu-variants.json" "$PY" -c "
import json; from pathlib import Path; from bench.repack import cli
runs = []
for layout, dtype in (('BLHNC', 'bfloat16'), ('LBNHC', 'uint8')):  # fp8 KV is stored as uint8
    path = Path('$OUT/repack-variant.json')
    cli(json_path=path, shapes='llama8b', block_sizes='16', patterns='compact50,compact80,scattered',
        reps=10, dtype=dtype, device='cuda', cold=True, kv_cache_layout=layout, threads=None)
    runs.append(json.loads(path.read_text()))
path.unlink()
Path('$OUT/repack-gpu-variants.json').write_text(json.dumps(runs, indent=1))"

# batched, vs SDPA of the same batch
stage scores 80 scores "$OUT/scores-gpu.json" "$PY" -c "
from pathlib import Path; from bench.scores import cli
cli(json_path=Path('$OUT/scores-gpu.json'), shapes='smollm2,llama8b', batches='1,32,128',
    seq_lens='1024,4096,16384', q_lens='1,32', reps=15, dtype='bfloat16', device='cuda')"

# every scored layer's decode rows in one launch, vs the per-layer kernels and SDPA decode
stage fused-scores 40 fused-scores "$OUT/fused-scores-gpu.json" "$PY" -c "
from pathlib import Path; from bench.fused_scores import cli
cli(json_path=Path('$OUT/fused-scores-gpu.json'), shapes='llama8b', batches='1,32,128',
    seq_lens='4096,16384', layers=32, reps=10, dtype='bfloat16', device='cuda')"

# a decode step captured in a CUDA graph; repack between replays; replay equals eager
stage cuda-graph 40 cuda-graph "$OUT/cuda-graph.json" "$PY" - "$OUT/cuda-graph.json" <<'PY'
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
stage runner-harness 45 runner-harness "$OUT/runner-harness.json" "$PY" -m bench.runner_harness "$OUT/runner-harness.json"

finish
