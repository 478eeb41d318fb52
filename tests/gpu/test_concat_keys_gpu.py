"""Pegasus-X-shaped block-local attention (keys concatenated in the scores, passes/concat_keys.py) on the
Hopper kernel: one op call over [B*H, blocks, block, D] queries and [B*H, blocks, G + block, D] keys, compiled
equal to eager within FlashAttention's rule."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from fa2_inductor import _extension  # noqa: E402

if _extension.C is None:
    pytest.skip(f"fa2_inductor._C not loaded: {_extension.status}", allow_module_level=True)

from tests.gpu.kernel_inputs import DEV, needs_kernel  # noqa: E402

B, H, N, K, G, D = 2, 4, 4, 256, 32, 64  # batch, heads, blocks, block size, global keys, head dim


def _block_local(q, global_k, global_v, k, v):
    bq, bk, bv = (t.view(B, H, N, K, D) for t in (q, k, v))
    scores = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", bq, global_k),
                        torch.einsum("BHNKF,BHNXF->BHNKX", bq, bk)], dim=-1)
    probs = (scores * D**-0.5).softmax(-1)
    return (torch.einsum("BHNKG,BHGF->BHNKF", probs[..., :G], global_v)
            + torch.einsum("BHNKX,BHNXF->BHNKF", probs[..., G:], bv))


def test_block_local_attention_runs_on_the_kernel():
    needs_kernel(D, "bf16")
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(B, H, N * K, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(3))
    global_k, global_v = (torch.randn(B, H, G, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    inputs = (q, global_k, global_v, k, v)
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(force_disable_caches=True):
        got = torch.compile(_block_local, backend="fa2_inductor")(*inputs)
    assert dict(counters["fa2_inductor"]) == {"rewrites": 1, "rewrites:no_mask": 1}
    ref = _block_local(*(t.double() for t in inputs))
    err = (got.double() - ref).abs().max().item()
    base_err = (_block_local(*inputs).double() - ref).abs().max().item()
    assert err <= 2 * base_err + 1e-5, f"compiled error {err:.3e} > 2 x eager bf16 error {base_err:.3e}"
