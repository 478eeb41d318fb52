"""Attention over keys concatenated in the scores (Pegasus-X's block-local attention: each block's queries
attend to the global keys and to the block's own keys, the softmax over both, the probabilities split back
and multiplied with each key set's values): one site over cat(k), cat(v); and the near misses, refused
with their reason and computed as in eager."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fa2_inductor
from fa2_inductor import config
from tests.pass_checks import compile_and_compare, pass_counts

B, H, N, K, G, D = 2, 3, 4, 8, 5, 16  # batch, heads, blocks, block size, global keys, head dim


def _inputs(batch=B, heads=H, blocks=N, block=K, global_keys=G, dim=D, padded=3, dtype=torch.float32):
    """q, local k, local v ``[B, H, N*K, D]``, global k, v ``[B, H, G, D]`` and a key padding mask ``[B, N*K]``
    (finfo.min on the last ``padded`` keys of the second row, as Pegasus-X's encoder pads)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, blocks * block, dim, dtype=dtype) for _ in range(3))
    global_k, global_v = (torch.randn(batch, heads, global_keys, dim, dtype=dtype) for _ in range(2))
    mask = torch.zeros(batch, blocks * block, dtype=dtype)
    if padded:
        mask[-1, -padded:] = torch.finfo(dtype).min
    return q, global_k, global_v, k, v, mask


def _blocked(t, block):
    b, h, s, d = t.shape
    return t.view(b, h, s // block, block, d)


def _block_local(block=K, global_first=True, probs_op=None, combine=None):
    """Pegasus-X's ``compute_local_attention_representations`` (einsum for einsum), with knobs for the near
    misses: the order of the two key sets, an op on the probabilities, how the two outputs are combined."""
    def fn(q, global_k, global_v, k, v, mask):
        bq, bk, bv = (_blocked(t, block) for t in (q, k, v))
        g = global_k.shape[2]
        b, n = mask.shape[0], mask.shape[1] // block
        to_global = torch.einsum("BHNKF,BHGF->BHNKG", bq, global_k)
        to_local = torch.einsum("BHNKF,BHNXF->BHNKX", bq, bk)
        if global_first:
            scores = torch.cat([to_global, to_local], dim=-1)
            extended = F.pad(mask.view(b, n, block), pad=(g, 0), value=0)
        else:
            scores = torch.cat([to_local, to_global], dim=-1)
            extended = F.pad(mask.view(b, n, block), pad=(0, g), value=0)
        probs = (scores + extended[:, None, :, None, :]).softmax(-1)
        if probs_op is not None:
            probs = probs_op(probs)
        global_probs, local_probs = (probs[..., :g], probs[..., g:]) if global_first else (probs[..., block:], probs[..., :block])
        out_global = torch.einsum("BHNKG,BHGF->BHNKF", global_probs, global_v)
        out_local = torch.einsum("BHNKX,BHNXF->BHNKF", local_probs, bv)
        return out_global + out_local if combine is None else combine(out_global, out_local)
    return fn


def _forward_op_calls(code: str) -> list[str]:
    return re.findall(r"flash_attention_fwd\.default\(([^\n]*)\)", code)


# --- rewritten ----------------------------------------------------------------------------------------
def test_block_local_attention_is_one_site_over_both_key_sets(cpu_pass):
    code = compile_and_compare(_block_local(), *_inputs(), rewrites=1)
    assert pass_counts() == {"rewrites": 1, "rewrites:key_mask": 1}
    # [B*H, N, K, D] queries against [B*H, N, G + K, D] keys: each block sees the global keys and its own.
    (call,) = _forward_op_calls(code)
    assert f"({B * H}, {N}, {K}, {D})" in call and f"({B * H}, {N}, {G + K}, {D})" in call
    report = fa2_inductor.explain(_block_local(), *_inputs())
    assert "keys concatenated from 2 products" in str(report.rewritten[0])
    assert not re.search(r"extern_kernels\.bmm", code)  # all four products are in the op


@pytest.mark.parametrize("sizes", [dict(batch=1, heads=1, blocks=1, block=7, global_keys=3, dim=8, padded=0),
                                   dict(batch=3, heads=2, blocks=5, block=3, global_keys=2, dim=24, padded=4)],
                         ids=["one_block_one_head", "odd_sizes"])
def test_odd_sizes(cpu_pass, sizes):
    compile_and_compare(_block_local(block=sizes["block"]), *_inputs(**sizes), rewrites=1)


def test_local_keys_first(cpu_pass):
    compile_and_compare(_block_local(global_first=False), *_inputs(), rewrites=1)


def test_bfloat16(cpu_pass):
    compile_and_compare(_block_local(), *_inputs(dtype=torch.bfloat16), rewrites=1)


def test_three_key_sets_with_a_scale(cpu_pass):
    """Three products of one q, scaled after the concatenation; the sum in another order than the keys."""
    def fn(q, k1, k2, k3, v1, v2, v3):
        scores = torch.cat([q @ k1.transpose(-1, -2), q @ k2.transpose(-1, -2), q @ k3.transpose(-1, -2)], -1)
        probs = (scores * 0.25).softmax(-1)
        return probs[..., 9:] @ v3 + (probs[..., :4] @ v1 + probs[..., 4:9] @ v2)

    torch.manual_seed(0)
    q = torch.randn(2, 3, 10, D)
    keys = [torch.randn(2, 3, n, D) for n in (4, 5, 6)]
    values = [torch.randn(2, 3, n, D) for n in (4, 5, 6)]
    compile_and_compare(fn, q, *keys, *values, rewrites=1)
    assert pass_counts() == {"rewrites": 1, "rewrites:no_mask": 1}


def test_values_follow_the_probabilities_key_ranges(cpu_pass):
    """With as many global keys as a block holds, the values may be paired with the other key range: the
    op's values are concatenated in the order of the probabilities' ranges, so this is still exact."""
    def fn(q, global_k, global_v, k, v, mask):
        bq, bk, bv = (_blocked(t, K) for t in (q, k, v))
        scores = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", bq, global_k),
                            torch.einsum("BHNKF,BHNXF->BHNKX", bq, bk)], dim=-1)
        probs = scores.softmax(-1)
        return (torch.einsum("BHNKX,BHNXF->BHNKF", probs[..., :K], bv)
                + torch.einsum("BHNKG,BHGF->BHNKF", probs[..., K:], global_v))

    compile_and_compare(fn, *_inputs(global_keys=K), rewrites=1)


# --- refused, and computed as in eager -----------------------------------------------------------------
def _refused(fn, inputs, reason, detail="", **kwargs):
    compile_and_compare(fn, *inputs, rewrites=0, **kwargs)
    assert pass_counts() == {f"refused:{reason}": 1}, pass_counts()
    if detail:
        (site,) = fa2_inductor.explain(fn, *inputs).refused
        assert detail in site.detail, site.detail


def test_key_ranges_that_overlap_are_refused(cpu_pass):
    def fn(q, global_k, global_v, k, v, mask):
        bq, bk, bv = (_blocked(t, K) for t in (q, k, v))
        scores = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", bq, global_k),
                            torch.einsum("BHNKF,BHNXF->BHNKX", bq, bk)], dim=-1)
        probs = scores.softmax(-1)
        extra_v = torch.cat([global_v, global_v[:, :, :1]], dim=2)  # G + 1 values for the G + 1 first keys
        return (torch.einsum("BHNKG,BHGF->BHNKF", probs[..., :G + 1], extra_v)
                + torch.einsum("BHNKX,BHNXF->BHNKF", probs[..., G:], bv))

    _refused(fn, _inputs(), "probs_used_elsewhere", "not each key once")


def test_a_key_range_left_out_is_refused(cpu_pass):
    def fn(q, global_k, global_v, k, v, mask):
        bq, bk, bv = (_blocked(t, K) for t in (q, k, v))
        scores = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", bq, global_k),
                            torch.einsum("BHNKF,BHNXF->BHNKX", bq, bk)], dim=-1)
        probs = scores.softmax(-1)
        return (torch.einsum("BHNKG,BHGF->BHNKF", probs[..., :G - 1], global_v[:, :, :G - 1])
                + torch.einsum("BHNKX,BHNXF->BHNKF", probs[..., G:], bv))

    _refused(fn, _inputs(), "probs_used_elsewhere", "not each key once")


def test_softmax_over_another_dim_is_refused(cpu_pass):
    def over_queries(q, global_k, global_v, k, v, mask):
        bq, bk, bv = (_blocked(t, K) for t in (q, k, v))
        scores = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", bq, global_k),
                            torch.einsum("BHNKF,BHNXF->BHNKX", bq, bk)], dim=-1)
        probs = scores.softmax(-2)
        return (torch.einsum("BHNKG,BHGF->BHNKF", probs[..., :G], global_v)
                + torch.einsum("BHNKX,BHNXF->BHNKF", probs[..., G:], bv))

    _refused(over_queries, _inputs(), "softmax_not_last_dim")


@pytest.mark.parametrize("combine", [torch.sub, lambda a, b: torch.add(a, b, alpha=2), lambda a, b: a + b * 0.5,
                                     lambda a, b: torch.cat([a, b], -1)],
                         ids=["difference", "alpha", "a_scaled_term", "concatenated"])
def test_outputs_not_summed_alone_are_refused(cpu_pass, combine):
    _refused(_block_local(combine=combine), _inputs(), "probs_used_elsewhere", "not summed")


def test_products_of_different_queries_are_refused(cpu_pass):
    def fn(q, global_k, global_v, k, v, mask):
        bq, bk, bv = (_blocked(t, K) for t in (q, k, v))
        scores = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", bq * 2, global_k),
                            torch.einsum("BHNKF,BHNXF->BHNKX", bq, bk)], dim=-1)
        probs = scores.softmax(-1)
        return (torch.einsum("BHNKG,BHGF->BHNKF", probs[..., :G], global_v)
                + torch.einsum("BHNKX,BHNXF->BHNKF", probs[..., G:], bv))

    _refused(fn, _inputs(), "unrecognised_scores", "different tensors")


def test_a_product_whose_rows_split_the_groups_is_refused(cpu_pass):
    """The first key set changes halfway through each row group: no group of the scores' rows shares one."""
    half = K // 2

    def fn(q, keys, values, k, v):
        halves = q.view(B, H, 2, half, D)
        first = (halves @ keys.transpose(-1, -2)).view(B, H, K, -1)
        probs = torch.cat([first, q @ k.transpose(-1, -2)], -1).softmax(-1)
        j = keys.shape[-2]
        return (probs[..., :j].reshape(B, H, 2, half, j) @ values).view(B, H, K, D) + probs[..., j:] @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, K, D) for _ in range(3))
    keys, values = (torch.randn(B, H, 2, 3, D) for _ in range(2))
    _refused(fn, (q, keys, values, k, v), "unrecognised_layout", "not whole groups")


def test_probabilities_also_returned_are_refused(cpu_pass):
    def fn(*inputs):
        probs = {}
        out = _block_local(probs_op=lambda p: probs.setdefault("p", p))(*inputs)
        return out, probs["p"]

    compile_and_compare(fn, *_inputs(), rewrites=0)
    assert pass_counts() == {"refused:probs_used_elsewhere": 1}


def test_dynamic_sizes_are_refused(cpu_pass):
    _refused(_block_local(), _inputs(), "unrecognised_layout", dynamic=True)


def test_training_is_refused(cpu_pass):
    inputs = [t.requires_grad_() if i < 5 else t for i, t in enumerate(_inputs())]
    _refused(_block_local(), inputs, "training_gradient_unmapped", train=True)


def test_a_refused_site_leaves_the_graph_as_it_was(cpu_pass, monkeypatch):
    """Without rewrite_on_cpu the rebuilt site is refused on CPU: it is dropped, and the code is plain Inductor's."""
    monkeypatch.setattr(config, "rewrite_on_cpu", False)
    inputs = _inputs()
    code = {}
    for backend in ("inductor", "fa2_inductor"):  # counters then hold the fa2_inductor run's
        code[backend] = compile_and_compare(_block_local(), *inputs, rewrites=0, backend=backend)
    assert pass_counts() == {"refused:cpu_device": 1}
    lines = {backend: [line for line in text.splitlines() if not line.lstrip().startswith("#")]
             for backend, text in code.items()}
    assert lines["fa2_inductor"] == lines["inductor"]
    assert len(re.findall(r"extern_kernels\.bmm\(", code["fa2_inductor"])) == 4
