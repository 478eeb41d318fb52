#!/usr/bin/env bash
# Builds, tests, sanitises and benchmarks fa2_inductor on a machine with a Hopper GPU (sm_90a) and this
# repository, writing every log and JSON into one results folder and ending with a summary table.
#
#   scripts/hopper_check.sh [RESULTS_DIR]                   default ./hopper_results
#   STAGES=build,gpu-tests,bench scripts/hopper_check.sh    a subset (they always run in the order below)
#   BUDGET_S=900 scripts/hopper_check.sh                    total time: a slow stage cuts the later ones
#
# Stages (default: all but demo and ncu):
#   env         GPU, driver, Python, torch, nvcc, setuptools, CUTLASS, test dependencies -> env.txt
#   build       the README's build, FA2_INDUCTOR_BUILD_CUDA=1 python -m pip install -v --no-build-isolation -e .
#               -> build.log (with the -Xptxas=-v report: pip builds in a fresh temporary folder, so every
#               kernel is compiled and reported), ptxas.txt (registers, spills, wgmma serialisation), info.txt
#   gpu-tests   python -m pytest tests/gpu, each test cut after TEST_TIMEOUT_S (a hang fails that test,
#               the stacks go to gpu_tests_hangs.txt, the run resumes after it) -> gpu_tests.log
#   sanitize    compute-sanitizer memcheck, racecheck and synccheck (barrier misuse) on scripts/sanitize_cases.py
#               (forward) and scripts/backward_sanitize.py -> *_memcheck.log, *_racecheck.log, *_synccheck.log
#   bench       python -m fa2_inductor.bench --json bench.json --plot bench.png (BENCH_ARGS adds options)
#   mask-bench  python -m fa2_inductor.bench --masks --json mask_bench.json
#   train-bench python -m fa2_inductor.bench --backward --json backward.json (forward+backward, backward alone)
#   masked-train python -m fa2_inductor.bench --backward --masks --json masked_backward.json (masked forward+backward
#               vs FlexAttention block masks)
#   overhead    python -m fa2_inductor.bench --overhead --json overhead.json (µs per call next to SDPA)
#   score-mods  python -m fa2_inductor.bench --score-mods --json score_mods.json (soft-capping and sinks)
#   decode      python -m fa2_inductor.bench --decode --json decode.json (decode steps vs every SDPA backend)
#   e2e         python -m fa2_inductor.bench_e2e --json e2e.json --profile e2e_profile.txt (E2E_ARGS adds options,
#               quotes allowed)
#   e2e-train   python -m fa2_inductor.bench_e2e --phases train train_padded --json e2e_train.json (a training
#               step of the same model, with and without padding; E2E_ARGS applies too)
#   zoo         python -m fa2_inductor.bench_e2e --zoo --json zoo.json (real model shapes with attention_mask)
#   suite       the README's tests (python -m pytest -q tests, one process: the hang guard follows one) with the same per-test cut -> suite.log
#   demo        python -m fa2_inductor.demo -> demo.log
#   ncu         Nsight Compute on cells beside cuDNN (scripts/attention_cell.py): NCU_CELLS, default
#               "64:512:causal 64:2048:causal 128:1024:causal 192:2048:full 128:2048:full:backward" (head
#               dim:seqlen:causal or full, then :backward for the main backward kernels instead of the forward's)
#               -> ncu_d<D>_s<S>_<causal|full>[_backward].txt (speed of light, memory, warp states, scheduler,
#               occupancy)
#   report      results.md from this folder's JSON (python -m fa2_inductor.bench.results)
# Every stage's status, exit code and wall time go to summary.md and summary.json; a failing stage never
# stops the run. To update docs/results.md, copy the JSON files into docs/measurements/ and regenerate
# (see docs/results.md).
#
# Needs a CUDA build of torch >= 2.11, nvcc (CUDA 12.3 or newer, the major version of torch.version.cuda),
# setuptools >= 77, the CUTLASS headers (pip install nvidia-cutlass==4.2.0.0, or CUTLASS_DIR=<a CUTLASS
# checkout>; see cutlass/README.md) and, for the tests, pytest, hypothesis and transformers
# (pip install -e ".[test]"). The script downloads nothing. Other settings: PYTHON (default: python, else
# python3), TEST_TIMEOUT_S (default 300), MAX_JOBS and the FA2_INDUCTOR_* build switches of the README.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "${1:-./hopper_results}" || exit 2
RESULTS=$(cd "${1:-./hopper_results}" && pwd)
cd "$ROOT"
PY=${PYTHON:-$(command -v python || command -v python3)}
[[ -n $PY ]] || { echo "no python on PATH (set PYTHON)"; exit 2; }
STAGES=${STAGES:-env,build,gpu-tests,sanitize,bench,mask-bench,train-bench,masked-train,overhead,score-mods,decode,e2e,e2e-train,zoo,suite,report}
BUDGET_S=${BUDGET_S:-3600}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-300}
START=$(date +%s)
export PYTHONUNBUFFERED=1
: > "$RESULTS/stages.jsonl"

wanted() { [[ ",$STAGES," == *",$1,"* ]]; }
seconds_left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# The stage under way may run until DEADLINE; its function sets RESULT (one line for the summary).
until_deadline() { local left=$(( DEADLINE - $(date +%s) )); echo $(( left > 1 ? left : 1 )); }  # timeout 0 = none
limited() { timeout --kill-after=20 "$(until_deadline)" "$@"; }

record() {  # STAGE STATUS RC WALL RESULT -> one line of stages.jsonl
  "$PY" -c 'import json, sys; values = [int(v) if v.isdigit() else v for v in sys.argv[1:]]
print(json.dumps(dict(zip(("stage", "status", "rc", "wall_s", "result"), values))))' "$@" >> "$RESULTS/stages.jsonl"
  printf '== %s: %s (rc %s, %s s) %s\n' "$@"
}

run_stage() {  # NAME CAP_S FUNCTION
  local name=$1 cap=$2 fn=$3
  wanted "$name" || return 0
  local left; left=$(seconds_left)
  (( left < cap )) && cap=$left
  if (( cap < 30 )); then record "$name" skipped - 0 "time budget (BUDGET_S=$BUDGET_S) spent"; return 0; fi
  echo "== $name (up to ${cap} s)"
  DEADLINE=$(( $(date +%s) + cap )); RESULT=""
  local t0; t0=$(date +%s)
  "$fn"
  local rc=$? status=ok
  if (( rc == 124 || rc == 137 )); then status=timeout; elif (( rc != 0 )); then status=FAILED; fi
  record "$name" "$status" "$rc" $(( $(date +%s) - t0 )) "$RESULT"
}

# ---------------------------------------------------------------- stages

stage_env() {
  {
    date -u +"%Y-%m-%d %H:%M:%S UTC"; uname -srm
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc: not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
    echo "compute-sanitizer: $(command -v compute-sanitizer || echo "not on PATH")"
    "$PY" - <<'PY'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "setuptools", "pytest", "hypothesis", "transformers", "matplotlib", "cutlass_library"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "installed"))
    except ImportError:
        print(name, "MISSING")
import torch
print("torch CUDA", torch.version.cuda, "| GPU", torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
      "| capability", torch.cuda.get_device_capability() if torch.cuda.is_available() else "-")
PY
  } > "$RESULTS/env.txt" 2>&1
  local problems=() gpu
  gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -1)
  [[ -n $gpu ]] || { gpu="no GPU (nvidia-smi)"; problems+=("nvidia-smi shows no GPU"); }
  [[ -z $gpu || $gpu == *", 9.0" || $gpu == no* ]] || problems+=("not a Hopper GPU: the kernel is sm_90a only")
  grep -q "^torch MISSING" "$RESULTS/env.txt" && problems+=("torch missing")
  grep -q "^torch CUDA None" "$RESULTS/env.txt" && problems+=("torch has no CUDA")
  grep -qE "^(pytest|hypothesis|transformers) MISSING" "$RESULTS/env.txt" && problems+=("test dependencies missing: pip install -e '.[test]'")
  "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null \
    || problems+=("setuptools < 77: pip install 'setuptools>=77'")
  [[ -z ${CUTLASS_DIR:-} && ! -d cutlass/include ]] && grep -q "^cutlass_library MISSING" "$RESULTS/env.txt" \
    && problems+=("CUTLASS headers: pip install nvidia-cutlass==4.2.0.0 or CUTLASS_DIR=<checkout>")
  RESULT="$gpu; $(grep -m1 '^torch ' "$RESULTS/env.txt") (CUDA $(grep -m1 '^torch CUDA' "$RESULTS/env.txt" | cut -d' ' -f3))"
  (( ${#problems[@]} == 0 )) && return 0
  RESULT+="; $(IFS=';'; echo "${problems[*]}")"
  return 1
}

stage_build() {
  FA2_INDUCTOR_BUILD_CUDA=1 limited "$PY" -m pip install -v --no-build-isolation --no-deps -e . > "$RESULTS/build.log" 2>&1
  local rc=$?
  "$PY" scripts/ptxas_report.py "$RESULTS/build.log" > "$RESULTS/ptxas.txt" 2>&1
  "$PY" -m fa2_inductor.info > "$RESULTS/info.txt" 2>&1
  RESULT="$(head -1 "$RESULTS/ptxas.txt"); $(grep -m1 '^kernel:' "$RESULTS/info.txt")"
  if grep -q "CUTLASS headers not found" "$RESULTS/build.log"; then
    RESULT="CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0, or CUTLASS_DIR=<a CUTLASS checkout>"
  elif (( rc != 0 )); then
    RESULT="build failed: $(grep -m1 -iE 'fatal error|error:|configuration error' "$RESULTS/build.log" | sed 's/^ *//' | cut -c1-200)"
  fi
  (( rc != 0 )) && return $rc
  grep -q "^kernel: loaded" "$RESULTS/info.txt" || return 1
  grep -qE " 0 with spills, 0 wgmma serialisation" "$RESULTS/ptxas.txt" || return 1
}

# guarded_pytest NAME PYTEST_ARGS...: pytest under the hang guard of tests/conftest.py. A test that runs past
# TEST_TIMEOUT_S ends the process; it is counted as hung and pytest starts again after it.
guarded_pytest() {
  local name=$1; shift
  local progress="$RESULTS/.${name}_progress" log="$RESULTS/$name.log" rc=0 attempt hung
  rm -rf "$progress"; mkdir -p "$progress"; : > "$log"
  for attempt in $(seq 1 50); do
    (( $(until_deadline) < 10 )) && { rc=124; break; }
    FA2_INDUCTOR_TEST_TIMEOUT_S=$TEST_TIMEOUT_S FA2_INDUCTOR_TEST_PROGRESS=$progress \
      limited "$PY" -m pytest -rfE -p no:cacheprovider "$@" >> "$log" 2>&1
    rc=$?
    [[ -f $progress/running ]] || break  # pytest ended between tests: done
    hung=$(cat "$progress/running"); rm -f "$progress/running"
    (( rc == 124 || rc == 137 )) && { RESULT_CUT=" (cut by the time limit in $hung)"; break; }
    echo "$hung" >> "$progress/hung"
    { echo "=== $hung: no result after ${TEST_TIMEOUT_S} s"; cat "$progress/hang_stacks.txt"; } >> "$RESULTS/${name}_hangs.txt"
    echo "HUNG after ${TEST_TIMEOUT_S} s: $hung (resuming after it)" >> "$log"
  done
  local passed failed skipped hung_count
  passed=$(grep -c "^passed" "$progress/finished" 2>/dev/null); failed=$(grep -c "^failed" "$progress/finished" 2>/dev/null)
  skipped=$(grep -c "^skipped" "$progress/finished" 2>/dev/null); hung_count=$(wc -l < "$progress/hung" 2>/dev/null || echo 0)
  RESULT="${passed:-0} passed, ${failed:-0} failed, ${hung_count:-0} hung, ${skipped:-0} skipped${RESULT_CUT:-}"
  [[ -s $progress/finished ]] || RESULT="pytest: $(grep -E '^=+ .* in [0-9.]+s' "$log" | tail -1 | tr -d '=' | xargs)"
  grep "^failed" "$progress/finished" 2>/dev/null | cut -f2 | head -20 | sed 's/^/FAILED /' >> "$RESULTS/failed_tests.txt"
  sed 's/^/HUNG /' "$progress/hung" 2>/dev/null >> "$RESULTS/failed_tests.txt"
  RESULT_CUT=""
  (( rc == 124 || rc == 137 )) && return $rc
  (( ${failed:-0} + ${hung_count:-0} > 0 )) && return 1
  (( rc == 5 )) && return 0  # nothing collected (e.g. every test deselected by a resume)
  return $rc
}

stage_gpu_tests() { guarded_pytest gpu_tests tests/gpu; }
stage_suite() { guarded_pytest suite -q tests; }

stage_sanitize() {
  local sanitizer; sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  if [[ ! -x $sanitizer ]]; then RESULT="compute-sanitizer not found (it comes with the CUDA toolkit, in its bin/)"; return 1; fi
  local tool cases rc=0 parts=()
  for cases in sanitize_cases backward_sanitize; do  # the forward's calls, then the backward's
    for tool in memcheck racecheck synccheck; do
      local log="$RESULTS/${cases}_$tool.log"
      limited "$sanitizer" --tool "$tool" --print-limit 50 --error-exitcode 3 "$PY" "scripts/$cases.py" > "$log" 2>&1 || rc=$?
      parts+=("$cases $tool: $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1 | sed 's/^=* *//')")
    done
  done
  RESULT="$(IFS=';'; echo "${parts[*]}")"
  return $rc
}

last_line() { tail -1 "$1" | cut -c1-240; }  # a failed command's own last word

stage_bench() {
  local -a extra; eval "extra=(${BENCH_ARGS:-})"
  limited "$PY" -m fa2_inductor.bench --json "$RESULTS/bench.json" --plot "$RESULTS/bench.png" "${extra[@]}" \
    > "$RESULTS/bench.log" 2>&1
  local rc=$?
  RESULT="$(grep -E 'cells in' "$RESULTS/bench.log" | tail -1 | cut -d';' -f1); WRONG or error cells: $(grep -cE ' (WRONG|error) ' "$RESULTS/bench.log"); $(grep -E '^fa2/cudnn: ' "$RESULTS/bench.log" | tail -1)"
  (( rc == 0 )) || RESULT=$(last_line "$RESULTS/bench.log")
  return $rc
}

stage_mask_bench() {
  limited "$PY" -m fa2_inductor.bench --masks --json "$RESULTS/mask_bench.json" > "$RESULTS/mask_bench.log" 2>&1
  local rc=$?
  RESULT="$(grep -c '| x' "$RESULTS/mask_bench.log") rows timed; $(grep -cE 'WRONG|refused the mask' "$RESULTS/mask_bench.log") WRONG or refused"
  (( rc == 0 )) || RESULT+="; $(last_line "$RESULTS/mask_bench.log")"
  return $rc
}

# A benchmark mode of python -m fa2_inductor.bench into NAME.json and NAME.log: stage_bench_mode NAME FLAG...
stage_bench_mode() {
  limited "$PY" -m fa2_inductor.bench "${@:2}" --json "$RESULTS/$1.json" > "$RESULTS/$1.log" 2>&1
  local rc=$?
  RESULT=$(last_line "$RESULTS/$1.log")
  return $rc
}
stage_train_bench() { stage_bench_mode backward --backward; }
stage_masked_train() { stage_bench_mode masked_backward --backward --masks; }
stage_overhead() { stage_bench_mode overhead --overhead; }
stage_score_mods() { stage_bench_mode score_mods --score-mods; }
stage_decode() { stage_bench_mode decode --decode; }

stage_zoo() {
  limited "$PY" -m fa2_inductor.bench_e2e --zoo --json "$RESULTS/zoo.json" --plot "$RESULTS/zoo.png" \
    > "$RESULTS/zoo.log" 2>&1
  local rc=$?
  RESULT=$(last_line "$RESULTS/zoo.log")
  return $rc
}

# python -m fa2_inductor.bench_e2e into NAME.json and NAME.log, E2E_ARGS after the options: stage_e2e_run NAME OPTION...
stage_e2e_run() {
  local -a extra; eval "extra=(${E2E_ARGS:-})"
  limited "$PY" -m fa2_inductor.bench_e2e "${@:2}" --json "$RESULTS/$1.json" "${extra[@]}" > "$RESULTS/$1.log" 2>&1
  local rc=$?
  RESULT=$("$PY" - "$RESULTS/$1.json" 2>/dev/null <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))["results"]
failed = [r for r in results if r["error"]]
first = f"; first failure: {failed[0]['variant']}: {failed[0]['error'][:100]}" if failed else ""
print(f"{len(results) - len(failed)} of {len(results)} variant runs timed{first}")
PY
)
  [[ -n $RESULT ]] || RESULT=$(last_line "$RESULTS/$1.log")
  return $rc
}
stage_e2e() { stage_e2e_run e2e --profile "$RESULTS/e2e_profile.txt"; }
stage_e2e_train() { stage_e2e_run e2e_train --phases train train_padded; }

stage_ncu() {
  local ncu; ncu=$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")
  if [[ ! -x $ncu ]]; then RESULT="ncu not found (Nsight Compute comes with the CUDA toolkit, in its bin/)"; return 1; fi
  local cell head_dim seqlen mode direction kernels name rc=0 done=0
  for cell in ${NCU_CELLS:-64:512:causal 64:2048:causal 128:1024:causal 192:2048:full 128:2048:full:backward}; do
    IFS=: read -r head_dim seqlen mode direction <<< "$cell"
    local -a flags=(--head-dim "$head_dim" --seqlen "$seqlen")
    [[ $mode == causal ]] && flags+=(--causal)
    kernels='fwd_kernel|fprop' name="ncu_d${head_dim}_s${seqlen}_$mode"
    if [[ $direction == backward ]]; then
      flags+=(--backward) kernels='bwd_kernel_sm90|bprop' name+=_backward
    fi
    # Our last two calls of four and cuDNN's first two; unlocked clocks, as the benchmark runs.
    limited "$ncu" --clock-control none --kernel-name regex:"$kernels" --launch-skip 2 --launch-count 4 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
      "$PY" scripts/attention_cell.py "${flags[@]}" > "$RESULTS/$name.txt" 2>&1 \
      && done=$((done + 1)) || rc=$?
  done
  RESULT="$done cells profiled (ncu_*.txt)"
  return $rc
}

stage_demo() {
  limited "$PY" -m fa2_inductor.demo > "$RESULTS/demo.log" 2>&1
  local rc=$?
  RESULT=$(last_line "$RESULTS/demo.log")
  return $rc
}

write_summary_json() {
  "$PY" - "$RESULTS" <<'PY'
import json, sys
from pathlib import Path
results = Path(sys.argv[1])
stages = [json.loads(line) for line in (results / "stages.jsonl").read_text().splitlines() if line.strip()]
try:
    import torch
    from fa2_inductor.bench import environment
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
except Exception as exc:  # the summary must be written even where torch or the package is broken
    env = {"device": f"unknown ({type(exc).__name__})"}
(results / "summary.json").write_text(json.dumps({"environment": env, "stages": stages}, indent=1))
PY
}

stage_report() {
  write_summary_json
  local files=()
  for f in summary.json bench.json mask_bench.json backward.json masked_backward.json overhead.json score_mods.json decode.json e2e.json e2e_train.json zoo.json; do [[ -f $RESULTS/$f ]] && files+=("$RESULTS/$f"); done
  limited "$PY" -m fa2_inductor.bench.results "${files[@]}" -o "$RESULTS/results.md" > "$RESULTS/report.log" 2>&1
  local rc=$?
  RESULT="results.md from ${#files[@]} JSON files"
  return $rc
}

# ---------------------------------------------------------------- the run

: > "$RESULTS/failed_tests.txt"
echo "fa2_inductor check: results in $RESULTS, stages $STAGES, budget ${BUDGET_S} s"
run_stage env 120 stage_env
run_stage build 1200 stage_build
run_stage gpu-tests 1200 stage_gpu_tests
run_stage sanitize 900 stage_sanitize
run_stage bench 900 stage_bench
run_stage mask-bench 300 stage_mask_bench
run_stage train-bench 900 stage_train_bench
run_stage masked-train 600 stage_masked_train
run_stage overhead 120 stage_overhead
run_stage score-mods 300 stage_score_mods
run_stage decode 300 stage_decode
run_stage e2e 900 stage_e2e
run_stage e2e-train 1200 stage_e2e_train
run_stage zoo 1200 stage_zoo
run_stage suite 2400 stage_suite
run_stage demo 300 stage_demo
run_stage ncu 600 stage_ncu
run_stage report 120 stage_report
write_summary_json

{
  echo "# fa2_inductor on $(hostname): $(date -u +'%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - START )) s"
  echo
  echo "| stage | status | rc | wall s | result |"
  echo "|---|---|---|---|---|"
  "$PY" - "$RESULTS/stages.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    stage = json.loads(line)
    print("| " + " | ".join(str(stage[key]) for key in ("stage", "status", "rc", "wall_s", "result")) + " |")
PY
  [[ -s $RESULTS/failed_tests.txt ]] && { echo; echo "Failed or hung tests:"; sed 's/^/- /' "$RESULTS/failed_tests.txt"; }
} > "$RESULTS/summary.md"
echo; cat "$RESULTS/summary.md"
