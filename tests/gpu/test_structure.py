"""Masks as structure on the Hopper kernel: causal and sliding-window positions as arguments, together
with a bool key-padding mask (or none), and the empty-row policy (rows with no visible key averaging V,
as Hugging Face's finfo.min masks make them). Numerics against float64 with FlashAttention's 2x rule,
NaN-poisoned outputs, odd sizes, GQA, left and right padding, windows narrower and wider than a tile.
Skipped without an sm_90 GPU and the built kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from fa2_inductor import EmptyRows, _cuda, _extension  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.attention_math import dense_attention_f64  # noqa: E402
from tests.gpu.kernel_inputs import (  # noqa: E402
    DEV, DTYPES, HEAD_DIMS, assert_twice_torch_error, make_qkv, needs_kernel,
)


def positions(sq, sk, window_left):
    i = torch.arange(sq, device=DEV).unsqueeze(1)
    j = torch.arange(sk, device=DEV).unsqueeze(0)
    visible = j <= i
    if window_left >= 0:
        visible &= j >= i - window_left
    return visible


def torch_attention(q, k, v, visible, scale, empty_rows):
    """Plain PyTorch attention in q's dtype (the error baseline)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (torch.matmul(q, k.transpose(-1, -2)) * scale).float()
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0).to(q.dtype)
    out = torch.matmul(p, v)
    empty = ~visible.any(-1, keepdim=True)
    if empty_rows == EmptyRows.MEAN_V:
        out = torch.where(empty, v.float().mean(-2, keepdim=True).to(q.dtype), out)
    elif empty_rows == EmptyRows.ALL_KEYS:
        out = torch.where(empty, torch.matmul(torch.softmax(s, dim=-1).to(q.dtype), v), out)
    return out


def key_padding(b, sk, side, g):
    """[B, 1, 1, Sk] bool: batch 0 unpadded, the others padded on ``side`` by a random amount."""
    pad = torch.randint(1, max(2, sk // 2), (b,), generator=g, device=DEV)
    pad[0] = 0
    j = torch.arange(sk, device=DEV)[None, :]
    keep = j >= pad[:, None] if side == "left" else j < (sk - pad)[:, None]
    return keep[:, None, None, :]


def check(q, k, v, mask, window_left, empty_rows, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, hq, sq, d = q.shape
    assert _cuda.kernel_unsupported_reason(q, k, v, mask, True, window_left) is None
    out = torch.full((b, sq, hq, d), float("nan"), device=DEV, dtype=q.dtype).transpose(1, 2)
    lse = torch.full((b, hq, sq), float("nan"), device=DEV, dtype=torch.float32)
    _cuda.forward(q, k, v, scale, True, out, lse, mask, window_left, empty_rows)
    torch.cuda.synchronize()
    ref, ref_lse = dense_attention_f64(q, k, v, mask, scale, True, window_left, empty_rows)
    visible = positions(sq, k.shape[2], window_left)[None, None]
    if mask is not None:
        visible = visible & mask
    base = torch_attention(q, k, v, visible.expand(b, hq, -1, -1), scale, empty_rows)
    assert_twice_torch_error(out, lse, ref, base)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows with no visible key differ (lse -inf pattern)"
    if finite.any():
        diff = (lse.double() - ref_lse)[finite].abs()
        assert bool((diff <= 2e-3 + 1e-3 * ref_lse[finite].abs()).all()), f"lse error {diff.max().item():.3e}"
    if empty_rows == EmptyRows.ZERO and (~finite).any():
        assert out[~finite].abs().max().item() == 0.0
    return out, lse


# (B, Hq, Hkv, Sq, Sk): odd sizes, GQA, a single query row, more keys than queries.
SHAPES = [(3, 4, 2, 257, 257), (2, 2, 1, 1000, 1000), (2, 4, 4, 130, 300), (1, 2, 1, 1, 97), (2, 2, 2, 700, 517)]
WINDOWS = [-1, 0, 63, 200, 4096]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window_left", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_causal_window_without_mask(d, dt, window_left, shape):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    check(*make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=sq + sk), None, window_left, EmptyRows.ZERO)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window_left", [-1, 63, 300], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("empty_rows", list(EmptyRows), ids=lambda e: e.name.lower())
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_key_padding_with_causal(d, empty_rows, side, window_left, shape):
    needs_kernel(d, "bf16")
    b, hq, hkv, sq, sk = shape
    g = torch.Generator(device=DEV).manual_seed(sq * 7 + sk)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=sq + 3 * sk)
    check(q, k, v, key_padding(b, sk, side, g), window_left, empty_rows)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_dense_bool_mask_with_causal_and_strided_inputs(d, layout):
    needs_kernel(d, "fp16")
    b, hq, hkv, sq, sk = 2, 4, 2, 300, 300
    g = torch.Generator(device=DEV).manual_seed(5)
    dense = torch.rand(b, 1, sq, sk, device=DEV, generator=g) < 0.8
    dense[:, :, 7] = False  # an empty row
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, torch.float16, layout=layout, seed=4)
    check(q, k, v, dense, 100, EmptyRows.ZERO)
    check(q, k, v, dense, -1, EmptyRows.MEAN_V)
    check(q, k, v, dense, 20, EmptyRows.ALL_KEYS)


def test_empty_row_policies_without_empty_rows_change_nothing():
    d, dt = 128, "bf16"
    needs_kernel(d, dt)
    q, k, v = make_qkv(2, 4, 2, 500, 500, d, DTYPES[dt], seed=1)
    mask = torch.ones(2, 1, 1, 500, dtype=torch.bool, device=DEV)
    out_zero, lse_zero = check(q, k, v, mask, -1, EmptyRows.ZERO)
    for policy in (EmptyRows.MEAN_V, EmptyRows.ALL_KEYS):
        out, lse = check(q, k, v, mask, -1, policy)
        assert torch.equal(out_zero, out) and torch.equal(lse_zero, lse)


def test_op_runs_the_structured_kernel():
    """The op's CUDA path with the new arguments gives the direct call's bits (no reference fallback)."""
    from torch._dynamo.utils import counters

    d, dt = 64, "bf16"
    needs_kernel(d, dt)
    counters.clear()
    q, k, v = make_qkv(2, 4, 2, 300, 300, d, DTYPES[dt], seed=2)
    mask = key_padding(2, 300, "left", torch.Generator(device=DEV).manual_seed(0))
    for policy in EmptyRows:
        out, lse = torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, mask, 0.125, True, 50, int(policy))
        ref_out, ref_lse = check(q, k, v, mask, 50, policy, scale=0.125)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert not any(key.startswith("reference_fallback") for key in counters["fa2_inductor"])


def test_structure_refusals():
    d, dt = 64, "bf16"
    needs_kernel(d, dt)
    q, k, v = make_qkv(1, 2, 2, 17, 16, d, DTYPES[dt])  # 17 rows: more than a decode step
    pad = torch.ones(1, 1, 1, 16, dtype=torch.bool, device=DEV)
    assert _cuda.kernel_unsupported_reason(q, k, v, pad, True, 5) is None
    assert _cuda.kernel_unsupported_reason(q, k, v, None, False, 5) == "window_left without is_causal"
    additive = torch.zeros(1, 1, 1, 16, device=DEV)
    assert _cuda.kernel_unsupported_reason(q, k, v, additive, True) == "additive attn_mask together with is_causal"
