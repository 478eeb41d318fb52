"""The persistent forward (one CTA per SM striding through the query tiles) against the same kernel
launched with one CTA per tile: every tile runs the same instructions either way, so out and lse must be
bit-equal, on shapes with several tiles per SM, tiles without any key, the rows-filter pass, GQA, windows,
strided inputs, soft-capping and masks (bool, additive, with causal positions); and the persistent results
pass the float64 accuracy rule.
Skipped unless an sm_90 GPU and fa2_inductor._C exist."""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from fa2_inductor import _cuda, _extension  # noqa: E402
from fa2_inductor.bench import implementations  # noqa: E402
from fa2_inductor.reference import attention_reference  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.gpu.kernel_inputs import (  # noqa: E402
    DEV, DTYPES, HEAD_DIMS, assert_twice_torch_error, make_qkv, masked_torch_attention, needs_kernel,
    torch_attention,
)


@pytest.fixture
def one_cta_per_tile():
    """Runs a call with the persistent grid switched off (one CTA per tile), back on afterwards."""
    return lambda call: implementations.one_cta_per_tile(call)()


def fwd(q, k, v, is_causal, window_left=-1, rows_filter=None, softcap=0.0, out=None, lse=None):
    """_C.fwd into NaN-poisoned outputs (or the given ones), synchronised."""
    b, hq, sq, d = q.shape
    if out is None:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, hq, sq), float("nan"), device=DEV, dtype=torch.float32)
    _extension.C.fwd(q, k, v, out, lse, 1.0 / math.sqrt(d), is_causal, window_left, rows_filter, softcap)
    torch.cuda.synchronize()
    return out, lse


def assert_same_both_ways(one_cta_per_tile, call):
    out, lse = call()
    out_tile, lse_tile = one_cta_per_tile(call)
    assert torch.equal(out, out_tile), "persistent and one-CTA-per-tile outputs differ"
    assert torch.equal(lse, lse_tile), "persistent and one-CTA-per-tile LSE differ"
    return out, lse


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k): 2-7 tiles per SM on 132 SMs (the first four; the fourth an
# odd number of 128-row tiles per head, so striding causal CTAs take a head's middle tile alone), fewer tiles
# than SMs (the last two), odd tails, Sq != Sk.
SHAPES = [
    (8, 16, 16, 512, 512),
    (3, 12, 4, 1000, 1000),
    (2, 8, 1, 4099, 4099),
    (6, 16, 4, 1100, 1100),
    (5, 6, 2, 300, 777),
    (1, 4, 4, 2000, 97),
]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dt", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True])
def test_bit_equal_and_accurate(one_cta_per_tile, d, dt, shape, is_causal):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], layout="bshd")
    out, lse = assert_same_both_ways(one_cta_per_tile, lambda: fwd(q, k, v, is_causal))
    if b * hq * sq * sk <= 8 * 16 * 512 * 512:  # the float64 reference of the largest shapes costs seconds
        scale = 1.0 / math.sqrt(d)
        ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), scale=scale, is_causal=is_causal)
        assert_twice_torch_error(out, lse, ref, torch_attention(q, k, v, scale, is_causal))
        torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_windows_with_tiles_that_see_no_key(one_cta_per_tile, d):
    """A window shorter than Sq - Sk leaves the last query tiles without any key: O = 0, LSE = -inf."""
    needs_kernel(d, "bf16")
    q, k, v = make_qkv(4, 8, 2, 1000, 200, d, torch.bfloat16)  # 1000 rows: causal calls stride
    out, lse = assert_same_both_ways(one_cta_per_tile, lambda: fwd(q, k, v, True, window_left=37))
    assert (lse[:, :, 237:] == float("-inf")).all() and (out[:, :, 237:] == 0).all()
    assert torch.isfinite(lse[:, :, :237]).all()


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rows_filter_runs_only_the_filtered_tiles(one_cta_per_tile, d):
    """The empty-rows pass: tiles without a -inf row in the filter keep what their outputs held."""
    needs_kernel(d, "fp16")
    q, k, v = make_qkv(3, 8, 8, 1100, 900, d, torch.float16, seed=3)
    rows_filter = torch.zeros(3, 8, 1100, device=DEV)
    rows_filter[0, 1, 5] = rows_filter[2, 7, 1099] = rows_filter[1, 3, 640] = float("-inf")

    def call():
        out = torch.full_like(q, 7.0)
        lse = torch.full((3, 8, 1100), 7.0, device=DEV)
        return fwd(q, k, v, False, rows_filter=rows_filter, out=out, lse=lse)

    out, lse = assert_same_both_ways(one_cta_per_tile, call)
    full_out, full_lse = fwd(q, k, v, False)
    ran = lse != 7.0  # the rows some tile wrote
    filtered = {(0, 1): 5, (2, 7): 1099, (1, 3): 640}
    for bi in range(3):
        for hi in range(8):
            rows = ran[bi, hi].nonzero().flatten().tolist()
            if (bi, hi) not in filtered:
                assert rows == []
                continue
            # one tile (its rows whole: a multiple of 64, or up to the last row) around the filtered row
            first, last = rows[0], rows[-1]
            assert rows == list(range(first, last + 1)) and first <= filtered[bi, hi] <= last
            assert first % 64 == 0 and ((last + 1) % 64 == 0 or last == 1099) and last - first < 256
    assert torch.equal(out[ran], full_out[ran]) and torch.equal(lse[ran], full_lse[ran])
    assert (out[~ran] == 7.0).all()


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_softcap_and_repeated_calls(one_cta_per_tile, d):
    """Soft-capping and back-to-back launches (each CTA's barriers start afresh) give the same bits."""
    needs_kernel(d, "bf16")
    q, k, v = make_qkv(6, 16, 4, 700, 700, d, torch.bfloat16, seed=5)
    first = assert_same_both_ways(one_cta_per_tile, lambda: fwd(q, k, v, True, softcap=20.0))
    for _ in range(3):
        again = fwd(q, k, v, True, softcap=20.0)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def _masks(b, hq, sq, sk):
    """Key padding with a sequence that sees no key (its tiles have no key block), a causal bool
    [1, 1, Sq, Sk] mask, and an additive bias with finfo.min holes."""
    g = torch.Generator(device=DEV).manual_seed(11)
    lengths = torch.tensor([sk, sk // 2, 37, 0][:b], device=DEV)
    padding = (torch.arange(sk, device=DEV) < lengths[:, None])[:, None, None, :]
    i, j = torch.arange(sq, device=DEV)[:, None], torch.arange(sk, device=DEV)[None, :]
    causal = (j <= i)[None, None]
    bias = torch.randn(1, hq, sq, sk, device=DEV, generator=g)
    bias = bias.masked_fill(torch.rand(1, hq, sq, sk, device=DEV, generator=g) < 0.3, torch.finfo(torch.float32).min)
    return {"padding": padding, "causal_bool": causal, "additive": bias}


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("mask_name", ["padding", "causal_bool", "additive"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_masked_kernels_bit_equal_and_accurate(one_cta_per_tile, d, mask_name, is_causal):
    """Masked kernels stride like the others (up to the causal limit): 4 x 8 heads x 8 tiles, 700 rows."""
    needs_kernel(d, "bf16")
    b, hq, hkv, sq, sk = 4, 8, 2, 700, 700
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, layout="bshd", seed=d)
    mask = _masks(b, hq, sq, sk)[mask_name]
    if _cuda.kernel_unsupported_reason(q, k, v, mask, is_causal) is not None:
        pytest.skip(_cuda.kernel_unsupported_reason(q, k, v, mask, is_causal))
    scale = 1.0 / math.sqrt(d)

    def call():
        out = torch.full((b, sq, hq, d), float("nan"), device=DEV, dtype=q.dtype).transpose(1, 2)
        lse = torch.full((b, hq, sq), float("nan"), device=DEV, dtype=torch.float32)
        _cuda.forward(q, k, v, scale, is_causal, out, lse, attn_mask=mask)
        torch.cuda.synchronize()
        return out, lse

    out, lse = assert_same_both_ways(one_cta_per_tile, call)
    if is_causal:  # the baseline takes one mask: causal positions folded in
        keep = torch.ones(sq, sk, dtype=torch.bool, device=DEV).tril()
        mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))
    ref_mask = mask if mask.dtype == torch.bool else mask.double()
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), attn_mask=ref_mask, scale=scale)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), "rows without a visible key differ"
    assert_twice_torch_error(out, lse, ref, masked_torch_attention(q, k, v, mask, scale))
