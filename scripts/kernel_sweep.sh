#!/usr/bin/env bash
# Tile / schedule sweep on the device: builds each variant (bf16 only) in its own copy of the tree,
# all in parallel, then times only our kernel per variant (same run). Usage, from the repo root with
# CUTLASS on PYTHONPATH: scripts/kernel_sweep.sh OUTDIR name:-DA=1+-DB=2 ...  ("+" separates flags)
set -uo pipefail
OUTDIR=$1; shift
ROOT=$PWD
pids=()
for spec in "$@"; do
  name=${spec%%:*}; flags=${spec#*:}; flags=${flags//+/ }
  dir=/tmp/sweep_$name
  rm -rf "$dir"; mkdir -p "$dir"
  cp -r setup.py pyproject.toml csrc fa2_inductor scripts "$dir"/ 2>/dev/null
  [ -d cutlass ] && cp -r cutlass "$dir"/
  rm -f "$dir"/fa2_inductor/_C*.so
  ( cd "$dir" && NVCC_APPEND_FLAGS="$flags" FA2_INDUCTOR_DTYPES=bf16 MAX_JOBS=${SWEEP_JOBS:-4} \
      python3 setup.py build_ext --inplace > "$dir/build.log" 2>&1; echo "build $name rc=$?" ) &
  pids+=($!)
done
wait "${pids[@]}"
for spec in "$@"; do
  name=${spec%%:*}; flags=${spec#*:}; flags=${flags//+/ }
  dir=/tmp/sweep_$name
  echo "=== variant $name ($flags)"
  grep -E "spill|registers" "$dir/build.log" | grep -B1 -E "[1-9][0-9]* bytes spill" | head -4
  ( cd "$dir" && PYTHONPATH=/tmp/site:$dir TIMING_IMPLS=ours TIMING_DTYPES=bf16 \
      timeout 120 python3 scripts/kernel_timing.py "$OUTDIR/sweep_$name.json" ${SWEEP_SEQLENS:-2048,8192} 2>&1 | tail -13 )
done
