"""The C++ forward and backward of csrc/fa2/reference_aten.hpp against fa2_inductor/reference.py's
attention_forward and backward_outputs (and _cuda.sinks_gradient), of which they are ports: on CPU, over dtypes,
shapes, GQA, masks, causal windows, soft-capping, sinks, empty-row policies (the filled rows' gradients too), scales,
an lse over more keys (a ring step's) and strided inputs, the two must give the same bits.

The header is compiled into a small extension first (half a minute to a few minutes), too long for every test
run: the module runs only when asked, as a developer does after changing either side:

    FA2_INDUCTOR_CPP_TESTS=1 python -m pytest -q -p no:cacheprovider tests/test_reference_aten.py
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from fa2_inductor import _cuda, reference
from fa2_inductor.reference import EmptyRows

ROOT = Path(__file__).resolve().parents[1]
ENABLE_VARIABLE = "FA2_INDUCTOR_CPP_TESTS"

if os.environ.get(ENABLE_VARIABLE) != "1":  # one skip for the module, not one per case
    pytest.skip(f"compiles csrc/fa2/reference_aten.hpp (minutes); run with {ENABLE_VARIABLE}=1",
                allow_module_level=True)

# load_inline puts torch/extension.h first and generates the bindings of FUNCTIONS.
SOURCE = """
#include "fa2/reference_aten.hpp"

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
             double scale, bool is_causal, at::Tensor out, at::Tensor lse, int64_t window_left, int64_t empty_rows,
             double softcap, const std::optional<at::Tensor>& sinks) {
  fa2::reference_forward(q, k, v, mask, scale, is_causal, out, lse, window_left, empty_rows, softcap, sinks);
}

fa2::BwdOutputs backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& mask,
                         double scale, bool is_causal, bool compute_mask_grad, int64_t window_left, double softcap,
                         const std::optional<at::Tensor>& sinks) {
  return fa2::reference_backward(grad_out, q, k, v, out, lse, mask, scale, is_causal, compute_mask_grad,
                                 window_left, softcap, sinks);
}

fa2::BwdOutputs backward_filled(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                const std::optional<at::Tensor>& mask, double scale, bool is_causal,
                                int64_t window_left, double softcap, int64_t empty_rows) {
  return fa2::with_filled_row_gradients(
      fa2::reference_backward(grad_out, q, k, v, out, lse, mask, scale, is_causal, false, window_left, softcap,
                              std::nullopt),
      grad_out, q, k, v, out, lse, scale, empty_rows, softcap);
}

at::Tensor sinks_gradient(const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                          const at::Tensor& sinks) {
  return fa2::sinks_gradient(grad_out, out, lse, sinks);
}
"""
FUNCTIONS = ["forward", "backward", "backward_filled", "sinks_gradient"]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DTYPE_IDS = ["f32", "bf16", "f16", "f64"]
# (is_causal, window_left)
CAUSAL = [(False, -1), (True, -1), (True, 2)]
CAUSAL_IDS = ["full", "causal", "window2"]
EMPTY_ROWS = list(EmptyRows)


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    from torch.utils.cpp_extension import load_inline

    # A fresh build directory: a cached build would not see a change of the header.
    return load_inline(
        name="fa2_reference_aten_test",
        cpp_sources=[SOURCE],
        functions=FUNCTIONS,
        extra_include_paths=[str(ROOT / "csrc")],
        build_directory=str(tmp_path_factory.mktemp("reference_aten_build")),
    )


def _random(gen, *shape, dtype):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * 2).to(dtype)


def _qkv(dtype, b=2, hq=4, hkv=2, sq=5, sk=9, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return _random(gen, b, hq, sq, d, dtype=dtype), _random(gen, b, hkv, sk, d, dtype=dtype), \
        _random(gen, b, hkv, sk, d, dtype=dtype)


def _mask(kind, dtype, b, hq, sq, sk, seed=1):
    """The masks a call may bring: bool or additive, of every rank that broadcasts to [B, Hq, Sq, Sk]."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "bool_empty_rows":  # [B, 1, Sq, Sk]; the first row of batch 0 sees nothing
        mask = torch.rand(b, 1, sq, sk, generator=gen) > 0.3
        mask[0, :, 0] = False
        return mask
    if kind == "bool_keys":  # [Sk], a padding mask
        mask = torch.rand(sk, generator=gen) > 0.4
        mask[-1:] = False
        return mask
    if kind == "bool_no_key":  # [Sk], every row empty
        return torch.zeros(sk, dtype=torch.bool)
    if kind == "bool_2d":  # [Sq, Sk]
        return torch.rand(sq, sk, generator=gen) > 0.5
    if kind == "add_heads":  # [1, Hq, 1, Sk] in the inputs' dtype
        return _random(gen, 1, hq, 1, sk, dtype=dtype)
    if kind == "add_3d_f32":  # [Hq, Sq, Sk] float32 whatever the inputs' dtype
        return _random(gen, hq, sq, sk, dtype=torch.float32)
    if kind == "add_min_rows":  # Hugging Face's padding: finfo.min where hidden, a whole row of it in batch 1
        hidden = torch.rand(b, 1, sq, sk, generator=gen) > 0.6
        hidden[-1, :, 0] = True
        return torch.zeros(b, 1, sq, sk, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)
    raise ValueError(kind)


MASKS = ["none", "bool_empty_rows", "bool_keys", "bool_no_key", "bool_2d", "add_heads", "add_3d_f32", "add_min_rows"]

# Integer views of each dtype: equal bits, not equal values (-0.0 == 0.0; NaN != NaN).
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _assert_same_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride(), what
    same = torch.equal(got.contiguous().view(_BITS[got.dtype]), want.contiguous().view(_BITS[want.dtype]))
    if not same:
        diff = (got.double() - want.double()).abs().nan_to_num(math.inf)
        raise AssertionError(f"{what} differs: max |diff| {diff.max().item()} at {int(diff.argmax())}\n"
                             f"got {got.flatten()[:8]}\nwant {want.flatten()[:8]}")


def _check(ext, q, k, v, mask=None, scale=None, is_causal=False, window_left=-1, empty_rows=0, softcap=0.0,
           sinks=None):
    """Both implementations into outputs of the op's layout; out and lse must match bit for bit."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    args = (window_left, int(empty_rows), softcap, sinks)
    want_out, want_lse = reference.empty_outputs(q, v)
    reference.attention_forward(q, k, v, mask, scale, is_causal, want_out, want_lse, *args)
    got_out, got_lse = reference.empty_outputs(q, v)
    ext.forward(q, k, v, mask, scale, is_causal, got_out, got_lse, *args)
    _assert_same_bits(got_out, want_out, "out")
    _assert_same_bits(got_lse, want_lse, "lse")
    return got_out, got_lse


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("seq_k", [0, 1, 9, 33])
@pytest.mark.parametrize("seq_q", [1, 5, 17])
@pytest.mark.parametrize("head_dim", [8, 16, 24])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_shapes(ext, dtype, head_dim, seq_q, seq_k, kv_heads):
    q, k, v = _qkv(dtype, hq=4, hkv=kv_heads, sq=seq_q, sk=seq_k, d=head_dim)
    _check(ext, q, k, v)


@pytest.mark.parametrize("empty_rows", EMPTY_ROWS, ids=[e.name for e in EMPTY_ROWS])
@pytest.mark.parametrize("causal", CAUSAL, ids=CAUSAL_IDS)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("seq_q, seq_k", [(5, 9), (17, 9)], ids=["5x9", "17x9"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_masks_causal_empty_rows(ext, dtype, seq_q, seq_k, mask_kind, causal, empty_rows):
    q, k, v = _qkv(dtype, sq=seq_q, sk=seq_k)
    mask = _mask(mask_kind, dtype, 2, 4, seq_q, seq_k)
    _check(ext, q, k, v, mask, is_causal=causal[0], window_left=causal[1], empty_rows=empty_rows)


@pytest.mark.parametrize("empty_rows", EMPTY_ROWS, ids=[e.name for e in EMPTY_ROWS])
@pytest.mark.parametrize("causal", [CAUSAL[0], CAUSAL[2]], ids=[CAUSAL_IDS[0], CAUSAL_IDS[2]])
@pytest.mark.parametrize("mask_kind", ["none", "bool_empty_rows", "add_min_rows"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softcap_sinks(ext, dtype, softcap, with_sinks, mask_kind, causal, empty_rows):
    q, k, v = _qkv(dtype, sq=17, sk=9)
    mask = _mask(mask_kind, dtype, 2, 4, 17, 9)
    sinks = _random(torch.Generator().manual_seed(2), 4, dtype=dtype) if with_sinks else None
    _check(ext, q, k, v, mask, is_causal=causal[0], window_left=causal[1], empty_rows=empty_rows, softcap=softcap,
           sinks=sinks)


@pytest.mark.parametrize("mask_kind", ["none", "bool_empty_rows"])
@pytest.mark.parametrize("scale", [0.0, -0.7, 2.5, None], ids=["zero", "negative", "large", "default"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scales(ext, dtype, scale, mask_kind):
    q, k, v = _qkv(dtype)
    mask = _mask(mask_kind, dtype, 2, 4, 5, 9)
    _check(ext, q, k, v, mask, scale=scale, is_causal=True, empty_rows=EmptyRows.MEAN_V, softcap=5.0)


@pytest.mark.parametrize("empty_rows", EMPTY_ROWS, ids=[e.name for e in EMPTY_ROWS])
@pytest.mark.parametrize("mask_kind", ["none", "bool_empty_rows", "add_heads"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_no_keys(ext, dtype, with_sinks, mask_kind, empty_rows):
    """Sk = 0: out 0 and lse -inf, or the sink's logit with sinks; no empty-row policy applies."""
    q, k, v = _qkv(dtype, sk=0)
    mask = _mask(mask_kind, dtype, 2, 4, 5, 0)
    sinks = _random(torch.Generator().manual_seed(2), 4, dtype=dtype) if with_sinks else None
    out, lse = _check(ext, q, k, v, mask, is_causal=True, empty_rows=empty_rows, sinks=sinks)
    assert not out.any()
    assert torch.equal(lse, sinks.float().view(1, 4, 1).expand_as(lse)) if with_sinks else bool(lse.isneginf().all())


def _strided(x, layout):
    """x's values as a strided view: heads of a wider [B, S, H, 2D] buffer (as a fused projection leaves
    them), or D-major."""
    if layout == "bshd_padded":
        b, h, s, d = x.shape
        buffer = x.new_zeros(b, s, h, 2 * d)
        buffer[..., :d] = x.transpose(1, 2)
        return buffer[..., :d].transpose(1, 2)
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa2", "mqa"])
@pytest.mark.parametrize("layout", ["bshd_padded", "d_major"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_non_contiguous_inputs(ext, dtype, layout, kv_heads):
    q, k, v = (_strided(x, layout) for x in _qkv(dtype, hkv=kv_heads, sq=17, sk=33))
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    mask = _mask("bool_empty_rows", dtype, 2, 4, 17, 33).transpose(-1, -2).contiguous().transpose(-1, -2)
    _check(ext, q, k, v, mask, is_causal=True, window_left=2, empty_rows=EmptyRows.ALL_KEYS, softcap=5.0)


def test_several_query_blocks(ext):
    """A call whose scores exceed one block's bound (256 MiB of float32): both split the rows alike."""
    b, hq, sq, sk = 64, 16, 17, 8192
    blocks = list(reference._query_blocks(b, hq, sq, sk))
    assert len(blocks) == 3, blocks
    q, k, v = _qkv(torch.float32, b=b, hq=hq, hkv=1, sq=sq, sk=sk, d=8)
    _check(ext, q, k, v, _mask("bool_keys", torch.float32, b, hq, sq, sk), softcap=5.0)


# ===== the backward ================================================================================


def _check_backward(ext, q, k, v, mask=None, scale=None, is_causal=False, window_left=-1, softcap=0.0, sinks=None,
                    compute_mask_grad=False, forward_kv=None, grad_layout=None):
    """Both backwards on the reference forward's out and lse (of forward_kv, longer K/V, where given: a ring
    step's global lse); the five outputs must match bit for bit."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    fk, fv, fmask = forward_kv if forward_kv is not None else (k, v, mask)
    out, lse = reference.attention_reference(q, fk, fv, fmask, scale, is_causal, window_left, 0, softcap, sinks)
    grad_out = _random(torch.Generator().manual_seed(3), *out.shape, dtype=q.dtype)
    if grad_layout is not None:
        grad_out = _strided(grad_out, grad_layout)
    args = (grad_out, q, k, v, out, lse, mask, scale, is_causal, compute_mask_grad, window_left, softcap, sinks)
    want = reference.backward_outputs(*args)
    got = ext.backward(*args)
    for name, a, b in zip(("dq", "dk", "dv", "dmask", "dsinks"), got, want):
        _assert_same_bits(a, b, name)
    return got


def _sinks(dtype, heads=4):
    return _random(torch.Generator().manual_seed(2), heads, dtype=dtype)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("seq_q, seq_k", [(1, 1), (1, 9), (5, 9), (17, 9), (9, 1), (5, 0)],
                         ids=["1x1", "1x9", "5x9", "17x9", "9x1", "5x0"])
@pytest.mark.parametrize("head_dim", [8, 24])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_shapes(ext, dtype, head_dim, seq_q, seq_k, kv_heads):
    q, k, v = _qkv(dtype, hq=4, hkv=kv_heads, sq=seq_q, sk=seq_k, d=head_dim)
    _check_backward(ext, q, k, v)


# (mask kind, compute_mask_grad): a gradient only for additive masks
BACKWARD_MASKS = [("none", False)] + [(kind, False) for kind in MASKS[1:5]] + \
    [(kind, grad) for kind in MASKS[5:] for grad in (False, True)]


@pytest.mark.parametrize("causal", CAUSAL, ids=CAUSAL_IDS)
@pytest.mark.parametrize("mask_kind, mask_grad", BACKWARD_MASKS,
                         ids=[f"{kind}{'-grad' if grad else ''}" for kind, grad in BACKWARD_MASKS])
@pytest.mark.parametrize("seq_q, seq_k", [(5, 9), (17, 9)], ids=["5x9", "17x9"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_masks_causal(ext, dtype, seq_q, seq_k, mask_kind, mask_grad, causal):
    q, k, v = _qkv(dtype, sq=seq_q, sk=seq_k)
    mask = _mask(mask_kind, dtype, 2, 4, seq_q, seq_k)
    dmask = _check_backward(ext, q, k, v, mask, is_causal=causal[0], window_left=causal[1],
                            compute_mask_grad=mask_grad)[3]
    assert dmask.shape == (mask.shape if mask_grad else (0,))


@pytest.mark.parametrize("causal", [CAUSAL[0], CAUSAL[2]], ids=[CAUSAL_IDS[0], CAUSAL_IDS[2]])
@pytest.mark.parametrize("mask_kind, mask_grad", [("none", False), ("bool_empty_rows", False),
                                                  ("add_min_rows", False), ("add_heads", True)],
                         ids=["none", "bool_empty_rows", "add_min_rows", "add_heads-grad"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_softcap_sinks(ext, dtype, softcap, with_sinks, mask_kind, mask_grad, causal):
    q, k, v = _qkv(dtype, sq=17, sk=9)
    mask = _mask(mask_kind, dtype, 2, 4, 17, 9)
    sinks = _sinks(dtype) if with_sinks else None
    dsinks = _check_backward(ext, q, k, v, mask, is_causal=causal[0], window_left=causal[1], softcap=softcap,
                             sinks=sinks, compute_mask_grad=mask_grad)[4]
    assert dsinks.shape == ((4,) if with_sinks else (0,))


@pytest.mark.parametrize("mask_kind", ["none", "bool_keys"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("causal", CAUSAL, ids=CAUSAL_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_lse_over_more_keys(ext, dtype, causal, softcap, with_sinks, mask_kind):
    """A ring step's call: the lse (and out) of all 21 keys, the gradients of the first 9."""
    q, k_all, v_all = _qkv(dtype, sq=17, sk=21)
    mask_all = _mask(mask_kind, dtype, 2, 4, 17, 21)
    mask = None if mask_all is None else mask_all[:9]
    k, v = k_all[:, :, :9], v_all[:, :, :9]
    _check_backward(ext, q, k, v, mask, is_causal=causal[0], window_left=causal[1], softcap=softcap,
                    sinks=_sinks(dtype) if with_sinks else None, forward_kv=(k_all, v_all, mask_all))


@pytest.mark.parametrize("scale", [0.0, -0.7, 2.5], ids=["zero", "negative", "large"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_scales(ext, dtype, scale):
    q, k, v = _qkv(dtype)
    mask = _mask("add_heads", dtype, 2, 4, 5, 9)
    _check_backward(ext, q, k, v, mask, scale=scale, is_causal=True, softcap=5.0, sinks=_sinks(dtype),
                    compute_mask_grad=True)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa2", "mqa"])
@pytest.mark.parametrize("layout", ["bshd_padded", "d_major"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_non_contiguous_inputs(ext, dtype, layout, kv_heads):
    q, k, v = (_strided(x, layout) for x in _qkv(dtype, hkv=kv_heads, sq=17, sk=33))
    mask = _mask("add_3d_f32", dtype, 2, 4, 17, 33).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or mask.is_contiguous())
    _check_backward(ext, q, k, v, mask, is_causal=True, window_left=2, softcap=5.0, sinks=_sinks(dtype),
                    compute_mask_grad=True, grad_layout=layout)


def test_backward_several_query_blocks(ext):
    """A call whose scores exceed one block's bound: both split the rows alike and add dk, dv over the blocks."""
    b, hq, sq, sk = 64, 16, 17, 8192
    assert len(list(reference._query_blocks(b, hq, sq, sk))) == 3
    q, k, v = _qkv(torch.float32, b=b, hq=hq, hkv=1, sq=sq, sk=sk, d=8)
    _check_backward(ext, q, k, v, _mask("bool_keys", torch.float32, b, hq, sq, sk), softcap=5.0,
                    sinks=_sinks(torch.float32, hq))


@pytest.mark.parametrize("empty_rows", EMPTY_ROWS, ids=[e.name.lower() for e in EMPTY_ROWS])
@pytest.mark.parametrize("mask_kind", ["bool_empty_rows", "bool_no_key", "bool_keys"])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_filled_rows(ext, dtype, kv_heads, softcap, mask_kind, empty_rows):
    """The gradients of the rows a finite fill's policy filled (with_filled_row_gradients), added alike."""
    q, k, v = _qkv(dtype, hkv=kv_heads, sq=17, sk=9)
    mask = _mask(mask_kind, dtype, 2, 4, 17, 9)
    out, lse = reference.attention_reference(q, k, v, mask, 0.3, True, 2, empty_rows, softcap)
    grad_out = _random(torch.Generator().manual_seed(3), *out.shape, dtype=dtype)
    args = (grad_out, q, k, v, out, lse, mask, 0.3, True, False, 2, softcap, None)
    want = reference.with_filled_row_gradients(reference.backward_outputs(*args), grad_out, q, k, v, out, lse, 0.3,
                                               empty_rows, softcap)
    got = ext.backward_filled(grad_out, q, k, v, out, lse, mask, 0.3, True, 2, softcap, empty_rows)
    for name, a, b in zip(("dq", "dk", "dv", "dmask", "dsinks"), got, want):
        _assert_same_bits(a, b, name)


@pytest.mark.parametrize("mask_kind", ["none", "bool_empty_rows", "bool_no_key"])
@pytest.mark.parametrize("seq_q, seq_k", [(1, 9), (17, 9), (5, 0)], ids=["1x9", "17x9", "5x0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sinks_gradient(ext, dtype, seq_q, seq_k, mask_kind):
    """What runs beside a backward kernel that knows nothing of sinks; one sink is -inf, so that a row with no key
    has lse -inf (and no gradient)."""
    q, k, v = _qkv(dtype, sq=seq_q, sk=seq_k)
    sinks = _sinks(dtype)
    sinks[1] = -math.inf
    out, lse = reference.attention_reference(q, k, v, _mask(mask_kind, dtype, 2, 4, seq_q, seq_k), None, False,
                                             sinks=sinks)
    grad_out = _random(torch.Generator().manual_seed(3), *out.shape, dtype=dtype)
    got = ext.sinks_gradient(grad_out, out, lse, sinks)
    _assert_same_bits(got, _cuda.sinks_gradient(grad_out, out, lse, sinks), "dsinks")
    assert got.isfinite().all()
