"""Masked Hopper kernel tests: boolean and additive masks (float32 / bf16 / fp16), every broadcast
form, against the float64 reference with FlashAttention's 2x rule (the kernel's max error at most
twice that of plain PyTorch attention in the input dtype). Covers block skipping (causal, sliding
window, padding, all-masked / all-visible masks), partial blocks only (random masks, T5-like bias),
fully masked rows (out = 0, lse = -inf), HF's finfo.min masks (uniform rows, not empty ones),
odd sizes, GQA, strided masks and the op's CUDA path. Skipped without an sm_90 GPU and the built
kernel with mask support.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

import fa2_inductor  # noqa: E402,F401
from fa2_inductor import _cuda, _extension  # noqa: E402
from fa2_inductor.reference import attention_reference  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)
if not hasattr(_extension.C, "fwd_masked"):
    pytest.skip("fa2_inductor._C built without mask support", allow_module_level=True)
if os.environ.get("FA2_INDUCTOR_DISABLE_MASK_KERNEL", "0") == "1":
    pytest.skip("masked kernels disabled (FA2_INDUCTOR_DISABLE_MASK_KERNEL=1)", allow_module_level=True)

from tests.gpu.kernel_inputs import (  # noqa: E402
    COMPILED, DEV, DTYPES, HEAD_DIMS, assert_twice_torch_error, make_qkv, needs_kernel,
)
from tests.gpu.kernel_inputs import masked_torch_attention as torch_attention  # noqa: E402


def run_masked(q, k, v, mask, scale):
    """The CUDA path directly, with NaN-poisoned outputs so unwritten elements fail."""
    b, hq, sq, d = q.shape
    out = torch.full((b, sq, hq, d), float("nan"), device=DEV, dtype=q.dtype).transpose(1, 2)
    lse = torch.full((b, hq, sq), float("nan"), device=DEV, dtype=torch.float32)
    reason = _cuda.kernel_unsupported_reason(q, k, v, mask, False)
    assert reason is None, reason
    _cuda.forward(q, k, v, scale, False, out, lse, attn_mask=mask)
    torch.cuda.synchronize()
    return out, lse


def check_masked(q, k, v, mask, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = run_masked(q, k, v, mask, scale)
    ref_mask = mask if mask.dtype == torch.bool else mask.double()
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), attn_mask=ref_mask, scale=scale)
    base = torch_attention(q, k, v, mask, scale)
    assert_twice_torch_error(out, lse, ref, base)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "fully masked rows differ (lse -inf pattern)"
    empty = ~finite
    if empty.any():  # fully masked rows: out exactly 0
        assert out[empty].abs().max().item() == 0.0, "fully masked rows must give out = 0"
    if finite.any():
        diff = (lse.double() - ref_lse)[finite].abs()
        tol = 2e-3 + 1e-3 * ref_lse[finite].abs()
        assert bool((diff <= tol).all()), f"lse error {diff.max().item():.3e}"
    return out, lse


# ---- mask builders: (b, hq, sq, sk, generator) -> mask in its natural (broadcast) shape ----------


def _pos(sq, sk):
    i = torch.arange(sq, device=DEV).unsqueeze(1)
    j = torch.arange(sk, device=DEV).unsqueeze(0)
    return i, j


def causal_bool(b, hq, sq, sk, g):  # [1, 1, Sq, Sk], top-left like is_causal
    i, j = _pos(sq, sk)
    return (j <= i)[None, None]


def sliding_bool(b, hq, sq, sk, g, window=300):  # Mistral-style: causal and within the window
    i, j = _pos(sq, sk)
    return ((j <= i) & (i - j < window))[None, None]


def padding_bool(b, hq, sq, sk, g):  # [B, 1, 1, Sk]; batch 0 sees every key, batch 1 none
    lengths = torch.randint(1, sk + 1, (b,), device=DEV, generator=g)
    lengths[0] = sk
    if b > 1:
        lengths[1] = 0
    return (torch.arange(sk, device=DEV)[None, :] < lengths[:, None])[:, None, None, :]


def random_bool(b, hq, sq, sk, g):  # full [B, Hq, Sq, Sk], no block structure; some empty / full rows
    m = torch.rand(b, hq, sq, sk, device=DEV, generator=g) < 0.5
    m[:, :, ::7] = False
    m[:, :, 3::11] = True
    return m


def blocks_bool(b, hq, sq, sk, g):  # [B, 1, Sq, Sk]: 128x128 blocks all masked / all visible / random
    nb_q, nb_k = -(-sq // 128), -(-sk // 128)
    kind = torch.randint(0, 3, (b, 1, nb_q, nb_k), device=DEV, generator=g)
    kind = kind.repeat_interleave(128, 2).repeat_interleave(128, 3)[:, :, :sq, :sk]
    rnd = torch.rand(b, 1, sq, sk, device=DEV, generator=g) < 0.7
    return torch.where(kind == 0, False, torch.where(kind == 1, True, rnd))


def all_false(b, hq, sq, sk, g):
    return torch.zeros(b, 1, sq, sk, dtype=torch.bool, device=DEV)


def all_true(b, hq, sq, sk, g):
    return torch.ones(1, 1, sq, sk, dtype=torch.bool, device=DEV)


def _additive(m, dtype, fill=float("-inf")):
    zero = torch.zeros((), dtype=dtype, device=DEV)
    return torch.where(m, zero, torch.tensor(fill, dtype=dtype, device=DEV))


def hf_min(b, hq, sq, sk, g, dtype=torch.float32):
    """HF's 4-D causal + left-padding mask: [B, 1, Sq, Sk] with finfo.min (not -inf): rows of a
    padded query position are all finfo.min, which SDPA treats as uniform, not empty."""
    i, j = _pos(sq, sk)
    pad = torch.randint(0, max(1, sk // 2), (b,), device=DEV, generator=g)
    keep = (j <= i)[None] & (torch.arange(sk, device=DEV)[None, :] >= pad[:, None])[:, None, :]
    return _additive(keep[:, None], dtype, torch.finfo(dtype).min)


def bias_add(b, hq, sq, sk, g, dtype=torch.float32):  # T5-like relative-position bias [1, Hq, Sq, Sk]
    i, j = _pos(sq, sk)
    slopes = torch.rand(hq, device=DEV, generator=g)[:, None, None] * 0.05
    return (-(i - j).abs()[None].float() * slopes)[None].to(dtype)


def random_add(b, hq, sq, sk, g, dtype=torch.float32):  # full, random values, -inf entries and rows
    m = torch.randn(b, hq, sq, sk, device=DEV, generator=g) * 2
    m = m.masked_fill(torch.rand(b, hq, sq, sk, device=DEV, generator=g) < 0.3, float("-inf"))
    m[:, :, ::5] = float("-inf")
    m[:, :, 2::9] = 0.0
    return m.to(dtype)


BOOL_MASKS = {
    "causal": causal_bool,
    "sliding": sliding_bool,
    "padding": padding_bool,
    "random": random_bool,
    "blocks": blocks_bool,
    "all_false": all_false,
    "all_true": all_true,
}
ADD_MASKS = {
    "causal_inf": lambda b, hq, sq, sk, g, dtype: _additive(causal_bool(b, hq, sq, sk, g), dtype).expand(b, 1, sq, sk),
    "padding_inf": lambda b, hq, sq, sk, g, dtype: _additive(padding_bool(b, hq, sq, sk, g), dtype),
    "hf_min": hf_min,
    "bias": bias_add,
    "random": random_add,
}
# (B, Hq, Hkv, Sq, Sk): odd sizes, GQA, one query row, skippable key blocks; Sk a multiple of 16
# (bool masks read 16 bytes at a time there), with and without a short last key tile
SHAPES = [(2, 4, 2, 200, 333), (2, 2, 1, 1, 257), (2, 2, 2, 700, 1100), (1, 2, 1, 384, 512), (2, 2, 2, 130, 272)]
MASK_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", list(BOOL_MASKS))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_bool_mask(d, dt, kind, shape):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    g = torch.Generator(device=DEV).manual_seed(sq * 3 + sk)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=sq + sk)
    check_masked(q, k, v, BOOL_MASKS[kind](b, hq, sq, sk, g))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mdt", list(MASK_DTYPES))
@pytest.mark.parametrize("kind", list(ADD_MASKS))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_additive_mask(d, dt, kind, mdt, shape):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    g = torch.Generator(device=DEV).manual_seed(sq * 5 + sk)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=sq + 2 * sk)
    check_masked(q, k, v, ADD_MASKS[kind](b, hq, sq, sk, g, MASK_DTYPES[mdt]))


BROADCASTS = {
    "2d": lambda m: m[0, 0],
    "1_1_sq_sk": lambda m: m[:1, :1],
    "b_1_sq_sk": lambda m: m[:, :1],
    "1_h_sq_sk": lambda m: m[:1],
    "b_1_1_sk": lambda m: m[:, :1, :1],
    "full": lambda m: m,
    "expanded_view": lambda m: m[:1, :1].expand(m.shape),
    "col_strided": lambda m: m.transpose(-1, -2).contiguous().transpose(-1, -2),
    # rows start at odd addresses: the bool pre-pass must fall back from its 16-byte loads
    "misaligned": lambda m: torch.cat([m[..., :1], m], -1)[..., 1:],
}


@pytest.mark.parametrize("sk", [517, 512])
@pytest.mark.parametrize("form", list(BROADCASTS))
@pytest.mark.parametrize("additive", [False, True], ids=["bool", "add"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_mask_broadcast_forms(d, additive, form, sk):
    needs_kernel(d, "bf16")
    b, hq, hkv, sq = 2, 4, 2, 300
    g = torch.Generator(device=DEV).manual_seed(11)
    full = torch.rand(b, hq, sq, sk, device=DEV, generator=g) < 0.6
    full[..., :200] = True  # some fully visible blocks
    full[..., 384:] = False  # some fully masked blocks
    full[:, :, 5] = False  # an empty row
    if additive:
        full = _additive(full, torch.bfloat16)
    mask = BROADCASTS[form](full)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=5)
    check_masked(q, k, v, mask)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_mask_custom_and_negative_scale(d):
    needs_kernel(d, "fp16")
    q, k, v = make_qkv(2, 2, 2, 257, 300, d, torch.float16, seed=9)
    g = torch.Generator(device=DEV).manual_seed(2)
    check_masked(q, k, v, sliding_bool(2, 2, 257, 300, g, window=100), scale=0.3)
    check_masked(q, k, v, random_add(2, 2, 257, 300, g, torch.float32), scale=-0.2)
    check_masked(q, k, v, random_bool(2, 2, 257, 300, g), scale=0.0)


def test_op_uses_masked_kernel():
    """The op's CUDA implementation runs the masked kernel (same bits as the direct call)."""
    d, dt = next(iter(sorted(COMPILED)))
    q, k, v = make_qkv(2, 2, 2, 300, 400, d, DTYPES[dt], seed=1)
    g = torch.Generator(device=DEV).manual_seed(3)
    for mask in (padding_bool(2, 2, 300, 400, g), hf_min(2, 2, 300, 400, g)):
        out, lse = torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, mask, 0.125, False)
        ref_out, ref_lse = run_masked(q, k, v, mask, 0.125)
        assert torch.equal(out, ref_out)
        assert torch.equal(lse, ref_lse)


def test_mask_refusals():
    d, dt = next(iter(sorted(COMPILED)))
    q, k, v = make_qkv(1, 2, 2, 16, 16, d, DTYPES[dt])
    ok = torch.ones(16, 16, dtype=torch.bool, device=DEV)
    assert _cuda.kernel_unsupported_reason(q, k, v, ok, False) is None
    assert _cuda.kernel_unsupported_reason(q, k, v, ok, True) is None  # bool mask and causal: both apply
    assert _cuda.kernel_unsupported_reason(q, k, v, ok.double(), False) is not None
    assert _cuda.kernel_unsupported_reason(q, k, v, ok.int(), False) is not None
    assert _cuda.kernel_unsupported_reason(q, k, v, torch.ones(3, 16, dtype=torch.bool, device=DEV), False) is not None
    assert _cuda.backward_unsupported_reason(q, k, v, ok, False) is None  # the backward kernel takes masks
