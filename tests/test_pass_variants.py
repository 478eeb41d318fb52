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
from tests.pass_checks import compile_and_compare, qkv

FLASH_FWD = torch.ops.fa2_inductor.flash_attention_fwd.default
D = 16


class OpNodes(CustomGraphPass):
    """Collects the op's nodes from each post-grad graph, to check the arguments the pass chose."""

    def __init__(self):
        self.nodes = []

    def __call__(self, graph):
        self.nodes += [n for n in graph.nodes if n.target is FLASH_FWD]

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
    _, _, _, attn_mask, _, is_causal = op_nodes[0].args
    assert attn_mask is None and is_causal is True
    assert counters["fa2_inductor"]["rewrites:is_causal"] == 1


def test_long_causal_mask_is_proven_too(op_nodes):
    # 8k x 8k: the size of the end-to-end benchmark's prefill, where a mask kept as a tensor costs time.
    compile_and_compare(_sdpa_with_position_mask, *qkv(batch=1, heads=1, seq_q=8192, dim=8), rewrites=1)
    _, _, _, attn_mask, _, is_causal = op_nodes[0].args
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
