"""The Hopper kernel's side of the op: when it can run a call, and how to run it.

``kernel_unsupported_reason`` is called on every op call, so it only reads tensor metadata (and a
cached device capability); importing this module never initialises CUDA.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import _extension

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=None)
def _compiled() -> frozenset:
    if _extension.C is None:
        return frozenset()
    return frozenset((int(d), str(n)) for d, n in _extension.C.compiled_kernels())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _data_ptr(t: Tensor) -> Optional[int]:
    """The address, or None for tensors without real storage (fake/functional tensors while
    torch.compile traces or a graph pass inspects node metadata); the op re-checks at run time."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor) or torch._is_functional_tensor(t):
        return None
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def _layout_reason(name: str, t: Tensor) -> Optional[str]:
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return f"{name} last dim not contiguous"
    ptr = _data_ptr(t)
    if ptr is not None and ptr % 16 != 0:
        return f"{name} not 16-byte aligned"
    for dim in range(3):
        if t.shape[dim] > 1 and (t.stride(dim) <= 0 or t.stride(dim) % 8 != 0):
            return f"{name} stride {t.stride(dim)} of dim {dim} is not a positive multiple of 8 elements"
    return None


def kernel_unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool
) -> Optional[str]:
    """None when the compiled kernel runs this call, else a short reason."""
    if _extension.C is None:
        return "kernel not built"
    if attn_mask is not None:
        return "attn_mask is not supported by the kernel"
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if _capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) != (9, 0):
        return "kernel needs an sm_90 (Hopper) GPU"
    name = _DTYPE_NAMES.get(q.dtype)
    if name is None:
        return f"dtype {q.dtype} not supported by the kernel"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v dtypes differ"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "inputs must be 4-D"
    d = q.shape[-1]
    if (d, name) not in _compiled():
        return f"no kernel compiled for head dim {d} {name}"
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if b > 65535 or hq > 65535:
        return "batch or heads above 65535"
    if sq >= 2**31 or sk >= 2**31:
        return "sequence too long"
    if hkv == 0 or hq % hkv != 0:
        return "Hq must be a multiple of Hkv"
    for tname, t in (("q", q), ("k", k), ("v", v)):
        reason = _layout_reason(tname, t)
        if reason is not None:
            return reason
    return None


def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, is_causal: bool, out: Tensor, lse: Tensor) -> None:
    """Runs the kernel into preallocated out [B,Hq,Sq,D] and lse [B,Hq,Sq] (float32, natural log)."""
    if q.numel() == 0 and (q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0):
        return
    if k.shape[2] == 0:  # no key at all: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return
    if scale < 0:  # the kernel tracks the max of raw scores, which needs a non-negative scale
        q, scale = -q, -scale
    _extension.C.fwd(q, k, v, out, lse, float(scale), bool(is_causal))


def _flash_backward_op():
    return getattr(torch.ops.aten, "_flash_attention_backward", None)


def backward_unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool
) -> Optional[str]:
    """None when ``backward`` can run this call through PyTorch's flash-attention backward."""
    if attn_mask is not None:
        return "attn_mask"
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if q.dtype not in _DTYPE_NAMES:
        return f"dtype {q.dtype}"
    if _flash_backward_op() is None:
        return "torch has no aten._flash_attention_backward"
    major, _ = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if major < 8:
        return "flash backward needs sm_80+"
    d = q.shape[-1]
    if d > 256 or d % 8 != 0:
        return f"head dim {d}"
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "empty sequence"
    # PyTorch's flash backward aligns a causal mask bottom-right when Sq != Sk; ours is top-left.
    if is_causal and q.shape[2] != k.shape[2]:
        return "causal with Sq != Sk (flash backward is bottom-right aligned)"
    return None


def backward(grad_out, q, k, v, out, lse, scale, is_causal):
    """(dq, dk, dv) from PyTorch's flash-attention backward, using the LSE our kernel wrote.

    That kernel takes [B, S, H, D] tensors (GQA handled inside) and the LSE as [B, Hq, Sq] float32.
    """
    sq, sk = q.shape[2], k.shape[2]
    no_rng = torch.empty((), dtype=torch.int64)
    dq, dk, dv = _flash_backward_op()(
        grad_out.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.contiguous(),
        None,
        None,
        sq,
        sk,
        0.0,
        bool(is_causal),
        no_rng,
        no_rng,
        scale=float(scale),
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
