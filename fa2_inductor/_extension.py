"""Loads the compiled kernel module ``fa2_inductor._C`` if it is there and usable.

Importing it never initialises CUDA. A missing or broken build is not an error: the op then runs its
reference implementation, and one warning says why and how to rebuild (for a missing build only where a
CUDA device exists).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from types import ModuleType
from typing import Optional

import torch

REBUILD_COMMAND = 'FA2_INDUCTOR_BUILD_CUDA=1 pip install --no-build-isolation -e .'


def _load() -> tuple[Optional[ModuleType], str]:
    """(module, reason): the module, or None with the reason it is not usable."""
    if importlib.util.find_spec("fa2_inductor._C") is None:
        return None, "fa2_inductor._C was not built (pure-Python install)"
    try:
        return importlib.import_module("fa2_inductor._C"), "loaded"
    except (ImportError, OSError) as exc:  # e.g. undefined symbol: built against another torch
        return None, f"fa2_inductor._C failed to load ({exc}); it was probably built for another torch"


def _cuda_device_present() -> bool:
    """Whether the machine shows a CUDA device. Asked through NVML, which unlike ``torch.cuda.is_available()``
    neither initialises the CUDA driver in this process nor makes a later fork unsafe."""
    if torch.version.cuda is None:
        return False
    count_through_nvml = getattr(torch.cuda, "_device_count_nvml", None)
    if count_through_nvml is None:  # cannot tell without initialising CUDA: assume a device
        return True
    return count_through_nvml() > 0  # -1: no NVML, i.e. no NVIDIA driver


C, status = _load()

# A missing build matters only where the kernel could run; a broken one is worth saying everywhere.
if C is None and ("failed to load" in status or _cuda_device_present()):
    warnings.warn(
        f"{status}. fa2_inductor uses its reference implementation (slow on GPU). "
        f"To build the Hopper kernel: {REBUILD_COMMAND}",
        RuntimeWarning,
        stacklevel=2,
    )
