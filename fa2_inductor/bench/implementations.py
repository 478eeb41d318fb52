"""The attention implementations the sweep times, and the SDPA check each one must pass first."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _cuda, _extension

FA2 = "fa2_inductor"
DEFAULT_IMPLS = (FA2, "sdpa_flash", "sdpa_cudnn")
# |out - sdpa| <= atol + rtol·|sdpa|. Both outputs are rounded to the dtype and both round P before P·V,
# so honest kernels differ by an ulp or two; a bug shows up far above these.
TOLERANCES = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3), torch.float32: (1e-4, 1e-4)}


class NotAvailable(Exception):
    """The implementation does not run this cell; the message says why."""


def _fa2_inductor(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Callable:
    if q.is_cuda:
        reason = _cuda.kernel_unsupported_reason(q, k, v, None, causal)
        if reason is not None:
            # The op would quietly run its reference implementation; timing that would mislead.
            raise NotAvailable(f"the kernel does not cover this cell ({reason})")

    def call(q, k, v):
        return torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, None, scale, causal)[0]

    return call


def one_cta_per_tile(call: Callable) -> Callable:
    """`call` with our kernels launched one CTA per tile instead of one per SM (what the persistent grid
    gains; kernels without it run alike either way); the persistent grid is back after each call."""
    def per_tile(*args):
        _extension.C.set_persistent_grid(False)
        try:
            return call(*args)
        finally:
            _extension.C.set_persistent_grid(True)

    return per_tile


def _fa2_inductor_per_tile(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Callable:
    """Our kernel with one CTA per query tile, measured in the same run as the persistent grid."""
    call = _fa2_inductor(q, k, v, causal, scale)
    return one_cta_per_tile(call) if q.is_cuda else call


def _sdpa_with(backend: SDPBackend) -> Callable:
    def build(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Callable:
        def call(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        return call

    return build


def attention_by_hand(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tensor:
    """softmax(q kᵀ · scale) v as a model author writes it, for Inductor to fuse as it sees fit."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1) @ v


def _inductor(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Callable:
    torch._dynamo.reset()  # one compile per cell; the sweep's shapes would otherwise pass the recompile limit
    compiled = torch.compile(attention_by_hand, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, scale, causal)


# name -> build(q, k, v, causal, scale) -> call(q, k, v) -> out; build raises NotAvailable to decline a cell.
IMPLEMENTATIONS: dict[str, Callable] = {
    FA2: _fa2_inductor,
    "fa2_per_tile": _fa2_inductor_per_tile,
    "sdpa_flash": _sdpa_with(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": _sdpa_with(SDPBackend.CUDNN_ATTENTION),
    "sdpa_efficient": _sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
    "inductor": _inductor,
}


def sdpa_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """What the implementations are checked against: SDPA with whichever backend it picks."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def compare_to_reference(out: Tensor, expected: Tensor) -> tuple[float, bool]:
    """(max abs error, whether every element is within the dtype's tolerance); NaN is never within."""
    if out.shape != expected.shape:
        return math.inf, False
    expected = expected.float()
    diff = (out.float() - expected).abs()
    atol, rtol = TOLERANCES[out.dtype]
    within = bool((diff <= atol + rtol * expected.abs()).all())
    return diff.max().item(), within
