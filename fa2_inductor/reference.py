"""Plain-PyTorch attention: the op's implementation on devices without the kernel, and the tests' reference.

Everything is computed in float32 (float64 stays float64) and processed in query blocks, so at most
``B * Hq * block * Sk`` scores exist at once. K and V are never repeated for GQA: queries are grouped
as ``[B, Hkv, G, Sq, D]`` against ``[B, Hkv, 1, Sk, D]``.

Rows whose keys are all masked out give ``lse = -inf`` and, as ``empty_rows`` (an ``EmptyRows``) says,
``out = 0`` (FlashAttention's convention), the mean of V over all keys, or attention over all keys.

``softcap`` > 0 caps the scaled scores as ``softcap * tanh(scores / softcap)`` before masks apply (Gemma 2's
logit soft-capping); ``sinks`` (one logit per query head) joins every row's softmax denominator without a
value (gpt-oss's attention sinks), so the probabilities of a row sum to less than one and ``lse`` includes it.
"""

from __future__ import annotations

import enum
import math
from typing import Iterator, Optional

import torch
from torch import Tensor

# Scores held at once by one query block, in elements (64 Mi float32 = 256 MiB).
_MAX_BLOCK_SCORES = 1 << 26

# torch 2.13's CPU build can compute a process's first large multi-threaded exp at reduced
# accuracy on the calling thread (float32 off by ~1e-4 relative; seen with OMP_NUM_THREADS=2, 4).
# One small exp on this thread first avoids it; it costs microseconds.
torch.exp(torch.zeros(1))


class EmptyRows(enum.IntEnum):
    """What a row with no visible key returns; its lse is -inf whichever is chosen.

    Masking code says which by the value it gives hidden scores: -inf (or a bool mask) leaves such a row
    empty; a finite fill far below every score (Hugging Face's finfo.min) makes the whole row the fill, a
    uniform softmax; a finite fill that hides keys but does not swallow the score (e.g. -65504, cuDNN's
    conversion of bool masks) shifts the whole row equally, which softmax ignores. An empty row gets no
    gradient; a filled one gets eager's for a fill added to its scores (``filled_row_gradients``).
    """

    ZERO = 0  # out = 0: SDPA's and FlashAttention's convention
    MEAN_V = 1  # the mean of V over all keys
    ALL_KEYS = 2  # attention over all keys, as if unmasked (no mask, no causal, no window)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _query_blocks(batch: int, heads: int, seq_q: int, seq_k: int) -> Iterator[slice]:
    per_row = max(1, batch * heads * max(seq_k, 1))
    block = max(1, min(seq_q, _MAX_BLOCK_SCORES // per_row))
    for start in range(0, seq_q, block):
        yield slice(start, min(start + block, seq_q))


def _group_view(x: Tensor, kv_heads: int) -> Tensor:
    """[B, Hq, S, X] -> [B, Hkv, G, S, X] (a view: K/V are never repeated)."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def _mask_block(
    attn_mask: Optional[Tensor], rows: slice, shape: tuple, kv_heads: int, dtype: torch.dtype
) -> Optional[Tensor]:
    """The additive bias for one query block, shaped [B|1, Hkv|1, G|1, rows, Sk] (broadcastable)."""
    if attn_mask is None:
        return None
    b, hq, sq, sk = shape
    mask = attn_mask
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[2] != 1:
        mask = mask[:, :, rows]
    if mask.shape[1] == 1:
        mask = mask.unsqueeze(2)
    else:
        mask = mask.unflatten(1, (kv_heads, hq // kv_heads))
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        return torch.where(mask, zero, float("-inf"))
    return mask.to(dtype)


def _causal_bias(rows: slice, seq_k: int, window_left: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Top-left causal: query i sees keys j <= i, and with window_left >= 0 no key before i - window_left."""
    q_pos = torch.arange(rows.start, rows.stop, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_k, device=device).unsqueeze(0)
    visible = k_pos <= q_pos
    if window_left >= 0:
        visible &= k_pos >= q_pos - window_left
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(visible, zero, float("-inf"))


def _capped_scores(q, k, scale, softcap, rows, kv_heads, acc):
    """Scaled (and soft-capped) scores of one query block, before masks: [B, Hkv, G, rows, Sk]."""
    scores = torch.matmul(_group_view(q[:, :, rows], kv_heads).to(acc), k.to(acc).unsqueeze(2).transpose(-1, -2))
    scores = scores * scale
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def _masked(scores, attn_mask, is_causal, window_left, rows, shape, kv_heads, acc):
    """``scores`` of one query block with the mask and the causal positions applied."""
    bias = _mask_block(attn_mask, rows, shape, kv_heads, acc)
    if bias is not None:
        scores = scores + bias
    if is_causal:
        scores = scores + _causal_bias(rows, shape[3], window_left, scores.device, acc)
    return scores


def empty_outputs(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Uninitialised (out, lse) with the layout every implementation returns.

    out is [B, Hq, Sq, Dv] with the strides of a [B, Sq, Hq, Dv] buffer, so the usual
    ``out.transpose(1, 2).reshape(B, Sq, Hq * Dv)`` that follows attention is free; lse is contiguous.
    """
    b, hq, sq, _ = q.shape
    dv = v.shape[-1]
    out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    return out, lse


def _sink_logits(sinks: Optional[Tensor], kv_heads: int, acc: torch.dtype) -> Optional[Tensor]:
    """[Hq] sink logits as [1, Hkv, G, 1, 1], broadcasting against a block's scores."""
    return None if sinks is None else sinks.to(acc).reshape(1, kv_heads, -1, 1, 1)


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    scale: float,
    is_causal: bool,
    out: Tensor,
    lse: Tensor,
    window_left: int = -1,
    empty_rows: int = 0,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> None:
    """Writes softmax(q kᵀ · scale + mask) v into ``out`` and the natural-log LSE into ``lse``."""
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    shape = (b, hq, sq, sk)
    acc = _accumulation_dtype(q.dtype)
    v_acc = v.to(acc).unsqueeze(2)
    sink = _sink_logits(sinks, hkv, acc)
    for rows in _query_blocks(b, hq, sq, sk):
        scores = _capped_scores(q, k, scale, softcap, rows, hkv, acc)
        scores = _masked(scores, attn_mask, is_causal, window_left, rows, shape, hkv, acc)
        probs, finite_max, row_sum = _shifted_exp(scores, sink)
        block_out = torch.matmul(probs, v_acc) / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
        block_lse = (finite_max + torch.log(row_sum)).squeeze(-1)
        out[:, :, rows] = block_out.flatten(1, 2).to(out.dtype)
        lse[:, :, rows] = block_lse.flatten(1, 2).to(lse.dtype)
    if empty_rows != EmptyRows.ZERO and sk > 0:
        fill_empty_rows(out, lse, q, k, v, scale, empty_rows, softcap)


def fill_empty_rows(out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, empty_rows: int,
                    softcap: float = 0.0) -> None:
    """Rows with lse = -inf get the mean of V over all keys, or attention over all keys, soft-capped like the
    call (``EmptyRows``)."""
    empty = torch.isneginf(lse).unsqueeze(-1)
    if empty_rows == EmptyRows.MEAN_V:
        group = out.shape[1] // v.shape[1]
        filled = v.to(_accumulation_dtype(v.dtype)).mean(dim=2).repeat_interleave(group, dim=1).unsqueeze(2)
    else:
        filled, _ = empty_outputs(q, v)
        attention_forward(q, k, v, None, scale, False, filled, torch.empty_like(lse), softcap=softcap)
    out.copy_(torch.where(empty, filled.to(out.dtype), out))


def _shifted_exp(scores: Tensor, sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(exp(scores - row max), row max, row sum of the exps, the sink's included); fully masked rows (max
    -inf) shift by 0 so exp gives 0 instead of NaN."""
    if scores.shape[-1] == 0:
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    else:
        row_max = scores.amax(dim=-1, keepdim=True)
    if sink is not None:
        row_max = torch.maximum(row_max, sink)
    finite_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - finite_max)
    row_sum = probs.sum(dim=-1, keepdim=True)
    if sink is not None:
        row_sum = row_sum + torch.exp(sink - finite_max)
    return probs, finite_max, row_sum


def _probabilities(scores: Tensor, row_lse: Tensor) -> Tensor:
    """softmax probabilities of ``scores`` under the forward's (float32) ``row_lse``.

    Where ``row_lse`` is these scores' own, rounded, the row is normalised here in full precision (float64
    stays exact; a row filled with finfo.min everywhere, whose lse lost log(row sum), stays right); else
    (an lse over more keys, as a ring step passes) P = exp(scores - lse). Rows with lse -inf get none."""
    local, row_max, row_sum = _shifted_exp(scores)
    own = (row_max + torch.log(row_sum)).to(row_lse.dtype) == row_lse
    lse = row_lse.to(scores.dtype)
    from_lse = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    from_lse = torch.where(torch.isfinite(lse), from_lse, torch.zeros_like(from_lse))
    return torch.where(own, local / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum)), from_lse)


def _score_gradients(probs: Tensor, d_out: Tensor, v_acc: Tensor, row_delta: Tensor) -> tuple[Tensor, Tensor]:
    """One block's share of dV (Pᵀ·dO) and its scores' gradient, the softmax's: P ∘ (dO·Vᵀ − rowsum(dO ∘ O))."""
    d_v = torch.matmul(probs.transpose(-1, -2), d_out)
    d_probs = torch.matmul(d_out, v_acc.transpose(-1, -2))
    return d_v, probs * (d_probs - row_delta)


def _query_key_gradients(d_scores, capped, softcap, k_acc, q_block, scale) -> tuple[Tensor, Tensor]:
    """One block's dQ ([B, Hq, rows, D]) and share of dK from its scores' gradient, through the soft-cap's slope
    (d(cap * tanh(x / cap)) / dx = 1 - (capped / cap)^2)."""
    if softcap:
        d_scores = d_scores * (1 - (capped / softcap) ** 2)
    d_q = torch.matmul(d_scores, k_acc).flatten(1, 2) * scale
    return d_q, torch.matmul(d_scores.transpose(-1, -2), q_block) * scale


def attention_backward(
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
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients of out w.r.t. q, k, v (the mask's when asked, the sinks' when given), with
    P = exp(scores - lse).

    ``lse`` may cover more keys than these (a ring step passes the global one). Rows whose lse is -inf
    get no gradient; rows whose lse is too large to locate the scores (a row filled with finfo.min
    everywhere: its lse lost log(row sum)) are normalised over these keys instead.
    """
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    shape = (b, hq, sq, sk)
    acc = _accumulation_dtype(q.dtype)
    k_acc = k.to(acc).unsqueeze(2)
    v_acc = v.to(acc).unsqueeze(2)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros((b, hkv, hq // hkv, sk, k.shape[-1]), dtype=acc, device=q.device)
    dv = torch.zeros((b, hkv, hq // hkv, sk, v.shape[-1]), dtype=acc, device=q.device)
    dmask = torch.zeros(shape, dtype=acc, device=q.device) if compute_mask_grad else None
    sink = _sink_logits(sinks, hkv, acc)
    dsink = None if sinks is None else torch.zeros((1, hkv, hq // hkv, 1, 1), dtype=acc, device=q.device)
    # rowsum(dO * O): the softmax Jacobian's correction term.
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    for rows in _query_blocks(b, hq, sq, sk):
        capped = _capped_scores(q, k, scale, softcap, rows, hkv, acc)
        scores = _masked(capped, attn_mask, is_causal, window_left, rows, shape, hkv, acc)
        row_lse = _group_view(lse[:, :, rows].unsqueeze(-1), hkv)
        if sink is None:
            probs = _probabilities(scores, row_lse)
        else:  # the sink as one more key, with no value
            probs = _probabilities(torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], -1), row_lse)
            probs, p_sink = probs[..., :-1], probs[..., -1:]
        row_delta = _group_view(delta[:, :, rows].unsqueeze(-1), hkv)
        d_v, d_scores = _score_gradients(probs, _group_view(grad_out[:, :, rows].to(acc), hkv), v_acc, row_delta)
        dv += d_v
        if dmask is not None:
            dmask[:, :, rows] = d_scores.flatten(1, 2)
        if dsink is not None:  # d(out)/d(sink) = -p_sink * out, so the row's share is -p_sink * delta
            dsink -= (p_sink * row_delta).sum(dim=(0, 3, 4), keepdim=True)
        q_block = _group_view(q[:, :, rows].to(acc), hkv)
        dq[:, :, rows], d_k = _query_key_gradients(d_scores, capped, softcap, k_acc, q_block, scale)
        dk += d_k
    grads = (dq.to(q.dtype), dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype))
    if dmask is not None:
        dmask = _reduce_to_shape(dmask, attn_mask.shape).to(attn_mask.dtype)
    if dsink is not None:
        dsink = dsink.reshape(sinks.shape).to(sinks.dtype)
    return (*grads, dmask, dsink)


def backward_outputs(*args) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``attention_backward(*args)`` as the backward op returns it: dq, dk, dv, dmask, dsinks, all contiguous,
    dmask and dsinks empty where not asked for."""
    q = args[1]
    dq, dk, dv, dmask, dsinks = attention_backward(*args)
    dmask = q.new_empty(0) if dmask is None else dmask.contiguous()
    dsinks = q.new_empty(0) if dsinks is None else dsinks.contiguous()
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dmask, dsinks


def filled_row_gradients(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, empty_rows: int,
    softcap: float = 0.0,
) -> Optional[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The gradients of the rows the forward filled (lse -inf, ``empty_rows`` MEAN_V or ALL_KEYS), which the
    backward's other paths leave out: (positions, dq at those query positions, dk, dv), in the accumulation
    dtype, or None when no row was filled.

    Eager computes such a row with the fill added to every score: its weights (uniform, or the softmax of the
    unmasked scores) give V the row's share of dO, and the scores get the softmax's gradient, which the fill
    passes on to q and k. Computed only at the query positions where some batch and head has such a row
    (finding them costs one wait for the device), or at every position while a CUDA graph is captured (which
    cannot wait)."""
    if empty_rows == EmptyRows.ZERO or k.shape[2] == 0:
        return None
    filled = torch.isneginf(lse)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        positions = torch.arange(q.shape[2], device=q.device)
    else:
        positions = filled.any(dim=1).any(dim=0).nonzero().squeeze(1)
        if positions.numel() == 0:
            return None
    b, hq = q.shape[:2]
    hkv, sk = k.shape[1], k.shape[2]
    acc = _accumulation_dtype(q.dtype)
    k_acc = k.to(acc).unsqueeze(2)
    v_acc = v.to(acc).unsqueeze(2)
    q_rows = q[:, :, positions]
    # dO of the other batches' and heads' rows at these positions is zeroed: the main backward gave theirs.
    d_out = torch.where(filled[:, :, positions].unsqueeze(-1), grad_out[:, :, positions].to(acc), 0)
    delta = (d_out * out[:, :, positions].to(acc)).sum(-1)
    dq = torch.empty(q_rows.shape, dtype=acc, device=q.device)
    dk = torch.zeros((b, hkv, hq // hkv, sk, k.shape[-1]), dtype=acc, device=q.device)
    dv = torch.zeros((b, hkv, hq // hkv, sk, v.shape[-1]), dtype=acc, device=q.device)
    for rows in _query_blocks(b, hq, positions.numel(), sk):
        capped = _capped_scores(q_rows, k, scale, softcap, rows, hkv, acc)
        if empty_rows == EmptyRows.MEAN_V:
            probs = torch.full_like(capped, 1.0 / sk)
        else:
            probs = torch.softmax(capped, dim=-1)
        row_delta = _group_view(delta[:, :, rows].unsqueeze(-1), hkv)
        d_v, d_scores = _score_gradients(probs, _group_view(d_out[:, :, rows], hkv), v_acc, row_delta)
        dv += d_v
        q_block = _group_view(q_rows[:, :, rows].to(acc), hkv)
        dq[:, :, rows], d_k = _query_key_gradients(d_scores, capped, softcap, k_acc, q_block, scale)
        dk += d_k
    return positions, dq, dk.sum(2), dv.sum(2)


def with_filled_row_gradients(
    outputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
    out: Tensor, lse: Tensor, scale: float, empty_rows: int, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward op's ``outputs`` with ``filled_row_gradients`` added to dq, dk and dv."""
    filled = filled_row_gradients(grad_out, q, k, v, out, lse, scale, empty_rows, softcap)
    if filled is None:
        return outputs
    positions, filled_dq, filled_dk, filled_dv = filled
    dq, dk, dv, dmask, dsinks = outputs
    dq = dq.index_add(2, positions, filled_dq.to(dq.dtype))  # those rows' dq is 0 where filled
    dk = (dk.to(filled_dk.dtype) + filled_dk).to(dk.dtype)
    dv = (dv.to(filled_dv.dtype) + filled_dv).to(dv.dtype)
    return dq, dk, dv, dmask, dsinks


def _reduce_to_shape(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sums a [B, Hq, Sq, Sk] gradient over the dimensions the mask was broadcast along."""
    extra = grad.dim() - len(shape)
    grad = grad.sum(dim=tuple(range(extra))) if extra > 0 else grad
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    window_left: int = -1,
    empty_rows: int = 0,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) computed by the reference path, for tests and examples."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = empty_outputs(q, v)
    attention_forward(q, k, v, attn_mask, scale, is_causal, out, lse, window_left, empty_rows, softcap, sinks)
    return out, lse
