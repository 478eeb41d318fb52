"""The textbook float64 attention the tests compare against: dense, K/V repeated, no tricks."""

from __future__ import annotations

import torch


def dense_attention_f64(q, k, v, attn_mask=None, scale=None, is_causal=False, window_left=-1, empty_rows=0):
    """(out, lse) in float64; rows with no visible key give lse = -inf and, by ``empty_rows`` (the op's
    EmptyRows: 0, 1, 2), out = 0, the mean of V over all keys, or unmasked attention over all keys."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    unmasked = torch.softmax(scores, dim=-1) @ v if empty_rows == 2 else None
    if is_causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        if window_left >= 0:
            visible &= torch.ones_like(visible).triu(-window_left)
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(torch.float64)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float64).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = probs @ v
    if empty_rows:
        filled = v.mean(dim=-2, keepdim=True) if empty_rows == 1 else unmasked
        out = torch.where(torch.isneginf(lse).unsqueeze(-1), filled, out)
    return out, lse
