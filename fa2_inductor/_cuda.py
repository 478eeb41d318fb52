"""The Hopper kernel's side of the op: when it can run a call, and how to run it.

``kernel_unsupported_reason`` is called on every op call, so it only reads tensor metadata (and a
cached device capability); importing this module never initialises CUDA.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from . import _extension, reference
from .reference import EmptyRows

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# Mask dtypes the masked kernels read: bool (True = attend) or additive float32/bf16/fp16.
_MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _compiled() -> frozenset:
    if _extension.C is None:
        return frozenset()
    return frozenset((int(d), str(n)) for d, n in _extension.C.compiled_kernels())


@functools.lru_cache(maxsize=None)
def limits() -> dict:
    """What every compiled kernel can take, as the extension reports it (empty without one)."""
    return {} if _extension.C is None else dict(_extension.C.limits())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _data_ptr(t: Tensor) -> Optional[int]:
    """The address, or None for tensors without real storage (fake/functional tensors while
    torch.compile traces or a graph pass inspects node metadata); the op re-checks at run time."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor) or t.device.type == "meta" or torch._is_functional_tensor(t):
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
    align = limits()["stride_align_elements"]
    for dim in range(3):
        if t.shape[dim] > 1 and (t.stride(dim) <= 0 or t.stride(dim) % align != 0):
            return f"{name} stride {t.stride(dim)} of dim {dim} is not a positive multiple of {align} elements"
    return None


def _expanded_mask(attn_mask: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """The mask as a [B, Hq, Sq, Sk] view (zero strides on broadcast dims)."""
    b, hq, sq, _ = q.shape
    return attn_mask.expand(b, hq, sq, k.shape[2])


def _mask_reason(attn_mask: Tensor, q: Tensor, k: Tensor, is_causal: bool) -> Optional[str]:
    if not hasattr(_extension.C, "fwd_masked"):
        return "kernel built without mask support"
    if os.environ.get("FA2_INDUCTOR_DISABLE_MASK_KERNEL", "0") == "1":
        return "masked kernels disabled (FA2_INDUCTOR_DISABLE_MASK_KERNEL=1)"
    if attn_mask.dtype not in _MASK_DTYPES:
        return f"attn_mask dtype {attn_mask.dtype} not supported by the kernel"
    if is_causal and attn_mask.dtype != torch.bool and not limits()["additive_mask_with_causal"]:
        return "additive attn_mask together with is_causal"
    if attn_mask.device != q.device:
        return "attn_mask on another device"
    if attn_mask.dim() > 4 or q.dim() != 4 or k.dim() != 4:
        return "attn_mask does not broadcast to [B, Hq, Sq, Sk]"
    try:
        mask = _expanded_mask(attn_mask, q, k)
    except RuntimeError:
        return "attn_mask does not broadcast to [B, Hq, Sq, Sk]"
    if any(s < 0 for s in mask.stride()):
        return "attn_mask has a negative stride"
    b, hq, sq, _ = q.shape
    class_b = 1 if b == 1 or mask.stride(0) == 0 else b
    class_h = 1 if hq == 1 or mask.stride(1) == 0 else hq
    class_m = 1 if sq == 1 or mask.stride(2) == 0 else -(-sq // limits()["mask_block_m"])
    if class_b * class_h > limits()["max_grid_dim"] or class_m > limits()["max_grid_dim"]:
        return "attn_mask too large for the block classification grid"
    return None


def kernel_unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, window_left: int = -1
) -> Optional[str]:
    """None when the compiled kernel runs this call, else a short reason. The one place that decides it:
    the op's CUDA path, the graph pass's device rules and ``explain`` all ask here."""
    if _extension.C is None:
        return "kernel not built"
    if window_left != -1 and not is_causal:
        return "window_left without is_causal"
    if attn_mask is not None:
        reason = _mask_reason(attn_mask, q, k, is_causal)
        if reason is not None:
            return reason
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
    if max(b, hq) > limits()["max_grid_dim"]:
        return f"batch or heads above {limits()['max_grid_dim']}"
    if max(sq, sk) > limits()["max_seqlen"]:
        return "sequence too long"
    if hkv == 0 or hq % hkv != 0:
        return "Hq must be a multiple of Hkv"
    for tname, t in (("q", q), ("k", k), ("v", v)):
        reason = _layout_reason(tname, t)
        if reason is not None:
            return reason
    return None


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    is_causal: bool,
    out: Tensor,
    lse: Tensor,
    attn_mask: Optional[Tensor] = None,
    window_left: int = -1,
    empty_rows: int = EmptyRows.ZERO,
) -> None:
    """Runs the kernel into preallocated out [B,Hq,Sq,D] and lse [B,Hq,Sq] (float32, natural log), with the
    op's meaning of every argument; only for calls ``kernel_unsupported_reason`` accepted.

    attn_mask: bool (True = attend) or additive float32/bf16/fp16, broadcastable to [B, Hq, Sq, Sk]; read
    through its strides.
    """
    if q.numel() == 0 and (q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0):
        return
    if k.shape[2] == 0:  # no key at all: every row is empty (and has no key to attend to)
        out.zero_()
        lse.fill_(float("-inf"))
        return
    if scale == 0:  # rare: the kernels mask scores with -inf before scaling (0 * -inf = NaN)
        reference.attention_forward(q, k, v, attn_mask, 0.0, is_causal, out, lse, window_left, empty_rows)
        return
    if scale < 0:  # the kernels track the max of raw scores, which needs a non-negative scale
        q, scale = -q, -scale
    if attn_mask is not None:
        _extension.C.fwd_masked(q, k, v, out, lse, float(scale), _expanded_mask(attn_mask, q, k), bool(is_causal),
                                int(window_left))
    else:
        _extension.C.fwd(q, k, v, out, lse, float(scale), bool(is_causal), int(window_left), None)
    if empty_rows == EmptyRows.MEAN_V:
        _extension.C.fill_empty_rows(out, lse, v)
    elif empty_rows == EmptyRows.ALL_KEYS:
        # Unmasked attention for the query tiles holding an empty row (the others exit at once), then
        # those rows copied over.
        unmasked, unmasked_lse = reference.empty_outputs(q, v)
        _extension.C.fwd(q, k, v, unmasked, unmasked_lse, float(scale), False, -1, lse)
        _extension.C.fill_empty_rows(out, lse, v, unmasked)


# ===== the Hopper backward kernel ==================================================================
# The backward's step entries name a query head of the group in 14 bits (csrc/fa2/bwd_mask.hpp kMaxHeadRatio).
_MAX_BACKWARD_HEAD_RATIO = 1 << 14


def backward_kernel_unsupported_reason(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    attn_mask: Optional[Tensor], is_causal: bool, compute_mask_grad: bool, window_left: int = -1,
) -> Optional[str]:
    """None when ``backward_kernel`` runs this call: what the forward kernel covers, less a window and a
    mask together with is_causal."""
    if not hasattr(_extension.C, "bwd"):
        return "kernel built without the backward"
    if window_left != -1:
        return "window_left (the backward kernel has no window)"
    if attn_mask is not None and is_causal:
        return "attn_mask together with is_causal (the backward kernel takes one or the other)"
    reason = kernel_unsupported_reason(q, k, v, attn_mask, is_causal)
    if reason is not None:
        return reason
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            return f"{name} does not match q"
    if q.shape[1] // k.shape[1] >= _MAX_BACKWARD_HEAD_RATIO:
        return f"more than {_MAX_BACKWARD_HEAD_RATIO - 1} query heads per kv head"
    if compute_mask_grad and torch.are_deterministic_algorithms_enabled():
        b, hq, sq, _ = q.shape
        full = (b, hq, sq, k.shape[2])
        shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
        if any(m == 1 and n > 1 for m, n in zip(shape, full)):
            return "deterministic mask gradient summed over broadcast dims"
    return None


def backward_kernel(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    attn_mask: Optional[Tensor], scale: float, is_causal: bool, compute_mask_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dmask) from the Hopper backward kernel (only where ``backward_kernel_unsupported_reason``
    accepted the call): contiguous, in the inputs' dtypes; dmask empty unless compute_mask_grad.
    Deterministic (bit-identical run to run) when torch.are_deterministic_algorithms_enabled()."""
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dmask_sum = None
    if compute_mask_grad:
        dmask_sum = torch.zeros((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape), dtype=torch.float32, device=q.device)
    if b * hq * sq == 0 or sk == 0:  # nothing to attend: every gradient is zero (or empty)
        for t in (dq, dk, dv):
            t.zero_()
    else:
        # Autograd may hand over any layout (e.g. the zero strides of a sum's gradient): copy what TMA can't read.
        grad_out, out = (t if _layout_reason("t", t) is None else t.contiguous() for t in (grad_out, out))
        mask = None if attn_mask is None else _expanded_mask(attn_mask, q, k)
        dmask = None if dmask_sum is None else dmask_sum.expand(b, hq, sq, sk)
        _extension.C.bwd(grad_out, q, k, v, out, lse, dq, dk, dv, float(scale), bool(is_causal),
                         torch.are_deterministic_algorithms_enabled(), mask, dmask)
    if dmask_sum is None:
        return dq, dk, dv, q.new_empty(0)
    return dq, dk, dv, dmask_sum.reshape(attn_mask.shape).to(attn_mask.dtype)
# ===== end of the Hopper backward kernel ===========================================================


def _flash_backward_op():
    return getattr(torch.ops.aten, "_flash_attention_backward", None)


def backward_unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, window_left: int = -1
) -> Optional[str]:
    """None when the op's backward runs a fast kernel: ours (``backward_kernel``) or else PyTorch's
    flash-attention backward (``backward``)."""
    if q.device.type == "cuda" and backward_kernel_unsupported_reason(
            q, q, k, v, q, attn_mask, is_causal, False, window_left) is None:
        return None
    return flash_backward_unsupported_reason(q, k, v, attn_mask, is_causal, window_left)


def flash_backward_unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, window_left: int = -1
) -> Optional[str]:
    """None when ``backward`` can run this call through PyTorch's flash-attention backward."""
    if attn_mask is not None:
        return "attn_mask"
    if window_left != -1 and not _flash_backward_takes_window():
        return "window_left: this torch's flash backward has no window arguments"
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


@functools.lru_cache(maxsize=None)
def _flash_backward_takes_window() -> bool:
    op = _flash_backward_op()
    return op is not None and "window_size_left" in {a.name for a in op.default._schema.arguments}


def backward(grad_out, q, k, v, out, lse, scale, is_causal, window_left=-1):
    """(dq, dk, dv) from PyTorch's flash-attention backward, using the LSE our kernel wrote.

    That kernel takes [B, S, H, D] tensors (GQA handled inside) and the LSE as [B, Hq, Sq] float32.
    A causal window maps to its window_size_left (window_size_right = 0 is the diagonal).
    """
    sq, sk = q.shape[2], k.shape[2]
    no_rng = torch.empty((), dtype=torch.int64)
    window = {"window_size_left": int(window_left), "window_size_right": 0} if window_left != -1 else {}
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
        **window,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
