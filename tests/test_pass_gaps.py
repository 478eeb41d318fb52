"""Softmaxes over scores the pass used to pass over in silence, and the attention forms it learnt since
(issue 15: a sweep of Hugging Face families): each is rewritten exactly, or refused with its reason."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fa2_inductor
from tests.pass_checks import compile_and_compare, pass_counts, qkv

D = 16


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(D)


# --- nothing silent: a softmax over scores that is not taken is refused with a reason -------------------
def _scores_beyond_the_walk(q, k, v):
    """Ten flips (an identity) between the scores and the softmax: further than the matcher follows."""
    s = _scores(q, k)
    for _ in range(10):
        s = s.flip(-1)
    return s.softmax(-1) @ v


def _probs_summed_by_hand(q, k, v):
    """P @ V as a broadcast product and a sum: no matmul takes the probabilities."""
    return (_scores(q, k).softmax(-1).unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)


def _sinks(q, k, v):
    """gpt-oss: a per-head sink logit joins each row's softmax and is dropped before P @ V."""
    s = _scores(q, k)
    sinks = torch.linspace(-1.0, 1.0, q.shape[1]).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    probs = torch.cat([s, sinks], dim=-1).softmax(-1)
    return probs[..., :-1] @ v


UNSEEN = {
    "unrecognised_scores": _scores_beyond_the_walk,
    "unrecognised_probs": _probs_summed_by_hand,
    "attention_sinks": _sinks,
}


@pytest.mark.parametrize("reason", UNSEEN)
def test_softmax_over_scores_is_never_silent(cpu_pass, reason):
    compile_and_compare(UNSEEN[reason], *qkv(), rewrites=0)
    assert pass_counts() == {f"refused:{reason}": 1}


def test_explain_lists_a_refused_softmax_over_scores(cpu_pass):
    report = fa2_inductor.explain(_sinks, *qkv())
    assert len(report.sites) == 1 and report.refused[0].reason == "attention_sinks", str(report)
    assert "no attention found" not in str(report)


def test_router_and_classifier_softmaxes_are_no_sites(cpu_pass):
    """A softmax over a linear layer's logits (an MoE router, a classifier head) is not attention."""
    x, w = torch.randn(2, 8, 16), torch.randn(16, 4)
    compile_and_compare(lambda x, w: (x @ w).softmax(-1) * 2.0, x, w, rewrites=0)
    assert pass_counts() == {}
