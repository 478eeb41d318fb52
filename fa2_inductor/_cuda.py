"""The Hopper kernel's side of the op: whether it runs a call, how, and what runs where it does not.

The decisions and the op's CUDA paths live in the compiled extension (csrc/api.cpp), which registers the
CUDA implementations of the forward and backward ops with the dispatcher when it loads. This module is their
Python face: ``kernel_unsupported_reason`` and ``backward_kernel_unsupported_reason`` ask the extension's
support rules about tensor metadata (so the graph pass and ``explain`` can ask about fake tensors),
``forward`` runs the CUDA path into preallocated outputs. Where the kernels do not run a call, the extension
computes it in C++ (the backward with PyTorch's flash backward where it can, else both with its port of the
reference) and only notifies Python: ``note_backward_fallback`` counts a backward call our backward kernel does
not run, ``note_reference_fallback`` counts a call that runs the reference and warns once per reason.
``reference_fallback`` and ``backward_fallback`` are the fallbacks of an install without the extension.
Importing this module never initialises CUDA.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import _extension, reference
from .reference import EmptyRows

KERNEL_NOT_BUILT = "kernel not built"


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


def _metadata(t: Tensor) -> tuple:
    """A tensor as the extension's support rules read it: (sizes, strides, dtype, device, address or None)."""
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device, _data_ptr(t)


def kernel_unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, window_left: int = -1,
    softcap: float = 0.0, sinks: Optional[Tensor] = None,
) -> Optional[str]:
    """None when the compiled kernel runs this call, else a short reason. The extension decides, with the
    same function its CUDA implementation asks on every call; the graph pass's device rules and ``explain``
    ask here."""
    if _extension.C is None:
        return KERNEL_NOT_BUILT
    mask = None if attn_mask is None else _metadata(attn_mask)
    return _extension.C.kernel_unsupported_reason(
        _metadata(q), _metadata(k), _metadata(v), mask, bool(is_causal), int(window_left), float(softcap),
        sinks is not None
    )


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
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> None:
    """Runs the op's CUDA path into preallocated out [B,Hq,Sq,D] and lse [B,Hq,Sq] (float32, natural log),
    with the op's meaning of every argument; only for calls ``kernel_unsupported_reason`` accepted.

    attn_mask: bool (True = attend) or additive float32/bf16/fp16, broadcastable to [B, Hq, Sq, Sk]; read
    through its strides.
    """
    _extension.C.forward(q, k, v, out, lse, float(scale), bool(is_causal), attn_mask, int(window_left),
                         int(empty_rows), float(softcap), sinks)


def note_reference_fallback(reason: str, stacklevel: int = 2) -> None:
    """A CUDA call (forward or backward) that runs the reference is correct but slow: counted, announced once.

    ``stacklevel`` is warnings.warn's, counted from here: 2 points at the caller, which is the op's caller when
    the extension calls (C++ frames do not count); the Python fallbacks pass 3, their own caller."""
    from torch._dynamo.utils import counters

    key = f"reference_fallback:{reason}"
    if counters["fa2_inductor"][key] == 0:
        warnings.warn(f"fa2_inductor: CUDA call runs the (slow) reference implementation: {reason}",
                      stacklevel=stacklevel)
    counters["fa2_inductor"][key] += 1


def reference_fallback(
    reason: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    scale: float,
    is_causal: bool,
    window_left: int,
    empty_rows: int,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of a CUDA call the kernel does not run: the reference's, correct but slow, so the call is
    counted under ``reference_fallback:<reason>`` and each reason is announced once."""
    note_reference_fallback(reason, stacklevel=3)
    return reference.attention_reference(q, k, v, attn_mask, scale, is_causal, window_left, empty_rows, softcap, sinks)


# ===== the Hopper backward kernel ==================================================================


def backward_kernel_unsupported_reason(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    attn_mask: Optional[Tensor], is_causal: bool, compute_mask_grad: bool, window_left: int = -1,
    softcap: float = 0.0, sinks: Optional[Tensor] = None,
) -> Optional[str]:
    """None when the backward op's CUDA implementation runs our backward kernel on this call, else a short
    reason. The extension decides, with the function that implementation asks on every call."""
    if _extension.C is None:
        return KERNEL_NOT_BUILT
    mask = None if attn_mask is None else _metadata(attn_mask)
    return _extension.C.backward_kernel_unsupported_reason(
        _metadata(grad_out), _metadata(q), _metadata(k), _metadata(v), _metadata(out), mask, bool(is_causal),
        bool(compute_mask_grad), int(window_left), float(softcap), sinks is not None,
        torch.are_deterministic_algorithms_enabled()
    )


def note_backward_fallback(reason: str) -> None:
    """A CUDA backward call our backward kernel does not run (PyTorch's flash backward or the reference does):
    counted under ``backward_fallback:<reason>``."""
    from torch._dynamo.utils import counters

    counters["fa2_inductor"][f"backward_fallback:{reason}"] += 1


def backward_fallback(
    reason: str, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    attn_mask: Optional[Tensor], scale: float, is_causal: bool, compute_mask_grad: bool, window_left: int = -1,
    softcap: float = 0.0, sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward op's outputs for a CUDA call of an install without the extension (counted under
    ``backward_fallback:<reason>``): PyTorch's flash backward where it can, else the reference (counted and
    announced as a reference fallback). The extension's own is csrc/api.cpp's backward_fallback."""
    note_backward_fallback(reason)
    if compute_mask_grad or flash_backward_unsupported_reason(q, k, v, attn_mask, is_causal, window_left, softcap,
                                                              sinks) is not None:
        note_reference_fallback(f"backward: {reason}", stacklevel=3)
        return reference.backward_outputs(grad_out, q, k, v, out, lse, attn_mask, scale, is_causal,
                                          compute_mask_grad, window_left, softcap, sinks)
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, scale, is_causal, window_left)
    dsinks = q.new_empty(0) if sinks is None else sinks_gradient(grad_out, out, lse, sinks)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), q.new_empty(0), dsinks


def sinks_gradient(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sinks for a forward whose LSE holds the sinks: a sink is one more key whose value is
    zero, so its score gradient is p_sink · (0 - rowsum(dO · O)), summed over batch and rows. The extension
    runs its C++ port (fa2::sinks_gradient, held to the same bits by tests/test_reference_aten.py)."""
    delta = (grad_out.float() * out.float()).sum(-1)  # [B, Hq, Sq]
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    p_sink = torch.where(torch.isneginf(lse), torch.zeros_like(p_sink), p_sink)  # no key and a -inf sink
    return (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)


def _flash_backward_op():
    return getattr(torch.ops.aten, "_flash_attention_backward", None)


def backward_unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, window_left: int = -1,
    softcap: float = 0.0, sinks: Optional[Tensor] = None,
) -> Optional[str]:
    """None when the op's backward runs a fast kernel: ours or else PyTorch's
    flash-attention backward (``backward``)."""
    if q.device.type == "cuda" and backward_kernel_unsupported_reason(
            q, q, k, v, q, attn_mask, is_causal, False, window_left, softcap, sinks) is None:
        return None
    return flash_backward_unsupported_reason(q, k, v, attn_mask, is_causal, window_left, softcap, sinks)


def flash_backward_unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, window_left: int = -1,
    softcap: float = 0.0, sinks: Optional[Tensor] = None,
) -> Optional[str]:
    """None when ``backward`` can run this call through PyTorch's flash-attention backward. The extension's
    backward asks the same rule in C++ (csrc/api.cpp's flash_backward_runs): change both together."""
    if attn_mask is not None:
        return "attn_mask"
    if softcap:
        return "softcap (PyTorch's flash backward has none)"
    if window_left != -1 and not _flash_backward_takes_window():
        return "window_left: this torch's flash backward has no window arguments"
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if q.dtype not in (torch.bfloat16, torch.float16):
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
    A causal window maps to its window_size_left (window_size_right = 0 is the diagonal). The extension makes
    the same call from C++ (csrc/api.cpp's flash_backward).
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


if _extension.C is not None:
    # The extension's CUDA implementations notify these where its kernels do not run a call.
    _extension.C.set_reference_hooks(note_reference_fallback, note_backward_fallback)
