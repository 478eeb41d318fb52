"""The dtype a site runs in, and the roundings inside its chain that the op reproduces.

The op computes scores and softmax in float32 and rounds the probabilities to its input dtype before
P @ V, as FlashAttention does. A chain that rounds scores or probabilities to that same dtype is
therefore within the op's rounding; a rounding to any other float dtype is not.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from . import op_table as ops
from .fx_utils import forward_users, tensor_val
from .refusals import Refusal, Refused
from .site import AttentionSite

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _upcast_source(node: fx.Node) -> Optional[fx.Node]:
    """x for ``x.to(float32)`` with x in a low-precision float dtype."""
    if not ops.calls(node, *ops.CAST):
        return None
    source = node.args[0]
    low = tensor_val(source).dtype
    return source if low in _LOW_PRECISION and tensor_val(node).dtype == torch.float32 else None


def run_in_input_precision(site: AttentionSite) -> None:
    """q, k, v upcast from one low-precision dtype, and the output cast back to it (how SDPA's math
    path and some models compute attention in float32 inside a bf16/fp16 model): the op takes the
    low-precision q, k, v and gives the low-precision output, within FlashAttention's rounding rule."""
    sources = [_upcast_source(n) for n in (site.q, site.k, site.v)]
    if None in sources or len({tensor_val(s).dtype for s in sources}) != 1:
        return
    low = tensor_val(sources[0]).dtype
    users = forward_users(site.anchor)
    if len(users) != 1 or not ops.calls(users[0], *ops.CAST) or tensor_val(users[0]).dtype != low:
        return
    if any(u is not users[0] for u in site.anchor.users):  # the float32 output is read elsewhere too
        return
    site.q, site.k, site.v = sources
    site.anchor = users[0]
    site.notes.append(f"{low} inputs, float32 inside")


def chain_rounding_refusal(site: AttentionSite, rounded_to: set) -> Optional[Refused]:
    """A refusal when the chain rounds scores or probabilities to another dtype than the op's input dtype."""
    dtype = tensor_val(site.q).dtype
    other = sorted(str(d) for d in rounded_to if d != dtype)
    if other:
        return Refused(Refusal.VALUE_CHANGING_CAST, f"rounding to {', '.join(other)} inside a {dtype} attention")
    return None
