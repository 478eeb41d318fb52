#!/usr/bin/env bash
# The CPU test suite under one torch version, in its own venv: the project supports torch 2.11 (the
# device) through 2.14, and Inductor's pass APIs differ between them.
#
#   bash scripts/test_on_torch.sh 2.11.0      (then 2.14.1; 2.13.0 is what CI runs)
#
# The extension is never built here (FA2_INDUCTOR_BUILD_CUDA=0): a CUDA torch plus a local nvcc would
# otherwise compile the kernel on this machine's cores. GPU tests skip without a Hopper GPU. Its host code is
# compiled against this torch's headers, syntax only (scripts/check_host_code.py; skipped for a CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: $0 TORCH_VERSION [pytest args, default: tests]}
shift
VENV=/tmp/fa2_inductor_torch$VERSION

[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==$VERSION" "setuptools>=77" wheel
FA2_INDUCTOR_BUILD_CUDA=0 "$VENV/bin/pip" install -q --no-build-isolation -e ".[test]"
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
"$VENV/bin/python" scripts/check_host_code.py
"$VENV/bin/python" -m pytest -q -rfEs -p no:cacheprovider "${@:-tests}"
