"""Hopper kernel tests: numerics against a float64 reference, LSE, layouts, GQA, opcheck,
gradients, torch.compile and CUDA graphs. Skipped unless an sm_90 GPU and fa2_inductor._C exist.

Accuracy rule (FlashAttention's): the kernel's max error against the float64 reference must be
at most twice the max error of the same attention computed by plain PyTorch in the input dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

import fa2_inductor  # noqa: E402
from fa2_inductor import _cuda, _extension  # noqa: E402
from fa2_inductor.reference import attention_reference  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.gpu.kernel_inputs import (  # noqa: E402
    COMPILED, DEV, DTYPES, HEAD_DIMS, assert_twice_torch_error, make_qkv, needs_kernel, torch_attention,
)


def run_kernel(q, k, v, scale, is_causal):
    """Calls the CUDA path directly with NaN-poisoned outputs so unwritten elements fail."""
    b, hq, sq, d = q.shape
    out = torch.full((b, sq, hq, d), float("nan"), device=DEV, dtype=q.dtype).transpose(1, 2)
    lse = torch.full((b, hq, sq), float("nan"), device=DEV, dtype=torch.float32)
    assert _cuda.kernel_unsupported_reason(q, k, v, None, is_causal) is None
    _cuda.forward(q, k, v, scale, is_causal, out, lse)
    torch.cuda.synchronize()
    return out, lse


def check_forward(q, k, v, is_causal, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = run_kernel(q, k, v, scale, is_causal)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), scale=scale, is_causal=is_causal)
    base = torch_attention(q, k, v, scale, is_causal)
    err, base_err = assert_twice_torch_error(out, lse, ref, base)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    assert lse_err <= 2e-3 + 1e-3 * ref_lse[finite].abs().max().item(), f"lse error {lse_err:.3e}"
    return err, base_err


# (B, Hq, Hkv, Sq, Sk)
SHAPES = [
    (1, 2, 2, 1, 1),
    (2, 3, 3, 17, 17),
    (1, 2, 2, 97, 1000),
    (1, 2, 2, 1000, 97),
    (1, 2, 2, 1025, 1025),
    (1, 2, 2, 1, 4099),
    (1, 1, 1, 4099, 4099),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_numerics(d, dt, is_causal, shape):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=sq * 7 + sk)
    check_forward(q, k, v, is_causal)


@pytest.mark.parametrize("shape", [(1, 2, 1, 8195, 8195), (1, 2, 2, 8200, 8300)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_long_causal(d, dt, shape):
    """Causal calls of 8k query rows and more, where a head dim's config may switch to its long-sequence tile."""
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, DTYPES[dt], seed=sq + sk)
    check_forward(q, k, v, True)


@pytest.mark.parametrize("hkv", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_gqa_strided(d, dt, is_causal, hkv):
    needs_kernel(d, dt)
    q, k, v = make_qkv(2, 8, hkv, 300, 333, d, DTYPES[dt], layout="bshd", seed=hkv)
    assert not q.is_contiguous()
    check_forward(q, k, v, is_causal)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_custom_scale_and_large_values(d):
    needs_kernel(d, "bf16")
    q, k, v = make_qkv(1, 2, 2, 257, 513, d, torch.bfloat16, seed=3)
    check_forward(q * 4, k * 4, v, False, scale=0.3)


@pytest.mark.parametrize("growth", [0.05, 1.0], ids=["below_threshold", "above_threshold"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward_row_max_growing_across_key_blocks(d, dt, is_causal, growth):
    """Scores that rise by `growth` powers of two per key towards the first keys, which the kernel visits
    last: a row's max grows block after block, by less than the rescale threshold (where the softmax rescales
    lazily, D=192/256, the running max is kept and P exceeds 1) or by far more (O is rescaled at every block)."""
    needs_kernel(d, dt)
    q, k, v = make_qkv(1, 2, 2, 200, 1000, d, DTYPES[dt], seed=int(growth * 100) + is_causal)
    scale = 1.0 / math.sqrt(d)
    position = torch.arange(999, -1, -1, device=DEV, dtype=torch.float64) * growth / (scale * math.log2(math.e))
    q[..., 0] = 1.0
    k[..., 0] = position.to(k.dtype)
    err, _ = check_forward(q, k, v, is_causal, scale=scale)
    # PyTorch's own error is large here (its scores are rounded to the input dtype), so the rule above is
    # loose: the output must also be within about two units in the last place of values up to 4.
    assert err <= (3.2e-2 if dt == "bf16" else 4e-3), f"out error {err:.3e}"


def test_forward_empty_keys():
    d, dt = next(iter(sorted(COMPILED)))
    q, k, v = make_qkv(1, 2, 2, 5, 0, d, DTYPES[dt])
    out, lse = torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, None, 0.1, False)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_unsupported_reasons():
    q, k, v = make_qkv(1, 2, 2, 17, 16, 128, torch.bfloat16)  # 17 rows: more than a decode step
    mask = torch.ones(17, 16, dtype=torch.bool, device=DEV)
    # Masks: bool/float32/bf16/fp16 run the masked kernels (tests/gpu/test_mask.py); others are refused.
    assert _cuda.kernel_unsupported_reason(q, k, v, mask.double(), False) is not None
    assert _cuda.kernel_unsupported_reason(q, k, v, mask.float(), True) is not None  # additive with causal
    assert _cuda.kernel_unsupported_reason(q[:, :, :16], k, v, mask[:16].float(), True) is None  # the decode kernel's
    assert _cuda.kernel_unsupported_reason(q.float(), k.float(), v.float(), None, False) is not None
    q100, k100, v100 = make_qkv(1, 2, 2, 16, 16, 100, torch.bfloat16)  # not a multiple of 8: never padded
    assert _cuda.kernel_unsupported_reason(q100, k100, v100, None, False) is not None
    # Unsupported calls still give the right answer through the op (reference path), counted and
    # announced once, since that path is slow.
    from torch._dynamo.utils import counters

    counters["fa2_inductor"].clear()
    with pytest.warns(UserWarning, match="reference implementation: no kernel compiled for head dim 100"):
        out, _ = torch.ops.fa2_inductor.flash_attention_fwd(q100, k100, v100, None, 0.1, False)
    torch.ops.fa2_inductor.flash_attention_fwd(q100, k100, v100, None, 0.1, False)
    assert counters["fa2_inductor"]["reference_fallback:no kernel compiled for head dim 100 bf16"] == 2
    ref, _ = attention_reference(q100.double(), k100.double(), v100.double(), scale=0.1)
    assert (out.double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_op_matches_kernel_and_layout(is_causal):
    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    q, k, v = make_qkv(2, 4, 2, 200, 200, d, DTYPES[dt], seed=11)
    out, lse = torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, None, 0.125, is_causal)
    kout, klse = run_kernel(q, k, v, 0.125, is_causal)
    assert torch.equal(out, kout) and torch.equal(lse, klse)
    assert out.shape == q.shape and lse.shape == (2, 4, 200) and lse.dtype == torch.float32
    assert out.transpose(1, 2).is_contiguous() and lse.is_contiguous()


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_opcheck(is_causal):
    d, dt = (64, "bf16") if (64, "bf16") in COMPILED else sorted(COMPILED)[0]
    q, k, v = make_qkv(1, 4, 2, 65, 65, d, DTYPES[dt], requires_grad=True, seed=5)
    torch.library.opcheck(torch.ops.fa2_inductor.flash_attention_fwd.default, (q, k, v, None, 0.125, is_causal))


def _grads(fn, q, k, v, g):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(g)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("shape", [(2, 4, 4, 256, 256), (1, 8, 2, 300, 300), (1, 4, 1, 129, 257)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gradients(d, dt, is_causal, shape):
    needs_kernel(d, dt)
    b, hq, hkv, sq, sk = shape
    dtype = DTYPES[dt]
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, layout="bshd", seed=d + sq)
    g = torch.randn(b, hq, sq, d, device=DEV, dtype=dtype, generator=torch.Generator(device=DEV).manual_seed(d + sk))
    scale = 1.0 / math.sqrt(d)
    ours = _grads(lambda q, k, v: fa2_inductor.flash_attention(q, k, v, is_causal=is_causal), q, k, v, g)
    ref = _grads(lambda q, k, v: torch_attention(q, k, v, scale, is_causal), q.double(), k.double(), v.double(), g.double())
    base = _grads(lambda q, k, v: torch_attention(q, k, v, scale, is_causal), q, k, v, g)
    for name, o, r, bse in zip(("out", "dq", "dk", "dv"), ours, ref, base):
        assert o.shape == r.shape, name
        assert not o.isnan().any(), name
        err = (o.double() - r).abs().max().item()
        base_err = (bse.double() - r).abs().max().item()
        assert err <= 2 * base_err + 1e-4, f"{name}: error {err:.3e} > 2 x torch {dtype} error {base_err:.3e}"


def test_backward_uses_flash_path():
    """The CUDA training path must use PyTorch's flash backward with our LSE (not the reference)."""
    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    q, k, v = make_qkv(1, 4, 2, 128, 128, d, DTYPES[dt])
    assert _cuda.backward_unsupported_reason(q, k, v, None, True) is None
    out, lse = run_kernel(q, k, v, 0.1, True)
    g = torch.randn_like(out)
    dq, dk, dv = _cuda.backward(g, q, k, v, out, lse, 0.1, True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_torch_compile_fullgraph(is_causal):
    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 4, 2, 333, 333, d, DTYPES[dt], seed=21)

    def fn(q, k, v):
        return fa2_inductor.flash_attention(q, k, v, is_causal=is_causal) * 2

    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(q, k, v), fn(q, k, v))


def test_cuda_graphs_reduce_overhead():
    d, dt = (128, "bf16") if (128, "bf16") in COMPILED else sorted(COMPILED)[0]
    torch._dynamo.reset()

    def fn(q, k, v):
        return fa2_inductor.flash_attention(q, k, v, is_causal=True) + 1

    compiled = torch.compile(fn, mode="reduce-overhead")
    for i in range(4):  # warm-up, record, then replays on fresh inputs
        q, k, v = make_qkv(1, 4, 4, 512, 512, d, DTYPES[dt], seed=100 + i)
        got = compiled(q, k, v).clone()
        assert torch.equal(got, fn(q, k, v)), f"iteration {i}"
