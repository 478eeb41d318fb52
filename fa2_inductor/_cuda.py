"""The Hopper kernel's side of the op: when it can run a call, and how to run it.

Placeholder until the kernel lands: it reports every call as unsupported, so the op uses the
reference implementation on CUDA too.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import _extension


def kernel_unsupported_reason(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> Optional[str]:
    if _extension.C is None:
        return "kernel not built"
    return "kernel not implemented yet"


def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, is_causal: bool, out: Tensor, lse: Tensor) -> None:
    raise NotImplementedError


def backward_unsupported_reason(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> Optional[str]:
    return "kernel backward not implemented yet"


def backward(grad_out, q, k, v, out, lse, scale, is_causal):
    raise NotImplementedError
