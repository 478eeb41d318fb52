"""Scores with extra terms and placements the op expresses exactly (issue: every family whose attention the
op can compute is rewritten): ``+ 0`` (DeBERTa), a scale after the mask (CodeGen), the row max subtracted by
hand (MiMo-V2-Flash), a scale on a merged operand (DeBERTa-v2), relative-position terms as additive masks
(DeBERTa's c2p/p2c); and their near misses, which stay refused with their reason."""

from __future__ import annotations

import math

import pytest
import torch

import fa2_inductor
from tests.pass_checks import compile_and_compare, pass_counts, qkv

_LOWEST = torch.finfo(torch.float32).min


def _visible(q, k):
    """Causal, with the last two keys of the second sequence padded: row 0 of it still sees key 0."""
    b, s = q.shape[0], q.shape[2]
    visible = torch.ones(b, 1, s, k.shape[2], dtype=torch.bool).tril()
    visible[1, ..., -2:] = False
    return visible


# --- scores + 0 (DeBERTa without relative attention adds rel_att = 0) ---------------------------------
def _plus_zero(zero):
    def fn(q, k, v):
        return (q @ k.transpose(-1, -2) * 0.25 + zero).softmax(-1) @ v
    return fn


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_adding_zero_is_no_transform(cpu_pass, train):
    compile_and_compare(_plus_zero(0), *qkv(train=train), rewrites=1, train=train)


def test_adding_another_number_is_refused(cpu_pass):
    compile_and_compare(_plus_zero(1.0), *qkv(), rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}


# --- a number scale after an additive mask (CodeGen: (s + mask) / sqrt(d)) -----------------------------
def _key_padding(q, k):
    keys = torch.ones(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool)
    keys[1, ..., -2:] = False
    return keys


def _codegen_like(fill, scale_kind="number"):
    def fn(q, k, v, keys):
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        mask = torch.where(causal & keys, 0.0, fill)
        scores = q @ k.transpose(-1, -2) + mask
        scale = torch.tensor(math.sqrt(q.shape[-1])) if scale_kind == "tensor" else math.sqrt(q.shape[-1])
        return (scores / scale).softmax(-1) @ v
    return fn


@pytest.mark.parametrize("fill", [_LOWEST, float("-inf")], ids=["lowest", "minus_inf"])
def test_scale_after_a_where_built_mask_scales_its_fill(cpu_pass, fill):
    """The mask stays a where() of constants (fill / c): its structure is proven, causal with a data term."""
    q, k, v = qkv()
    compile_and_compare(_codegen_like(fill), q, k, v, _key_padding(q, k), rewrites=1)
    assert pass_counts()["rewrites:is_causal+key_mask"] == 1, pass_counts()


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_scale_after_a_mask_input_scales_the_mask(cpu_pass, train):
    def fn(q, k, v, bias):
        return ((q @ k.transpose(-1, -2) + bias) * 0.3).softmax(-1) @ v
    q, k, v = qkv(train=train)
    bias = torch.randn(q.shape[0], 1, q.shape[2], k.shape[2])
    compile_and_compare(fn, q, k, v, bias, rewrites=1, train=train)


def test_scale_after_a_low_precision_mask_scales_it_as_eager_does(cpu_pass):
    """A bfloat16 mask added to float32 scores is promoted first, then scaled in float32."""
    def fn(q, k, v, bias):
        return ((q @ k.transpose(-1, -2) + bias) / 3.0).softmax(-1) @ v
    q, k, v = qkv()
    bias = torch.randn(q.shape[0], 1, q.shape[2], k.shape[2]).to(torch.bfloat16)
    compile_and_compare(fn, q, k, v, bias, rewrites=1)


def test_tensor_scale_after_a_mask_is_refused(cpu_pass):
    q, k, v = qkv()
    compile_and_compare(_codegen_like(_LOWEST, scale_kind="tensor"), q, k, v, _key_padding(q, k), rewrites=0)
    assert pass_counts() == {"refused:scale_after_mask": 1}


def test_scale_after_a_finite_replacing_fill_is_refused(cpu_pass):
    """where(visible, s, -1e4) * c replaces scores: no additive mask, scaled or not."""
    def fn(q, k, v):
        return ((q @ k.transpose(-1, -2)).masked_fill(~_visible(q, k), -1e4) * 0.25).softmax(-1) @ v
    compile_and_compare(fn, *qkv(), rewrites=0)
    assert pass_counts() == {"refused:scale_after_mask": 1}


# --- softmax(x - max(x)) (MiMo-V2-Flash subtracts the row max itself) ----------------------------------
def _row_max_subtracted(dim, keepdim=True):
    def fn(q, k, v):
        scores = q @ k.transpose(-1, -2) * 0.25 + torch.where(_visible(q, k), 0.0, _LOWEST)
        row_max = scores.max(dim=dim, keepdim=keepdim).values
        return (scores - (row_max if keepdim else row_max.unsqueeze(dim))).softmax(-1) @ v
    return fn


def test_row_max_subtracted_by_hand_is_the_softmax(cpu_pass):
    compile_and_compare(_row_max_subtracted(-1), *qkv(), rewrites=1)


def test_row_max_subtracted_in_training_stays_with_inductor(cpu_pass):
    """The backward reads the max's indices: an intermediate of the site used outside it."""
    compile_and_compare(_row_max_subtracted(-1), *qkv(train=True), rewrites=0, train=True)
    assert pass_counts() == {"refused:intermediate_used_elsewhere": 1}


def test_column_max_subtracted_is_refused(cpu_pass):
    compile_and_compare(_row_max_subtracted(-2), *qkv(), rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}


# --- a scale on the merged [B*H, D, S] kᵀ of a 4-D attention (DeBERTa-v2) -------------------------------
def _deberta_v2_like(q, k, v, visible):
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
    scores = torch.bmm(q3, k3.transpose(-1, -2) / math.sqrt(d))
    scores = scores.view(-1, h, s, k.shape[2]).masked_fill(~visible, _LOWEST)
    probs = scores.softmax(-1)
    out = torch.bmm(probs.view(-1, s, k.shape[2]), v3)
    return out.view(-1, h, s, d).permute(0, 2, 1, 3)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_scale_on_a_merged_operand_is_the_scale(cpu_pass, train):
    q, k, v = qkv(train=train)
    compile_and_compare(_deberta_v2_like, q, k, v, _visible(q, k), rewrites=int(not train), train=train)
    if train:  # a finite fill in a training graph: s + fill would pass gradients to a fully masked row
        assert pass_counts() == {"refused:finite_fill_value": 1}


# --- relative-position terms computed from q and k (DeBERTa's c2p and p2c) -------------------------------
def _disentangled(q, k, v, pos_k, pos_q, relative, term_from_scores=False, masked=True):
    """scores + c2p + p2c: q against position keys and k against position queries, gathered by relative
    distance; then a padding fill at the lowest value."""
    span = pos_k.shape[-2] // 2
    index = (relative + span).clamp(0, 2 * span - 1).expand(q.shape[0], q.shape[1], -1, -1)
    scores = q @ k.transpose(-1, -2)
    c2p = torch.gather(q @ pos_k.transpose(-1, -2), -1, index)
    p2c = torch.gather(k @ pos_q.transpose(-1, -2), -1, index).transpose(-1, -2)
    term = c2p + p2c + (scores * 0.5 if term_from_scores else 0)
    scores = scores + term
    if masked:
        scores = scores.masked_fill(~_visible(q, k), _LOWEST)
    return scores.softmax(-1) @ v


def _relative_inputs(train=False):
    q, k, v = qkv(seq_q=8, train=train)
    q_scaled = q / math.sqrt(3 * q.shape[-1])  # DeBERTa scales q before both of its products
    generator = torch.Generator().manual_seed(5)
    pos_k, pos_q = (torch.randn(1, q.shape[1], 8, q.shape[-1], generator=generator) for _ in range(2))
    positions = torch.arange(8)
    relative = (positions[:, None] - positions[None, :]).reshape(1, 1, 8, 8)
    return q_scaled, k, v, pos_k, pos_q, relative


def test_relative_position_terms_are_an_additive_mask(cpu_pass):
    with torch.no_grad():
        compile_and_compare(_disentangled, *_relative_inputs(), rewrites=1)
    assert pass_counts()["rewrites:mask"] == 1


def test_a_term_computed_from_the_scores_is_refused(cpu_pass):
    def fn(*args):
        return _disentangled(*args, term_from_scores=True)
    with torch.no_grad():
        compile_and_compare(fn, *_relative_inputs(), rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}
    report = fa2_inductor.explain(fn, *_relative_inputs())
    assert report.sites[0].detail == ("a sum of two terms that are both products: which one is q @ kᵀ and which "
                                      "an added bias is unclear"), str(report)


def test_relative_position_terms_in_training_are_refused(cpu_pass):
    q, k, v, pos_k, pos_q, relative = _relative_inputs()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    compile_and_compare(lambda *args: _disentangled(*args, masked=False), q, k, v, pos_k, pos_q, relative,
                        rewrites=0, train=True)
    assert pass_counts() == {"refused:training_gradient_unmapped": 1}


# --- a multiplicative 0/1 mask (OpenAI GPT's w * b + -1e4 * (1 - b)) stays refused ------------------------
def test_multiplicative_mask_is_refused_with_its_detail(cpu_pass):
    def fn(q, k, v, b):
        w = q @ k.transpose(-1, -2) * 0.25
        return (w * b + -1e4 * (1 - b)).softmax(-1) @ v
    q, k, v = qkv()
    b = torch.ones(1, 1, q.shape[2], k.shape[2]).tril()
    compile_and_compare(fn, q, k, v, b, rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}
    report = fa2_inductor.explain(fn, q, k, v, b)
    assert "multiplicative mask" in report.sites[0].detail, str(report)
