#!/usr/bin/env bash
# Tile / schedule sweep on a Hopper machine: each variant is a set of -D flags for the macros in
# csrc/fa2/tile_config.h, bwd_traits.hpp and decode.hpp (FA2_PINGPONG, FA2_TILE_N_HDIM192,
# FA2_BWD_STAGED_DQ_HDIM256, FA2_DECODE_COL_SPLIT, ...). Every variant is built (bf16 only) in its own copy
# of the tree, all in parallel, then only fa2_inductor is timed per variant, one after the other, with
# python -m fa2_inductor.bench (JSON, plot and log per variant in RESULTS_DIR).
#
#   scripts/tile_sweep.sh RESULTS_DIR base: pp:-DFA2_PINGPONG=1 wideN:-DFA2_TILE_N_HDIM128=176
#   SWEEP_BENCH_ARGS="--seqlens 2048 8192 --head-dims 128" scripts/tile_sweep.sh ...   (default: 2k, 8k, all head dims)
#
#   FA2_INDUCTOR_HEAD_DIMS=192,256 SWEEP_BENCH_ARGS="--impls fa2_inductor sdpa_cudnn --head-dims 192 256" \
#     scripts/tile_sweep.sh ...   (only those head dims built; cuDNN timed beside each variant: ratios compare)
#   SWEEP_BENCH_ARGS="--backward --head-dims 256" scripts/tile_sweep.sh ...   (the training rows instead)
#
# "+" separates several flags of one variant (name:-DA=1+-DB=2). SWEEP_JOBS compile jobs per variant
# (default 4). CUTLASS headers are found as for the normal build (see cutlass/README.md).
set -uo pipefail
[[ $# -ge 2 ]] || { sed -n '2,16p' "$0"; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1" && RESULTS=$(cd "$1" && pwd); shift
PY=${PYTHON:-$(command -v python || command -v python3)}
BENCH_ARGS=${SWEEP_BENCH_ARGS:---seqlens 2048 8192}
pids=()
for spec in "$@"; do
  name=${spec%%:*}; flags=${spec#*:}; flags=${flags//+/ }
  dir=$RESULTS/tree_$name
  rm -rf "$dir"; mkdir -p "$dir"
  cp -r "$ROOT"/{setup.py,pyproject.toml,csrc,fa2_inductor,cutlass} "$dir"/
  rm -f "$dir"/fa2_inductor/_C*.so
  ( cd "$dir" && NVCC_APPEND_FLAGS="$flags" FA2_INDUCTOR_BUILD_CUDA=1 FA2_INDUCTOR_DTYPES=bf16 MAX_JOBS=${SWEEP_JOBS:-4} \
      "$PY" setup.py build_ext --inplace > "$RESULTS/build_$name.log" 2>&1
    echo "built $name ($flags): rc=$?; $("$PY" "$ROOT/scripts/ptxas_report.py" "$RESULTS/build_$name.log" | head -1)" ) &
  pids+=($!)
done
wait "${pids[@]}"
for spec in "$@"; do
  name=${spec%%:*}
  echo "=== $name"
  # shellcheck disable=SC2086  (BENCH_ARGS is a list of flags)
  ( cd "$RESULTS/tree_$name" && PYTHONPATH=$PWD "$PY" -m fa2_inductor.bench --impls fa2_inductor --dtypes bf16 $BENCH_ARGS \
      --json "$RESULTS/sweep_$name.json" --plot "$RESULTS/sweep_$name.png" > "$RESULTS/sweep_$name.log" 2>&1
    grep -E "^ +[0-9]+ " "$RESULTS/sweep_$name.log" )
done
