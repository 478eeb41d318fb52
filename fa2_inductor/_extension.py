"""Loads the compiled kernel module ``fa2_inductor._C`` if it is there and usable.

Importing it never initialises CUDA. A missing, broken or out-of-date build is not an error: the op then
runs its reference implementation, and one warning says why and how to rebuild (for a missing build only
where a CUDA device exists). Loading the module also registers the op's CUDA implementation with the
dispatcher (csrc/api.cpp).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from types import ModuleType
from typing import Optional

import torch

REBUILD_COMMAND = 'FA2_INDUCTOR_BUILD_CUDA=1 python -m pip install --no-build-isolation -e .'
NOT_BUILT = "fa2_inductor._C was not built (pure-Python install)"
# What the package (and its GPU tests) call on the module; a build from older sources lacks some of them.
REQUIRED_FUNCTIONS = (
    "compiled_kernels", "limits", "kernel_unsupported_reason", "forward", "set_reference_hooks",
    "fwd", "fwd_masked", "fill_empty_rows", "interface_version", "set_persistent_grid", "bwd",
    "backward_kernel_unsupported_reason",
)
# The bindings' argument version this package calls (csrc/api.cpp kInterfaceVersion).
INTERFACE_VERSION = 9


def _load() -> tuple[Optional[ModuleType], str]:
    """(module, reason): the module, or None with the reason it is not usable."""
    if importlib.util.find_spec("fa2_inductor._C") is None:
        return None, NOT_BUILT
    try:
        module = importlib.import_module("fa2_inductor._C")
    except (ImportError, OSError) as exc:  # e.g. undefined symbol: built against another torch
        return None, f"fa2_inductor._C failed to load ({exc}); it was probably built for another torch"
    missing = [name for name in REQUIRED_FUNCTIONS if not hasattr(module, name)]
    if missing:
        return None, f"fa2_inductor._C is out of date (it lacks {', '.join(missing)}): it was built from older sources"
    if module.interface_version() != INTERFACE_VERSION:
        return None, (f"fa2_inductor._C is out of date (interface {module.interface_version()}, this package needs "
                      f"{INTERFACE_VERSION}): it was built from older sources")
    return module, "loaded"


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

# A missing build matters only where the kernel could run; a broken or stale one is worth saying everywhere.
if C is None and (status != NOT_BUILT or _cuda_device_present()):
    warnings.warn(
        f"{status}. fa2_inductor uses its reference implementation (slow on GPU). "
        f"To build the Hopper kernel: {REBUILD_COMMAND}",
        RuntimeWarning,
        stacklevel=2,
    )
