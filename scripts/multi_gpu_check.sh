#!/usr/bin/env bash
# The multi-GPU checks on one host with 2 or more GPUs, in one go:
#   FSDP2 (1 GPU vs 2 GPUs) and tensor parallel (2 GPUs vs 1) with the compiled tiny Llama, through torchrun;
#   the context-parallel benchmark (ring attention on the op vs SDPA under PyTorch's context parallel);
#   the rest of tests/distributed (sharding rules, ring attention on 2 GPUs).
# Logs and JSON go to RESULTS_DIR; the loss tables, per-rank rewrite counters and CP numbers are printed.
#
#   bash scripts/multi_gpu_check.sh RESULTS_DIR        (CP_ARGS="--seqs 32768 65536" to change the benchmark)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:?usage: $0 RESULTS_DIR}
mkdir -p "$RESULTS"
PYTHON=${PYTHON:-python}
# NVLink multicast is not used.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
step() {
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS
    if "$@" >"$RESULTS/$name.log" 2>&1; then
        echo "   ok ($((SECONDS - start)) s)"
    else
        echo "   FAILED ($((SECONDS - start)) s), last lines of $RESULTS/$name.log:"
        tail -n 30 "$RESULTS/$name.log" | sed 's/^/   | /'
        status=1
    fi
}
torchrun_n() { "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$@"; }

"$PYTHON" -c "import torch, fa2_inductor; print('torch', torch.__version__, '| GPUs:', torch.cuda.device_count(), '|', fa2_inductor.__version__)" | tee "$RESULTS/environment.txt"
step fsdp2_1 torchrun_n 1 -m tests.distributed.llama_flows fsdp2 --out "$RESULTS/fsdp2_1.json"
step fsdp2_2 torchrun_n 2 -m tests.distributed.llama_flows fsdp2 --out "$RESULTS/fsdp2_2.json"
step tp_2 torchrun_n 2 -m tests.distributed.llama_flows tp --out "$RESULTS/tp_2.json"
# shellcheck disable=SC2086
step cp_2 torchrun_n 2 -m fa2_inductor.distributed.bench_cp --out "$RESULTS/cp_2.json" ${CP_ARGS:-}
# The flows above are what test_llama_flows.py checks; the report below checks their JSON the same way.
step pytest "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/distributed --ignore tests/distributed/test_llama_flows.py
echo
"$PYTHON" -m tests.distributed.report "$RESULTS" | tee "$RESULTS/report.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
exit $status
