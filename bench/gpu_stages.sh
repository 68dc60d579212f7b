# Stage helpers of bench/gpu_check.sh and bench/gpu_engine_check.sh; sourced, not run.
#
# begin OUTDIR [OUTPUT...]: create OUTDIR, remove the OUTPUT files listed there (no stale
#   output survives a run), set OUT (its absolute path), ROOT (the checkout, put first on
#   PYTHONPATH and made the working directory), PY ($PYTHON or python3), start an empty
#   OUT/summary.txt and `failed=0`. DEADLINE_S, where set (gpu_check.sh: 450), bounds the
#   whole check, counted from the shell's start ($SECONDS): each stage runs under the lesser
#   of its limit and what is left (a stage cut short says so; one with no time left is NOT
#   RUN). Unset or 0: each stage's own limit alone.
# stage NAME LIMIT_S KIND DOCUMENT COMMAND...: run COMMAND under LIMIT_S seconds. With a
#   KIND other than "-", the verdict `python -m bench.gpu_verdict KIND DOCUMENT` decides
#   in the time the command left of LIMIT_S (DOCUMENT is removed first, so a stale one
#   counts for nothing): the stage passes only when the command exited 0 and the verdict
#   passed, whose one-line reason the summary shows. A test run in which no test ran is
#   NOT RUN. A command killed before its limit (exit 137: SIGKILL, e.g. out of memory) is
#   reported as killed, not as timed out.
# pytest_stage NAME LIMIT_S KIND REPORT PYTEST_ARGS...: a stage running pytest on
#   PYTEST_ARGS, its output in REPORT.txt (the last lines shown), its JUnit XML in
#   REPORT.xml, judged by KIND.
# not_run NAME REASON: a stage that could not run.
# finish: print the summary; exit 0 only when every stage passed.
# Every stage adds one line to OUT/summary.txt: NAME, PASS / FAIL / NOT RUN, and why.

begin() {
  ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  mkdir -p "$1"
  OUT="$(cd "$1" && pwd)"
  shift
  local output
  for output in "$@"; do rm -f "$OUT/$output"; done
  PY="${PYTHON:-python3}"
  DEADLINE_S="${DEADLINE_S:-0}"
  case "$DEADLINE_S" in
    *[!0-9]*) echo "DEADLINE_S must be a whole number of seconds, not '$DEADLINE_S'" >&2; exit 2 ;;
  esac
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  unset TRITON_INTERPRET PYTEST_ADDOPTS
  cd "$ROOT" || exit 1
  : > "$OUT/summary.txt"
  failed=0
}

# result NAME STATE DETAIL: one summary line; any state but PASS fails the check.
result() {
  printf '%-22s %-8s %s\n' "$1" "$2" "$3" | tee -a "$OUT/summary.txt"
  [ "$2" = PASS ] || failed=1
}

not_run() {
  result "$1" "NOT RUN" "$2"
}

stage() {
  local name="$1" limit="$2" kind="$3" document="$4"
  shift 4
  [ "$document" = - ] || rm -f "$document"
  local left=$((DEADLINE_S - SECONDS)) cut=""
  if [ "$DEADLINE_S" -gt 0 ] && [ "$left" -lt 1 ]; then
    not_run "$name" "not started: the check's ${DEADLINE_S}s deadline was reached"
    return
  fi
  if [ "$DEADLINE_S" -gt 0 ] && [ "$left" -lt "$limit" ]; then
    cut=" (cut from ${limit}s by the check's ${DEADLINE_S}s deadline)"
    limit=$left
  fi
  echo "== $name (limit ${limit}s$cut)"
  local started=$SECONDS rc took reason="" verdict=0
  timeout --kill-after=5 "$limit" "$@"
  rc=$?
  took=$((SECONDS - started))
  if { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ "$took" -ge "$limit" ]; then
    result "$name" FAIL "timed out after ${limit}s$cut"
    return
  fi
  if [ $rc -eq 137 ]; then
    result "$name" FAIL "killed (exit 137: SIGKILL, out of memory?) after ${took}s"
    return
  fi
  if [ "$kind" != - ] && { [ $rc -eq 0 ] || [ -e "$document" ]; }; then
    if [ $((limit - took)) -lt 1 ]; then
      result "$name" FAIL "no time left in ${limit}s$cut to check $(basename "$document")"
      return
    fi
    reason="$(timeout $((limit - took)) "$PY" -m bench.gpu_verdict "$kind" "$document" 2>&1)"
    verdict=$?
    reason="$(printf '%s\n' "$reason" | tail -1)"
  fi
  if [ $verdict -eq 3 ]; then
    not_run "$name" "$reason"
  elif [ $rc -ne 0 ] && [ $verdict -ne 0 ]; then
    result "$name" FAIL "exit status $rc after ${took}s${reason:+: $reason}"
  elif [ $rc -ne 0 ]; then
    result "$name" FAIL "exit status $rc after ${took}s"
  elif [ $verdict -ne 0 ]; then
    result "$name" FAIL "${reason:-the check of $(basename "$document") exited $verdict}"
  else
    result "$name" PASS "${took}s${reason:+; $reason}"
  fi
}

pytest_stage() {
  local name="$1" limit="$2" kind="$3" report="$4"
  shift 4
  stage "$name" "$limit" "$kind" "$report.xml" bash -c '
    report="$1"
    shift
    "$@" > "$report.txt" 2>&1
    rc=$?
    tail -3 "$report.txt"
    exit $rc' _ "$report" "$PY" -m pytest -q -rs --tb=short \
    -p no:cacheprovider -o junit_logging=no --junitxml="$report.xml" "$@"
}

finish() {
  echo "== summary (results in $OUT)"
  cat "$OUT/summary.txt"
  exit "$failed"
}
