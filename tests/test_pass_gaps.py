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
    """Two sink logits per row (one per head and query position): not the op's per-head sinks."""
    s = _scores(q, k)
    sinks = torch.linspace(-1.0, 1.0, 2 * q.shape[2]).reshape(1, 1, -1, 2).expand(q.shape[0], q.shape[1], -1, 2)
    probs = torch.cat([s, sinks], dim=-1).softmax(-1)
    return probs[..., :-2] @ v


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


# --- baddbmm(bias, q, kᵀ, beta=1, alpha=scale): scores with an additive bias (BLOOM's ALiBi, MHA's float mask) ---
def _flat(t):
    return t.reshape(-1, *t.shape[2:])


def _baddbmm_attention(bias_shape, beta=1.0, alpha=0.25):
    def fn(q, k, v):
        bias = torch.linspace(-2.0, 2.0, math.prod(bias_shape)).reshape(bias_shape)
        scores = torch.baddbmm(bias, _flat(q), _flat(k).transpose(1, 2), beta=beta, alpha=alpha)
        return scores.softmax(-1) @ _flat(v)
    return fn


def _baddbmm_zero_bias(q, k, v):
    """GPT-NeoX-Japanese: a zero tensor as the bias, i.e. no mask at all."""
    zeros = torch.zeros(q.shape[0] * q.shape[1], q.shape[2], k.shape[2])
    return torch.baddbmm(zeros, _flat(q), _flat(k).transpose(1, 2), alpha=0.25).softmax(-1) @ _flat(v)


def _bloom_like(q, k, v):
    """The product's [B*H, M, K] output viewed as [B, H, M, K] for a padding mask, P viewed back to 3-D."""
    b, h, s, _ = q.shape
    alibi = torch.arange(s, dtype=torch.float32).reshape(1, 1, s).expand(b * h, 1, s) * -0.5
    scores = torch.baddbmm(alibi, _flat(q), _flat(k).transpose(-1, -2), beta=1.0, alpha=0.25).view(b, h, s, -1)
    visible = torch.ones(b, 1, s, s, dtype=torch.bool)
    visible[1, ..., -3:] = False
    scores = scores + torch.zeros(()).masked_fill(torch.tensor(True), torch.finfo(torch.float32).min) * ~visible
    probs = scores.softmax(-1).view(b * h, s, -1)
    return (probs @ _flat(v)).view(b, h, s, -1)


BADDBMM_REWRITTEN = {
    "bias_per_key": (_baddbmm_attention((8, 1, 8)), "rewrites:key_mask"),
    "bias_per_score": (_baddbmm_attention((8, 8, 8), alpha=1.0), "rewrites:mask"),
    "broadcast_bias": (_baddbmm_attention((1, 8, 8)), "rewrites:mask"),
    "zero_bias": (_baddbmm_zero_bias, "rewrites:no_mask"),
    "bloom_like": (_bloom_like, "rewrites:mask"),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", BADDBMM_REWRITTEN)
def test_baddbmm_bias_is_an_additive_mask(cpu_pass, name, train):
    fn, form = BADDBMM_REWRITTEN[name]
    compile_and_compare(fn, *qkv(batch=2, heads=4, seq_q=8, train=train), rewrites=1, train=train)
    assert pass_counts()[form] == 1


@pytest.mark.parametrize("beta", [0.5, 0.0])
def test_baddbmm_with_beta_other_than_one_is_refused(cpu_pass, beta):
    compile_and_compare(_baddbmm_attention((8, 1, 8), beta=beta), *qkv(batch=2, heads=4, seq_q=8), rewrites=0)
    assert pass_counts() == {"refused:unsupported_argument": 1}


# --- q, k, v as any permuted view: each operand's permutation is its layout ---------------------------
def _sequence_first(q, k, v):
    """F.multi_head_attention_forward, FSMT, WavLM: [S, B*H, D] tensors, the bmm on their transposes."""
    q, k, v = (t.reshape(-1, *t.shape[2:]).transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v))
    return torch.bmm(torch.bmm(q * 0.25, k.transpose(1, 2)).softmax(-1), v)


def _head_dim_before_sequence(q, k, v):
    """SqueezeBERT: q and v held as [B, H, D, S] (1x1 convolutions' layout), k used as is."""
    q, k, v = (t.transpose(-1, -2).contiguous() for t in (q, k, v))
    scores = q.transpose(-1, -2) @ k * 0.25
    return (scores.softmax(-1) @ v.transpose(-1, -2)).transpose(-1, -2)


LAYOUTS = {"sequence_first": _sequence_first, "head_dim_before_sequence": _head_dim_before_sequence}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_permuted_operands_are_taken_as_views(cpu_pass, name, train):
    compile_and_compare(LAYOUTS[name], *qkv(seq_q=8, seq_k=12, train=train), rewrites=1, train=train)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_module(cpu_pass, need_weights):
    """nn.MultiheadAttention (sequence first) with a float mask: rewritten; returning the head-averaged
    weights too, the probabilities are read elsewhere."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4).eval()
    x = torch.randn(10, 2, 32)
    bias = torch.randn(10, 10)

    def fn(x, bias):
        out, weights = mha(x, x, x, attn_mask=bias, need_weights=need_weights)
        return out if weights is None else (out, weights)

    with torch.no_grad():
        compile_and_compare(fn, x, bias, rewrites=int(not need_weights))
    assert pass_counts().get("refused:probs_used_elsewhere", 0) == int(need_weights), pass_counts()


# --- a clamp from below at the dtype's lowest value (XGLM) is the identity on finite scores --------------
def _clamped(bound):
    def fn(q, k, v):
        b, h, s, _ = q.shape
        visible = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
        mask = torch.zeros(b, 1, s, s).masked_fill(~visible, torch.finfo(torch.float32).min)
        scores = torch.max(q @ k.transpose(-1, -2) + mask, torch.tensor(bound))
        return scores.softmax(-1) @ v
    return fn


def test_clamp_at_the_lowest_value_is_no_transform(cpu_pass):
    compile_and_compare(_clamped(torch.finfo(torch.float32).min), *qkv(), rewrites=1)


def test_clamp_above_the_lowest_value_is_refused(cpu_pass):
    compile_and_compare(_clamped(-1.0), *qkv(), rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}


def _clamped_over(mask_kind):
    """A clamp at the lowest value above a mask given as input: -inf in it becomes finfo.min in eager."""
    def fn(q, k, v, visible):
        scores = q @ k.transpose(-1, -2)
        if mask_kind == "additive_input":
            scores = scores + torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
        elif mask_kind == "minus_inf_fill":
            scores = scores.masked_fill(~visible, float("-inf"))
        else:  # a finite fill built in the graph: the clamp changes nothing
            scores = scores + torch.where(visible, 0.0, torch.finfo(torch.float32).min)
        return torch.max(scores, torch.tensor(torch.finfo(torch.float32).min)).softmax(-1) @ v
    return fn


@pytest.mark.parametrize("mask_kind, rewrites", [("additive_input", 0), ("minus_inf_fill", 0), ("finite_fill", 1)])
def test_clamp_over_a_mask_is_exact_only_for_finite_masks(cpu_pass, mask_kind, rewrites):
    q, k, v = qkv()
    visible = torch.rand(q.shape[0], 1, q.shape[2], k.shape[2], generator=torch.Generator().manual_seed(3)) > 0.3
    visible[0, 0, 2] = False  # a row with no visible key: eager averages V over all of it
    compile_and_compare(_clamped_over(mask_kind), q, k, v, visible, rewrites=rewrites)
    if not rewrites:
        assert pass_counts() == {"refused:score_transform": 1}


# --- logit soft-capping: cap * tanh(scores / cap), then the masks (Gemma 2) -----------------------------
def _softcapped(form):
    def fn(q, k, v, mask):
        scores = q @ k.transpose(-1, -2) * 0.25
        if form == "divide":
            scores = torch.tanh(scores / 5.0) * 5.0 + mask
        elif form == "reciprocal":
            scores = 5.0 * torch.tanh(scores * (1 / 5.0)) + mask
        elif form == "mask_inside":
            scores = torch.tanh((scores + mask) / 5.0) * 5.0
        elif form == "other_factor":
            scores = torch.tanh(scores / 5.0) * 4.0 + mask
        else:  # a tanh with no cap around it
            scores = torch.tanh(scores) + mask
        return scores.softmax(-1) @ v
    return fn


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("form", ["divide", "reciprocal"])
def test_softcapped_scores_are_the_ops_softcap(cpu_pass, form, train):
    q, k, v = qkv(train=train)
    mask = torch.randn(q.shape[0], 1, q.shape[2], k.shape[2])
    compile_and_compare(_softcapped(form), q, k, v, mask, rewrites=1, train=train)


@pytest.mark.parametrize("form", ["mask_inside", "other_factor", "bare_tanh"])
def test_tanh_that_is_not_the_ops_softcap_is_refused(cpu_pass, form):
    q, k, v = qkv()
    mask = torch.randn(q.shape[0], 1, q.shape[2], k.shape[2])
    compile_and_compare(_softcapped(form), q, k, v, mask, rewrites=0)
    assert pass_counts() == {"refused:softcap": 1}


# --- attention sinks: softmax(cat([scores, sinks], -1) - row max)[..., :K] @ V (gpt-oss) -----------------
def _gpt_oss_attention(q, k, v, mask, sinks):
    scores = q @ k.transpose(-1, -2) * 0.25 + mask
    combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


def test_per_head_sinks_are_the_ops_sinks(cpu_pass):
    q, k, v = qkv()
    mask = torch.randn(q.shape[0], 1, q.shape[2], k.shape[2])
    mask[0, 0, 3] = float("-inf")  # a row with no visible key: all its weight goes to the sink
    compile_and_compare(_gpt_oss_attention, q, k, v, mask, torch.linspace(-2.0, 3.0, q.shape[1]), rewrites=1)


def test_sinks_in_training_stay_with_inductor(cpu_pass):
    q, k, v = qkv(train=True)
    mask = torch.randn(q.shape[0], 1, q.shape[2], k.shape[2])
    sinks = torch.linspace(-2.0, 3.0, q.shape[1]).requires_grad_()
    compile_and_compare(_gpt_oss_attention, q, k, v, mask, sinks, rewrites=0, train=True)
    assert pass_counts() == {"refused:intermediate_used_elsewhere": 1}


# --- a fill held as a 0-d graph constant: GPT-Neo's where(causal, s, torch.tensor(finfo.min)) -------------
def _constant_fill(fill):
    def fn(q, k, v, visible):
        s = q.shape[2]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        padding = torch.where(visible, torch.tensor(0.0), torch.finfo(torch.float32).min)
        scores = torch.where(causal, q @ k.transpose(-1, -2), torch.tensor(fill))
        return (scores + padding).softmax(-1) @ v
    return fn


def _padding(q):
    visible = torch.ones(q.shape[0], 1, 1, q.shape[2], dtype=torch.bool)
    visible[1, ..., -3:] = False
    return visible


def test_fill_held_as_a_graph_constant_is_an_additive_mask(cpu_pass):
    q, k, v = qkv(seq_q=11)
    compile_and_compare(_constant_fill(torch.finfo(torch.float32).min), q, k, v, _padding(q), rewrites=1)


def test_graph_constant_fill_that_does_not_absorb_the_scores_is_refused(cpu_pass):
    q, k, v = qkv(seq_q=11)
    compile_and_compare(_constant_fill(-1e4), q, k, v, _padding(q), rewrites=0)
    assert pass_counts() == {"refused:finite_fill_value": 1}


def test_fill_with_more_than_one_value_is_refused(cpu_pass):
    """A constant per key is no fill (a where() branch that broadcasts a vector)."""
    def fn(q, k, v):
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        fills = torch.linspace(-3e38, -2e38, k.shape[2])
        return torch.where(causal, q @ k.transpose(-1, -2), fills).softmax(-1) @ v
    compile_and_compare(fn, *qkv(), rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}


# --- a single key: Inductor decomposes P @ V into the outer product [N, M, 1] * [N, 1, D] (SegFormer) ------
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("heads", [1, 3])
def test_attention_over_a_single_key(cpu_pass, heads, train):
    compile_and_compare(lambda q, k, v: _scores(q, k).softmax(-1) @ v,
                        *qkv(heads=heads, seq_q=9, seq_k=1, train=train), rewrites=1, train=train)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_attention_with_one_head(cpu_pass, train):
    """[B, 1, M, K] scores are also a [B, M, K] product: q @ kᵀ and P @ V are read with the same rank."""
    compile_and_compare(lambda q, k, v: _scores(q, k).softmax(-1) @ v,
                        *qkv(heads=1, seq_q=9, seq_k=7, train=train), rewrites=1, train=train)


def test_outer_product_into_another_dtype_is_refused(cpu_pass):
    """P [N, M, 1] times a float64 V [N, 1, D]: a product that promotes, not the op's P @ V."""
    def fn(q, k, v):
        probs = torch.bmm(_flat(q), _flat(k).transpose(1, 2)).softmax(-1)
        return probs * _flat(v).double()
    compile_and_compare(fn, *qkv(seq_q=9, seq_k=1), rewrites=0)
    assert pass_counts() == {"refused:unrecognised_probs": 1}


# --- a bias computed by products of its own (relative positions from q: Conformer, SAM, SpeechT5) -----------
def _relative_shift(x):
    """Transformer-XL's shift of [B, H, M, 2M-1] position scores to [B, H, M, M]."""
    b, h, m, n = x.shape
    x = F.pad(x, (1, 0)).view(b, h, n + 1, m)[:, :, 1:].view(b, h, m, n)
    return x[..., :m]


def _position_bias(term):
    def fn(q, k, v, positions, mask):
        scores = q @ k.transpose(-1, -2) * 0.25
        if term == "relative_shift":  # Conformer: rel_shift((q + bias) @ posᵀ), scaled as the scores are
            bias = _relative_shift((q + 0.5) @ positions.transpose(-1, -2)) * 0.25
        elif term == "from_the_scores":
            bias = (scores @ v @ k.transpose(-1, -2)).flip(-1)
        else:  # "second_product": q @ posᵀ with one position per key, as plain as q @ kᵀ itself
            bias = q @ positions[:, :, : k.shape[2]].transpose(-1, -2)
        return (scores + bias + mask).softmax(-1) @ v
    return fn


def _position_inputs():
    q, k, v = qkv(seq_q=10)
    positions = torch.randn(1, 1, 2 * q.shape[2] - 1, q.shape[3])
    mask = torch.zeros(q.shape[0], 1, 1, k.shape[2])
    mask[1, ..., -3:] = float("-inf")
    return q, k, v, positions, mask


def test_bias_computed_from_q_is_an_additive_mask(cpu_pass):
    compile_and_compare(_position_bias("relative_shift"), *_position_inputs(), rewrites=1)


@pytest.mark.parametrize("term", ["from_the_scores", "second_product"])
def test_term_that_is_no_independent_bias_is_refused(cpu_pass, term):
    compile_and_compare(_position_bias(term), *_position_inputs(), rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}
