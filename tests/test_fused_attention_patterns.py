"""PyTorch's own fused-attention suite against the fa2_inductor backend.

Every ``_sfdp_pattern_*`` of Inductor's fuse_attention.py (tests/fused_attention_patterns.py), run as
Inductor's test_fused_attention.py runs them: inference, training (every floating input requires grad,
masks included), dropout, a dynamic batch. Each must be rewritten or refused with the reason listed in
``VERDICTS``, and the compiled graphs must give eager's outputs and gradients. The graphs are run
eagerly after the backend's graph passes (``graph_passes_backend``): the pass's decisions and rewrites
are what is checked here, code generation elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from tests.fused_attention_patterns import PATTERNS, pattern_inputs
from tests.pass_checks import TOLERANCE, graph_passes_backend

REWRITTEN = "rewritten"
# pattern -> verdict in inference and in training (dropout_p = 0); a dtype-keyed dict where they differ.
VERDICTS = {
    **{n: (REWRITTEN, REWRITTEN) for n in PATTERNS},
    # GPT-2's where(causal, s, finfo.min): s + finfo.min would give a fully masked row's scores gradients
    18: (REWRITTEN, "finite_fill_value"),
    19: (REWRITTEN, "finite_fill_value"),
    # MBart: the mask (requiring grad) is added to a 4-D view of the 3-D scores; the op's mask is its
    # [B*H, M, K] copy, whose gradient is not the mask's
    24: (REWRITTEN, "training_gradient_unmapped"),
}


def _verdict(counts) -> str:
    refused = [key.split(":", 1)[1] for key in counts if key.startswith("refused:")]
    assert counts.get("rewrites", 0) + len(refused) == 1, counts  # one site, one decision
    return REWRITTEN if counts.get("rewrites") else refused[0]


def _compile_and_compare(fn, inputs, *, train, dynamic_batch=False):
    torch._dynamo.reset()
    counters.clear()
    if dynamic_batch:  # every input with the batch dim (masks too: their batch is q's)
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.shape[0] == inputs[0].shape[0]:
                torch._dynamo.mark_dynamic(t, 0)
    got = torch.compile(fn, backend=graph_passes_backend, fullgraph=True)(*inputs)
    expected = fn(*inputs)
    got, expected = (got[0], expected[0]) if isinstance(got, tuple) else (got, expected)
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    if train:
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to(expected.dtype)
        for g, e in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(expected, leaves, grad)):
            torch.testing.assert_close(g, e, atol=tol * 4, rtol=tol * 4)
    return _verdict(dict(counters["fa2_inductor"]))


CASES = [(n, dtype) for n, p in PATTERNS.items() for dtype in p.dtypes]


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("number, dtype", CASES, ids=[f"p{n}-{str(d)[6:]}" for n, d in CASES])
def test_pattern(cpu_pass, number, dtype, train):
    pattern = PATTERNS[number]
    verdict = _compile_and_compare(pattern.fn, pattern_inputs(pattern, dtype, train=train), train=train)
    assert verdict == VERDICTS[number][train], verdict


@pytest.mark.parametrize("number", PATTERNS)
def test_pattern_with_dynamic_batch(cpu_pass, number):
    pattern = PATTERNS[number]
    inputs = pattern_inputs(pattern, pattern.dtypes[0])
    assert _compile_and_compare(pattern.fn, inputs, train=False, dynamic_batch=True) == VERDICTS[number][False]


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("number", [1, 2, 5])
def test_pattern_under_activation_checkpointing(cpu_pass, number, train):
    """Inductor's suite also runs patterns inside torch.utils.checkpoint (recomputed in the backward)."""
    pattern = PATTERNS[number]

    def checkpointed(*inputs):
        return torch.utils.checkpoint.checkpoint(pattern.fn, *inputs, use_reentrant=False)

    inputs = pattern_inputs(pattern, torch.float32, train=train)
    assert _compile_and_compare(checkpointed, inputs, train=train) == REWRITTEN


@pytest.mark.parametrize("number", [n for n in PATTERNS if "dropout_p" in PATTERNS[n].extras])
def test_active_dropout_is_refused(cpu_pass, number):
    """Random: only the decision is checked (Inductor's own suite does not compare values either)."""
    pattern = PATTERNS[number]
    torch._dynamo.reset()
    counters.clear()
    torch.compile(pattern.fn, backend=graph_passes_backend)(*pattern_inputs(pattern, pattern.dtypes[0], dropout_p=0.3))
    assert _verdict(dict(counters["fa2_inductor"])) == "dropout_active"


# --- the other tests of test_fused_attention.py -----------------------------------------------------
def _weights_returned(q, k, v):
    weights = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1)
    return weights.matmul(v), weights


class _TensorFactor(torch.nn.Module):
    """A scale given as a [H, 1, 1] tensor: per head, not the op's one scalar."""

    def __init__(self, divide):
        super().__init__()
        self.divide = divide

    def forward(self, q, k, v, factor):
        scores = torch.matmul(q, k.transpose(-2, -1))
        scores = scores.div(factor.detach()) if self.divide else scores.mul(factor.detach())
        return scores.softmax(dim=-1).matmul(v)


def _unsupported_mask(q, k, v, mask):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


def _tril_filled_mask(q, k, v):
    """test_sdpa_rewriter_5 v1: a causal mask built as float(-inf / 0) from tril."""
    mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(diagonal=0)
    mask = mask.masked_fill(torch.logical_not(mask), -float("inf"))
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


def _zeros_bool_mask_added(q, k, v):
    """test_sdpa_rewriter_5 v2 (pytorch issue 100318): a bool mask *added* to the scores."""
    mask = torch.zeros(q.size(-2), k.size(-2), dtype=torch.bool)
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


def _clone_between(q, k, v):
    """test_sdpa_prev_13: a clone between the softmax and P @ V."""
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).clone().matmul(v)


def _float_mask_tril(q, k, v):
    """test_sdpa_rewriter_16_fp32_mask (dropout 0): a float32 random mask, tril'ed."""
    mask = torch.randn(q.size(1), k.size(1), generator=torch.Generator().manual_seed(3)).tril(diagonal=0)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    return (torch.matmul(q, k.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1).matmul(v)


def _qkv(shape=(2, 4, 8, 16), train=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_(train) for _ in range(3)]


OTHER_TESTS = {
    # name: (fn, extra inputs, verdict)
    "pattern_fails_with_reuse": (_weights_returned, [], "probs_used_elsewhere"),
    "tensor_factor_div": (_TensorFactor(True).eval(), [torch.randn(4, 1, 1)], "score_transform"),
    "tensor_factor_mul": (_TensorFactor(False).eval(), [torch.randn(4, 1, 1)], "score_transform"),
    "unsupported_mask_int": (_unsupported_mask, [torch.randint(-2, 3, (2, 4, 8, 8))], "non_float_additive_mask"),
    "unsupported_mask_python_float": (_unsupported_mask, [2.0], "score_transform"),
    # masked_fill of a bool tensor keeps it bool (-inf becomes True): a bool added to the scores
    "rewriter_5_tril_mask": (_tril_filled_mask, [], "non_float_additive_mask"),
    "rewriter_5_bool_added": (_zeros_bool_mask_added, [], "non_float_additive_mask"),
    "prev_13_clone": (_clone_between, [], REWRITTEN),
    "rewriter_16_fp32_mask": (_float_mask_tril, [], REWRITTEN),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", OTHER_TESTS)
def test_other_peer_tests(cpu_pass, name, train):
    fn, extras, verdict = OTHER_TESTS[name]
    inputs = _qkv(train=train) + extras
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(fn, backend=graph_passes_backend)(*inputs)
    expected = fn(*inputs)
    got, expected = (got[0], expected[0]) if isinstance(got, tuple) else (got, expected)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert _verdict(dict(counters["fa2_inductor"])) == verdict
