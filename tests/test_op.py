"""The op on CPU (reference path): numerics, gradients, opcheck, layouts and errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fa2_inductor
from fa2_inductor import reference
from tests.attention_math import dense_attention_f64

op = torch.ops.fa2_inductor.flash_attention_fwd.default

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _qkv(b, hq, hkv, sq, sk, d, dtype=torch.float32, requires_grad=False):
    q = torch.randn(b, hq, sq, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, hkv, sk, d, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(b, hkv, sk, d, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def _assert_matches_f64(q, k, v, attn_mask=None, scale=None, is_causal=False, window_left=-1, empty_rows=False):
    scale_value = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = op(q, k, v, attn_mask, scale_value, is_causal, window_left, empty_rows)
    ref_out, ref_lse = dense_attention_f64(q, k, v, attn_mask, scale_value, is_causal, window_left, empty_rows)
    tol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    lse_tol = max(tol, TOLERANCE[torch.float32])  # lse is float32 whatever the input dtype
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_tol * 10, rtol=lse_tol)
    return out, lse


@pytest.mark.parametrize("seq", [1, 17, 97, 1000])
def test_odd_lengths_match_float64(seq):
    _assert_matches_f64(*_qkv(1, 2, 2, seq, seq, 40))


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1)], ids=["gqa", "mqa"])
def test_grouped_query_heads(hq, hkv):
    _assert_matches_f64(*_qkv(2, hq, hkv, 33, 21, 16))


@pytest.mark.parametrize("sq,sk", [(17, 97), (97, 17), (1, 50)])
def test_causal_with_different_lengths_is_top_left(sq, sk):
    _assert_matches_f64(*_qkv(2, 4, 2, sq, sk, 32), is_causal=True)


@pytest.mark.parametrize("window_left", [0, 1, 5, 40])
@pytest.mark.parametrize("sq,sk", [(33, 33), (17, 40), (40, 17)])
def test_causal_sliding_window(sq, sk, window_left):
    """Query i sees keys i - window_left ... i; rows past Sk + window_left see nothing (lse = -inf)."""
    _assert_matches_f64(*_qkv(2, 4, 2, sq, sk, 32), is_causal=True, window_left=window_left)


def test_mask_and_causal_both_apply():
    q, k, v = _qkv(2, 4, 2, 37, 37, 16)
    key_padding = torch.ones(2, 1, 1, 37, dtype=torch.bool)
    key_padding[1, ..., 30:] = False
    key_padding[0, ..., :3] = False  # left padding: rows 0-2 of batch 0 see no key
    out, lse = _assert_matches_f64(q, k, v, key_padding, is_causal=True, window_left=9)
    assert torch.isneginf(lse[0, :, :3]).all() and (out[0, :, :3] == 0).all()


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("empty_rows, fill", [(fa2_inductor.EmptyRows.MEAN_V, torch.finfo(torch.float32).min),
                                              (fa2_inductor.EmptyRows.ALL_KEYS, -65504.0)], ids=["mean_v", "all_keys"])
def test_empty_rows_policies_match_eager_finite_fills(mask_kind, empty_rows, fill):
    """A row with no visible key gives what eager softmax gives when masked scores hold a finite fill:
    finfo.min swallows the scores (a uniform average of V), -65504 shifts them equally (all keys, unmasked)."""
    q, k, v = _qkv(2, 4, 2, 20, 24, 16)
    visible = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    visible[0, ..., :5] = False
    mask = visible if mask_kind == "bool" else torch.where(visible, 0.0, float("-inf"))
    out, lse = _assert_matches_f64(q, k, v, mask, is_causal=True, empty_rows=empty_rows)
    assert torch.isneginf(lse[0, :, :5]).all()
    # Eager's math in float64, where adding -65504 to a score does not round it (float32 would by 2**-8).
    causal = torch.ones(20, 24, dtype=torch.bool).tril()
    bias = torch.where(visible & causal, 0.0, fill).double()
    q, k, v = (t.double() for t in (q, k, v))
    eager = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4 + bias, -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out.double(), eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("hkv", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("empty_rows, fill", [(fa2_inductor.EmptyRows.MEAN_V, torch.finfo(torch.float32).min),
                                              (fa2_inductor.EmptyRows.ALL_KEYS, -65504.0)], ids=["mean_v", "all_keys"])
def test_empty_rows_policies_gradients_match_eager_finite_fills(empty_rows, fill, hkv, softcap):
    """The rows a finite fill leaves without a visible key get eager's gradients, the fill added to their scores:
    V their weights times dO, q and k the softmax's gradient through the scores (float64 on both sides)."""
    q, k, v = (t.double().requires_grad_() for t in _qkv(2, 4, hkv, 20, 24, 16))
    visible = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    visible[0, ..., :5] = False  # left padding: rows 0-4 of batch 0 see no key
    out = fa2_inductor.flash_attention(q, k, v, attn_mask=visible, scale=0.25, is_causal=True, empty_rows=empty_rows,
                                       softcap=softcap)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    causal = torch.ones(20, 24, dtype=torch.bool).tril()
    scores = q @ k.repeat_interleave(4 // hkv, 1).transpose(-1, -2) * 0.25
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores + torch.where(visible & causal, 0.0, fill).double(), -1)
    eager = probs @ v.repeat_interleave(4 // hkv, 1)
    want = torch.autograd.grad(eager, (q, k, v), grad_out)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"d{name}")
    assert got[0][0, :, :5].abs().amax() > 0.01  # the filled rows' dq is not zero


@pytest.mark.parametrize(
    "mask_shape", [(2, 4, 19, 23), (2, 1, 19, 23), (1, 1, 19, 23), (2, 1, 1, 23), (19, 23), (23,)]
)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks_broadcast(mask_shape, kind):
    q, k, v = _qkv(2, 4, 2, 19, 23, 16)
    if kind == "bool":
        mask = torch.rand(mask_shape) > 0.3
    else:
        mask = torch.randn(mask_shape)
    _assert_matches_f64(q, k, v, attn_mask=mask)


def test_fully_masked_rows_give_zero_and_minus_inf_lse():
    q, k, v = _qkv(1, 2, 2, 5, 7, 8)
    mask = torch.ones(1, 1, 5, 7, dtype=torch.bool)
    mask[..., 2, :] = False
    out, lse = _assert_matches_f64(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 2] == 0)
    assert torch.all(lse[:, :, 2] == float("-inf"))
    assert torch.isfinite(out).all()


def test_additive_minus_inf_mask_matches_boolean():
    q, k, v = _qkv(1, 2, 2, 9, 9, 8)
    visible = torch.rand(9, 9) > 0.5
    additive = torch.zeros(9, 9).masked_fill(~visible, float("-inf"))
    torch.testing.assert_close(op(q, k, v, additive, 0.3, False), op(q, k, v, visible, 0.3, False))


def test_bshd_inputs_seen_through_transpose():
    b, s, h, d = 2, 37, 4, 24
    q, k, v = (torch.randn(b, s, h, d).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    _assert_matches_f64(q, k, v, is_causal=True)


def test_explicit_scale():
    _assert_matches_f64(*_qkv(1, 2, 2, 13, 13, 16), scale=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(dtype):
    _assert_matches_f64(*_qkv(2, 4, 2, 29, 31, 64, dtype=dtype), is_causal=False)


def test_output_layout_is_bshd():
    q, k, v = _qkv(2, 4, 4, 9, 9, 16)
    out, lse = op(q, k, v, None, 0.25, False)
    assert out.transpose(1, 2).is_contiguous()
    assert lse.is_contiguous()


def test_long_sequence_works_in_query_blocks(monkeypatch):
    monkeypatch.setattr(reference, "_MAX_BLOCK_SCORES", 4096)
    q, k, v = _qkv(1, 2, 1, 300, 200, 8)
    assert len(list(reference._query_blocks(1, 2, 300, 200))) > 1
    _assert_matches_f64(q, k, v, is_causal=True)


def test_first_call_in_a_fresh_multithreaded_process_is_accurate():
    # torch 2.13's CPU exp could lose accuracy on its first large multi-threaded call (see reference.py);
    # it showed in about half of fresh two-thread processes, so try several.
    script = textwrap.dedent(
        """
        import torch, fa2_inductor
        from tests.attention_math import dense_attention_f64
        torch.manual_seed(0)
        q, k, v = torch.randn(2, 16, 1024, 128), torch.randn(2, 4, 1024, 128), torch.randn(2, 4, 1024, 128)
        out = fa2_inductor.flash_attention(q, k, v, is_causal=True)
        expected, _ = dense_attention_f64(q, k, v, None, 128 ** -0.5, True)
        print((out.double() - expected).abs().max().item())
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    for _ in range(4):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        assert float(result.stdout) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("shape", [(0, 2, 5, 5), (2, 2, 0, 5), (2, 2, 5, 0)], ids=["batch0", "sq0", "sk0"])
def test_empty_inputs(shape):
    b, h, sq, sk = shape
    q, k, v = _qkv(b, h, h, sq, sk, 8)
    out, lse = op(q, k, v, None, 0.3, False)
    assert out.shape == (b, h, sq, 8) and lse.shape == (b, h, sq)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


# Gradients -------------------------------------------------------------------------------------


def _f64_grads(q, k, v, mask, grad_out, scale, is_causal):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask64 = None
    if mask is not None:
        mask64 = mask.detach().double().requires_grad_() if mask.is_floating_point() else mask
    out, _ = dense_attention_f64(*leaves, mask64, scale, is_causal)
    wrt = leaves + ([mask64] if mask is not None and mask.is_floating_point() else [])
    return torch.autograd.grad(out, wrt, grad_out.double())


@pytest.mark.parametrize(
    "hq,hkv,sq,sk,causal,mask_kind",
    [
        (4, 4, 17, 17, False, None),
        (4, 2, 13, 29, True, None),
        (6, 1, 29, 13, False, "bool"),
        (4, 2, 17, 19, False, "additive"),
    ],
)
def test_gradients_match_float64_autograd(hq, hkv, sq, sk, causal, mask_kind):
    q, k, v = _qkv(2, hq, hkv, sq, sk, 16, requires_grad=True)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, sq, sk) > 0.3
    elif mask_kind == "additive":
        mask = torch.randn(1, hq, sq, sk, requires_grad=True)
    out = fa2_inductor.flash_attention(q, k, v, attn_mask=mask, scale=0.2, is_causal=causal)
    grad_out = torch.randn_like(out)
    wrt = [q, k, v] + ([mask] if mask_kind == "additive" else [])
    grads = torch.autograd.grad(out, wrt, grad_out)
    expected = _f64_grads(q, k, v, mask, grad_out, 0.2, causal)
    for got, want in zip(grads, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_gradcheck_float64():
    q, k, v = (t.double() for t in _qkv(1, 2, 1, 5, 6, 4))
    mask = torch.randn(1, 1, 5, 6, dtype=torch.float64, requires_grad=True)
    for t in (q, k, v):
        t.requires_grad_()
    fn = lambda q, k, v, m: fa2_inductor.flash_attention(q, k, v, attn_mask=m)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


def test_lse_is_not_differentiable():
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, requires_grad=True)
    out, lse = op(q, k, v, None, 0.3, False)
    assert out.requires_grad and not lse.requires_grad


# opcheck ---------------------------------------------------------------------------------------


def _opcheck_samples():
    yield _qkv(2, 4, 2, 17, 23, 16, requires_grad=True) + (None, 0.25, False)
    yield _qkv(1, 4, 1, 9, 9, 8) + (None, 0.3, True)
    q, k, v = _qkv(2, 2, 2, 7, 11, 8, requires_grad=True)
    yield q, k, v, torch.rand(2, 1, 7, 11) > 0.4, 0.3, False
    yield q, k, v, torch.randn(1, 2, 1, 11, requires_grad=True), 0.3, False
    b, s, h, d = 2, 13, 4, 16
    yield tuple(torch.randn(b, s, h, d).transpose(1, 2) for _ in range(3)) + (None, 0.25, True)
    yield _qkv(1, 2, 2, 5, 6, 8, dtype=torch.bfloat16) + (None, 0.3, False)


@pytest.mark.parametrize("sample", list(_opcheck_samples()), ids=lambda s: "x".join(map(str, s[0].shape)))
def test_opcheck(sample):
    torch.library.opcheck(op, sample)


# Bad input -------------------------------------------------------------------------------------


def _bad(**overrides):
    args = dict(
        q=torch.randn(2, 4, 8, 16), k=torch.randn(2, 2, 8, 16), v=torch.randn(2, 2, 8, 16), attn_mask=None, is_causal=False,
        window_left=-1, empty_rows=0,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(q=torch.randn(4, 8, 16)), "must be 4-D"),
        (dict(k=torch.randn(2, 2, 8, 16, dtype=torch.float64)), "share a dtype"),
        (dict(q=torch.zeros(2, 4, 8, 16, dtype=torch.int32)), "share a dtype"),
        (dict(k=torch.randn(2, 2, 8, 32), v=torch.randn(2, 2, 8, 32)), "head dims differ"),
        (dict(k=torch.randn(2, 3, 8, 16), v=torch.randn(2, 3, 8, 16)), "multiple of key/value heads"),
        (dict(k=torch.randn(3, 2, 8, 16), v=torch.randn(3, 2, 8, 16)), "batch sizes differ"),
        (dict(v=torch.randn(2, 2, 9, 16)), "same heads and length"),
        (dict(q=torch.randn(2, 4, 8, 320), k=torch.randn(2, 2, 8, 320), v=torch.randn(2, 2, 8, 320)), "larger than"),
        (dict(attn_mask=torch.ones(2, 4, 8, 7, dtype=torch.bool)), "does not broadcast"),
        (dict(attn_mask=torch.ones(3, 1, 8, 8, dtype=torch.bool)), "does not broadcast"),
        (dict(attn_mask=torch.ones(1, 2, 4, 8, 8, dtype=torch.bool)), "does not broadcast"),
        (dict(attn_mask=torch.ones(8, 8, dtype=torch.int64)), "must be bool"),
        (dict(window_left=3), "window_left must be -1 or, with is_causal=True"),
        (dict(window_left=-2, is_causal=True), "window_left must be -1 or, with is_causal=True"),
        (dict(empty_rows=3), "empty_rows must be one of"),
    ],
)
def test_bad_input_names_the_problem(overrides, message):
    args = _bad(**overrides)
    with pytest.raises(ValueError, match=message):
        op(args["q"], args["k"], args["v"], args["attn_mask"], 0.25, args["is_causal"], args["window_left"],
           args["empty_rows"])


@pytest.mark.parametrize("q", [None, [1.0, 2.0]], ids=["none", "list"])
def test_non_tensor_q_is_a_value_error(q):
    with pytest.raises(ValueError, match="q must be a tensor"):
        fa2_inductor.flash_attention(q, torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))


def test_head_dim_zero_is_a_value_error():
    x = torch.randn(1, 1, 4, 0)
    with pytest.raises(ValueError, match="head_dim is 0"):
        fa2_inductor.flash_attention(x, x, x)


def test_integer_inputs_are_refused():
    x = torch.zeros(1, 1, 4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="unsupported dtype"):
        op(x, x, x, None, 0.25, False)


@pytest.mark.skipif(not torch.backends.mps.is_available() and not torch.cuda.is_available(), reason="needs a GPU")
def test_float64_is_refused_on_gpu():
    x = torch.zeros(1, 1, 4, 8, dtype=torch.float64, device="cuda")
    with pytest.raises(ValueError, match="float64 runs only on CPU"):
        op(x, x, x, None, 0.25, False)


def test_float64_is_refused_off_cpu_even_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(1, 1, 4, 8, dtype=torch.float64, device="meta")
        with pytest.raises(ValueError, match="float64 runs only on CPU"):
            op(x, x, x, None, 0.25, False)
