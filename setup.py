"""Build script: pure Python by default, plus the Hopper kernel extension when asked or possible.

FA2_INDUCTOR_BUILD_CUDA=auto (default) builds fa2_inductor._C only when torch is importable, has CUDA,
and nvcc is found; 0 never builds it; 1 must build it. torch is imported only when a CUDA build is
considered, so a CPU install needs nothing but setuptools.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# A CUTLASS translation unit can take a few GiB in nvcc; keep parallel jobs within memory.
GIB_PER_COMPILE_JOB = 4


def _env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def _build_mode() -> str:
    mode = os.environ.get("FA2_INDUCTOR_BUILD_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        sys.exit(f"FA2_INDUCTOR_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    return mode


def _cuda_build_blocker() -> str | None:
    """Why a CUDA build cannot happen here, or None when it can."""
    try:
        import torch
    except ImportError:
        # pip builds in an isolated environment without it, or a `pip` of another Python runs the build
        return (f"torch is not importable by {sys.executable}, the Python running this build: install with "
                "that Python's pip and --no-build-isolation (python -m pip install --no-build-isolation ...)")
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc was not found (set CUDA_HOME)"
    return None


def cutlass_include_dirs() -> list[str]:
    """CUTLASS_DIR, else cutlass/include in this repo, else the PyPI package nvidia-cutlass."""
    candidates = []
    if os.environ.get("CUTLASS_DIR"):
        candidates.append(Path(os.environ["CUTLASS_DIR"]) / "include")
    candidates.append(ROOT / "cutlass" / "include")
    try:
        import cutlass_library

        candidates.append(Path(cutlass_library.__file__).parent / "source" / "include")
    except ImportError:
        pass
    for include in candidates:
        if (include / "cute" / "tensor.hpp").is_file():
            util = include.parent / "tools" / "util" / "include"
            return [str(include)] + ([str(util)] if util.is_dir() else [])
    sys.exit(
        "CUTLASS headers not found. Looked in: $CUTLASS_DIR/include, cutlass/include, and the PyPI "
        "package nvidia-cutlass==4.2.0.0 (pip install nvidia-cutlass==4.2.0.0). See cutlass/README.md."
    )


def _kernel_table():
    return runpy.run_path(str(ROOT / "csrc" / "kernel_table.py"))


def _write_if_changed(path: Path, text: str) -> None:
    """Rewrites a generated file only when its text changes, so unchanged units are not rebuilt."""
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def generated_sources() -> list[str]:
    """Writes the compile units and the binding's table for FA2_INDUCTOR_HEAD_DIMS / _DTYPES; returns the units."""
    table = _kernel_table()
    head_dims = {int(d) for d in _env_list("FA2_INDUCTOR_HEAD_DIMS", ",".join(map(str, table["DEFAULT_HEAD_DIMS"])))}
    dtypes = set(_env_list("FA2_INDUCTOR_DTYPES", ",".join(table["DTYPES"])))
    unknown = sorted(map(str, head_dims - set(table["HEAD_DIMS"]))) + sorted(dtypes - set(table["DTYPES"]))
    if unknown or not head_dims or not dtypes:
        sys.exit(f"FA2_INDUCTOR_HEAD_DIMS / FA2_INDUCTOR_DTYPES: choose from {table['HEAD_DIMS']} and "
                 f"{sorted(table['DTYPES'])}; got unknown or empty {unknown or 'selection'}")
    units = table["compile_units"](head_dims, dtypes)
    for path, text in units.items():
        _write_if_changed(ROOT / path, text)
    _write_if_changed(ROOT / table["GENERATED_DIR"] / "kernel_table.inc", table["binding_table"](head_dims, dtypes))
    return list(units)  # in BUILD_ORDER, the order their names sort into and the build starts them in


def _bound_max_jobs() -> None:
    if "MAX_JOBS" in os.environ:
        return
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8
    os.environ["MAX_JOBS"] = str(max(1, min(os.cpu_count() or 1, int(mem_gib // GIB_PER_COMPILE_JOB))))


def cuda_extension_kwargs() -> dict:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    _bound_max_jobs()
    # Only sm_90a: without this torch adds a plain sm_90 target for the GPU it sees, which doubles the
    # compile and cannot hold wgmma/setmaxnreg code.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    sources = generated_sources()
    nvcc_flags = [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-O3",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "--use_fast_math",
        "-Xptxas=-v",
        "-DNDEBUG",
    ]
    extension = CUDAExtension(
        name="fa2_inductor._C",
        sources=["csrc/api.cpp", *sources],
        include_dirs=[str(ROOT / "csrc"), *cutlass_include_dirs()],
        extra_compile_args={"cxx": ["-O3", _kernel_table()["host_cxx_standard"](torch.__version__)],
                            "nvcc": nvcc_flags},
    )
    print(f"fa2_inductor: building {len(sources)} kernel instantiations with MAX_JOBS={os.environ['MAX_JOBS']}")
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


def extension_kwargs() -> dict:
    mode = _build_mode()
    if mode == "0":
        return {}
    blocker = _cuda_build_blocker()
    if blocker is None:
        return cuda_extension_kwargs()
    if mode == "1":
        sys.exit(f"FA2_INDUCTOR_BUILD_CUDA=1 but the CUDA extension cannot be built: {blocker}")
    print(f"fa2_inductor: installing pure Python ({blocker})")
    return {}


setup(**extension_kwargs())
