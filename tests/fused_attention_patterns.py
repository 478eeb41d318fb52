"""The attention spellings Inductor's own fusion knows (``_sfdp_pattern_1`` .. ``_30`` of
torch/_inductor/fx_passes/fuse_attention.py), written out as plain functions.

Each entry gives the function and how to build its inputs; the pass must rewrite it or refuse it with a
named reason, and compiled must equal eager either way (tests/test_fused_attention_patterns.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

B, H, S, D = 2, 4, 8, 16


def _heads_first(*tensors):
    """[B, S, H, D] -> [B, H, S, D] views (what makes Inductor's patterns see clones)."""
    return [t.permute(0, 2, 1, 3) for t in tensors]


def p1(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(D)).softmax(dim=-1).matmul(v)


def p2(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).mul(1.0 / math.sqrt(D)).softmax(dim=-1).matmul(v)


def p3(q, k, v, dropout_p):
    return F.dropout(torch.matmul(q, k.transpose(-2, -1)).div(3.0).softmax(dim=-1), p=dropout_p).matmul(v)


def p4(q, k, v, dropout_p):
    return F.dropout(torch.matmul(q, k.transpose(-2, -1)).mul(0.4).softmax(dim=-1), p=dropout_p).matmul(v)


def p5(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) / 3.0 + mask, dim=-1) @ v


def p6(q, k, v, mask, dropout_p):
    weights = torch.softmax(q @ k.transpose(-2, -1) / 3.0 + mask, dim=-1)
    return torch.dropout(weights, dropout_p, True) @ v


def _half_softmax_chain(q, k, v, dropout_p=None, scale_q=False):
    """Patterns 7-10: scores upcast to float32 for the softmax, probabilities cast back to half."""
    q, k, v = _heads_first(q, k, v)
    if scale_q:
        q = q / math.sqrt(D)
        scores = q @ k.transpose(-2, -1)
    else:
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    weights = torch.softmax(scores.to(torch.float32), dim=-1)
    if dropout_p is not None:
        weights = torch.dropout(weights, dropout_p, True)
    return weights.to(v.dtype) @ v


def p7(q, k, v, dropout_p):
    return _half_softmax_chain(q, k, v, dropout_p)


def p8(q, k, v):
    return _half_softmax_chain(q, k, v)


def p9(q, k, v, dropout_p):
    return _half_softmax_chain(q, k, v, dropout_p, scale_q=True)


def p10(q, k, v):
    return _half_softmax_chain(q, k, v, scale_q=True)


def p11(q, k, v):
    q, k, v = _heads_first(q, k, v)
    return torch.matmul(q, k.transpose(-2, -1)).div(3.0).softmax(dim=-1).matmul(v)


def p12(q, k, v, dropout_p):
    q, k, v = _heads_first(q, k, v)
    return F.dropout(torch.matmul(q, k.transpose(-2, -1)).div(3.0).softmax(dim=-1), p=dropout_p).matmul(v)


def p13(q, k, v, dropout_p):
    weights = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
    return torch.bmm(F.dropout(weights, p=dropout_p), v)


def p14(q, k, v, mask):
    q, k, v = _heads_first(q, k, v)
    return (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1).matmul(v)


def _padding_fill(scores, padding):
    """DistilBert: key padding [B, Sk] (1 = token) -> blocked positions, filled with -inf."""
    blocked = (padding == 0).view(scores.shape[0], 1, 1, scores.shape[-1]).expand_as(scores)
    return scores.masked_fill(blocked, torch.full((), -float("inf"), dtype=scores.dtype))


def p15(q, k, v, padding):
    q, k, v = _heads_first(q, k, v)
    return torch.softmax(_padding_fill(q @ k.transpose(-2, -1) / 3.0, padding), dim=-1) @ v


def p16(q, k, v, mask, dropout_p):
    q, k, v = _heads_first(q, k, v)
    weights = (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1)
    return F.dropout(weights, dropout_p).to(dtype=q.dtype).matmul(v)


def p17(q, k, v, padding, dropout_p):
    q, k, v = _heads_first(q, k, v)
    weights = torch.softmax(_padding_fill(q @ k.transpose(-2, -1) / 3.0, padding), dim=-1)
    return F.dropout(weights, dropout_p) @ v


def _gpt2_scores(q, k, causal):
    """hf GPT-2: scores divided by a 0-d tensor, then where(causal, scores, finfo.min)."""
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    scores = scores.div(torch.full((), math.sqrt(D), dtype=scores.dtype))
    return torch.where(causal, scores, torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype))


def p18(q, k, v, causal, dropout_p):
    q, k, v = _heads_first(q, k, v)
    out = F.dropout(_gpt2_scores(q, k, causal).softmax(dim=-1), dropout_p).matmul(v)
    return out, k, v


def p19(q, k, v, causal, mask, dropout_p):
    scores = _gpt2_scores(q, k, causal) + mask
    return F.dropout(scores.softmax(dim=-1).type(v.dtype), dropout_p).matmul(v)


def p20(q, k, v, padding, dropout_p):
    q, k, v = _heads_first(q, k, v)
    scores = q.div(3.0) @ k.transpose(-2, -1)
    return F.dropout(torch.softmax(_padding_fill(scores, padding), dim=-1), dropout_p) @ v


def _t5_scores(q, k, mask=None):
    scores = torch.matmul(q, k.permute(0, 1, 3, 2))
    return scores if mask is None else scores + mask


def p21(q, k, v, mask):
    q, k, v = _heads_first(q, k, v)
    scores = _t5_scores(q, k, mask).type_as(q)
    return scores.float().softmax(dim=-1).type_as(q).matmul(v)


def p22(q, k, v, mask):
    out = p21(q, k, v, mask)
    _, k, v = _heads_first(q, k, v)
    return out, k, v


def p23(q, k, v):
    q, k, v = _heads_first(q, k, v)
    scores = _t5_scores(q, k).float().type_as(q)
    return scores.float().softmax(dim=-1).type_as(q).matmul(v), k, v


def p24(q, k, v, mask):
    """MBart: 3-D bmm scores, the mask added through a 4-D view."""
    b, h, s, d = q.shape
    q3, k3, v3 = q.view(b * h, -1, d), k.reshape(b * h, -1, d), v.reshape(b * h, -1, d)
    scores = torch.bmm(q3, k3.transpose(1, 2))
    scores = (scores.view(b, h, s, -1) + mask).view(b * h, s, -1)
    weights = F.softmax(scores, dim=-1)
    if q.dtype == torch.half:
        weights = weights.to(torch.half)
    return torch.bmm(weights, v3).view(b, h, s, d)


def p25(q, k, v, mask, dropout_p):
    q, k, v = _heads_first(q, k, v)
    return F.dropout(_t5_scores(q, k, mask).float().softmax(dim=-1).type_as(q), dropout_p).matmul(v)


def p26(q, k, v, mask, dropout_p):
    out = p25(q, k, v, mask, dropout_p)
    _, k, v = _heads_first(q, k, v)
    return out, k, v


def p27(q, k, v, dropout_p):
    q, k, v = _heads_first(q, k, v)
    out = F.dropout(_t5_scores(q, k).float().softmax(dim=-1).type_as(q), dropout_p).matmul(v)
    return out, k, v


def p28(q, k, v, dropout_p):
    """Visformer: pattern 4 on non-contiguous q/k/v."""
    return p4(q, k, v, dropout_p)


def _math_sdpa(q, k, v, mask=None):
    """SDPA's math decomposition: sqrt of the scale on q and on kᵀ, then a safe softmax."""
    q, k, v = _heads_first(q, k, v)
    root = D**-0.25
    scores = torch.ops.aten.mul.Scalar(q, root) @ torch.ops.aten.mul.Scalar(k.transpose(-2, -1), root)
    if mask is not None:
        scores = scores + mask
    return torch.ops.aten._safe_softmax(scores, -1) @ v


def p29(q, k, v, mask):
    return _math_sdpa(q, k, v, mask)


def p30(q, k, v):
    return _math_sdpa(q, k, v)


@dataclass(frozen=True)
class Pattern:
    fn: Callable
    layout: str = "bhsd"  # of q/k/v as passed: "bhsd", "bshd" (the function permutes), "flat" ([B*H, S, D])
    extras: tuple = ()  # further arguments, in order: "mask", "padding", "causal", "dropout_p"
    dtypes: tuple = (torch.float32,)  # the dtypes Inductor's own tests use for it


PATTERNS = {
    1: Pattern(p1),
    2: Pattern(p2),
    3: Pattern(p3, extras=("dropout_p",)),
    4: Pattern(p4, extras=("dropout_p",)),
    5: Pattern(p5, extras=("mask",)),
    6: Pattern(p6, extras=("mask", "dropout_p")),
    7: Pattern(p7, "bshd", ("dropout_p",), (torch.float16,)),
    8: Pattern(p8, "bshd", dtypes=(torch.float16,)),
    9: Pattern(p9, "bshd", ("dropout_p",), (torch.float16,)),
    10: Pattern(p10, "bshd", dtypes=(torch.float16,)),
    11: Pattern(p11, "bshd"),
    12: Pattern(p12, "bshd", ("dropout_p",)),
    13: Pattern(p13, "flat", ("dropout_p",)),
    14: Pattern(p14, "bshd", ("mask",)),
    15: Pattern(p15, "bshd", ("padding",)),
    16: Pattern(p16, "bshd", ("mask", "dropout_p")),
    17: Pattern(p17, "bshd", ("padding", "dropout_p")),
    18: Pattern(p18, "bshd", ("causal", "dropout_p")),
    19: Pattern(p19, "bhsd", ("causal", "mask", "dropout_p")),
    20: Pattern(p20, "bshd", ("padding", "dropout_p")),
    21: Pattern(p21, "bshd", ("mask",)),
    22: Pattern(p22, "bshd", ("mask",)),
    23: Pattern(p23, "bshd"),
    24: Pattern(p24, extras=("mask",)),
    25: Pattern(p25, "bshd", ("mask", "dropout_p")),
    26: Pattern(p26, "bshd", ("mask", "dropout_p")),
    27: Pattern(p27, "bshd", ("dropout_p",)),
    28: Pattern(p28, extras=("dropout_p",)),
    29: Pattern(p29, "bshd", ("mask",), (torch.float32, torch.float16, torch.bfloat16)),
    30: Pattern(p30, "bshd", dtypes=(torch.float32, torch.float16, torch.bfloat16)),
}


def pattern_inputs(pattern: Pattern, dtype, *, train=False, dropout_p=0.0, seed=0):
    """q, k, v and the pattern's extra arguments (masks in the inputs' dtype, as models build them; float
    masks require grad in training, as in Inductor's own suite)."""
    gen = torch.Generator().manual_seed(seed)
    shape = {"bhsd": (B, H, S, D), "bshd": (B, S, H, D), "flat": (B * H, S, D)}[pattern.layout]
    qkv = [torch.randn(shape, generator=gen).to(dtype).requires_grad_(train) for _ in range(3)]
    extras = {  # float masks take part in training, as in Inductor's suite
        "mask": lambda: torch.randn(B, 1, S, S, generator=gen).to(dtype).requires_grad_(train),
        # a visible key in every row: eager's -inf softmax gives NaN on rows with none
        "padding": lambda: torch.cat([torch.ones(B, 1), torch.randint(0, 2, (B, S - 1), generator=gen)], 1).to(dtype),
        "causal": lambda: torch.ones(S, S, dtype=torch.bool).tril(),
        "dropout_p": lambda: dropout_p,
    }
    return [*qkv, *(extras[name]() for name in pattern.extras)]
