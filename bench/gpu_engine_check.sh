#!/usr/bin/env bash
# Engine check for a machine with an NVIDIA GPU and vLLM 0.32's CUDA build (and pytest,
# transformers, the repository's test dependencies). Usage:
#   bench/gpu_engine_check.sh OUTDIR [VARIANT...]
# VARIANT: flash_attn, flashinfer, triton_attn, flashinfer_fp8 (default: all four). Each
# variant is one stage with a 540 s limit, so one variant per command fits a 10-minute
# device command. Runs the engine tests (tests/workers, engine builders taking bf16,
# head_dim 128 and piecewise CUDA graphs from the device) with VTOKEN_UNVERIFIED_CUDA=1,
# and the no-host-stall test. Every stage prints PASS, FAIL or NOT RUN; a stage passes
# when pytest exits 0 and its JUnit XML (OUTDIR/engine-VARIANT.xml, read by
# bench/gpu_verdict.py) shows at least one test passed and none skipped (every test
# skipped or none collected: NOT RUN). The exit status is 0 only when every stage passed:
# without vLLM's CUDA build every stage is NOT RUN and the check fails. Stage helpers:
# bench/gpu_stages.sh.
set -uo pipefail
# shellcheck source=bench/gpu_stages.sh
source "$(dirname "$0")/gpu_stages.sh"
begin "${1:?usage: bench/gpu_engine_check.sh OUTDIR [VARIANT...]}"
shift
VARIANTS="${*:-flash_attn flashinfer triton_attn flashinfer_fp8}"
export VTOKEN_UNVERIFIED_CUDA=1 VLLM_USE_V2_MODEL_RUNNER=0
TESTS="tests/workers/test_engine_identity.py tests/workers/test_engine_on_demand.py
  tests/workers/test_engine_eviction.py tests/workers/test_query_capture.py
  tests/workers/test_engine_cuda_sync.py"

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
  for variant in $VARIANTS; do not_run "engine-$variant" "$(echo "$problem" | tail -1)"; done
  finish
fi

for variant in $VARIANTS; do
  case "$variant" in
    flashinfer) select="flashinfer and not fp8" ;;
    flash_attn) select="flash_attn or test_query_capture" ;;  # and the variant-free tests
    *) select="$variant" ;;
  esac
  # shellcheck disable=SC2086
  pytest_stage "engine-$variant" 540 engine-tests "$OUT/engine-$variant" -k "$select" $TESTS
done
finish
