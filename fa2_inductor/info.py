"""``python -m fa2_inductor.info``: what this install can run."""

from __future__ import annotations

import torch

from . import __version__, _extension


def describe() -> str:
    lines = [
        f"fa2_inductor {__version__}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
    ]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"GPU: {torch.cuda.get_device_name()} (sm_{major}{minor})")
    else:
        lines.append("GPU: none visible (the op runs its reference implementation)")
    lines.append(f"kernel: {_extension.status}")
    if _extension.C is not None:
        kernels = ", ".join(f"hdim{d} {dtype}" for d, dtype in _extension.C.compiled_kernels())
        lines.append(f"compiled kernels: {kernels or 'none'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
