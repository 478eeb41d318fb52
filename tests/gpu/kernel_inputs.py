"""Inputs, skips, the PyTorch baseline and the accuracy rule shared by the Hopper kernel tests.

Import it after the module-level skips: it reads the compiled kernel list from fa2_inductor._C.
"""

from __future__ import annotations

import pytest
import torch

from fa2_inductor import _extension

COMPILED = {(int(d), str(n)) for d, n in _extension.C.compiled_kernels()}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 128, 192, 256)  # the head dims with kernels of their own, forward and backward
DEV = "cuda"


def needs_kernel(d: int, dt: str) -> None:
    """Skips the test when the build did not compile this head dim and dtype."""
    if (d, dt) not in COMPILED:
        pytest.skip(f"hdim{d} {dt} not compiled")


def make_qkv(b, hq, hkv, sq, sk, d, dtype, layout="bhsd", requires_grad=False, seed=0):
    """Random q [b, hq, sq, d] and k, v [b, hkv, sk, d]; layout "bshd" views a [B, S, H, D] buffer
    (non-contiguous strides, as models produce them)."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def one(h, s):
        if layout == "bshd":
            t = torch.randn(b, s, h, d, device=DEV, dtype=dtype, generator=g).transpose(1, 2)
        else:
            t = torch.randn(b, h, s, d, device=DEV, dtype=dtype, generator=g)
        return t.detach().requires_grad_(requires_grad)

    return one(hq, sq), one(hkv, sk), one(hkv, sk)


def torch_attention(q, k, v, scale, is_causal):
    """Plain PyTorch attention in q's dtype (the error baseline); GQA by repeating heads."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if is_causal:
        sq, sk = q.shape[2], k.shape[2]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    p = torch.softmax(s.to(acc), dim=-1).to(q.dtype)
    return torch.matmul(p, v)


def masked_torch_attention(q, k, v, mask, scale):
    """Plain PyTorch attention in q's dtype with a bool or additive mask (the error baseline of masked
    calls); fully masked rows give 0."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = (torch.matmul(q, k.transpose(-1, -2)) * scale).float()
    if mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    else:
        s = s + mask.float()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.matmul(p, v)


def assert_twice_torch_error(out, lse, ref, base):
    """FlashAttention's rule: the kernel's max error against the float64 reference ``ref`` is at most twice
    that of plain PyTorch attention in the input dtype (``base``); NaN means an unwritten element.
    Returns (kernel error, PyTorch error)."""
    assert not out.isnan().any(), "kernel left NaN (unwritten or invalid) output"
    assert not lse.isnan().any(), "kernel left NaN (unwritten or invalid) lse"
    err = (out.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    assert err <= 2 * base_err + 1e-5, f"out error {err:.3e} > 2 x torch {out.dtype} error {base_err:.3e}"
    return err, base_err
