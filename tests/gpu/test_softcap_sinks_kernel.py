"""Soft-capping and attention sinks on the Hopper kernels: the forward (every kernel variant: plain, causal,
window, bool and additive masks) against the float64 reference with FlashAttention's 2x rule, the LSE, rows
and calls without a visible key, and the op end to end (no reference fallback in the forward; with sinks the
backward runs the backward kernel and the sinks' gradient follows the 2x rule; soft-capped backward is the
reference's, counted). Skipped unless an sm_90 GPU and fa2_inductor._C exist.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

import fa2_inductor  # noqa: E402
from fa2_inductor import _cuda, _extension  # noqa: E402
from fa2_inductor.reference import attention_backward, attention_reference  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.gpu.kernel_inputs import (  # noqa: E402
    DEV, DTYPES, HEAD_DIMS, assert_twice_torch_error, make_qkv, needs_kernel,
)

op = torch.ops.fa2_inductor.flash_attention_fwd.default


@pytest.fixture
def fresh_counters():
    counters["fa2_inductor"].clear()
    yield counters["fa2_inductor"]
    counters["fa2_inductor"].clear()


def positions_kept(sq, sk, is_causal, window_left):
    """[Sq, Sk] bool: the keys causal and window positions leave each query."""
    keep = torch.ones(sq, sk, dtype=torch.bool, device=DEV)
    if is_causal:
        i = torch.arange(sq, device=DEV)[:, None]
        j = torch.arange(sk, device=DEV)[None, :]
        keep = j <= i
        if window_left >= 0:
            keep = keep & (j >= i - window_left)
    return keep


def torch_attention(q, k, v, scale, is_causal, window_left, mask, softcap, sinks):
    """Plain PyTorch in q's dtype (the error baseline): scores, cap and mask in q's dtype, float32 softmax
    with the sink as one more column."""
    rep = q.shape[1] // k.shape[1]
    s = torch.matmul(q, k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.float()
    s = s.masked_fill(~positions_kept(q.shape[2], k.shape[2], is_causal, window_left), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if sinks is not None:
        column = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    else:
        visible = torch.isfinite(s).any(-1, keepdim=True)
        p = torch.softmax(torch.where(visible, s, torch.zeros_like(s)), dim=-1) * visible
    return torch.matmul(p.to(q.dtype), v.repeat_interleave(rep, 1))


def check_forward(q, k, v, is_causal, softcap, sinks, mask=None, window_left=-1):
    scale = 1.0 / math.sqrt(q.shape[-1])
    b, hq, sq, d = q.shape
    out = torch.full((b, sq, hq, d), float("nan"), device=DEV, dtype=q.dtype).transpose(1, 2)
    lse = torch.full((b, hq, sq), float("nan"), device=DEV, dtype=torch.float32)
    assert _cuda.kernel_unsupported_reason(q, k, v, mask, is_causal, window_left, softcap, sinks) is None
    _cuda.forward(q, k, v, scale, is_causal, out, lse, mask, window_left, 0, softcap, sinks)
    md = None if mask is None or mask.dtype == torch.bool else mask.double()
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), mask if md is None else md, scale,
                                       is_causal, window_left, 0, softcap, None if sinks is None else sinks.double())
    base = torch_attention(q, k, v, scale, is_causal, window_left, mask, softcap, sinks)
    assert_twice_torch_error(out, lse, ref, base)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        lse_err = (lse.double() - ref_lse)[finite].abs().max().item()
        assert lse_err <= 2e-3 + 1e-3 * ref_lse[finite].abs().max().item(), f"lse error {lse_err:.3e}"
    return out, lse


SHAPES = [(1, 2, 2, 1, 1), (2, 4, 2, 17, 97), (1, 2, 1, 1000, 1000), (1, 2, 2, 97, 4099)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", ["plain", "causal", "window", "bool", "bool_causal", "additive"])
@pytest.mark.parametrize("extra", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_numerics(d, dt, extra, variant, shape):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=sq + sk)
    q = q * 4  # large scores, so that a cap of 5 bends them
    softcap = 5.0 if extra in ("softcap", "both") else 0.0
    sinks = torch.linspace(-2.0, 3.0, hq, device=DEV) if extra in ("sinks", "both") else None
    g = torch.Generator(device=DEV).manual_seed(sk)
    mask, is_causal, window_left = None, variant in ("causal", "window", "bool_causal"), -1
    if variant == "window":
        window_left = 31
    if variant.startswith("bool"):
        mask = torch.rand(b, 1, sq, sk, device=DEV, generator=g) > 0.3
    if variant == "additive":
        mask = torch.randn(b, 1, sq, sk, device=DEV, generator=g, dtype=DTYPES[dt])
    check_forward(q, k, v, is_causal, softcap, sinks, mask, window_left)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_rows_without_a_key_give_all_weight_to_the_sink(dt):
    d = HEAD_DIMS[0]
    needs_kernel(d, dt)
    q, k, v = make_qkv(1, 2, 2, 300, 300, d, DTYPES[dt])
    mask = torch.ones(1, 1, 300, 300, dtype=torch.bool, device=DEV)
    mask[..., 7, :] = False
    mask[..., 128:256, :] = False  # a whole query tile: its key block list is empty
    sinks = torch.tensor([0.5, -1.5], device=DEV)
    out, lse = check_forward(q, k, v, False, 0.0, sinks, mask)
    for row in (7, 128, 255):
        assert torch.equal(out[:, :, row], torch.zeros_like(out[:, :, row]))
        assert torch.equal(lse[0, :, row], sinks)


def test_no_keys_with_sinks_gives_zero_and_the_sink_as_lse():
    d = HEAD_DIMS[0]
    q = torch.randn(1, 2, 5, d, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 0, d, device=DEV, dtype=torch.bfloat16)
    sinks = torch.tensor([0.25, 2.0], device=DEV)
    out, lse = op(q, kv, kv, None, 0.1, False, -1, 0, 0.0, sinks)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.view(1, 2, 1).expand(1, 2, 5))


def _grads(q, k, v, sinks, g, softcap, is_causal):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, sinks)]
    out = fa2_inductor.flash_attention(*leaves[:3], is_causal=is_causal, softcap=softcap, sinks=leaves[3])
    out.backward(g)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sinks_train_on_the_kernels(dt, is_causal, fresh_counters):
    """No fallback either way; dq, dk, dv and dsinks within twice PyTorch's own error (autograd in the dtype).
    dsinks is one sum per head whose error is that of O's rounding to the dtype (PyTorch's: dP's); over 4
    heads the max of such sums exceeds 2x in about one draw of 13, over 32 heads it stays within 1.7x."""
    d = 128 if (128, dt) in {(dd, t) for dd, t in _extension.C.compiled_kernels()} else HEAD_DIMS[0]
    needs_kernel(d, dt)
    q, k, v = make_qkv(2, 32, 8, 333, 333, d, DTYPES[dt], seed=3)
    sinks = torch.linspace(-1.0, 2.0, 32, device=DEV)
    g = torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=torch.Generator(device=DEV).manual_seed(4))
    got = _grads(q, k, v, sinks, g, 0.0, is_causal)
    assert not any(key.startswith(("reference_fallback", "backward_fallback")) for key in fresh_counters), dict(
        fresh_counters)
    scale = 1.0 / math.sqrt(d)
    qd, kd, vd, gd, sd = (t.double() for t in (q, k, v, g, sinks))
    out, lse = attention_reference(qd, kd, vd, None, scale, is_causal, sinks=sd)
    ref = attention_backward(gd, qd, kd, vd, out, lse, None, scale, is_causal, False, sinks=sd)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, sinks)]
    torch_attention(*leaves[:3], scale, is_causal, -1, None, 0.0, leaves[3]).backward(g)
    for name, x, r, base in zip(("dq", "dk", "dv", "dsinks"), got, ref[:3] + (ref[4],), [t.grad for t in leaves]):
        err = (x.double() - r).abs().max().item()
        base_err = (base.double() - r).abs().max().item()
        assert err <= 2 * base_err + 1e-4 * max(1.0, r.abs().max().item()), f"{name}: {err:.3e} vs {base_err:.3e}"


def test_softcapped_backward_runs_the_kernel_except_with_an_additive_mask(fresh_counters):
    d = HEAD_DIMS[0]
    q, k, v = make_qkv(1, 2, 2, 64, 64, d, torch.bfloat16, requires_grad=True)
    fa2_inductor.flash_attention(q, k, v, is_causal=True, softcap=20.0).sum().backward()
    assert not any(key.startswith(("reference_fallback", "backward_fallback")) for key in fresh_counters), dict(
        fresh_counters)
    bias = torch.zeros(1, 1, 64, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="softcap"):
        fa2_inductor.flash_attention(q, k, v, attn_mask=bias, softcap=20.0).sum().backward()
    assert sum(n for key, n in fresh_counters.items() if key.startswith("backward_fallback:softcap with an additive")) == 1
