"""Symbolic shapes (dynamic=True): sites are still rewritten and one graph serves several shapes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.pass_checks import compile_and_compare, qkv


def _symbolic_scale(q, k, v):
    return (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(-1) @ v


def _constant_scale(q, k, v):
    return (q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v


def _bmm_3d(q, k, v):
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
    return torch.bmm(torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) * 0.25, -1), v3).reshape(b, h, s, d)


def _gqa(q, k, v):
    b, hkv, s, d = k.shape
    n_rep = q.shape[1] // hkv
    k = k[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)
    v = v[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)
    return (q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


CASES = {"symbolic_scale": _symbolic_scale, "constant_scale": _constant_scale, "bmm_3d": _bmm_3d,
         "gqa": _gqa, "sdpa": _sdpa}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", CASES)
def test_dynamic_shapes(cpu_pass, name, train):
    fn = CASES[name]
    kv_heads = 2 if name == "gqa" else None
    compile_and_compare(fn, *qkv(seq_q=8, kv_heads=kv_heads, train=train), rewrites=1, train=train, dynamic=True)


def test_one_graph_for_several_lengths(cpu_pass):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_symbolic_scale, backend="fa2_inductor", dynamic=True)
    for seq in (5, 9, 13):
        q, k, v = qkv(seq_q=seq)
        torch.testing.assert_close(compiled(q, k, v), _symbolic_scale(q, k, v), atol=2e-5, rtol=2e-5)
    assert counters["fa2_inductor"]["rewrites"] == 1  # compiled once, rewritten once
