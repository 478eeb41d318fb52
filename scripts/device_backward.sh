#!/usr/bin/env bash
# One device run for the Hopper backward kernel: build (scripts/device_kernel.sh's build stage, with its
# ptxas summary), a smoke run that stops the run early on a hang, tests/gpu/test_backward.py,
# compute-sanitizer (memcheck, racecheck, synccheck) on small calls, and the backward benchmark.
# Logs go to $OUT.
#
#   bash scripts/device_backward.sh                        # every stage
#   STAGES=build,smoke,test bash scripts/device_backward.sh
#   BENCH_ARGS="--seqlens 2048 8192 --head-dims 128" STAGES=bench bash scripts/device_backward.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fa2_backward_out}
mkdir -p "$OUT"
STAGES=${STAGES:-build,smoke,test,sanitize,bench}
BENCH_ARGS=${BENCH_ARGS:---quick}
export PYTHONUNBUFFERED=1
has() { [[ ",$STAGES," == *",$1,"* ]]; }
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

if has build; then
  OUT="$OUT/build" STAGES=build bash scripts/device_kernel.sh
  note "build: $(grep -c 'spill' "$OUT/build/build.log") ptxas reports, \
$(grep -E 'bytes spill stores' "$OUT/build/build.log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads') with spills"
fi
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD}

if has smoke; then  # every variant once, small: a hang here would cost the rest of the run
  timeout 120 python3 scripts/backward_sanitize.py > "$OUT/smoke.log" 2>&1
  rc=$?
  note "smoke: rc=$rc"; tail -30 "$OUT/smoke.log" | tee -a "$SUMMARY"
  [ $rc -ne 0 ] && exit 1
fi
if has test; then
  timeout 1200 python3 -m pytest -q -rfE -p no:cacheprovider --timeout=180 tests/gpu/test_backward.py \
    > "$OUT/test_backward.log" 2>&1
  note "test_backward: rc=$? | $(tail -1 "$OUT/test_backward.log")"
fi
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    timeout 900 compute-sanitizer --tool $tool --error-exitcode 1 python3 scripts/backward_sanitize.py \
      > "$OUT/sanitize_$tool.log" 2>&1
    note "compute-sanitizer $tool: rc=$? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
  done
fi
if has bench; then
  timeout 1800 python3 -m fa2_inductor.bench --backward $BENCH_ARGS --json "$OUT/backward.json" \
    --plot "$OUT/backward.png" > "$OUT/bench.log" 2>&1
  note "bench --backward: rc=$?"; cat "$OUT/bench.log" | tee -a "$SUMMARY"
fi
