"""The attention op: schema, input checks, fake, reference and CUDA implementations, autograd.

``torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, attn_mask, scale, is_causal, window_left=-1,
empty_rows=0, softcap=0.0, sinks=None) -> (out, lse)`` computes ``softmax(q kᵀ · scale + mask) v`` like
``F.scaled_dot_product_attention`` and also returns the natural-log log-sum-exp of the scaled, masked
scores. ``lse`` is not differentiable. Unlike SDPA, ``attn_mask`` and ``is_causal`` may come together
(both apply), ``window_left`` bounds a causal sliding window, ``empty_rows`` (an ``EmptyRows``) picks
what rows with no visible key return, ``softcap`` caps the scaled scores at ``softcap * tanh(s / softcap)``
before masks apply, and ``sinks`` (a logit per query head) joins each row's softmax denominator.

The CUDA implementation runs the Hopper kernel where it covers the call and the reference otherwise,
so every device gets a correct answer. With the compiled extension loaded it is C++ (csrc/api.cpp
registers it; see ``_cuda``); without it, CUDA calls run the reference from here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _cuda, _extension, reference
from .reference import EmptyRows

MAX_HEAD_DIM = 256
_EMPTY_ROWS_VALUES = frozenset(int(e) for e in EmptyRows)  # a plain set: Dynamo traces check_inputs
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, window_left: int = -1,
    empty_rows: int = EmptyRows.ZERO, softcap: float = 0.0, sinks: Optional[Tensor] = None,
) -> None:
    """Raises ValueError naming the problem when the arguments do not describe a valid attention."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"flash_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"flash_attention: unsupported dtype {q.dtype}; use float16, bfloat16 or float32")
    if q.dtype == torch.float64 and q.device.type != "cpu":
        raise ValueError("flash_attention: float64 runs only on CPU (the reference path); use float32, float16 or bfloat16")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, hq, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"flash_attention: batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"flash_attention: head dims differ: q {d}, k {k.shape[-1]}, v {v.shape[-1]}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim {d} is larger than the supported {MAX_HEAD_DIM}")
    if d == 0:
        raise ValueError("flash_attention: head_dim is 0")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same heads and length")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"flash_attention: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if window_left != -1 and not (is_causal and window_left >= 0):
        raise ValueError(f"flash_attention: window_left must be -1 or, with is_causal=True, >= 0; got {window_left}")
    if empty_rows not in _EMPTY_ROWS_VALUES:
        raise ValueError(f"flash_attention: empty_rows must be one of {[int(e) for e in EmptyRows]} (EmptyRows), got {empty_rows}")
    if not 0 <= softcap < math.inf:
        raise ValueError("flash_attention: softcap must be finite and >= 0 (0: no soft-capping)")
    if sinks is not None:
        _check_sinks(sinks, hq, q, empty_rows)
    if attn_mask is not None:
        _check_mask(attn_mask, (b, hq, sq, k.shape[2]), q)


def _check_sinks(sinks: Tensor, hq: int, q: Tensor, empty_rows: int) -> None:
    if not isinstance(sinks, Tensor):
        raise ValueError(f"flash_attention: sinks must be a tensor or None, got {type(sinks).__name__}")
    if sinks.dim() != 1 or sinks.shape[0] != hq or not sinks.dtype.is_floating_point:
        raise ValueError(f"flash_attention: sinks must be a floating tensor of shape [Hq] = [{hq}], got {sinks.dtype} "
                         f"of shape {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"flash_attention: sinks is on {sinks.device}, q on {q.device}")
    if empty_rows != EmptyRows.ZERO:
        raise ValueError("flash_attention: with sinks a row with no visible key gives all its weight to the sink "
                         "(out = 0): empty_rows must be EmptyRows.ZERO")


def _check_mask(attn_mask: Tensor, shape: tuple, q: Tensor) -> None:
    if not isinstance(attn_mask, Tensor):
        raise ValueError(f"flash_attention: attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise ValueError(f"flash_attention: attn_mask must be bool (True = attend) or floating (additive), got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"flash_attention: attn_mask is on {attn_mask.device}, q on {q.device}")
    mask_shape = tuple(attn_mask.shape)
    fits = attn_mask.dim() <= 4 and all(
        m == 1 or m == t for m, t in zip(reversed(mask_shape), reversed(shape))
    )
    if not fits:
        raise ValueError(f"flash_attention: attn_mask of shape {mask_shape} does not broadcast to [B, Hq, Sq, Sk] = {list(shape)}")


@torch.library.custom_op("fa2_inductor::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    scale: float,
    is_causal: bool,
    window_left: int = -1,
    empty_rows: int = 0,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    check_inputs(q, k, v, attn_mask, is_causal, window_left, empty_rows, softcap, sinks)
    return reference.attention_reference(q, k, v, attn_mask, scale, is_causal, window_left, empty_rows, softcap, sinks)


def _register_cuda_kernel(op, fn) -> None:
    """Makes ``fn`` op's CUDA implementation unless the loaded extension registered a C++ one (csrc/api.cpp's
    TORCH_LIBRARY_IMPL ran when ``_extension`` imported it, before this module defined the op)."""
    if _extension.C is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op._qualname, "CUDA"):
        return
    op.register_kernel("cuda")(fn)


def _flash_attention_fwd_cuda(q, k, v, attn_mask, scale, is_causal, window_left=-1, empty_rows=0, softcap=0.0,
                              sinks=None):
    """CUDA calls without the extension: the reference, counted and announced like any fallback."""
    check_inputs(q, k, v, attn_mask, is_causal, window_left, empty_rows, softcap, sinks)
    return _cuda.reference_fallback(_cuda.KERNEL_NOT_BUILT, q, k, v, attn_mask, scale, is_causal, window_left,
                                    empty_rows, softcap, sinks)


_register_cuda_kernel(flash_attention_fwd, _flash_attention_fwd_cuda)


@flash_attention_fwd.register_fake
def _flash_attention_fwd_fake(q, k, v, attn_mask, scale, is_causal, window_left=-1, empty_rows=0, softcap=0.0,
                              sinks=None):
    check_inputs(q, k, v, attn_mask, is_causal, window_left, empty_rows, softcap, sinks)
    return reference.empty_outputs(q, v)


@torch.library.custom_op("fa2_inductor::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Optional[Tensor],
    scale: float,
    is_causal: bool,
    compute_mask_grad: bool,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    empty_rows: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dmask, dsinks), all contiguous; dmask is empty unless compute_mask_grad, dsinks unless
    sinks are given. Rows without a visible key (lse = -inf) get no gradient under ``EmptyRows.ZERO``; under
    the others, what the forward filled them with gets eager's gradient (reference.filled_row_gradients)."""
    outputs = reference.backward_outputs(grad_out, q, k, v, out, lse, attn_mask, scale, is_causal, compute_mask_grad,
                                         window_left, softcap, sinks)
    return reference.with_filled_row_gradients(outputs, grad_out, q, k, v, out, lse, scale, empty_rows, softcap)


def _flash_attention_bwd_cuda(grad_out, q, k, v, out, lse, attn_mask, scale, is_causal, compute_mask_grad,
                              window_left=-1, softcap=0.0, sinks=None, empty_rows=0):
    """CUDA calls without the extension: PyTorch's flash backward where it can, else the reference, counted."""
    outputs = _cuda.backward_fallback(_cuda.KERNEL_NOT_BUILT, grad_out, q, k, v, out, lse, attn_mask, scale,
                                      is_causal, compute_mask_grad, window_left, softcap, sinks)
    return reference.with_filled_row_gradients(outputs, grad_out, q, k, v, out, lse, scale, empty_rows, softcap)


_register_cuda_kernel(flash_attention_bwd, _flash_attention_bwd_cuda)


@flash_attention_bwd.register_fake
def _flash_attention_bwd_fake(grad_out, q, k, v, out, lse, attn_mask, scale, is_causal, compute_mask_grad,
                              window_left=-1, softcap=0.0, sinks=None, empty_rows=0):
    dmask = attn_mask.new_empty(attn_mask.shape) if compute_mask_grad else q.new_empty(0)
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask, dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, scale, is_causal, window_left, empty_rows, softcap, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, sinks)
    ctx.scale = scale
    ctx.is_causal = is_causal
    ctx.window_left = window_left
    ctx.empty_rows = empty_rows
    ctx.softcap = softcap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, attn_mask, sinks = ctx.saved_tensors
    compute_mask_grad = bool(ctx.needs_input_grad[3])
    dq, dk, dv, dmask, dsinks = flash_attention_bwd(
        grad_out, q, k, v, out, lse, attn_mask, ctx.scale, ctx.is_causal, compute_mask_grad, ctx.window_left,
        ctx.softcap, sinks, ctx.empty_rows
    )
    grads = [dq, dk, dv, dmask if compute_mask_grad else None] + [None] * (len(ctx.needs_input_grad) - 4)
    if sinks is not None and ctx.needs_input_grad[9]:
        grads[9] = dsinks
    return tuple(grads)


# The extension registers this same formula in C++ for CUDA tensors (csrc/api.cpp, FlashAttentionAutograd), which
# takes precedence there; every other device, and CUDA without the extension, runs this one.
flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    window_left: int = -1,
    empty_rows: int = EmptyRows.ZERO,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Differentiable ``softmax(q kᵀ · scale + mask) v`` with SDPA's layout and meaning.

    q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D] with Hq % Hkv == 0 (GQA/MQA without copying K/V).
    attn_mask: bool (True = attend) or additive float, broadcastable to [B, Hq, Sq, Sk].
    is_causal: top-left aligned (query i sees keys j <= i), as in SDPA; together with attn_mask both apply.
    window_left: with is_causal, query i also sees no key before i - window_left (a sliding window of
        window_left + 1 keys); -1 for none.
    empty_rows: what rows with no visible key return (``EmptyRows``): 0 by default.
    softcap: > 0 caps the scaled scores at softcap * tanh(scores / softcap) before masks apply; 0 for none.
    sinks: a logit per query head, [Hq], that joins each row's softmax denominator (attention sinks).
    scale defaults to 1/sqrt(D).
    """
    # Every implementation of the op checks its arguments (``check_inputs``; in C++ for the CUDA kernel), so
    # a call pays for the checks once. Here only calls the op cannot even be handed, or whose default scale
    # is undefined, are checked first: for them check_inputs raises the ValueError naming the problem.
    if not all(isinstance(t, Tensor) for t in (q, k, v)) or q.dim() == 0 or q.shape[-1] == 0:
        check_inputs(q, k, v, attn_mask, is_causal, window_left, empty_rows, softcap, sinks)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, _ = flash_attention_fwd(q, k, v, attn_mask, float(scale), bool(is_causal), int(window_left),
                                 int(empty_rows), float(softcap), sinks)
    return out
