"""The pass's newer rewrites on the Hopper kernel: what they rely on the kernel computing exactly.

- finite fills (``where(mask, s, finfo.min)``) become additive masks: the kernel's additive path must
  average V over a row whose every entry is finfo.min, as eager does (it never skips finite values);
- SDPA's safe softmax: rows whose scores are all -inf give 0;
- float32 attention on upcast bf16 q/k/v runs on the bf16 kernel, within FlashAttention's 2x rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from fa2_inductor import _extension  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.gpu.kernel_inputs import DEV, assert_twice_torch_error, make_qkv, needs_kernel  # noqa: E402

B, H, S, D = 2, 4, 256, 128


def _visible_with_empty_rows():
    visible = torch.rand(B, 1, S, S, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)) > 0.3
    visible[..., 0] = True
    visible[0, :, 17] = False  # rows that see no key
    visible[1, :, 200:] = False
    return visible


def _attention_f64(q, k, v, bias):
    scores = q.double() @ k.double().transpose(-2, -1) * D**-0.5 + bias.double()
    return scores.softmax(-1) @ v.double()


def test_kernel_averages_v_over_rows_filled_with_finfo_min():
    needs_kernel(D, "bf16")
    q, k, v = make_qkv(B, H, H, S, S, D, torch.bfloat16)
    fill = torch.tensor(torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=DEV)
    bias = torch.where(_visible_with_empty_rows(), torch.zeros_like(fill), fill)
    out, lse = torch.ops.fa2_inductor.flash_attention_fwd(q, k, v, bias, D**-0.5, False)
    base = (q @ k.transpose(-2, -1) * D**-0.5 + bias).softmax(-1) @ v
    assert_twice_torch_error(out, lse, _attention_f64(q, k, v, bias), base)
    torch.testing.assert_close(out[0, :, 17].float(), v[0].float().mean(-2), atol=2e-2, rtol=2e-2)


def _compile_count(fn, *inputs):
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(fn, backend="fa2_inductor")(*inputs)
    return out, counters["fa2_inductor"]["rewrites"]


def _finfo_min_fill(q, k, v, visible):
    scores = q @ k.transpose(-2, -1) * D**-0.5
    return torch.where(visible, scores, torch.finfo(scores.dtype).min).softmax(-1) @ v


def _safe_softmax(q, k, v, visible):
    scores = (q @ k.transpose(-2, -1) * D**-0.5).masked_fill(~visible, float("-inf"))
    return torch.ops.aten._safe_softmax(scores, -1) @ v


def _float32_math_cast_back(q, k, v, visible):
    qf, kf, vf = (t.float() for t in (q, k, v))
    return (torch.ops.aten._safe_softmax(qf @ kf.transpose(-2, -1) * D**-0.5, -1) @ vf).to(q.dtype)


@pytest.mark.parametrize("fn", [_finfo_min_fill, _safe_softmax, _float32_math_cast_back],
                         ids=["finfo_min_fill", "safe_softmax", "float32_math"])
def test_compiled_equals_eager_on_the_kernel(fn):
    needs_kernel(D, "bf16")
    q, k, v = make_qkv(B, H, H, S, S, D, torch.bfloat16)
    visible = _visible_with_empty_rows()
    with torch._inductor.config.patch(force_disable_caches=True):
        got, rewrites = _compile_count(fn, q, k, v, visible)
    assert rewrites == 1, dict(counters["fa2_inductor"])
    expected = fn(q, k, v, visible)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2 * scale, rtol=0)
    assert not F.mse_loss(got.float(), expected.float()).isnan()
