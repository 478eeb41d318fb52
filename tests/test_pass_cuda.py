"""The pass on a GPU with the Hopper kernel built (skipped elsewhere): what it rewrites there, and what not.

Run on the H200: ``python -m pytest -q tests/test_pass_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fa2_inductor
from fa2_inductor import _cuda
from tests.pass_checks import compile_and_compare, op_calls, pass_counts, qkv


def _kernel_missing_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    q = torch.empty(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    return _cuda.kernel_unsupported_reason(q, q, q, None, True)


pytestmark = pytest.mark.skipif(_kernel_missing_reason() is not None, reason=str(_kernel_missing_reason()))
D = 64


@pytest.fixture(autouse=True)
def fresh_compile():
    assert fa2_inductor.config.rewrite_on_cpu is False
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


def _hand_written_causal(q, k, v):
    visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-2, -1) * D**-0.5).masked_fill(~visible, float("-inf"))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _sdpa_gqa_causal(q, k, v):
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), is_causal=True)


def _padding_mask_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("fn", [_hand_written_causal, _sdpa_gqa_causal], ids=["hand_written", "sdpa_gqa"])
def test_rewritten_on_the_gpu(fn, train, dtype):
    kv_heads = 2 if fn is _sdpa_gqa_causal else 8
    q, k, v = qkv(batch=2, heads=8, kv_heads=kv_heads, seq_q=256, dim=D, dtype=dtype, train=train, device="cuda")
    code = compile_and_compare(fn, q, k, v, rewrites=1, train=train)
    args = op_calls(code)[0].split(", ")
    assert (args[3], args[5]) == ("None", "True"), op_calls(code)  # no mask, causal


def test_dynamic_shapes_on_the_gpu():
    # 512 keys: a masked site at this head dim is taken from there on (support.min_keys)
    q, k, v = qkv(batch=2, heads=8, seq_q=512, dim=D, dtype=torch.bfloat16, device="cuda")
    compile_and_compare(_hand_written_causal, q, k, v, rewrites=1, dynamic=True)


def test_a_padding_mask_runs_on_the_kernel():
    q, k, v = qkv(batch=2, heads=8, seq_q=512, dim=D, dtype=torch.bfloat16, device="cuda")
    mask = torch.ones(2, 1, 512, 512, dtype=torch.bool, device="cuda")
    mask[1, ..., 400:] = False
    compile_and_compare(_padding_mask_attention, q, k, v, mask, rewrites=1)


def test_float32_stays_with_inductor():
    compile_and_compare(_hand_written_causal, *qkv(seq_q=128, dim=D, device="cuda"), rewrites=0)
    assert pass_counts() == {"refused:kernel_unsupported": 1}


def test_softmax_over_queries_matches_eager():
    def over_queries(q, k, v):
        return (q @ k.transpose(-2, -1) * D**-0.5).softmax(dim=-2) @ v

    compile_and_compare(over_queries, *qkv(seq_q=128, dim=D, dtype=torch.float16, device="cuda"), rewrites=0)
    assert pass_counts() == {"refused:softmax_not_last_dim": 1}
