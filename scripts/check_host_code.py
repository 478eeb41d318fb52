"""Compiles the extension's host code (csrc/api.cpp) against the installed torch's headers, syntax only: no nvcc
run, no GPU, seconds instead of a build. torch's C++ API differs between the releases the project supports
(torch 2.13's headers take `t.sum({0, 2})`, 2.11's find it ambiguous), so check the oldest and the newest
before a device build:

    bash scripts/test_on_torch.sh 2.11.0          (runs this too)
    python scripts/check_host_code.py             (with the torch to check installed)

Needs a CUDA build of torch (its c10/cuda headers; a CPU build has none) and the CUDA toolkit's headers
(CUDA_HOME, else /usr/local/cuda). Exit status 0: compiles (or skipped, said why); 1: compile errors.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]
SHOWN_ERROR_LINES = 40


def _cuda_include() -> Path:
    """The toolkit's include folder: CUDA_HOME's, torch's guess, nvcc's (through links), else /usr/local/cuda's."""
    nvcc = shutil.which("nvcc")
    homes = [os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME,
             str(Path(nvcc).resolve().parents[1]) if nvcc else None, "/usr/local/cuda"]
    for home in filter(None, homes):
        if (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    return Path("/usr/local/cuda/include")


def main() -> int:
    includes = [Path(p) for p in cpp_extension.include_paths()]
    if not any((p / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file() for p in includes):
        print(f"skipped: torch {torch.__version__} is a CPU build (no c10/cuda headers)")
        return 0
    if not (_cuda_include() / "cuda_runtime.h").is_file():
        print(f"skipped: no CUDA toolkit headers in {_cuda_include()} (set CUDA_HOME)")
        return 0
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        print("skipped: no C++ compiler (set CXX)")
        return 0
    table = runpy.run_path(str(ROOT / "csrc" / "kernel_table.py"))
    # api.cpp includes the binding's table that a build generates: the last build's, else the default selection's.
    generated = ROOT / table["GENERATED_DIR"] / "kernel_table.inc"
    if not generated.is_file():
        generated.parent.mkdir(parents=True, exist_ok=True)
        generated.write_text(table["binding_table"](table["DEFAULT_HEAD_DIMS"], table["DTYPES"]))
    abi = int(torch.compiled_with_cxx11_abi())
    command = [compiler, "-fsyntax-only", table["host_cxx_standard"](torch.__version__),
               "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               *(f"-I{p}" for p in includes), f"-I{sysconfig.get_paths()['include']}", f"-I{_cuda_include()}",
               f"-I{ROOT / 'csrc'}", str(ROOT / "csrc" / "api.cpp")]
    result = subprocess.run(command, capture_output=True, text=True)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    if result.returncode != 0:
        print("\n".join(errors[:SHOWN_ERROR_LINES]) or result.stderr[-4000:])
        print(f"csrc/api.cpp does not compile against torch {torch.__version__}'s headers ({len(errors)} error lines)")
        return 1
    print(f"csrc/api.cpp compiles against torch {torch.__version__}'s headers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
