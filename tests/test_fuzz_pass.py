"""Differential fuzzing: random attention-like functions, compiled with the pass == eager, whatever it decides."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fa2_inductor
from tests.pass_checks import TOLERANCE

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CASES = st.fixed_dictionaries(
    {
        "batch": st.sampled_from([1, 2]),
        "kv_heads": st.sampled_from([1, 2]),
        "n_rep": st.sampled_from([1, 2]),
        # Length 1 is left out: Inductor decomposes such a bmm into pointwise ops before the pass runs.
        "seq_q": st.integers(1, 9),
        # Sk >= 2: over a single key, ATen computes the matmuls as broadcast multiplies: no attention to find.
        "seq_k": st.integers(2, 9),
        "dim": st.sampled_from([8, 16]),
        "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
        "scale_at": st.sampled_from(["none", "div_scores", "mul_scores", "q", "k", "split"]),
        "matmul": st.sampled_from(["matmul", "bmm3", "einsum", "sdpa"]),
        "k_transpose": st.sampled_from(["transpose", "mT", "permute"]),
        "bshd": st.booleans(),
        "mask": st.sampled_from(["none", "additive", "bool_fill", "bool_where", "hf_min", "causal_tril", "causal_arange"]),
        "upcast": st.booleans(),
        "gqa": st.sampled_from(["repeat_kv", "repeat_interleave"]),
        "softmax_dim": st.sampled_from([-1, -1, -1, -2]),
        "return_weights": st.sampled_from([False, False, False, True]),
        "train": st.booleans(),
    }
)


def _repeat(x, n_rep, how):
    if n_rep == 1:
        return x
    if how == "repeat_interleave":
        return x.repeat_interleave(n_rep, dim=1)
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _mask_input(case):
    """The mask passed in as a graph input (None for in-graph causal masks and no mask)."""
    gen = torch.Generator().manual_seed(case["seq_q"] * 31 + case["seq_k"])
    shape = (case["batch"], 1, case["seq_q"], case["seq_k"])
    if case["mask"] == "additive":  # in the inputs' dtype, as models build it (a float32 one makes eager's p @ v fail)
        return torch.randn(shape, generator=gen).to(case["dtype"])
    if case["mask"] in ("bool_fill", "bool_where", "hf_min"):
        mask = torch.rand(shape, generator=gen) > 0.5
        mask[..., 0] = True  # a visible key in every row: eager's -inf softmax gives NaN otherwise
        return mask
    return None


def _causal(sq, sk, how):
    if how == "causal_tril":
        return torch.ones(sq, sk, dtype=torch.bool).tril()
    return torch.arange(sk)[None, :] <= torch.arange(sq)[:, None]


def make_attention(case):
    d = case["dim"]
    root = d**-0.25

    def scores_of(q, k):
        if case["scale_at"] in ("q", "split"):
            q = q * (root * root if case["scale_at"] == "q" else root)
        if case["scale_at"] in ("k", "split"):
            k = k * (root * root if case["scale_at"] == "k" else root)
        if case["matmul"] == "einsum":
            s = torch.einsum("bhqd,bhkd->bhqk", q, k)
        elif case["matmul"] == "bmm3":
            b, h = q.shape[:2]
            s = torch.bmm(q.reshape(b * h, -1, d), k.reshape(b * h, -1, d).transpose(1, 2)).view(b, h, q.shape[2], -1)
        else:
            kt = {"transpose": lambda t: t.transpose(-2, -1), "mT": lambda t: t.mT,
                  "permute": lambda t: t.permute(0, 1, 3, 2)}[case["k_transpose"]](k)
            s = q @ kt
        if case["scale_at"] == "div_scores":
            s = s / math.sqrt(d)
        elif case["scale_at"] == "mul_scores":
            s = s * (1.0 / math.sqrt(d))
        return s

    def apply_mask(s, mask):
        kind = case["mask"]
        if kind == "additive":
            return s + mask
        if kind == "bool_fill":
            return s.masked_fill(~mask, float("-inf"))
        if kind == "bool_where":
            return torch.where(mask, s, float("-inf"))
        if kind == "hf_min":
            return s + torch.where(mask, 0.0, torch.finfo(s.dtype).min).to(s.dtype)
        if kind.startswith("causal"):
            return s.masked_fill(~_causal(s.shape[-2], s.shape[-1], kind), float("-inf"))
        return s

    def attention(q, k, v, mask):
        if case["bshd"]:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = _repeat(k, case["n_rep"], case["gqa"]), _repeat(v, case["n_rep"], case["gqa"])
        if case["matmul"] == "sdpa":
            causal_mask = _causal(q.shape[-2], k.shape[-2], case["mask"]) if case["mask"].startswith("causal") else None
            sdpa_mask = causal_mask if causal_mask is not None else mask
            if case["mask"] == "hf_min":
                sdpa_mask = torch.where(mask, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=1.0 if case["scale_at"] == "none" else None)
        s = apply_mask(scores_of(q, k), mask)
        if case["upcast"]:
            p = F.softmax(s, dim=case["softmax_dim"], dtype=torch.float32).to(q.dtype)
        else:
            p = s.softmax(case["softmax_dim"])
        out = p @ v
        return (out, p) if case["return_weights"] else out

    return attention


def _inputs(case):
    gen = torch.Generator().manual_seed(case["dim"] + case["seq_q"])
    heads = case["kv_heads"] * case["n_rep"]

    def make(h, s):
        shape = (case["batch"], s, h, case["dim"]) if case["bshd"] else (case["batch"], h, s, case["dim"])
        return torch.randn(shape, generator=gen).to(case["dtype"]).requires_grad_(case["train"])

    return make(heads, case["seq_q"]), make(case["kv_heads"], case["seq_k"]), make(case["kv_heads"], case["seq_k"])


@pytest.fixture(scope="module")
def cpu_pass():
    previous = fa2_inductor.config.rewrite_on_cpu
    fa2_inductor.config.rewrite_on_cpu = True
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    fa2_inductor.config.rewrite_on_cpu = previous
    torch._dynamo.reset()


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=CASES)
def test_compiled_equals_eager(cpu_pass, case):
    attention = make_attention(case)
    q, k, v = _inputs(case)
    mask = _mask_input(case)
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(attention, backend="fa2_inductor")(q, k, v, mask)
    expected = attention(q, k, v, mask)
    counts = counters["fa2_inductor"]
    decisions = counts["rewrites"] + sum(n for key, n in counts.items() if key.startswith("refused:"))
    assert decisions == 1, (case, dict(counters["fa2_inductor"]))  # exactly one site, rewritten or refused
    tol = TOLERANCE[case["dtype"]]
    # equal_nan: a softmax over queries can meet a key column no query sees; eager gives NaN there too.
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol, equal_nan=True,
                               msg=lambda m: f"{case}\n{dict(counters['fa2_inductor'])}\n{m}")
    if case["train"]:
        out, ref = (got[0], expected[0]) if isinstance(got, tuple) else (got, expected)
        grad = torch.randn_like(ref)
        got_grads = torch.autograd.grad(out, (q, k, v), grad)
        expected_grads = torch.autograd.grad(ref, (q, k, v), grad)
        for g, e in zip(got_grads, expected_grads):
            torch.testing.assert_close(g, e, atol=tol * 4, rtol=tol * 4, equal_nan=True, msg=lambda m: f"{case}\n{m}")
