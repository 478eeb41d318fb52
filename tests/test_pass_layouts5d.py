"""Layouts beyond the op's [B, H, S, D] that the pass maps exactly (issue: every family whose attention the op
can compute is rewritten): more than two leading dims (Hiera's windows, ProphetNet's n-gram streams) merged
into the op's batch, einsum's permuted P @ V output and seq-first operands (Funnel, XLNet), a mask subtracted
from the scores (Funnel), size-1 head or block dims that einsum moves out of the product's batch (CvT, LongT5,
whose in-place bias leaves the scores viewed away and back); and their near misses, which stay refused with
their reason."""

from __future__ import annotations

import pytest
import torch

import fa2_inductor
from tests.pass_checks import compile_and_compare, pass_counts

S, D = 8, 16


def _windows(*leading, seq=S, train=False):
    """q, k, v of shape [*leading, seq, D]."""
    torch.manual_seed(0)
    return [torch.randn(*leading, seq, D, requires_grad=train) for _ in range(3)]


# --- more than two leading dims: merged into the op's batch --------------------------------------------
def _hiera_like(q, k, v):
    return ((q * 0.25) @ k.transpose(-1, -2)).softmax(-1) @ v


def _masked(q, k, v, mask):
    return (q @ k.transpose(-1, -2) * 0.25 + mask).softmax(-1) @ v


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_windows_of_heads_are_merged_into_the_batch(cpu_pass, train):
    compile_and_compare(_hiera_like, *_windows(2, 3, 4, train=train), rewrites=1, train=train)
    assert pass_counts() == {"rewrites": 1, "rewrites:no_mask": 1}


def test_six_dims_of_odd_sizes(cpu_pass):
    compile_and_compare(_hiera_like, *_windows(2, 3, 2, 5, seq=7), rewrites=1)


def test_dynamic_leading_sizes(cpu_pass):
    q, k, v = _windows(2, 3, 4)
    compile_and_compare(_masked, q, k, v, torch.randn(2, 1, 4, S, S), rewrites=1, dynamic=True)


# Masks broadcast over some leading dims: a view where the merged dims are all 1, a merged copy otherwise.
MASK_SHAPES = {"keys_and_queries": (S, S), "per_batch_and_window": (2, 1, 4, S, S), "per_batch_and_head_keys": (2, 3, 1, 1, S),
               "per_window": (1, 1, 4, S, S), "rank_4": (3, 4, S, S)}


@pytest.mark.parametrize("shape", MASK_SHAPES.values(), ids=MASK_SHAPES.keys())
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_masks_broadcast_over_the_merged_dims(cpu_pass, shape, train):
    torch.manual_seed(1)
    mask = torch.randn(shape)
    compile_and_compare(_masked, *_windows(2, 3, 4, train=train), mask, rewrites=1, train=train)


def test_a_mask_that_needs_its_gradient_stays_in_training(cpu_pass):
    """The op gets a merged copy of a 5-D mask: its gradient has no node to map to."""
    mask = torch.randn(2, 1, 4, S, S, requires_grad=True)
    compile_and_compare(_masked, *_windows(2, 3, 4, train=True), mask, rewrites=0, train=True)
    assert pass_counts() == {"refused:training_gradient_unmapped": 1}


def _batch_split_differently(out_leading):
    """One [24, S, D] product whose scores are seen as [2, 3, 4, S, S] and whose output as ``out_leading``."""
    def fn(q, k, v):
        scores = torch.bmm(q.reshape(24, S, D), k.reshape(24, S, D).transpose(1, 2)).view(2, 3, 4, S, S)
        probs = (scores * 0.25).softmax(-1)
        return torch.bmm(probs.reshape(24, S, S), v.reshape(24, S, D)).view(*out_leading, S, D)
    return fn


def test_leading_dims_split_alike_are_merged(cpu_pass):
    q, k, v = _windows(2, 3, 4)
    compile_and_compare(_batch_split_differently((2, 3, 4)), q, k, v, rewrites=1)


@pytest.mark.parametrize("leading", [((2, 3, 4), (3, 2, 4), (2, 3, 4)), ((2, 3, 4), (2, 3, 4), (3, 2, 4))],
                         ids=["k_split_otherwise", "output_split_otherwise"])
def test_leading_dims_split_otherwise_are_refused(cpu_pass, leading):
    """A product proves only the leading sizes' products equal; the output is split back with q's."""
    q_leading, k_leading, out_leading = leading
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, S, D) for shape in (q_leading, k_leading, q_leading))
    compile_and_compare(_batch_split_differently(out_leading), q, k, v, rewrites=0)
    assert pass_counts() == {"refused:unrecognised_layout": 1}


def test_ngram_streams_with_a_permuted_mask(cpu_pass):
    """ProphetNet's predict stream: [B, ngram, H, S, 2S] scores, its mask permuted from [B, H, ngram, ...]."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, S, D)
    k, v = (torch.randn(2, 2, 3, 2 * S, D) for _ in range(2))
    mask = torch.randn(2, 3, 2, S, 2 * S)

    def fn(q, k, v, mask):
        scores = torch.einsum("bnhtc,bnhsc->bnhts", q, k) + mask.permute(0, 2, 1, 3, 4)
        return torch.einsum("bnhts,bnhsc->bnhtc", scores.softmax(-1), v)

    compile_and_compare(fn, q, k, v, mask, rewrites=1)


# --- einsum's layouts: the output permuted, operands sequence-first -----------------------------------
def test_einsum_output_in_another_order(cpu_pass):
    """Funnel's ``bnij,bjnd->bind``: P @ V is read through the permutation einsum leaves on its output."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, S, 3, D) for _ in range(3))

    def fn(q, k, v):
        scores = torch.einsum("bind,bjnd->bnij", q * 0.25, k)
        return torch.einsum("bnij,bjnd->bind", scores.softmax(-1), v)

    compile_and_compare(fn, q, k, v, rewrites=1)


def test_sequence_first_operands_from_einsum_projections(cpu_pass):
    """XLNet: q, k, v are ``ibh,hnd->ibnd`` products (sequence first) and P @ V writes ``ibnd`` too."""
    torch.manual_seed(0)
    x = torch.randn(S, 2, 24)
    weights = [torch.randn(24, 3, D) / 5 for _ in range(3)]

    def fn(x, wq, wk, wv):
        q, k, v = (torch.einsum("ibh,hnd->ibnd", x, w) for w in (wq, wk, wv))
        scores = torch.einsum("ibnd,jbnd->bnij", q, k) * 0.25
        return torch.einsum("bnij,jbnd->ibnd", scores.softmax(-1), v)

    compile_and_compare(fn, x, *weights, rewrites=1)


def test_probabilities_transposed_before_einsum_are_refused(cpu_pass):
    """``bnji`` reads P transposed: the softmax's rows are not the product's rows."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, S, 3, D) for _ in range(3))

    def fn(q, k, v):
        scores = torch.einsum("bind,bjnd->bnij", q, k)
        return torch.einsum("bnji,bjnd->bind", scores.softmax(-1), v)

    compile_and_compare(fn, q, k, v, rewrites=0)
    assert pass_counts() == {"refused:unrecognised_layout": 1}


# --- a mask subtracted from the scores (Funnel's s - INF * (1 - mask)) ---------------------------------
def _keys(batch=2):
    keys = torch.ones(batch, S)
    keys[1, -3:] = 0
    return keys


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_subtracted_mask_is_an_additive_mask(cpu_pass, train):
    def fn(q, k, v, keys):
        scores = q @ k.transpose(-1, -2) * 0.25
        return (scores - 1e6 * (1 - keys[:, None, None])).softmax(-1) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, S, D, requires_grad=train) for _ in range(3))
    compile_and_compare(fn, q, k, v, _keys(), rewrites=1, train=train)


def test_scores_subtracted_from_a_mask_are_refused(cpu_pass):
    def fn(q, k, v, keys):
        return (1e6 * (1 - keys[:, None, None]) - q @ k.transpose(-1, -2)).softmax(-1) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, S, D) for _ in range(3))
    compile_and_compare(fn, q, k, v, _keys(), rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}


# --- size-1 head or block dims that einsum moves out of the product's batch --------------------------
def _one_head_einsum(q, k, v):
    """CvT: einsum leaves a single head beside the bmm's batch and puts it back around the product."""
    scores = torch.einsum("bhlk,bhtk->bhlt", q, k) * 0.25
    return torch.einsum("bhlt,bhtv->bhlv", scores.softmax(-1), v)


@pytest.mark.parametrize("heads", [3, 1])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_one_head_moved_by_einsum(cpu_pass, heads, train):
    torch.manual_seed(0)
    q = torch.randn(2, heads, 12, D, requires_grad=train)
    k, v = (torch.randn(2, heads, 6, D, requires_grad=train) for _ in range(2))
    compile_and_compare(_one_head_einsum, q, k, v, rewrites=1, train=train)


def test_one_head_with_the_probabilities_transposed_is_refused(cpu_pass):
    """``bhtl`` reads P transposed (square, so the shapes agree): the size-1 head changes nothing to that."""
    def fn(q, k, v):
        scores = torch.einsum("bhlk,bhtk->bhlt", q, k)
        return torch.einsum("bhtl,bhtv->bhlv", scores.softmax(-1), v)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, S, D) for _ in range(3))
    compile_and_compare(fn, q, k, v, rewrites=0)
    assert pass_counts() == {"refused:unrecognised_layout": 1}
    assert "another order" in fa2_inductor.explain(fn, q, k, v).refused[0].detail


def _local_blocks(blocks, keys_per_block=3 * S, heads=2, train=False):
    """LongT5's local attention: q [B, blocks, S, H, D], keys and values [B, blocks, 3S, H, D], and a bias
    [1, 1, H, S, 3S] plus a key mask [B, blocks, 1, 1, 3S] added in place to einsum's scores."""
    torch.manual_seed(0)
    q = torch.randn(2, blocks, S, heads, D, requires_grad=train)
    k, v = (torch.randn(2, blocks, keys_per_block, heads, D, requires_grad=train) for _ in range(2))
    bias = torch.randn(1, 1, heads, S, keys_per_block)
    mask = torch.where(torch.rand(2, blocks, 1, 1, keys_per_block) > 0.3, 0.0, -1e10)
    return q, k, v, bias + mask


def _local_block_attention(q, k, v, bias):
    scores = torch.einsum("...qhd,...khd->...hqk", q, k)
    scores += bias
    probs = torch.nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
    return torch.einsum("...hqk,...khd->...qhd", probs, v)


@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_blocks_of_local_attention(cpu_pass, blocks, train):
    """One block: einsum moves its size-1 dim out of the product; several: the block dim is merged into
    the op's batch. The in-place bias leaves the sum viewed into the product's layout and back (and in
    training, its backward a chain of ops under seq_nrs the graph no longer holds)."""
    compile_and_compare(_local_block_attention, *_local_blocks(blocks, train=train), rewrites=1, train=train)
    assert pass_counts() == {"rewrites": 1, "rewrites:mask": 1}


@pytest.mark.parametrize("blocks", [1, 3])
def test_blocks_of_local_attention_with_dynamic_shapes(cpu_pass, blocks):
    """Five heads: a size of its own (two dims of one size share a symbol, whose products einsum's views
    then spell differently)."""
    compile_and_compare(_local_block_attention, *_local_blocks(blocks, heads=5), rewrites=1, dynamic=True)


def test_scores_viewed_back_transposed_are_refused(cpu_pass):
    """The same in-place bias, but the scores come back with queries and keys swapped (a square block, so
    the shape is the same): the softmax then runs over the queries."""
    def fn(q, k, v, bias):
        scores = torch.einsum("...qhd,...khd->...hqk", q, k)
        scores += bias
        return torch.einsum("...hqk,...khd->...qhd", scores.transpose(-1, -2).softmax(-1), v)

    compile_and_compare(fn, *_local_blocks(1, keys_per_block=S), rewrites=0)
    assert pass_counts() == {"refused:score_transform": 1}
