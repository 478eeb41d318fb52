"""What chains do around the softmax that the op still computes exactly (issue: every family whose attention the
op can compute is rewritten): probabilities zeroed where the mask hides keys (DeBERTa's XSoftmax, CPM-Ant,
Conformer), a bool mask beside another mask (CPM-Ant's position bias), DeBERTa-v2's relative terms summed with
[B*H, M, K] scores, sinks applied after P @ V as ``sigmoid(logsumexp(scores) - sinks)`` (Granite SWA); and the
near misses, which stay refused with their reason."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fa2_inductor.passes.mask_structure import same_computation

from tests.pass_checks import compile_and_compare, pass_counts, qkv

_LOWEST = torch.finfo(torch.float32).min


def _blocked(q, k):
    """Key padding that leaves every row of the second sequence without a visible key, and one key
    of the first hidden."""
    blocked = torch.zeros(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool)
    blocked[0, ..., 3] = True
    blocked[1] = True
    return blocked


def _scores(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


# --- probabilities zeroed where the mask hides keys: rows without a visible key give 0 ------------------
def _xsoftmax(fill, keep_form=False):
    """DeBERTa's XSoftmax: masked_fill(blocked, fill), softmax, masked_fill(blocked, 0) (or where(visible, p, 0))."""
    def fn(q, k, v, blocked):
        probs = _scores(q, k).masked_fill(blocked, fill).softmax(-1)
        probs = torch.where(~blocked, probs, 0.0) if keep_form else probs.masked_fill(blocked, 0.0)
        return probs @ v
    return fn


def _mask_built_twice(q, k, v, padding):
    """CPM-Ant: the bool mask is built again (``mask == False``) for the zeroing."""
    scores = _scores(q, k).masked_fill(padding == torch.tensor(False), float("-inf")).softmax(-1)
    return scores.masked_fill(padding == torch.tensor(False), 0.0) @ v


@pytest.mark.parametrize("fill", [_LOWEST, float("-inf")], ids=["lowest", "minus_inf"])
@pytest.mark.parametrize("keep_form", [False, True], ids=["masked_fill", "where_visible"])
def test_probabilities_zeroed_where_the_mask_hides_keys(cpu_pass, fill, keep_form):
    q, k, v = qkv(seq_q=7, seq_k=9)
    compile_and_compare(_xsoftmax(fill, keep_form), q, k, v, _blocked(q, k), rewrites=1)
    assert fill == float("-inf") or not _xsoftmax(fill, keep_form)(q, k, v, _blocked(q, k)).isnan().any()


def test_zeroing_in_training(cpu_pass):
    q, k, v = qkv(seq_q=7, seq_k=9, train=True)
    compile_and_compare(_xsoftmax(_LOWEST), q, k, v, _blocked(q, k), rewrites=1, train=True)


def test_zeroing_by_a_mask_built_twice(cpu_pass):
    q, k, v = qkv(seq_q=7, seq_k=9)
    compile_and_compare(_mask_built_twice, q, k, v, ~_blocked(q, k), rewrites=1)


def _zeroed_elsewhere(q, k, v, blocked):
    """Zeroed by another mask than the one that hides the keys: a different attention."""
    probs = _scores(q, k).masked_fill(blocked, _LOWEST).softmax(-1)
    return probs.masked_fill(blocked.roll(1, -1), 0.0) @ v


def _zeroed_beside_a_padding_mask(q, k, v, blocked):
    """A finite fill beside a finfo.min additive mask: a row whose visible keys all carry that mask gives
    the filled keys weight before the zeroing, which -inf would not."""
    additive = torch.zeros(q.shape[0], 1, 1, k.shape[2]).masked_fill(blocked.roll(2, -1), _LOWEST)
    probs = (_scores(q, k) + additive).masked_fill(blocked, _LOWEST).softmax(-1)
    return probs.masked_fill(blocked, 0.0) @ v


def _zeroed_twice(q, k, v, blocked):
    probs = _scores(q, k).masked_fill(blocked, _LOWEST).softmax(-1)
    return probs.masked_fill(blocked, 0.0).masked_fill(blocked.roll(1, -1), 0.0) @ v


def _zeroed_with_a_shallow_fill(q, k, v, blocked):
    probs = _scores(q, k).masked_fill(blocked, -1e4).softmax(-1)
    return probs.masked_fill(blocked, 0.0) @ v


ZEROING_REFUSED = {
    "zeroed_elsewhere": (_zeroed_elsewhere, "probs_modified"),
    "beside_a_padding_mask": (_zeroed_beside_a_padding_mask, "probs_modified"),
    "zeroed_twice": (_zeroed_twice, "probs_modified"),
    "shallow_fill": (_zeroed_with_a_shallow_fill, "finite_fill_value"),
}


@pytest.mark.parametrize("name", ZEROING_REFUSED)
def test_zeroing_that_is_not_the_empty_rows_is_refused(cpu_pass, name):
    fn, reason = ZEROING_REFUSED[name]
    q, k, v = qkv(seq_q=7, seq_k=9)
    compile_and_compare(fn, q, k, v, _blocked(q, k), rewrites=0)
    assert pass_counts() == {f"refused:{reason}": 1}


# --- a bool mask beside another mask: an additive -inf mask summed with it ------------------------------
def _bool_and_bias(order):
    def fn(q, k, v, blocked, bias):
        if order == "bias_first":
            scores = (_scores(q, k) + bias).masked_fill(blocked, float("-inf"))
        else:
            scores = _scores(q, k).masked_fill(blocked, float("-inf")) + bias
        return scores.softmax(-1) @ v
    return fn


@pytest.mark.parametrize("order", ["bias_first", "bias_last"])
def test_bool_mask_beside_an_additive_one(cpu_pass, order):
    q, k, v = qkv(seq_q=7, seq_k=9)
    bias = torch.randn(1, q.shape[1], 7, 9)
    blocked = _blocked(q, k)
    blocked[1] = False  # no row without a visible key: eager's NaN rows are not compared
    compile_and_compare(_bool_and_bias(order), q, k, v, blocked, bias, rewrites=1)
    assert pass_counts()["rewrites:mask"] == 1


# --- DeBERTa-v2: relative terms summed with [B*H, M, K] scores, then viewed as [B, H, M, K] -----------------
def _flat_sum(broadcast_term=False):
    """A term computed from q and position keys (DeBERTa's c2p), added to the [B*H, M, K] scores."""
    def fn(q, k, v, blocked, position_keys):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
        term = torch.bmm(q3, position_keys.transpose(-1, -2)) * 0.1
        if broadcast_term:
            term = term[:1]
        scores = torch.bmm(q3, k3.transpose(-1, -2) / math.sqrt(d)) + term
        scores = scores.view(-1, h, s, k.shape[2]).masked_fill(blocked, _LOWEST)
        probs = scores.softmax(-1).masked_fill(blocked, 0.0)
        return torch.bmm(probs.view(-1, s, k.shape[2]), v3).view(b, h, s, d)
    return fn


def _position_keys(q, k):
    return torch.randn(q.shape[0] * q.shape[1], k.shape[2], q.shape[3], generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("broadcast_term", [False, True], ids=["term_per_score", "broadcast_term"])
def test_terms_summed_with_merged_scores(cpu_pass, broadcast_term):
    """A term with the scores' [B*H, M, K] shape is an additive mask of their [B, H, M, K] view; a term that
    broadcasts stays refused."""
    q, k, v = qkv(seq_q=7, seq_k=9)
    with torch.no_grad():
        compile_and_compare(_flat_sum(broadcast_term), q, k, v, _blocked(q, k), _position_keys(q, k),
                            rewrites=int(not broadcast_term))
    if broadcast_term:
        assert pass_counts() == {"refused:unrecognised_layout": 1}


# --- sinks applied after P @ V: (P @ V) * sigmoid(logsumexp(scores) - sinks) (Granite SWA) ----------------
def _sink_gate(lse_of=None, gate=torch.sigmoid, reversed_difference=False, dtype=None):
    def fn(q, k, v, mask, sinks):
        scores = _scores(q, k) + mask
        lse = torch.logsumexp(scores if lse_of is None else lse_of(scores), dim=-1)
        difference = sinks.view(1, -1, 1) - lse if reversed_difference else lse - sinks.view(1, -1, 1)
        scale = gate(difference.to(torch.float32))
        out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return out * scale.unsqueeze(-1).to(out.dtype if dtype is None else dtype)
    return fn


def _sink_inputs(dtype=torch.float32):
    q, k, v = qkv(seq_q=7, seq_k=9, dtype=dtype)
    mask = torch.zeros(q.shape[0], 1, 7, 9, dtype=dtype).masked_fill(_blocked(q, k), torch.finfo(dtype).min)
    sinks = torch.linspace(-1.0, 2.0, q.shape[1], dtype=dtype)
    return q, k, v, mask, sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_applied_after_the_product_are_the_ops_sinks(cpu_pass, dtype):
    code = compile_and_compare(_sink_gate(), *_sink_inputs(dtype), rewrites=1)
    assert "flash_attention_fwd" in code and pass_counts()["rewrites"] == 1


SINK_GATES_REFUSED = {
    "lse_of_other_scores": (_sink_gate(lse_of=lambda s: s * 2.0), "intermediate_used_elsewhere"),
    "another_gate": (_sink_gate(gate=torch.tanh), "intermediate_used_elsewhere"),
    "reversed_difference": (_sink_gate(reversed_difference=True), "intermediate_used_elsewhere"),
}


@pytest.mark.parametrize("name", SINK_GATES_REFUSED)
def test_a_gate_that_is_no_sink_is_refused(cpu_pass, name):
    fn, reason = SINK_GATES_REFUSED[name]
    compile_and_compare(fn, *_sink_inputs(), rewrites=0)
    assert pass_counts() == {f"refused:{reason}": 1}


@pytest.mark.parametrize("sinks_learnt", [False, True], ids=["frozen_sinks", "learnt_sinks"])
def test_a_sink_gate_in_training(cpu_pass, sinks_learnt):
    """Gradients reach q, k and v through the op's backward; a sinks gradient is not mapped yet: refused."""
    q, k, v, mask, sinks = _sink_inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks.requires_grad_(sinks_learnt)
    compile_and_compare(_sink_gate(), q, k, v, mask, sinks, rewrites=int(not sinks_learnt), train=True)
    if sinks_learnt:
        assert pass_counts() == {"refused:training_gradient_unmapped": 1}


# --- the same mask built twice, as the zeroing's match reads it ------------------------------------------
def test_same_computation_compares_how_masks_are_built():
    def fn(x, y):
        built = [x == torch.tensor(0.0), x == torch.tensor(0.0), x == torch.tensor(1.0), y == torch.tensor(0.0)]
        return built + [torch.rand(3) > 0.5, torch.rand(3) > 0.5]
    graph = make_fx(fn)(torch.zeros(3), torch.zeros(3)).graph
    masks = next(n for n in graph.nodes if n.op == "output").args[0]
    assert same_computation(masks[0], masks[1])
    assert not same_computation(masks[0], masks[2])  # another constant
    assert not same_computation(masks[0], masks[3])  # another input
    assert not same_computation(masks[4], masks[5])  # two draws
