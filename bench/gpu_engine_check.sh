#!/usr/bin/env bash
# Engine check for a machine with an NVIDIA GPU and vLLM 0.32's CUDA build (and pytest,
# transformers, the repository's test dependencies). Usage:
#   bench/gpu_engine_check.sh OUTDIR [VARIANT...]
# VARIANT: flash_attn, flashinfer, triton_attn, flashinfer_fp8 (default: all four). Each
# variant is one stage with a 540 s limit, so one variant per command fits a 10-minute
# device command. Runs the engine tests (tests/workers, engine builders taking bf16,
# head_dim 128 and piecewise CUDA graphs from the device) with VTOKEN_UNVERIFIED_CUDA=1,
# and the no-host-stall test. Every stage prints PASS, FAIL or NOT RUN; the exit status is
# 0 only when every stage passed: without vLLM's CUDA build every stage is NOT RUN and the
# check fails.
set -uo pipefail
OUT="${1:?usage: bench/gpu_engine_check.sh OUTDIR [VARIANT...]}"
shift
VARIANTS="${*:-flash_attn flashinfer triton_attn flashinfer_fp8}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export VTOKEN_UNVERIFIED_CUDA=1 VLLM_USE_V2_MODEL_RUNNER=0
unset TRITON_INTERPRET
cd "$ROOT"
: > "$OUT/summary.txt"
failed=0
TESTS="tests/workers/test_engine_identity.py tests/workers/test_engine_on_demand.py
  tests/workers/test_engine_eviction.py tests/workers/test_query_capture.py
  tests/workers/test_engine_cuda_sync.py"

result() {
  printf '%-22s %-8s %s\n' "$1" "$2" "$3" | tee -a "$OUT/summary.txt"
  [ "$2" = PASS ] || failed=1
}

problem=$("$PY" - <<'PY' 2>&1
import sys
try:
    import torch
    import vllm
    from vllm.platforms import current_platform
except Exception as error:  # noqa: BLE001
    sys.exit(f"vLLM does not import: {error}")
if not vllm.__version__.startswith("0.32."):
    sys.exit(f"vLLM {vllm.__version__}, not 0.32")
if not (torch.cuda.is_available() and current_platform.is_cuda()):
    sys.exit("not vLLM's CUDA build on a visible GPU")
PY
)
if [ -n "$problem" ]; then
  for variant in $VARIANTS; do result "engine-$variant" "NOT RUN" "$(echo "$problem" | tail -1)"; done
  exit 1
fi

for variant in $VARIANTS; do
  echo "== engine tests, variant $variant (limit 540s)"
  started=$SECONDS
  case "$variant" in
    flashinfer) select="flashinfer and not fp8" ;;
    flash_attn) select="flash_attn or test_query_capture" ;;  # and the variant-free tests
    *) select="$variant" ;;
  esac
  # shellcheck disable=SC2086
  timeout --kill-after=10 540 "$PY" -m pytest -q -p no:cacheprovider -k "$select" $TESTS \
    > "$OUT/engine-$variant.txt" 2>&1
  rc=$?
  tail -3 "$OUT/engine-$variant.txt"
  took=$((SECONDS - started))
  if [ $rc -eq 0 ] && ! grep -q " skipped" "$OUT/engine-$variant.txt"; then
    result "engine-$variant" PASS "${took}s"
  elif [ $rc -eq 0 ]; then
    result "engine-$variant" FAIL "tests skipped (see engine-$variant.txt)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    result "engine-$variant" FAIL "timed out after 540s"
  else
    result "engine-$variant" FAIL "exit status $rc after ${took}s"
  fi
done
echo "== summary (results in $OUT)"
cat "$OUT/summary.txt"
exit $failed
