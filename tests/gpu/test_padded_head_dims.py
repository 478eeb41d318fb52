"""Head dims without a kernel of their own (96 has one where the build asked for it): they run on the
smallest larger compiled kernel, zero-padded by its TMA loads and clipped by its stores. Forward (plain, causal, bool and
additive masks, GQA, strided) and backward (dq, dk, dv, the additive mask's gradient) against the float64
reference with FlashAttention's 2x rule, into NaN-poisoned outputs, so a column written past the tensor's
head dim or one left unwritten fails. A head dim that is not a multiple of 8 stays with the reference. Skipped
unless an sm_90 GPU and fa2_inductor._C exist.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from fa2_inductor import _cuda, _extension  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.gpu.kernel_inputs import COMPILED, DEV, DTYPES, make_qkv  # noqa: E402
from tests.gpu.test_backward import check_backward  # noqa: E402
from tests.gpu.test_kernel import check_forward  # noqa: E402
from tests.gpu.test_mask import check_masked  # noqa: E402

# Real models' head dims between and below the compiled ones (Phi-3: 96, CLIP ViT-H: 80, ...).
PADDED = (32, 48, 80, 96, 112, 160, 184, 200)


def needs_larger_kernel(d: int, dt: str) -> None:
    if not any(cd > d and name == dt for cd, name in COMPILED):
        pytest.skip(f"no compiled {dt} kernel above head dim {d}")


def needs_backward_kernel(q, k, v) -> None:
    """A build may hold a head dim's forward kernel without a backward one (FA2_INDUCTOR_HEAD_DIMS=96 alone)."""
    reason = _cuda.backward_kernel_unsupported_reason(q, q, k, v, q, None, False, False)
    if reason is not None and reason.startswith("no backward kernel compiled"):
        pytest.skip(reason)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", PADDED)
def test_forward(d, dt, is_causal, layout):
    needs_larger_kernel(d, dt)
    q, k, v = make_qkv(2, 4, 2, 97, 1000, d, DTYPES[dt], layout=layout, seed=d)
    check_forward(q, k, v, is_causal)  # asserts the kernel takes the call


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("d", (80, 96))
def test_forward_masked(d, mask_kind):
    needs_larger_kernel(d, "bf16")
    q, k, v = make_qkv(1, 2, 2, 300, 333, d, torch.bfloat16, seed=5)
    g = torch.Generator(device=DEV).manual_seed(0)
    mask = torch.rand(1, 1, 300, 333, device=DEV, generator=g) > 0.3
    if mask_kind == "additive":
        mask = torch.randn(1, 2, 300, 333, device=DEV, generator=g)
    check_masked(q, k, v, mask)  # asserts the kernel takes the call


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", PADDED)
def test_backward(d, dt, is_causal):
    needs_larger_kernel(d, dt)
    q, k, v = make_qkv(2, 4, 2, 333, 257, d, DTYPES[dt], seed=d + 1)
    needs_backward_kernel(q, k, v)
    check_backward(q, k, v, is_causal, seed=d)


@pytest.mark.parametrize("d", (80, 96))
def test_backward_additive_mask_gradient(d):
    needs_larger_kernel(d, "bf16")
    q, k, v = make_qkv(1, 2, 2, 200, 300, d, torch.bfloat16, seed=7)
    needs_backward_kernel(q, k, v)
    bias = torch.randn(1, 2, 200, 300, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    check_backward(q, k, v, False, mask=bias, mask_grad=True)


def test_a_head_dim_not_a_multiple_of_8_stays_with_the_reference():
    dt = sorted(COMPILED)[0][1]
    q, k, v = make_qkv(1, 2, 2, 16, 16, 100, DTYPES[dt])
    assert _cuda.kernel_unsupported_reason(q, k, v, None, False) == f"no kernel compiled for head dim 100 {dt}"
