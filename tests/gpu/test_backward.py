"""Hopper backward kernel tests: dq, dk, dv (and the additive mask's gradient) against the float64
reference with FlashAttention's 2x rule (the kernel's max error at most twice that of plain PyTorch
attention computed by autograd in the input dtype), over head dims x dtypes x causal x masks, odd sizes,
Sq != Sk, GQA/MQA, strided inputs and outputs, NaN-poisoned gradient buffers, fully masked rows (zero
gradients, never NaN), the deterministic mode (two runs bit-equal) and the persistent grid against one CTA
per tile. Skipped unless an sm_90 GPU and fa2_inductor._C with the backward exist.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

import fa2_inductor  # noqa: E402
from fa2_inductor import _cuda, _extension  # noqa: E402
from fa2_inductor.bench.implementations import one_cta_per_tile  # noqa: E402
from fa2_inductor.reference import EmptyRows, attention_backward, attention_reference  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.gpu.kernel_inputs import COMPILED, DEV, DTYPES, HEAD_DIMS, make_qkv, needs_kernel  # noqa: E402


# ---- the three computations compared ----------------------------------------------------------------


def causal_bool(sq, sk, window_left=-1):
    """[Sq, Sk] top-left causal positions: query i sees keys i - window_left .. i (window_left -1: 0 .. i)."""
    i = torch.arange(sq, device=DEV).unsqueeze(1)
    j = torch.arange(sk, device=DEV).unsqueeze(0)
    visible = j <= i
    return visible & (j >= i - window_left) if window_left >= 0 else visible


def torch_grads(q, k, v, g, scale, is_causal, mask, window_left=-1, softcap=0.0):
    """Plain PyTorch attention in q's dtype through autograd (the error baseline): float32 softmax, rows
    without any visible key give 0. GQA by repeating heads (autograd sums them back)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    mask_leaf = None
    if mask is not None and mask.dtype != torch.bool:
        mask_leaf = mask.detach().requires_grad_(True)
    rep = q.shape[1] // k.shape[1]
    s = (torch.matmul(q, k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale).float()
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if is_causal:
        s = s.masked_fill(~causal_bool(q.shape[2], k.shape[2], window_left), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask_leaf.float()
    visible = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(visible, s, torch.zeros_like(s)), dim=-1) * visible
    out = torch.matmul(p.to(q.dtype), v.repeat_interleave(rep, 1))
    out.backward(g)
    return q.grad, k.grad, v.grad, (None if mask_leaf is None else mask_leaf.grad)


def reference_grads(q, k, v, g, scale, is_causal, mask, compute_mask_grad, window_left=-1, softcap=0.0):
    """The float64 reference: the op's own reference backward on float64 inputs."""
    qd, kd, vd, gd = (t.double() for t in (q, k, v, g))
    md = None if mask is None or mask.dtype == torch.bool else mask.double()
    md = mask if md is None else md
    out, lse = attention_reference(qd, kd, vd, attn_mask=md, scale=scale, is_causal=is_causal, window_left=window_left,
                                   softcap=softcap)
    return attention_backward(gd, qd, kd, vd, out, lse, md, scale, is_causal, compute_mask_grad, window_left, softcap)


def kernel_forward(q, k, v, scale, is_causal, mask, window_left=-1, softcap=0.0):
    """(out, lse) of the forward kernel; where it has no kernel for the call (an additive mask with is_causal
    has no causal forward instantiation by default) the float32 reference's, in q's dtype."""
    b, hq, sq, d = q.shape
    out = torch.empty(b, sq, hq, d, device=DEV, dtype=q.dtype).transpose(1, 2)
    lse = torch.empty(b, hq, sq, device=DEV, dtype=torch.float32)
    if _cuda.kernel_unsupported_reason(q, k, v, mask, is_causal, window_left, softcap) is None:
        _cuda.forward(q, k, v, scale, is_causal, out, lse, attn_mask=mask, window_left=window_left, softcap=softcap)
        return out, lse
    assert mask is not None and mask.dtype != torch.bool and is_causal
    ref_out, ref_lse = attention_reference(q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=scale,
                                           is_causal=True, window_left=window_left)
    out.copy_(ref_out)
    return out, ref_lse


def kernel_grads(q, k, v, g, scale, is_causal, mask=None, dmask=None, deterministic=False, out_layout="bshd",
                 window_left=-1, softcap=0.0):
    """The backward kernel straight through the binding, into NaN-poisoned gradient buffers (bshd: the
    strides of a [B, S, H, D] buffer, so the TMA stores run on non-contiguous outputs)."""
    out, lse = kernel_forward(q, k, v, scale, is_causal, mask, window_left, softcap)

    def poisoned(t):
        b, h, s, d = t.shape
        if out_layout == "bshd":
            return torch.full((b, s, h, d), float("nan"), device=DEV, dtype=t.dtype).transpose(1, 2)
        return torch.full(t.shape, float("nan"), device=DEV, dtype=t.dtype)

    dq, dk, dv = poisoned(q), poisoned(k), poisoned(v)
    expanded = None if mask is None else mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    dmask_view = None if dmask is None else dmask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    _extension.C.bwd(g, q, k, v, out, lse, dq, dk, dv, scale, is_causal, deterministic, expanded, dmask_view,
                     window_left, softcap)
    torch.cuda.synchronize()
    return dq, dk, dv


def assert_twice_torch_error(name, got, ref, base):
    assert not got.isnan().any(), f"{name}: NaN (unwritten or invalid) gradient"
    err = (got.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    tol = 2 * base_err + 1e-4 * max(1.0, ref.abs().max().item())
    assert err <= tol, f"{name}: error {err:.3e} > 2 x torch {got.dtype} error {base_err:.3e}"


def check_backward(q, k, v, is_causal, mask=None, scale=None, mask_grad=False, seed=0, window_left=-1, softcap=0.0):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    gen = torch.Generator(device=DEV).manual_seed(seed)
    g = torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=gen)
    dmask = None
    if mask_grad:
        dmask = torch.zeros((1,) * (4 - mask.dim()) + tuple(mask.shape), device=DEV, dtype=torch.float32)
    got = kernel_grads(q, k, v, g, scale, is_causal, mask, dmask, window_left=window_left, softcap=softcap)
    ref = reference_grads(q, k, v, g, scale, is_causal, mask, mask_grad, window_left, softcap)
    base = torch_grads(q, k, v, g, scale, is_causal, mask, window_left, softcap)
    for name, x, r, bse in zip(("dq", "dk", "dv"), got, ref, base):
        assert x.shape == r.shape, name
        assert_twice_torch_error(name, x, r, bse)
    if mask_grad:
        assert_twice_torch_error("dmask", dmask.reshape(mask.shape), ref[3].double(), base[3])
    return got


# ---- unmasked and causal ----------------------------------------------------------------------------

# (B, Hq, Hkv, Sq, Sk): odd sizes, tails on both sides, Sq != Sk both ways; 160 queries fill two whole 80-row
# query tiles (D = 128 without causal) and end inside a 64-row one causal, its edges inside the 128-key tiles;
# 2080 queries are whole 80-row tiles causal too (D = 128 causal takes them from 2048 query rows).
SHAPES = [
    (1, 2, 2, 1, 1),
    (2, 3, 3, 17, 17),
    (1, 2, 2, 160, 300),
    (1, 2, 2, 2080, 2200),
    (1, 2, 2, 97, 1000),
    (1, 2, 2, 1000, 97),
    (1, 1, 1, 4099, 4099),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_numerics(d, dt, is_causal, shape):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=sq * 7 + sk)
    check_backward(q, k, v, is_causal, seed=sq)


@pytest.mark.parametrize("hkv", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_gqa_strided(d, dt, is_causal, hkv):
    needs_kernel(d, dt)
    q, k, v = make_qkv(2, 8, hkv, 300, 333, d, DTYPES[dt], layout="bshd", seed=hkv)
    assert not q.is_contiguous()
    check_backward(q, k, v, is_causal, seed=hkv)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_scales(d):
    """Custom, negative and zero scales (masked entries are zeroed in P, so any scale works)."""
    needs_kernel(d, "bf16")
    q, k, v = make_qkv(1, 2, 1, 129, 257, d, torch.bfloat16, seed=3)
    for scale in (0.3, -0.2, 0.0):
        check_backward(q * 2, k * 2, v, True, scale=scale, seed=d)


def test_backward_contiguous_outputs_and_op_path():
    """The op's CUDA backward runs the kernel (no fallback counted) and returns contiguous gradients (autograd
    then gives each leaf its gradient in the leaf's own strides)."""
    from torch._dynamo.utils import counters

    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    q, k, v = make_qkv(2, 4, 2, 200, 300, d, DTYPES[dt], layout="bshd", requires_grad=True, seed=9)
    counters["fa2_inductor"].clear()
    out = fa2_inductor.flash_attention(q, k, v, is_causal=True)
    out.sum().backward()  # a gradient with zero strides: copied before the TMA loads
    assert not any(key.startswith("backward_fallback") for key in counters["fa2_inductor"])
    for t in (q, k, v):
        assert not t.grad.isnan().any()
    lse = torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, None, 1 / math.sqrt(d), True)[1]
    grads = torch.ops.fa2_inductor.flash_attention_bwd(torch.ones_like(out), q, k, v, out, lse, None,
                                                       1 / math.sqrt(d), True, False)
    assert all(g.is_contiguous() for g in grads[:3])
    ref = reference_grads(q.detach(), k.detach(), v.detach(), torch.ones_like(out), 1 / math.sqrt(d), True, None, False)
    base = torch_grads(q, k, v, torch.ones_like(out), 1 / math.sqrt(d), True, None)
    for name, x, r, bse in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref, base):
        assert_twice_torch_error(name, x, r, bse)


# ---- masks ------------------------------------------------------------------------------------------


def _pos(sq, sk):
    return torch.arange(sq, device=DEV).unsqueeze(1), torch.arange(sk, device=DEV).unsqueeze(0)


def padding_bool(b, hq, sq, sk, gen):  # [B, 1, 1, Sk]; batch 1 sees no key at all (empty rows)
    lengths = torch.randint(1, sk + 1, (b,), device=DEV, generator=gen)
    lengths[0] = sk
    lengths[1] = 0
    return (torch.arange(sk, device=DEV)[None, :] < lengths[:, None])[:, None, None, :]


def sliding_bool(b, hq, sq, sk, gen, window=150):  # [Sq, Sk]: causal within a window
    i, j = _pos(sq, sk)
    return (j <= i) & (i - j < window)


def random_bool(b, hq, sq, sk, gen):  # [B, Hq, Sq, Sk], no block structure; empty and full rows
    m = torch.rand(b, hq, sq, sk, device=DEV, generator=gen) < 0.5
    m[:, :, ::7] = False
    m[:, :, 3::11] = True
    return m


def empty_rows_bool(b, hq, sq, sk, gen):  # [1, 1, Sq, Sk]: every third query row sees nothing
    m = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=DEV)
    m[:, :, ::3] = False
    return m


def bias_f32(b, hq, sq, sk, gen):  # [1, Hq, Sq, Sk] T5-like bias: partial blocks only, batch-broadcast
    return torch.randn(1, hq, sq, sk, device=DEV, generator=gen)


def padding_additive(b, hq, sq, sk, gen, dtype=torch.bfloat16):  # [B, 1, 1, Sk] additive, -inf padding
    m = padding_bool(b, hq, sq, sk, gen)
    return torch.where(m, torch.zeros((), dtype=dtype, device=DEV), torch.tensor(float("-inf"), dtype=dtype, device=DEV))


def row_bias_f32(b, hq, sq, sk, gen):  # [B, 1, 1, Sk] finite additive bias shared by every query row
    return torch.randn(b, 1, 1, sk, device=DEV, generator=gen)


MASKS = {
    "padding": padding_bool,
    "sliding": sliding_bool,
    "random": random_bool,
    "empty_rows": empty_rows_bool,
    "bias": bias_f32,
    "padding_additive": padding_additive,
}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_masks(d, dt, mask_name):
    needs_kernel(d, dt)
    gen = torch.Generator(device=DEV).manual_seed(d)
    b, hq, hkv, sq, sk = 2, 4, 2, 300, 413
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], layout="bshd", seed=d + 1)
    mask = MASKS[mask_name](b, hq, sq, sk, gen)
    if mask.dtype == torch.bfloat16 and dt == "fp16":
        mask = mask.half()
    dq, dk, dv = check_backward(q, k, v, False, mask=mask, seed=d)
    _, lse = kernel_forward(q, k, v, 1 / math.sqrt(d), False, mask)
    empty = torch.isneginf(lse)
    if empty.any():  # rows with no visible key: exactly zero dq, and no NaN anywhere
        assert dq[empty].abs().max().item() == 0.0


@pytest.mark.parametrize("mask_name", ["bias", "row_bias", "padding_additive"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_mask_gradient(d, mask_name):
    """dmask = dS summed over the mask's broadcast dims (batch for the bias, heads and query rows for
    the row bias), on the GPU."""
    needs_kernel(d, "bf16")
    gen = torch.Generator(device=DEV).manual_seed(d + 7)
    b, hq, hkv, sq, sk = 2, 4, 4, 200, 257
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=d + 2)
    builder = {"bias": bias_f32, "row_bias": row_bias_f32, "padding_additive": padding_additive}[mask_name]
    mask = builder(b, hq, sq, sk, gen)
    check_backward(q, k, v, False, mask=mask, mask_grad=True, seed=d)


def test_op_mask_gradient_layout():
    """The op returns dmask with the mask's shape and dtype, contiguous (as the fake does)."""
    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    q, k, v = make_qkv(2, 4, 2, 100, 150, d, DTYPES[dt], requires_grad=True, seed=4)
    bias = torch.randn(4, 100, 150, device=DEV, dtype=DTYPES[dt], requires_grad=True)
    out = fa2_inductor.flash_attention(q, k, v, attn_mask=bias)
    out.backward(torch.randn_like(out))
    assert bias.grad.shape == bias.shape and bias.grad.dtype == bias.dtype and bias.grad.is_contiguous()
    assert not bias.grad.isnan().any()


# ---- causal windows, and masks together with the causal positions -----------------------------------

# (B, Hq, Hkv, Sq, Sk, window_left): windows of 0 keys, shorter than a tile, across tiles, Sq != Sk both ways.
WINDOW_SHAPES = [
    (2, 3, 3, 17, 17, 0),
    (1, 2, 2, 97, 1000, 30),
    (1, 2, 2, 1000, 97, 200),
    (1, 4, 2, 777, 777, 128),
    (1, 1, 1, 4099, 4099, 1000),
]


@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_window(d, dt, shape):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk, window_left = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], layout="bshd", seed=sum(shape))
    check_backward(q, k, v, True, seed=d, window_left=window_left)


@pytest.mark.parametrize("window_left", [-1, 100], ids=["causal", "window"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_masks_with_causal(d, dt, mask_name, window_left):
    """A mask and the causal positions (and a window) together: blocks hidden by either are skipped,
    rows hidden by both get zero gradients."""
    needs_kernel(d, dt)
    gen = torch.Generator(device=DEV).manual_seed(d + 3)
    b, hq, hkv, sq, sk = 2, 4, 2, 300, 413
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], layout="bshd", seed=d + 5)
    mask = MASKS[mask_name](b, hq, sq, sk, gen)
    if mask.dtype == torch.bfloat16 and dt == "fp16":
        mask = mask.half()
    check_backward(q, k, v, True, mask=mask, seed=d, window_left=window_left)


@pytest.mark.parametrize("mask_name", ["bias", "padding_additive"])
def test_backward_mask_gradient_with_causal(mask_name):
    """dmask under the causal positions and a window: zero where they hide a key, dS elsewhere."""
    d = 128 if (128, "bf16") in COMPILED else sorted(COMPILED)[0][0]
    needs_kernel(d, "bf16")
    gen = torch.Generator(device=DEV).manual_seed(11)
    b, hq, hkv, sq, sk = 2, 4, 4, 200, 257
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=12)
    mask = {"bias": bias_f32, "padding_additive": padding_additive}[mask_name](b, hq, sq, sk, gen)
    check_backward(q, k, v, True, mask=mask, mask_grad=True, seed=d, window_left=64)


def test_op_backward_runs_the_kernel_for_masks_with_causal_and_windows():
    """The op's CUDA backward takes a bool mask with is_causal and a window without any fallback."""
    from torch._dynamo.utils import counters

    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    q, k, v = make_qkv(2, 4, 2, 257, 257, d, DTYPES[dt], requires_grad=True, seed=21)
    keys = padding_bool(2, 4, 257, 257, torch.Generator(device=DEV).manual_seed(2))
    counters.clear()
    try:
        for mask, window_left in ((keys, -1), (None, 64), (keys, 64)):
            out = torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, mask, 1 / math.sqrt(d), True, window_left)[0]
            out.backward(torch.randn_like(out))
        assert not any(key.startswith(("backward_fallback", "reference_fallback")) for key in counters["fa2_inductor"])
    finally:
        counters.clear()


# ---- soft-capping ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["full", "causal", "window", "padding", "padding_causal", "empty_rows"])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_softcap(d, dt, softcap, case):
    """Soft-capped scores (Gemma 2's cap * tanh(x / cap)): small caps saturate many scores (the slope 1 - tanh^2
    far from 1), large ones few; with bool masks, causal positions and windows."""
    needs_kernel(d, dt)
    gen = torch.Generator(device=DEV).manual_seed(d + 17)
    b, hq, hkv, sq, sk = 2, 4, 2, 300, 413
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], layout="bshd", seed=d + 19)
    q = q * 3  # scores of a few units, so that a cap of 5 bends them
    mask = None
    if case.startswith("padding"):
        mask = padding_bool(b, hq, sq, sk, gen)
    elif case == "empty_rows":
        mask = empty_rows_bool(b, hq, sq, sk, gen)
    is_causal = case in ("causal", "window", "padding_causal")
    window_left = 100 if case == "window" else -1
    check_backward(q, k, v, is_causal, mask=mask, seed=d, window_left=window_left, softcap=softcap)


# ---- rows a finite fill's policy filled ---------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("empty_rows", [EmptyRows.MEAN_V, EmptyRows.ALL_KEYS], ids=["mean_v", "all_keys"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_op_backward_filled_rows(dt, empty_rows, softcap):
    """Left padding under MEAN_V / ALL_KEYS (Hugging Face's finfo.min masks): the rows that see no key get
    eager's gradients for a fill added to their scores (V their weights times dO, q and k the softmax's
    gradient), the others the kernel's (no fallback counted); against the float64 op on CPU, 2x rule, with
    PyTorch's own bf16/fp16 eager math (the fill added) as the base."""
    from torch._dynamo.utils import counters

    d = 128 if (128, dt) in COMPILED else sorted(d for d, n in COMPILED if n == dt)[0]
    needs_kernel(d, dt)
    b, hq, hkv, s = 2, 4, 2, 300
    q, k, v = make_qkv(b, hq, hkv, s, s, d, DTYPES[dt], layout="bshd", seed=23)
    q, k, v = (q * 3).requires_grad_(), k.requires_grad_(), v.requires_grad_()  # q * 3: a cap of 5 bends scores
    visible = torch.ones(b, 1, 1, s, dtype=torch.bool, device=DEV)
    visible[1, ..., :37] = False  # rows 0-36 of batch 1 see no key (causal)
    g = torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=torch.Generator(device=DEV).manual_seed(29))
    options = dict(attn_mask=visible, is_causal=True, empty_rows=empty_rows, softcap=softcap)
    counters["fa2_inductor"].clear()
    got = torch.autograd.grad(fa2_inductor.flash_attention(q, k, v, **options), (q, k, v), g)
    assert not any(key.startswith("backward_fallback") for key in counters["fa2_inductor"])
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(fa2_inductor.flash_attention(*leaves, **{**options, "attn_mask": visible.cpu()}),
                              leaves, g.double().cpu())
    hidden = ~(visible & causal_bool(s, s))
    if empty_rows == EmptyRows.ALL_KEYS:  # a fill that shifts the whole row: as if unmasked there
        hidden &= ~hidden.all(-1, keepdim=True)
    scores = q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2) / math.sqrt(d)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + torch.where(hidden, torch.finfo(q.dtype).min, 0.0).to(q.dtype)
    eager = torch.softmax(scores, -1) @ v.repeat_interleave(hq // hkv, 1)
    base = torch.autograd.grad(eager, (q, k, v), g)
    for name, x, r, bse in zip(("dq", "dk", "dv"), got, ref, base):
        assert_twice_torch_error(name, x, r.to(DEV), bse)
    assert got[0][1, :, :37].abs().amax() > 0.01  # the filled rows' dq


def test_op_backward_no_filled_row_is_zero_policy():
    """MEAN_V with no row left empty (right padding under causal) adds nothing: in deterministic mode the
    gradients equal EmptyRows.ZERO's bit for bit (the check for filled rows finds none)."""
    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    q, k, v = make_qkv(2, 4, 2, 300, 300, d, DTYPES[dt], layout="bshd", requires_grad=True, seed=31)
    visible = torch.ones(2, 1, 1, 300, dtype=torch.bool, device=DEV)
    visible[1, ..., 250:] = False
    g = torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=torch.Generator(device=DEV).manual_seed(37))
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        grads = [torch.autograd.grad(fa2_inductor.flash_attention(q, k, v, attn_mask=visible, is_causal=True,
                                                                  empty_rows=policy), (q, k, v), g)
                 for policy in (EmptyRows.ZERO, EmptyRows.MEAN_V)]
    finally:
        torch.use_deterministic_algorithms(previous)
    for name, zero, mean_v in zip("qkv", *grads):
        assert torch.equal(zero, mean_v), f"d{name}"


# ---- determinism ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["full", "causal", "gqa_causal", "causal_long", "window", "mask", "mask_causal",
                                  "mask_window"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_deterministic(d, case):
    """Deterministic mode: two runs give bit-identical gradients (and still the right ones); causal_long runs
    the long-sequence tile where a head dim has one."""
    needs_kernel(d, "bf16")
    hkv = 2 if case == "gqa_causal" else 4
    sq, sk = (2080, 2200) if case == "causal_long" else (700, 900)
    q, k, v = make_qkv(2, 4, hkv, sq, sk, d, torch.bfloat16, seed=d)
    is_causal = case != "full" and case != "mask"
    window_left = 300 if case.endswith("window") else -1
    masked = case.startswith("mask")
    mask = random_bool(2, 4, sq, sk, torch.Generator(device=DEV).manual_seed(1)) if masked else None
    g = torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=torch.Generator(device=DEV).manual_seed(d + 1))
    scale = 1 / math.sqrt(d)
    first = kernel_grads(q, k, v, g, scale, is_causal, mask, deterministic=True, window_left=window_left)
    second = kernel_grads(q, k, v, g, scale, is_causal, mask, deterministic=True, window_left=window_left)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    ref = reference_grads(q, k, v, g, scale, is_causal, mask, False, window_left)
    base = torch_grads(q, k, v, g, scale, is_causal, mask, window_left)
    for name, x, r, bse in zip(("dq", "dk", "dv"), first, ref, base):
        assert_twice_torch_error(name, x, r, bse)


def test_deterministic_mode_follows_torch_flag():
    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    q, k, v = make_qkv(1, 4, 4, 500, 500, d, DTYPES[dt], seed=6)
    out, lse = kernel_forward(q, k, v, 0.1, False, None)
    g = torch.randn_like(q)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        runs = [torch.ops.fa2_inductor.flash_attention_bwd(g, q, k, v, out, lse, None, 0.1, False, False)
                for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(previous)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][:3], runs[1][:3]))


def test_unsupported_backward_reasons():
    d, dt = next(iter(sorted(COMPILED)))
    q, k, v = make_qkv(1, 2, 2, 16, 16, d, DTYPES[dt])
    ok = torch.ones(16, 16, dtype=torch.bool, device=DEV)
    assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, ok, False, False) is None
    assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, None, True, False) is None
    assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, ok, True, False, 4) is None
    assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, ok.float(), True, False, 4) is None
    assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, None, False, False, 4) == "window_left without is_causal"
    assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, ok, True, False, -1, 30.0) is None
    assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, ok.float(), False, False, -1, 30.0).startswith(
        "softcap with an additive mask")
    assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, ok.double(), False, False) is not None
    assert _cuda.backward_kernel_unsupported_reason(q[:, :, :8], q, k, v, q, None, False, False) is not None
    bias = torch.zeros(1, 1, 16, 16, device=DEV)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, bias, False, True) is not None
        assert _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, bias.expand(1, 2, 16, 16).clone(), False, True) is None
    finally:
        torch.use_deterministic_algorithms(previous)


# ---- the persistent grid ----------------------------------------------------------------------------

# name -> ((B, Hq, Hkv, Sq, Sk), is_causal, mask): several key tiles per CTA on 132 SMs; the last three leave
# key tiles that no query sees (keys past a short causal query range, a batch padded to nothing) between
# tiles with work, so a CTA's stride runs tiles without steps.
PERSISTENT_CASES = {
    "full": ((3, 48, 48, 700, 700), False, None),
    "gqa_causal": ((3, 48, 16, 700, 700), True, None),
    "causal_long": ((2, 16, 16, 2080, 2080), True, None),  # D = 128: the long-sequence (80-row) tile
    "causal_more_keys": ((2, 32, 32, 150, 1500), True, None),
    "padding": ((4, 32, 32, 600, 600), False, padding_bool),
    "padding_causal": ((4, 32, 32, 600, 600), True, padding_bool),
}


@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_backward_persistent_grid(d, dt, case):
    """One CTA per SM taking slots of key tiles (the default) against one CTA per tile: dK and dV
    bit-equal (a tile sums its steps in the same order either way), dQ (added in whatever order the tiles
    finish) and all three within the 2x rule."""
    needs_kernel(d, dt)
    (b, hq, hkv, sq, sk), is_causal, make_mask = PERSISTENT_CASES[case]
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=d + sq)
    gen = torch.Generator(device=DEV).manual_seed(5)
    mask = None if make_mask is None else make_mask(b, hq, sq, sk, gen)
    g = torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=gen)
    scale = 1 / math.sqrt(d)
    persistent = kernel_grads(q, k, v, g, scale, is_causal, mask)
    per_tile = one_cta_per_tile(lambda: kernel_grads(q, k, v, g, scale, is_causal, mask))()
    assert torch.equal(persistent[1], per_tile[1]), "dk: persistent and one-CTA-per-tile differ"
    assert torch.equal(persistent[2], per_tile[2]), "dv: persistent and one-CTA-per-tile differ"
    ref = reference_grads(q, k, v, g, scale, is_causal, mask, False)
    base = torch_grads(q, k, v, g, scale, is_causal, mask)
    for grads in (persistent, per_tile):
        for name, x, r, bse in zip(("dq", "dk", "dv"), grads, ref, base):
            assert_twice_torch_error(name, x, r, bse)
