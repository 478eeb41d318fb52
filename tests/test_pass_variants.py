"""Every spelling of attention the pass must rewrite: exact count, op in the code, eager numerics, grads.

CPU only (fa2_inductor.config.rewrite_on_cpu); Inductor's caches are off so the pass really runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import fa2_inductor
from fa2_inductor.reference import EmptyRows
from tests.pass_checks import compile_and_compare, pass_counts, qkv

FLASH_FWD = torch.ops.fa2_inductor.flash_attention_fwd.default
FLASH_BWD = torch.ops.fa2_inductor.flash_attention_bwd.default


def _argument(node, name):
    """An op node's argument by its schema name, whether passed by position, by keyword or defaulted."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(name, argument.default_value)
    raise KeyError(name)


D = 16


class OpNodes(CustomGraphPass):
    """Collects the op's nodes (forward, then backward) from each post-grad graph, to check the arguments
    the pass chose."""

    def __init__(self):
        self.nodes = []

    def __call__(self, graph):
        self.nodes += [n for n in graph.nodes if n.target in (FLASH_FWD, FLASH_BWD)]

    def uuid(self):
        return None


@pytest.fixture
def op_nodes(monkeypatch):
    monkeypatch.setattr(fa2_inductor.config, "rewrite_on_cpu", True)
    capture = OpNodes()
    with torch._inductor.config.patch(force_disable_caches=True, post_grad_custom_post_pass=capture):
        yield capture.nodes
    torch._dynamo.reset()


def _softmax_pv(scores, v):
    return scores.softmax(dim=-1) @ v


# --- where the scale goes -------------------------------------------------------------------------
SCALES = {
    "div_sqrt_d": lambda q, k, v: _softmax_pv(q @ k.transpose(-2, -1) / math.sqrt(D), v),
    "mul_inv_sqrt_d": lambda q, k, v: _softmax_pv(torch.matmul(q, k.transpose(-2, -1)) * (1 / math.sqrt(D)), v),
    "on_q": lambda q, k, v: _softmax_pv((q * D**-0.5) @ k.transpose(-2, -1), v),
    "on_k": lambda q, k, v: _softmax_pv(q @ (k * D**-0.5).transpose(-2, -1), v),
    "on_k_transposed": lambda q, k, v: _softmax_pv(q @ (k.transpose(-2, -1) / math.sqrt(D)), v),
    "split_q_k": lambda q, k, v: _softmax_pv((q * D**-0.25) @ (k * D**-0.25).transpose(-2, -1), v),
    "absent": lambda q, k, v: _softmax_pv(q @ k.transpose(-2, -1), v),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", SCALES)
def test_scale_placement(op_nodes, name, train):
    compile_and_compare(SCALES[name], *qkv(train=train), rewrites=1, train=train)
    scale = 1.0 if name == "absent" else D**-0.5
    assert op_nodes[0].args[4] == pytest.approx(scale)


# --- matmul spellings and the transpose of k ------------------------------------------------------
def _bmm_3d(q, k, v):
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
    out = torch.bmm(torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(d), dim=-1), v3)
    return out.reshape(b, h, s, d)


def _einsum(q, k, v):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


MATMULS = {
    "matmul_transpose": lambda q, k, v: _softmax_pv(q @ k.transpose(2, 3) * D**-0.5, v),
    "matmul_permute": lambda q, k, v: _softmax_pv(q @ k.permute(0, 1, 3, 2) * D**-0.5, v),
    "matmul_mT": lambda q, k, v: _softmax_pv(q @ k.mT * D**-0.5, v),
    "bmm_3d": _bmm_3d,
    "einsum": _einsum,
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", MATMULS)
def test_matmul_forms(op_nodes, name, train):
    compile_and_compare(MATMULS[name], *qkv(train=train), rewrites=1, train=train)


def _bshd_inputs(q, k, v):
    """[B, S, H, D] projections transposed inside, as most models write it."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return _softmax_pv(q @ k.transpose(-2, -1) * D**-0.5, v).transpose(1, 2)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_bshd_inputs_transposed_inside(op_nodes, train):
    compile_and_compare(_bshd_inputs, *qkv(train=train, bshd=True), rewrites=1, train=train)


# --- softmax precision and dtypes -----------------------------------------------------------------
def _hf_upcast_softmax(q, k, v):
    scores = q @ k.transpose(-2, -1) * D**-0.5
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [SCALES["div_sqrt_d"], _hf_upcast_softmax], ids=["input_dtype", "float32_softmax"])
def test_dtypes_and_softmax_precision(op_nodes, fn, dtype):
    compile_and_compare(fn, *qkv(dtype=dtype), rewrites=1)


# --- masks ----------------------------------------------------------------------------------------
def _bool_mask(seq_q, seq_k):
    torch.manual_seed(1)
    mask = torch.rand(2, 1, seq_q, seq_k) > 0.4
    mask[..., 0] = True  # every row sees a key: eager's -inf softmax would give NaN otherwise
    return mask


def _additive_mask(q, k, v, mask):
    return _softmax_pv(q @ k.transpose(-2, -1) * D**-0.5 + mask, v)


def _masked_fill(q, k, v, mask):
    return _softmax_pv((q @ k.transpose(-2, -1) * D**-0.5).masked_fill(~mask, float("-inf")), v)


def _where_inf(q, k, v, mask):
    return _softmax_pv(torch.where(mask, q @ k.transpose(-2, -1) * D**-0.5, float("-inf")), v)


def _where_finfo_min_added(q, k, v, mask):
    bias = torch.where(mask, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
    return _softmax_pv(q @ k.transpose(-2, -1) * D**-0.5 + bias, v)


MASKS = {
    "additive_b11k": (_additive_mask, lambda sq, sk: torch.randn(2, 1, 1, sk)),
    "additive_qk": (_additive_mask, lambda sq, sk: torch.randn(sq, sk)),
    "bool_masked_fill": (_masked_fill, _bool_mask),
    "bool_where_inf": (_where_inf, _bool_mask),
    "bool_where_finfo_min": (_where_finfo_min_added, _bool_mask),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", MASKS)
def test_masks(op_nodes, name, train):
    fn, make_mask = MASKS[name]
    q, k, v = qkv(seq_q=8, seq_k=8, train=train)
    compile_and_compare(fn, q, k, v, make_mask(8, 8), rewrites=1, train=train)
    assert op_nodes[0].args[3] is not None and op_nodes[0].args[5] is False


def _mask_scaled_by_alpha(q, k, v, mask):
    return torch.add(q @ k.transpose(-2, -1) * D**-0.5, mask, alpha=0.5).softmax(-1) @ v


def _scores_scaled_by_alpha(q, k, v, mask):
    return torch.add(mask, q @ k.transpose(-2, -1), alpha=D**-0.5).softmax(-1) @ v


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("fn", [_mask_scaled_by_alpha, _scores_scaled_by_alpha], ids=["mask_alpha", "scores_alpha"])
def test_add_with_alpha(op_nodes, fn, train):
    """``add(x, y, alpha=a)`` is ``x + a * y`` (Inductor's own fusion drops a mask's alpha: torch 2.13 gives
    errors of ~1 here, so refusing would not be enough)."""
    q, k, v = qkv(seq_q=16, train=train)
    compile_and_compare(fn, q, k, v, torch.randn(1, 1, 16, 16) * 4, rewrites=1, train=train)
    assert op_nodes[0].args[4] == pytest.approx(D**-0.5)


# --- masks provably causal become is_causal=True ----------------------------------------------------
def _tril_ones(q, k, v):
    visible = torch.tril(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool))
    return _masked_fill(q, k, v, visible)


def _triu_blocked(q, k, v):
    blocked = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(diagonal=1)
    scores = (q @ k.transpose(-2, -1) * D**-0.5).masked_fill(blocked, float("-inf"))
    return _softmax_pv(scores, v)


def _arange_compare_hf(q, k, v):
    """Hugging Face eager: a bool mask from positions, turned into where(mask, 0, finfo.min), sliced."""
    q_pos = torch.arange(q.shape[-2])[:, None]
    k_pos = torch.arange(k.shape[-2])[None, :]
    mask = (k_pos <= q_pos)[None, None].expand(q.shape[0], 1, -1, -1)
    bias = torch.where(mask, torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)
    scores = q @ k.transpose(-2, -1) * D**-0.5 + bias[:, :, :, : k.shape[-2]]
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _sdpa_with_position_mask(q, k, v):
    mask = torch.arange(k.shape[-2])[None, :] <= torch.arange(q.shape[-2])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


CAUSAL = {"tril_ones": _tril_ones, "triu_blocked": _triu_blocked, "arange_compare_hf": _arange_compare_hf,
          "sdpa_position_mask": _sdpa_with_position_mask}


@pytest.mark.parametrize("seq_k", [8, 11], ids=["self", "cross"])
@pytest.mark.parametrize("name", CAUSAL)
def test_causal_masks_become_is_causal(op_nodes, name, seq_k):
    compile_and_compare(CAUSAL[name], *qkv(seq_q=8, seq_k=seq_k), rewrites=1)
    _, _, _, attn_mask, _, is_causal = op_nodes[0].args[:6]
    assert attn_mask is None and is_causal is True
    assert counters["fa2_inductor"]["rewrites:is_causal"] == 1


def test_long_causal_mask_is_proven_too(op_nodes):
    # 8k x 8k: the size of the end-to-end benchmark's prefill, where a mask kept as a tensor costs time.
    compile_and_compare(_sdpa_with_position_mask, *qkv(batch=1, heads=1, seq_q=8192, dim=8), rewrites=1)
    _, _, _, attn_mask, _, is_causal = op_nodes[0].args[:6]
    assert attn_mask is None and is_causal is True


def test_causal_mask_in_training(op_nodes):
    compile_and_compare(_tril_ones, *qkv(train=True), rewrites=1, train=True)
    assert op_nodes[0].args[3] is None and op_nodes[0].args[5] is True


# --- dropout that does nothing ---------------------------------------------------------------------
def _dropout_p0_training_mode(q, k, v):
    probs = F.dropout((q @ k.transpose(-2, -1) * D**-0.5).softmax(-1), p=0.0, training=True)
    return probs @ v


class _AttentionWithDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, q, k, v):
        return self.dropout((q @ k.transpose(-2, -1) * D**-0.5).softmax(-1)) @ v


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_dropout_p0(op_nodes, train):
    compile_and_compare(_dropout_p0_training_mode, *qkv(train=train), rewrites=1, train=train)


def test_dropout_module_in_eval(op_nodes):
    compile_and_compare(_AttentionWithDropout().eval(), *qkv(train=True), rewrites=1, train=True)


# --- GQA: repeated K/V mapped back to the op's native GQA -------------------------------------------
def _repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _gqa_repeat_kv(q, k, v):
    n_rep = q.shape[1] // k.shape[1]
    return _softmax_pv(q @ _repeat_kv(k, n_rep).transpose(-2, -1) * D**-0.5, _repeat_kv(v, n_rep))


def _gqa_repeat_interleave(q, k, v):
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return _softmax_pv(q @ k.transpose(-2, -1) * D**-0.5, v)


def _sdpa_repeat_kv(q, k, v):
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), is_causal=True)


def _sdpa_enable_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3)


GQA = {"repeat_kv": _gqa_repeat_kv, "repeat_interleave": _gqa_repeat_interleave,
       "sdpa_repeat_kv": _sdpa_repeat_kv, "sdpa_enable_gqa": _sdpa_enable_gqa}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", GQA)
def test_gqa_uses_native_heads(op_nodes, name, train):
    compile_and_compare(GQA[name], *qkv(heads=4, kv_heads=2, train=train), rewrites=1, train=train)
    q, k, v = op_nodes[0].args[:3]
    assert q.meta["val"].shape[1] == 4 and k.meta["val"].shape[1] == 2 and v.meta["val"].shape[1] == 2


# --- SDPA calls and cross-attention -----------------------------------------------------------------
SDPA = {
    "plain": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "scale": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.2),
    "float_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(q.shape[-2], k.shape[-2]) * 0.5),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", SDPA)
def test_sdpa(op_nodes, name, train):
    compile_and_compare(SDPA[name], *qkv(seq_q=8, seq_k=8, train=train), rewrites=1, train=train)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_cross_attention(op_nodes, train):
    q, k, v = qkv(seq_q=5, seq_k=12, train=train)
    compile_and_compare(SCALES["div_sqrt_d"], q, k, v, rewrites=1, train=train)


def test_two_sites_sharing_k_and_v(op_nodes):
    def two_layers(q, k, v):
        return SCALES["div_sqrt_d"](SCALES["on_q"](q, k, v), k, v)

    compile_and_compare(two_layers, *qkv(), rewrites=2)


def test_two_sites_in_a_training_graph(op_nodes):
    def two_layers(q, k, v):
        return SCALES["div_sqrt_d"](SCALES["on_q"](q, k, v), k.flip(2), v.flip(2))

    compile_and_compare(two_layers, *qkv(train=True), rewrites=2, train=True)


# --- finite fills: where(mask, s, finfo.min) is the bool mask, with empty rows averaging V ---------
def _visible_with_an_empty_row(seq_q, seq_k):
    visible = _bool_mask(seq_q, seq_k)
    visible[0, :, 3] = False  # a query row that sees no key: eager averages V there, and so must we
    return visible


def _where_finfo_min(q, k, v, visible):
    scores = q @ k.transpose(-2, -1) * D**-0.5
    return _softmax_pv(torch.where(visible, scores, torch.finfo(scores.dtype).min), v)


def _masked_fill_finfo_min(q, k, v, visible):
    scores = q @ k.transpose(-2, -1) * D**-0.5
    return _softmax_pv(scores.masked_fill(~visible, torch.finfo(scores.dtype).min), v)


def _where_full_finfo_min_upcast(q, k, v, visible):
    """GPT-2's spelling: the fill as a 0-d tensor, then a float32 softmax cast back."""
    scores = q @ k.transpose(-2, -1) / torch.full((), D**0.5, dtype=q.dtype)
    scores = torch.where(visible, scores, torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


FILLS = {"where": _where_finfo_min, "masked_fill": _masked_fill_finfo_min, "gpt2": _where_full_finfo_min_upcast}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", FILLS)
def test_finfo_min_fills_are_bool_masks_that_average_empty_rows(op_nodes, name, dtype):
    q, k, v = qkv(seq_q=8, seq_k=8, dtype=dtype)
    compile_and_compare(FILLS[name], q, k, v, _visible_with_an_empty_row(8, 8), rewrites=1)
    (forward,) = op_nodes
    assert forward.args[3].meta["val"].dtype == torch.bool
    assert _argument(forward, "empty_rows") == EmptyRows.MEAN_V


@pytest.mark.parametrize("name", FILLS)
def test_finfo_min_fills_stay_in_training(cpu_pass, name):
    """In a fully masked row, s + fill would pass gradients to scores that where() cuts off."""
    q, k, v = qkv(seq_q=8, seq_k=8, train=True)
    compile_and_compare(FILLS[name], q, k, v, _visible_with_an_empty_row(8, 8), rewrites=0, train=True)
    assert pass_counts() == {"refused:finite_fill_value": 1}


@pytest.mark.parametrize("fill, dtype", [(-1e9, torch.float32), (torch.finfo(torch.float16).min, torch.float16)],
                         ids=["minus_1e9", "float16_min"])
def test_fills_that_do_not_absorb_the_scores_are_refused(cpu_pass, fill, dtype):
    """A fully masked row averages V in eager; scores + fill would not be uniform there."""
    def attention(q, k, v, visible):
        return _softmax_pv((q @ k.transpose(-2, -1) * D**-0.5).masked_fill(~visible, fill), v)

    compile_and_compare(attention, *qkv(dtype=dtype), _bool_mask(8, 8), rewrites=0)
    assert pass_counts() == {"refused:finite_fill_value": 1}


# --- masks added through a 4-D view of 3-D (bmm) scores -------------------------------------------
def _mask_on_4d_view_of_bmm_scores(q, k, v, mask):
    b, h, s, d = q.shape
    q3, k3, v3 = q.reshape(b * h, s, d), k.reshape(b * h, -1, d), v.reshape(b * h, -1, d)
    scores = torch.bmm(q3, k3.transpose(1, 2)) * D**-0.5
    scores = (scores.view(b, h, s, -1) + mask).view(b * h, s, -1)
    return torch.bmm(scores.softmax(-1), v3).view(b, h, s, d)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("mask_shape", [(2, 1, 8, 8), (1, 1, 8, 8), (2, 4, 8, 8), (8,)], ids=str)
def test_mask_added_to_a_4d_view_of_3d_scores(op_nodes, mask_shape, train):
    mask = torch.randn(mask_shape) * 3
    compile_and_compare(_mask_on_4d_view_of_bmm_scores, *qkv(train=train), mask, rewrites=1, train=train)


# --- SDPA's safe softmax: rows whose scores are all -inf give 0, as the op does --------------------
def _safe_softmax_attention(q, k, v, mask):
    scores = q @ k.transpose(-2, -1) * D**-0.5 + mask
    return torch.ops.aten._safe_softmax(scores, -1) @ v


def _blocking_mask(dtype):
    mask = torch.randn(2, 1, 8, 8).to(dtype)
    mask[:, :, :, 5:] = float("-inf")
    mask[1, :, 2] = float("-inf")  # a row with no visible key
    return mask


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_safe_softmax(op_nodes, dtype, train):
    compile_and_compare(_safe_softmax_attention, *qkv(dtype=dtype, train=train), _blocking_mask(dtype),
                        rewrites=1, train=train)


def _zeroed_where_scores_are_negative(q, k, v):
    scores = q @ k.transpose(-2, -1) * D**-0.5
    probs = scores.softmax(-1)
    return torch.where(scores.amax(-1, keepdim=True) < 0, 0.0, probs) @ v


def test_other_zeroed_rows_are_no_safe_softmax(cpu_pass):
    compile_and_compare(_zeroed_where_scores_are_negative, *qkv(), rewrites=0)
    assert pass_counts() == {"refused:probs_modified": 1}


# --- float32 attention on upcast fp16/bf16 q, k, v (SDPA's math path; ViT under torch.compile) -------
def _float32_math_cast_back(q, k, v, mask=None):
    root = D**-0.25
    qf, kf, vf = (t.float() for t in (q, k, v))
    scores = (qf * root) @ (kf.transpose(-2, -1) * root)
    if mask is not None:
        scores = scores + mask
    return (torch.ops.aten._safe_softmax(scores, -1) @ vf).to(q.dtype)


def _sdpa_math_path(q, k, v):
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [_float32_math_cast_back, _sdpa_math_path], ids=["hand_written", "sdpa_math"])
def test_float32_math_on_upcast_inputs_runs_in_their_dtype(op_nodes, fn, dtype, train):
    compile_and_compare(fn, *qkv(dtype=dtype, train=train), rewrites=1, train=train)
    q, k, v = op_nodes[0].args[:3]
    assert {t.meta["val"].dtype for t in (q, k, v)} == {dtype}


def test_float32_math_whose_output_stays_float32_runs_in_float32(op_nodes):
    def float32_out(q, k, v):
        qf, kf, vf = (t.float() for t in (q, k, v))
        return (qf @ kf.transpose(-2, -1) * D**-0.5).softmax(-1) @ vf

    compile_and_compare(float32_out, *qkv(dtype=torch.bfloat16), rewrites=1)
    assert op_nodes[0].args[0].meta["val"].dtype == torch.float32


# --- training: masks that require grad, q/k/v views other ops read too --------------------------------
@pytest.mark.parametrize("mask_shape", [(2, 1, 8, 8), (2, 4, 8, 8), (1, 1, 1, 8)], ids=str)
def test_mask_gradient_comes_from_the_op(op_nodes, mask_shape):
    q, k, v = qkv(train=True)
    mask = torch.randn(mask_shape, requires_grad=True)
    compile_and_compare(_additive_mask, q, k, v, mask, rewrites=1, train=True)
    (backward,) = [n for n in op_nodes if n.target is FLASH_BWD]
    assert _argument(backward, "compute_mask_grad") is True


@pytest.mark.parametrize("mask_shape", [(2, 4, 8, 8), (2, 1, 8, 8)], ids=str)
def test_gradient_of_a_mask_added_with_alpha(op_nodes, mask_shape):
    """The op's mask is alpha * mask, whose gradient is not the mask's: that site stays."""
    q, k, v = qkv(train=True)
    mask = torch.randn(mask_shape, requires_grad=True)
    compile_and_compare(_mask_scaled_by_alpha, q, k, v, mask, rewrites=0, train=True)
    assert pass_counts() == {"refused:training_gradient_unmapped": 1}


def _keys_also_returned(q, k, v):
    """q, k, v arrive [B, S, H, D]; the transposed k and v are returned too (T5 in Inductor's patterns 22/26)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return _softmax_pv(q @ k.transpose(-2, -1) * D**-0.5, v), k, v


def _keys_also_used(q, k, v):
    """The transposed k feeds a second, differentiable output: its gradient is the sum of both."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return _softmax_pv(q @ k.transpose(-2, -1) * D**-0.5, v) + k.sum(-2, keepdim=True) * 0.5


@pytest.mark.parametrize("fn", [_keys_also_returned, _keys_also_used], ids=["returned", "used"])
def test_views_of_inputs_read_elsewhere_in_training(op_nodes, fn):
    compile_and_compare(fn, *qkv(train=True, bshd=True), rewrites=1, train=True)
    assert [n.target for n in op_nodes] == [FLASH_FWD, FLASH_BWD]


def _scores_divided_in_place(q, k, v, mask):
    scores = q @ k.transpose(-2, -1)
    scores.div_(D**0.5)  # functionalised into a view of a view of the scores
    return torch.add(scores, mask, alpha=0.5).softmax(-1) @ v


def test_scores_changed_in_place(op_nodes):
    compile_and_compare(_scores_divided_in_place, *qkv(), torch.randn(2, 1, 8, 8), rewrites=1)
    assert op_nodes[0].args[4] == pytest.approx(D**-0.5)


def test_scores_changed_in_place_in_training(op_nodes):
    """The in-place op's backward is a chain under seq_nrs of ops the graph no longer holds, between the
    site's own backward nodes: part of the site's backward region."""
    compile_and_compare(_scores_divided_in_place, *qkv(train=True), torch.randn(2, 1, 8, 8), rewrites=1, train=True)
    assert [n.target for n in op_nodes] == [FLASH_FWD, FLASH_BWD]


def test_scores_changed_in_place_with_a_mask_that_needs_its_gradient_stay(op_nodes):
    """The op's dmask is the gradient of its own mask, here 0.5 * mask: no node holds that."""
    mask = torch.randn(2, 1, 8, 8, requires_grad=True)
    compile_and_compare(_scores_divided_in_place, *qkv(train=True), mask, rewrites=0, train=True)
    assert pass_counts() == {"refused:training_gradient_unmapped": 1}


def test_training_with_a_row_masked_by_finfo_min(op_nodes):
    """HF's additive mask: a query row whose every key is finfo.min averages V, and its gradients match
    (the op's lse there has lost log(row sum): its backward must not recompute P from it)."""
    q, k, v = qkv(train=True)
    bias = torch.where(_visible_with_an_empty_row(8, 8), 0.0, torch.finfo(torch.float32).min)
    compile_and_compare(_additive_mask, q, k, v, bias, rewrites=1, train=True)


@pytest.mark.parametrize("mask_shape", [(2, 1, 8, 8), (1, 1, 8, 8)], ids=str)
def test_mask_added_to_a_4d_view_of_3d_scores_with_dynamic_shapes(op_nodes, mask_shape):
    compile_and_compare(_mask_on_4d_view_of_bmm_scores, *qkv(), torch.randn(mask_shape), rewrites=1, dynamic=True)
